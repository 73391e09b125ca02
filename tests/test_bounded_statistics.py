"""Bounded influence of uploaded statistics (strategies/platform/statistics.py, ``stats-bound``):
one forged contribution among five moves each method's server statistic by a bounded amount."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from promptfcl.strategies.platform.statistics import bound_counts, bound_scales, bound_vectors, bounded_mean
from tests.conftest import tiny_config

D = 16
rng = np.random.default_rng(0)
TRUE_MEAN = rng.normal(size=D)


def honest_vectors(k: int = 4, spread: float = 0.1) -> np.ndarray:
    return TRUE_MEAN + spread * np.random.default_rng(1).normal(size=(k, D))


FORGERIES = {"scaled x20": lambda v: 20 * v, "shifted by 50": lambda v: v + 50.0}


def test_a_hostile_minority_cannot_move_the_bounded_statistics_far():
    honest = honest_vectors()
    spread = np.linalg.norm(honest - np.median(honest, axis=0), axis=1).max()
    for forge in FORGERIES.values():
        vectors = np.vstack([honest, forge(honest[0])])
        free = vectors.mean(axis=0)
        bounded = bound_vectors(vectors, 3.0).mean(axis=0)
        assert np.linalg.norm(free - honest.mean(axis=0)) > 5  # without the bound: far off
        # with it the forged row is at most 3 x the honest distances from the median
        assert np.linalg.norm(bounded - honest.mean(axis=0)) < 3 * spread
    assert np.array_equal(bound_vectors(vectors, 0.0), vectors)  # off: untouched
    assert np.array_equal(bound_vectors(vectors[:2], 3.0), vectors[:2])  # two reporters: nothing to compare
    np.testing.assert_allclose(bound_scales(np.array([1.0, 1.2, 0.9, 100.0]), 2.0), [1, 1, 1, 0.02])
    np.testing.assert_allclose(bound_counts(np.array([100, 120, 90, 10**6]), 2.0), [100, 120, 90, 200])
    # noisy covariances (client-side DP) can have negative traces: a negative one is left alone,
    # and a bound is read only from a positive lower median (never flipping or erasing the rest)
    np.testing.assert_allclose(bound_scales(np.array([-1.0, 2.0, 3.0, 100.0]), 3.0), [1, 1, 1, 0.06])
    np.testing.assert_array_equal(bound_scales(np.array([-5.0, -3.0, 1.0, 2.0]), 3.0), [1, 1, 1, 1])
    weighted = bounded_mean(np.vstack([honest, honest[0] + 50]), np.array([100, 100, 100, 100, 5000]), 2.0)
    assert np.linalg.norm(weighted - honest.mean(axis=0)) < 2.5  # forged count and mean both bounded


@pytest.mark.parametrize("kind", ["full", "diag"])
def test_hgp_class_mixture_bounds_a_forged_mean_covariance_and_count(kind):
    from promptfcl.strategies.hgp.gaussians import _mixture_from_raw, class_statistics
    from promptfcl.strategies.hgp.options import HGPOptions

    opts = HGPOptions(cov_type=kind)
    gen = torch.Generator().manual_seed(0)
    raws = []
    for client in range(5):
        feats = torch.from_numpy(TRUE_MEAN).float() + 0.3 * torch.randn(60, D, generator=gen)
        stats = {k: v.numpy() for k, v in class_statistics(feats, torch.zeros(60, dtype=torch.long), opts).items()}
        if client == 4:  # the forger: mean x20, covariance x100, count x50
            stats["means"] = stats["means"] * 20
            for key in [k for k in stats if k.startswith("cov-")]:
                stats[key] = stats[key] * 100
            stats["counts"] = stats["counts"] * 50
        raws.append(stats)
    raw = {k: np.concatenate([r[k] for r in raws]) for k in raws[0] if k != "classes"}
    free, bounded = _mixture_from_raw(0, raw, 1e-4, 0.0), _mixture_from_raw(0, raw, 1e-4, 3.0)
    assert free is not None and bounded is not None

    def mixture_mean(m):
        return (m.weights[:, None] * m.means.double()).sum(0).numpy()

    assert np.linalg.norm(mixture_mean(free) - TRUE_MEAN) > 50  # the forger dominates an unbounded mixture
    assert np.linalg.norm(mixture_mean(bounded) - TRUE_MEAN) < 1.0
    assert float(bounded.weights[4]) < 0.45  # its count is cut to 3 x the median
    traces = torch.diagonal(bounded.covariances(), dim1=1, dim2=2).sum(1)
    free_traces = torch.diagonal(free.covariances(), dim1=1, dim2=2).sum(1)
    assert float(free_traces[4]) > 50 * float(free_traces[:4].max())
    assert float(traces[4]) <= 3.05 * float(traces[:4].max())  # its covariance too (3 x the lower median)


def test_fppl_class_prototype_bounds_a_forged_prototype():
    from promptfcl.strategies.fppl.prototypes import PrototypeSet

    honest = honest_vectors()
    for forge in FORGERIES.values():
        protos = PrototypeSet(np.zeros(5, np.int64), np.vstack([honest, forge(honest[0])]), np.arange(5))
        _, free = protos.class_means()
        _, bounded = protos.class_means(bound=3.0)
        assert np.linalg.norm(free[0] - honest.mean(axis=0)) > 5
        assert np.linalg.norm(bounded[0] - honest.mean(axis=0)) < 0.5


def test_powder_alphas_bound_a_forged_vector_and_count():
    from promptfcl.common.records import to_array_record
    from promptfcl.strategies.powder.strategy import PowderStrategy

    def strategy(bound):
        cfg = tiny_config(num_tasks=2, num_clients=5, clients_per_round=5, pool_size=4, stats_bound=bound)
        return PowderStrategy(cfg, 10)

    width = strategy(0.0).width
    honest = np.abs(np.random.default_rng(2).normal(1.0, 0.05, size=(4, width)))

    def record(alpha, count):
        return to_array_record({"tasks": np.array([0]), "task-alpha": alpha[None], "task-count": np.array([count]),
                                "classes": np.zeros(0, np.int64), "class-alpha": np.zeros((0, width)),
                                "class-count": np.zeros(0, np.int64)})

    records = [record(a, 50) for a in honest] + [record(-30 * honest[0], 5000)]  # reversed, x30, 100x the count
    free, bounded = strategy(0.0), strategy(3.0)
    free.update_correlation(records)
    bounded.update_correlation(records)
    assert np.linalg.norm(free.task_alpha[0] - honest.mean(axis=0)) > 10
    assert np.linalg.norm(bounded.task_alpha[0] - honest.mean(axis=0)) < 0.5
    assert np.all(bounded.task_alpha[0] > 0)  # the forged sign does not survive
