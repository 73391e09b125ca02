"""deploy/Dockerfile and deploy/compose.yaml, read as files (no Docker engine can build them here).

What the image and the composition must get right: dependencies from the project's own
pyproject.toml (DP's accountant and the audit's metrics included), mount points owned by the
user the containers run as, each node's caches writable (a read-only backbone cache silently
turns ``backbone-cache-disk`` off), the CA's key in no container, and the Control API out of
the nodes' reach.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if current.strip():
                word, _, rest = current.strip().partition(" ")
                out.append((word.upper(), rest))
            current = ""
    return out


def pip_installs(text: str) -> list[list[str]]:
    """The arguments of every ``pip install`` in the Dockerfile's RUN instructions."""
    found = []
    for word, rest in instructions(text):
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", rest):
            tokens = shlex.split(command)
            if "pip" in tokens and "install" in tokens:
                found.append(tokens[tokens.index("install") + 1:])
    return found


def test_the_image_installs_the_project_from_its_own_pyproject():
    installs = pip_installs(DOCKERFILE)
    assert installs, "no pip install in the Dockerfile"
    targets = [t for args in installs for t in args if not t.startswith("-") and not t.startswith("$")]
    # only the project itself ('.' or '.[extra]'): no hand-kept list of packages to drift from pyproject
    assert targets and all(re.fullmatch(r"\.(\[[a-z,-]+\])?", t) for t in targets), targets
    assert not any("-e" == t or "--no-deps" == t for args in installs for t in args)  # a real install, deps included
    # and the image checks that what DP and the audit need is importable
    assert "import promptfcl.server.app, promptfcl.client.app, opacus, torchmetrics" in DOCKERFILE


def test_volumes_are_owned_by_the_user_the_containers_run_as():
    steps = instructions(DOCKERFILE)
    users = [rest.strip() for word, rest in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    volumes = next(rest for word, rest in steps if word == "VOLUME")
    mounts = re.findall(r'"(/[^"]+)"', volumes)
    assert "/cache/backbones" in mounts and "/state" in mounts
    setup = " ".join(rest for word, rest in steps[: steps.index(("VOLUME", volumes))] if word == "RUN")
    for mount in mounts:  # created and handed to the user before the VOLUME line
        assert re.search(rf"mkdir -p[^&]*{re.escape(mount)}\b", setup), mount
        assert re.search(r"chown -R flower(:flower)? [^&]*/cache", setup) and "/state" in setup


def services() -> dict:
    return COMPOSE["services"]


def volume_mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of a service's volumes."""
    out = []
    for entry in service.get("volumes", []):
        parts = entry.split(":")
        out.append((parts[0], parts[1], len(parts) > 2 and parts[2] == "ro"))
    return out


def test_no_container_gets_the_ca_key_and_nodes_get_only_their_own_key():
    for name, service in services().items():
        for source, target, _ in volume_mounts(service):
            assert not source.endswith("ca.key") and not target.endswith("ca.key"), (name, source)
            assert source.rstrip("/") not in ("./certs", "certs"), f"{name} mounts the whole certs folder"
            if source.startswith("./keys"):
                private = not source.endswith(".pub")
                assert not private or name.startswith("supernode"), f"{name} gets a private node key {source}"


def test_each_nodes_caches_are_writable():
    nodes = {n: s for n, s in services().items() if n.startswith("supernode")}
    assert len(nodes) >= 2
    for name, service in nodes.items():
        mounts = {target: (source, ro) for source, target, ro in volume_mounts(service)}
        assert "/cache" in mounts and not mounts["/cache"][1], name
        assert "/cache/backbones" in mounts and not mounts["/cache/backbones"][1], \
            f"{name}: a read-only backbone cache turns backbone-cache-disk off"
        assert "/data" in mounts and mounts["/data"][1], f"{name}: a node's data is mounted read-only"


def test_the_control_api_is_out_of_the_nodes_reach():
    link = services()["superlink"]
    command = link["command"]
    assert command[command.index("--control-host") + 1] == "127.0.0.1"
    control_port = command[command.index("--control-port") + 1]
    fleet_port = command[command.index("--port") + 1]
    assert [p.split(":")[-1] for p in link.get("ports", [])] == [fleet_port]  # only the Fleet API is published
    for name in ("register", "submit"):
        service = services()[name]
        assert service["network_mode"] == "service:superlink", name  # the SuperLink's loopback
        text = " ".join(service["command"]) if isinstance(service["command"], list) else service["command"]
        assert f"127.0.0.1:{control_port}" in text, name
    for name, service in services().items():
        if name.startswith("supernode"):
            command = service["command"]
            assert command[command.index("--superlink") + 1] == f"superlink:{fleet_port}", name
