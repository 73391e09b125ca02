"""End to end: a real Flower Ray simulation through the `promptfcl simulate` command."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.simulation


# fedavg_run: tests/conftest.py (one Ray run per suite, shared with test_ray_cluster.py)


def test_results_have_every_promised_key(fedavg_run):
    results, out = fedavg_run
    for key in ("config", "accuracy_matrix", "final_average_accuracy", "average_incremental_accuracy",
                "average_forgetting", "rounds", "communication"):
        assert key in results
    assert len(results["rounds"]) == 2 * 2
    for r in results["rounds"]:
        for key in ("task", "round", "accuracy", "bytes_s2c", "bytes_c2s", "client_seconds", "server_seconds"):
            assert key in r
    assert (out / "accuracy_over_rounds.png").stat().st_size > 1000
    assert (out / "accuracy_matrix.png").stat().st_size > 1000
    assert results["config"]["strategy"] == "fedavg" and results["config"]["num-tasks"] == 2


def test_accuracy_matrix_is_lower_triangular_and_metrics_consistent(fedavg_run):
    results, _ = fedavg_run
    acc = results["accuracy_matrix"]
    assert acc[1][0] is None  # task 2 not yet seen after task 1
    assert all(0.0 <= v <= 100.0 for row in acc for v in row if v is not None)
    assert results["final_average_accuracy"] == pytest.approx((acc[0][1] + acc[1][1]) / 2)
    assert results["average_forgetting"] == pytest.approx(acc[0][0] - acc[0][1])


def test_bytes_match_the_parameters_that_travel(fedavg_run):
    results, _ = fedavg_run
    n_params = results["communication"]["trainable_parameters"]
    for r in results["rounds"]:
        per_client_s2c = r["bytes_s2c"] / r["clients_sampled"]
        # float32 parameters plus a small framing overhead, and nothing else (no backbone)
        assert 4 * n_params <= per_client_s2c <= 4 * n_params * 1.05 + 4096
        assert r["bytes_c2s"] > 0


@pytest.mark.e2e
def test_same_seed_same_result(fedavg_run, tmp_path):
    """The same configuration run again, in this process instead of on Ray actors, gives the same
    accuracy matrix: results depend on the seed, not on the engine or the order replies arrive in."""
    from tests.helpers import simulate_in_process

    first, _ = fedavg_run
    again = simulate_in_process(tmp_path / "again", lr=0.01)
    assert again["accuracy_matrix"] == first["accuracy_matrix"]


def test_bad_config_fails_before_training(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "promptfcl.server.cli", "simulate", "--set", "num-tasks=3", "--set", "pool-size=4",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "pool-size" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "promptfcl.server.cli", "simulate", "--strategy", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown strategy 'nope'" in proc.stderr
