"""Citable: each method's BibTeX lives once in the code (``Method.citation``) and docs/methods.md
repeats it exactly; reports name it; the project's CITATION.cff and the backbone's model card say
what the project and its configuration say."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from promptfcl.common.config.experiment import ExperimentConfig
from promptfcl.strategies.registry import Method, cite, methods

ROOT = Path(__file__).resolve().parents[1]
OURS = ("c2prompt", "fedavg", "fedcprompt", "fppl", "hepco", "hgp", "lorm", "pilora", "powder")


def bibtex_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bibtex\n(.*?)```", text, re.DOTALL)]


def test_every_method_of_the_repository_has_one_well_formed_entry():
    keys = set()
    for name in OURS:
        method = methods()[name]
        entry = method.citation
        assert entry.count("{") == entry.count("}"), name
        assert method.citation_key and method.citation_title, name
        keys.add(method.citation_key)
        # an entry without authors, venue or year says so instead of leaving them out silently
        for field in ("author", "year"):
            assert re.search(rf"^\s*{field}\s*=", entry, re.MULTILINE) or "names no" in entry, (name, field)
    assert len(keys) == len(OURS)
    assert methods()["fedavg"].citation_title.startswith("CODA-Prompt: ")  # FedAvg-Prompt cites its prompt
    assert methods()["fedavg"].citation_key == "smith2023codaprompt"


def test_docs_methods_repeat_the_codes_entries_exactly():
    blocks = bibtex_blocks((ROOT / "docs" / "methods.md").read_text())
    assert sorted(blocks) == sorted(methods()[name].citation.strip() for name in OURS)


def test_key_and_title_are_read_from_the_entry():
    method = Method("x", strategy=".s:S", learner=".l:L", prompt=".p:P", citation="@misc{k1,\n  title = {{ABC}: a Title},\n}")
    assert (method.citation_key, method.citation_title) == ("k1", "ABC: a Title")
    assert Method("y", strategy=".s:S", learner=".l:L", prompt=".p:P").citation_key is None


def test_the_method_line_of_table_and_show_prints_key_and_title(tmp_path, capsys):
    from promptfcl.server.cli import main
    from promptfcl.server.report import table

    hgp = methods()["hgp"]
    assert cite("hgp") == f'hgp (cite {hgp.citation_key}: "{hgp.citation_title}")'
    assert cite("not-installed-here") == "not-installed-here"  # a run made where another plug-in was
    results = {"accuracy_matrix": [[50.0]], "average_accuracy_per_task": [50.0],
               "final_average_accuracy": 50.0, "average_incremental_accuracy": 50.0, "average_forgetting": 0.0,
               "backward_transfer": None,
               "config": {"strategy": "hgp", "dataset": "digits", "partition": "dirichlet", "num-clients": 3},
               "communication": {"bytes_s2c_per_round": 1, "bytes_c2s_per_round": 1, "trainable_parameters": 1},
               "timing": {"client_seconds_per_round": 0.1, "server_seconds_per_round": 0.1, "total_seconds": 1.0}}
    assert f"| strategy | {cite('hgp')} |" in table(results)
    (tmp_path / "results.json").write_text(json.dumps(results))
    capsys.readouterr()
    assert main(["show", str(tmp_path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| strategy |"))
    assert hgp.citation_key in line and hgp.citation_title in line


def test_citation_cff_names_the_project_its_license_and_version():
    yaml = pytest.importorskip("yaml")
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert cff["cff-version"] == "1.2.0" and cff["title"] == "promptfcl" and cff["message"]
    assert cff["authors"] == [{"name": "promptfcl developers"}]
    assert cff["license"] == project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert str(cff["version"]) == project["version"]


def test_the_backbone_model_card_states_the_default_architecture():
    card = (ROOT / "docs" / "backbone.md").read_text()
    cfg = ExperimentConfig()
    assert cfg.model.weights == "pretrained:fashion-mnist" and f"`{cfg.model.backbone}`" in card
    for text in (f"{cfg.model.image_size} x {cfg.model.image_size} inputs", f"{cfg.model.patch_size} x {cfg.model.patch_size} patches",
                 f"width {cfg.model.embed_dim}", f"{cfg.model.depth} blocks", f"{cfg.model.num_heads} heads"):
        assert text in card, text
