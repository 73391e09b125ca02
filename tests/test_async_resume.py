"""Asynchronous arrival and checkpoints: HePCo, FPPL and HGP keep per-client state across rounds
(class statistics, prototypes, each client's turn in the schedule); a run stopped while two
tasks are in flight and resumed must end exactly as the uninterrupted run.

The uninterrupted run is a real Ray simulation (Flower's simulation engine, client actors) and
the stopped and resumed one runs in-process: the asynchronous run finishes on Ray with a
complete accuracy matrix, and both ways of running give the same numbers."""

from __future__ import annotations

import pytest

from tests.helpers import simulate, simulate_in_process

ASYNC = {"num-clients": 4, "clients-per-round": 2, "switch-every": 1, "switch-fraction": 0.5, "lr": 0.01}
OPTIONS = {"hepco": {"hepco.generator-epochs": 3, "hepco.distill-epochs": 3}, "hgp": {"hgp.samples-per-class": 32},
           "fppl": {}}


@pytest.mark.simulation
@pytest.mark.parametrize("strategy", sorted(OPTIONS))
def test_resumed_asynchronous_run_equals_the_uninterrupted_one(strategy, tmp_path):
    settings = {**ASYNC, **OPTIONS[strategy]}
    whole = simulate(tmp_path / "whole", strategy=strategy, **settings)  # Ray
    matrix = whole["accuracy_matrix"]
    assert all(v is not None for i, row in enumerate(matrix) for v in row[i:])  # complete: each task from its end on
    rounds = whole["rounds"]
    assert len(set(rounds[1]["client_tasks"])) == 2 or len(set(rounds[2]["client_tasks"])) == 2  # tasks in flight
    simulate_in_process(tmp_path / "split", strategy=strategy, **settings, **{"max-rounds": 2})
    resumed = simulate_in_process(tmp_path / "split", strategy=strategy, **settings, resume=True, **{"max-rounds": 0})
    assert resumed["accuracy_matrix"] == whole["accuracy_matrix"]
    assert [r["accuracy"] for r in resumed["rounds"]] == [r["accuracy"] for r in rounds]
