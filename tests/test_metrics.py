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
