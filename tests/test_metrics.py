"""Metrics against hand-computed examples (each paper's definitions)."""

import numpy as np
import pytest

from promptfcl.common import metrics

NAN = np.nan
# acc[i][t]: accuracy on task i after learning task t
ACC = np.array([
    [90.0, 70.0, 60.0],
    [NAN, 80.0, 50.0],
    [NAN, NAN, 85.0],
])


def test_average_accuracies_per_step():
    np.testing.assert_allclose(metrics.average_accuracies(ACC), [90.0, 75.0, (60 + 50 + 85) / 3])


def test_final_and_incremental_accuracy():
    assert metrics.final_average_accuracy(ACC) == pytest.approx(65.0)
    assert metrics.average_incremental_accuracy(ACC) == pytest.approx((90 + 75 + 65) / 3)


def test_forgetting_uses_the_best_earlier_accuracy():
    # task 0: max(90, 70) - 60 = 30; task 1: max(80) - 50 = 30 -> mean 30
    assert metrics.average_forgetting(ACC) == pytest.approx(30.0)
    # FPPL-code variant divides by all T tasks (the last contributes 0)
    assert metrics.average_forgetting(ACC, include_last=True) == pytest.approx(20.0)


def test_forgetting_per_task():
    # task 0: max(90, 70) - 60 = 30; task 1: 80 - 50 = 30; after task 1 only: task 0 90 - 70
    np.testing.assert_allclose(metrics.task_forgetting(ACC), [30.0, 30.0])
    np.testing.assert_allclose(metrics.task_forgetting(ACC, upto=1), [20.0])
    acc = np.array([[50.0, 70.0, 65.0], [NAN, 80.0, 90.0], [NAN, NAN, 1.0]])
    np.testing.assert_allclose(metrics.task_forgetting(acc), [5.0, -10.0])  # best earlier, not the first


def test_forgetting_partial_run_and_single_task():
    # after task 1 only: task 0 dropped from 90 to 70
    assert metrics.average_forgetting(ACC, upto=1) == pytest.approx(20.0)
    assert metrics.average_forgetting(ACC, upto=0) == 0.0


def test_improvement_gives_negative_forgetting():
    acc = np.array([[50.0, 70.0], [NAN, 80.0]])
    assert metrics.average_forgetting(acc) == pytest.approx(-20.0)


def test_backward_transfer_is_gems_final_minus_just_learnt_accuracy():
    # GEM's BWT: task 0: 60 - 90, task 1: 50 - 80 -> mean -30 (the last task is not an old task)
    assert metrics.backward_transfer(ACC) == pytest.approx(-30.0)
    # after task 1 only: task 0 went from 90 to 70
    assert metrics.backward_transfer(ACC, upto=1) == pytest.approx(-20.0)
    # one task learnt: 1/(T-1) is undefined, not 0
    assert metrics.backward_transfer(ACC, upto=0) is None
    # against the just-learnt accuracy, not the best earlier one (where it differs from forgetting)
    acc = np.array([[50.0, 70.0, 65.0], [NAN, 80.0, 90.0], [NAN, NAN, 1.0]])
    assert metrics.backward_transfer(acc) == pytest.approx(((65 - 50) + (90 - 80)) / 2)
    assert metrics.average_forgetting(acc) == pytest.approx(((70 - 65) + (80 - 90)) / 2)


def test_backward_transfer_leaves_out_an_unevaluated_cell():
    acc = ACC.copy()
    acc[1, 1] = NAN  # task 1 never scored right after it was learnt: no a_{1,1} to compare with
    assert metrics.backward_transfer(acc) == pytest.approx(60.0 - 90.0)
    acc[0, 2] = NAN
    assert metrics.backward_transfer(acc) is None  # no old task has both cells
    assert metrics.summary(ACC)["backward_transfer"] == pytest.approx(-30.0)


def test_results_summary_and_table_carry_backward_transfer_of_the_finished_tasks():
    from promptfcl.server.report import table
    from promptfcl.server.results import summary_so_far

    stopped = ACC.copy()
    stopped[:, 2] = NAN  # stopped early (max-rounds) before task 2 ended
    assert summary_so_far(stopped)["backward_transfer"] == pytest.approx(-20.0)
    assert summary_so_far(metrics.empty_matrix(3))["backward_transfer"] is None
    first = metrics.empty_matrix(3)
    first[0, 0] = 90.0
    assert summary_so_far(first)["backward_transfer"] is None
    results = {"accuracy_matrix": [[None if np.isnan(v) else v for v in row] for row in ACC],
               "average_accuracy_per_task": [90.0, 75.0, 65.0], **summary_so_far(ACC),
               "config": {"strategy": "fedavg", "dataset": "digits", "partition": "dirichlet", "num-clients": 3},
               "communication": {"bytes_s2c_per_round": 1, "bytes_c2s_per_round": 1, "trainable_parameters": 1},
               "timing": {"client_seconds_per_round": 0.1, "server_seconds_per_round": 0.1, "total_seconds": 1.0}}
    assert "| backward transfer (BWT) | -30.00 |" in table(results)
    del results["backward_transfer"]  # results.json written before it was reported
    assert "| backward transfer (BWT) | n/a |" in table(results)


@pytest.mark.e2e
def test_a_runs_results_table_show_and_tensorboard_carry_backward_transfer(tmp_path, capsys):
    """A short in-process run: results.json's backward_transfer is BWT of its own accuracy matrix,
    and table.md, ``promptfcl show`` and TensorBoard report it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from promptfcl.server.cli import main
    from tests.helpers import simulate_in_process

    out = tmp_path / "run"
    results = simulate_in_process(out, "fedavg", **{"num-tasks": 5, "pool-size": 10, "rounds-per-task": 1,
                                                    "tracker": "tensorboard"})
    acc = np.array([[NAN if v is None else v for v in row] for row in results["accuracy_matrix"]])
    assert results["backward_transfer"] == pytest.approx(metrics.backward_transfer(acc))
    assert results["backward_transfer"] == pytest.approx(np.mean([acc[i, 4] - acc[i, i] for i in range(4)]))
    row = f"| backward transfer (BWT) | {results['backward_transfer']:.2f} |"
    assert row in (out / "table.md").read_text()
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert row in capsys.readouterr().out
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("BWT")] == [2, 3, 4, 5]  # defined from the second task on
    assert events.Scalars("BWT")[-1].value == pytest.approx(results["backward_transfer"], abs=1e-4)
    assert events.Scalars("final/backward_transfer")[0].value == pytest.approx(results["backward_transfer"], abs=1e-4)
