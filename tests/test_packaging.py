"""The distribution: one installed name, every package of the layers in it, the paper configs and
deployment scripts as package data, a license."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("common", "strategies", "client", "server")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_of_the_layers_is_installed_under_promptfcl():
    listed = set(pyproject()["tool"]["setuptools"]["packages"])
    found = {"promptfcl." + ".".join(p.parent.relative_to(ROOT).parts) for layer in LAYERS
             for p in (ROOT / layer).rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert "promptfcl" in listed and all(name.startswith("promptfcl.") for name in listed - {"promptfcl"})


def test_the_wheel_holds_one_top_level_package_with_its_configs_and_scripts(tmp_path):
    import shutil

    source = tmp_path / "src"  # a copy: building writes build/ beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "__init__.py"):
        shutil.copy(ROOT / name, source / name)
    for folder in (*LAYERS, "configs", "deploy"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source),
                           "-w", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("promptfcl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"promptfcl", wheel.name.split("-py3")[0] + ".dist-info"}
    for config in (ROOT / "configs").glob("*.toml"):
        assert f"promptfcl/configs/{config.name}" in names
    for script in ("start-server.sh", "start-client.sh", "submit-run.sh", "register-node.sh", "superlink.py", "supernode.py",
                   "run.toml", "Dockerfile", "compose.yaml"):
        assert f"promptfcl/deploy/{script}" in names
    for method in ("c2prompt", "fedavg", "fedcprompt", "fppl", "hepco", "hgp", "lorm", "pilora", "powder"):
        assert f"promptfcl/strategies/{method}/strategy.py" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert any(n.endswith("licenses/LICENSE") for n in names)


def test_pins_are_tested_ranges_and_flower_is_on_1_42_with_its_reason():
    """Each dependency a range closed above (the newest tested release's series), never one
    exact version; Flower below 1.43, whose changes docs/flower.md describes."""
    from packaging.requirements import Requirement

    deps = [Requirement(d) for d in pyproject()["project"]["dependencies"]]
    assert all("==" not in str(d.specifier) for d in deps), deps
    assert all(any(s.operator == "<" for s in d.specifier) for d in deps), "every pin needs an upper bound"
    flwr = next(d for d in deps if d.name == "flwr")
    assert flwr.extras == {"simulation"} and str(flwr.specifier) in (">=1.42,<1.43", "<1.43,>=1.42")
    text = (ROOT / "pyproject.toml").read_text().replace("\n    # ", " ")
    assert "below 1.43, which cannot be installed and tested here yet" in text
    assert (ROOT / "docs" / "flower.md").is_file()
