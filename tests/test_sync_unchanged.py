"""Synchronous runs are unchanged by asynchronous task arrival (issue #17, item 4).

``tests/data/sync_matrices.json`` holds the accuracy matrices (and every round's accuracies) of
tiny synchronous in-process runs of HePCo, FPPL and HGP, made with the code of commit 2e0aba9,
before those methods learnt asynchronous arrival; each run is repeated here and must give the
same values bit for bit (JSON keeps a float's shortest exact representation, so equality of
the loaded values is equality of the doubles).

Regenerate (only when a change is meant to alter synchronous runs)::

    python -m tests.test_sync_unchanged [COMMIT]   # from a tree of the code that makes the expectation
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

FIXTURE = Path(__file__).parent / "data" / "sync_matrices.json"

#: run name -> (method, the settings of its tiny synchronous run on top of simulate_in_process's
#: defaults). Five tasks, so that the steps over earlier tasks (past generator, old prototypes,
#: CR_old) run; "-partial": 5 of 10 clients per round, so that rounds of one task see different
#: clients (HGP's per-client statistics, FPPL's per-client prototypes)
PARTIAL = {"num-clients": 10, "clients-per-round": 5, "rounds-per-task": 3}
#: HePCo's stateless population draws each client's data per round with the same code since 2e0aba9
#: (the static partitions have since become NIID-Bench's own, with another random stream)
STATELESS = {"partition": "stateless"}
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "hgp": ("hgp", {**STATELESS, "lr": 0.01, "num-tasks": 5, "pool-size": 10, "hgp.samples-per-class": 64}),
    "fppl": ("fppl", {**STATELESS, "lr": 0.01, "num-tasks": 5, "pool-size": 10}),
    "hepco": ("hepco", {**STATELESS, "lr": 0.01, "num-tasks": 5, "pool-size": 10, "hepco.generator-epochs": 5,
                        "hepco.distill-epochs": 5}),
    "hgp-partial": ("hgp", {**STATELESS, "lr": 0.01, "num-tasks": 5, "pool-size": 10, "hgp.samples-per-class": 64, **PARTIAL}),
    "fppl-partial": ("fppl", {**STATELESS, "lr": 0.01, "num-tasks": 5, "pool-size": 10, **PARTIAL}),
    "hepco-partial": ("hepco", {**STATELESS, "lr": 0.01, "num-tasks": 5, "pool-size": 10, "hepco.generator-epochs": 5,
                                "hepco.distill-epochs": 5, **PARTIAL}),
}


#: readings whose defaults changed since the expectation was made (HePCo's weighted client sums
#: and whole-pool training, issue 40; its generators over every seen class, issue 58): the old
#: readings, options now, reproduce it
OLD_DEFAULTS = {"hepco": {"hepco.client-weights": "uniform", "hepco.pool-training": "task-slices",
                          "hepco.generator-classes": "task"}}


def run_record(name: str, out: Path) -> dict[str, Any]:
    """The accuracy matrix and per-round accuracies of the tiny synchronous run ``name``."""
    from tests.conftest import PLAIN_MEAN
    from tests.helpers import simulate_in_process

    strategy, settings = RUNS[name]
    # the expectation predates the robustness defaults (update-clip, direction check, stats-bound)
    results = simulate_in_process(out, strategy=strategy, **{**PLAIN_MEAN, **OLD_DEFAULTS.get(strategy, {}), **settings})
    return {"strategy": strategy, "settings": settings, "accuracy_matrix": results["accuracy_matrix"],
            "round_accuracy": [r["accuracy"] for r in results["rounds"]]}


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(RUNS))
def test_synchronous_matrix_unchanged(name, tmp_path):
    expected = json.loads(FIXTURE.read_text())[name]
    got = run_record(name, tmp_path / name)
    assert (got["strategy"], got["settings"]) == (expected["strategy"], expected["settings"])
    assert got["accuracy_matrix"] == expected["accuracy_matrix"]
    assert got["round_accuracy"] == expected["round_accuracy"]


if __name__ == "__main__":
    import subprocess
    import sys

    # the commit whose code made the runs (an exported tree has no git: pass it)
    commit = sys.argv[1] if len(sys.argv) > 1 else subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                                  text=True).stdout.strip()
    record = {"recorded-at-commit": commit}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(RUNS):
            record[name] = run_record(name, Path(tmp) / name)
    FIXTURE.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {FIXTURE}")
