"""Synchronous runs are unchanged by asynchronous task arrival (issue #17, item 4).

``tests/data/sync_matrices.json`` holds the accuracy matrices of tiny synchronous in-process
runs of HePCo, FPPL and HGP (and every round's accuracies) made before those methods learnt asynchronous arrival; each run
is repeated here and must give the same matrix bit for bit (JSON keeps a float's shortest
exact representation, so equality of the loaded values is equality of the doubles).

Regenerate (only when a change is meant to alter synchronous runs)::

    python -m tests.test_sync_unchanged
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

FIXTURE = Path(__file__).parent / "data" / "sync_matrices.json"

#: method -> the settings of its tiny synchronous run (on top of simulate_in_process's defaults);
#: five tasks so that the steps over earlier tasks (past generator, old prototypes, CR_old) run
RUNS: dict[str, dict[str, Any]] = {
    "hgp": {"lr": 0.01, "num-tasks": 5, "pool-size": 10, "hgp.samples-per-class": 64},
    "fppl": {"lr": 0.01, "num-tasks": 5, "pool-size": 10},
    "hepco": {"lr": 0.01, "num-tasks": 5, "pool-size": 10, "hepco.generator-epochs": 5, "hepco.distill-epochs": 5},
}


def run_record(strategy: str, out: Path) -> dict[str, Any]:
    """The accuracy matrix and per-round accuracies of ``strategy``'s tiny synchronous run."""
    from tests.helpers import simulate_in_process

    results = simulate_in_process(out, strategy=strategy, **RUNS[strategy])
    return {"settings": RUNS[strategy], "accuracy_matrix": results["accuracy_matrix"],
            "round_accuracy": [r["accuracy"] for r in results["rounds"]]}


@pytest.mark.parametrize("strategy", sorted(RUNS))
def test_synchronous_matrix_unchanged(strategy, tmp_path):
    expected = json.loads(FIXTURE.read_text())[strategy]
    got = run_record(strategy, tmp_path / strategy)
    assert got["settings"] == expected["settings"]
    assert got["accuracy_matrix"] == expected["accuracy_matrix"]
    assert got["round_accuracy"] == expected["round_accuracy"]


if __name__ == "__main__":
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"recorded-at-commit": commit}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(RUNS):
            record[name] = run_record(name, Path(tmp) / name)
    FIXTURE.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {FIXTURE}")
