"""Bounded influence of uploaded statistics, the platform's (strategies/platform/statistics.py,
``stats-bound``): honest rows are left exactly as they are, forged ones are cut to the bound,
and every method's statistics go through it without the method doing anything."""

from __future__ import annotations

import numpy as np
import pytest

from promptfcl.common.records import ARRAYS, METRICS
from promptfcl.strategies.platform.statistics import (
    DIAGONAL,
    FACTOR,
    PACKED_TRIU,
    Statistics,
    StatisticsBound,
)

D = 8
SPEC = Statistics(vectors=("means",), counts=("counts",),
                  second_moments={"cov-triu": PACKED_TRIU, "cov-diag": DIAGONAL, "cov-factor": FACTOR})


def honest_record(seed: int, classes: int = 2, count: int = 30) -> dict[str, np.ndarray]:
    """One client's statistics of ``classes`` classes: means of norm about 3, unit-ish covariances."""
    rng = np.random.default_rng(seed)
    means = 3 * rng.normal(size=(classes, D)) / np.sqrt(D) + 1.0
    cov = np.stack([np.eye(D) * rng.uniform(0.8, 1.2) for _ in range(classes)])
    row, col = np.triu_indices(D)
    return {"classes": np.arange(classes, dtype=np.int64), "counts": np.full(classes, count, np.int64),
            "means": means.astype(np.float32), "cov-triu": cov[:, row, col].astype(np.float16),
            "cov-diag": np.diagonal(cov, axis1=1, axis2=2).astype(np.float32),
            "cov-factor": np.sqrt(cov[:, :, :2]).astype(np.float32)}


def test_honest_rows_are_left_exactly_as_they_are():
    records = [honest_record(s, classes=1 + s % 3, count=[1, 5, 400, 2, 60][s]) for s in range(5)]
    out, changed = StatisticsBound(3.0)(records, [400] * 5, SPEC)
    assert changed == 0
    for before, after in zip(records, out):
        assert all(after[k] is before[k] for k in before)  # the very arrays: bit for bit


@pytest.mark.parametrize("forge, name, factor", [
    ("mean x20", "means", 20.0), ("mean shifted", "means", None), ("covariance x100", "cov-triu", 100.0),
    ("diagonal x100", "cov-diag", 100.0), ("factor x10", "cov-factor", 10.0)])
def test_a_forged_row_is_cut_to_the_bound_and_only_it(forge, name, factor):
    records = [honest_record(s) for s in range(5)]
    forged = dict(records[4])
    forged[name] = (forged[name].astype(np.float64) * factor if factor else forged[name] + 5.0).astype(forged[name].dtype)
    records[4] = forged
    out, changed = StatisticsBound(3.0)(records, [60] * 5, SPEC)
    assert changed == 2  # both of its rows
    for before, after in zip(records[:4], out[:4]):
        assert all(after[k] is before[k] for k in before)
    honest_scale = {"means": lambda r: np.linalg.norm(r, axis=1), "cov-diag": lambda r: r.sum(1),
                    "cov-factor": lambda r: np.square(r).sum((1, 2)),
                    "cov-triu": lambda r: r[:, np.triu_indices(D)[0] == np.triu_indices(D)[1]].sum(1)}[name]
    pool = np.concatenate([honest_scale(np.asarray(r[name], np.float64)) for r in out])
    lower_median = np.sort(pool)[(len(pool) - 1) // 2]
    assert honest_scale(np.asarray(out[4][name], np.float64)).max() <= 3.0 * lower_median * 1.01
    assert honest_scale(np.asarray(records[4][name], np.float64)).max() > 4 * lower_median  # beyond it before


def test_counts_are_cut_to_the_replys_own_examples_never_against_other_clients():
    """Label skew: one client holds 480 of a class, two hold 10 each; nothing is rewritten (the old
    bound against the class's other reporters gave them 0.60 / 0.20 / 0.20). A count above the
    reply's own num-examples is cut to it."""
    records = [{"counts": np.array([480])}, {"counts": np.array([10])}, {"counts": np.array([10])}]
    out, changed = StatisticsBound(3.0)(records, [480, 10, 10], Statistics(counts=("counts",)))
    assert changed == 0 and [int(r["counts"][0]) for r in out] == [480, 10, 10]
    out, changed = StatisticsBound(3.0)(records, [480, 10, 5], Statistics(counts=("counts",)))
    assert changed == 1 and int(out[2]["counts"][0]) == 5


def test_off_one_holder_and_noisy_covariances_leave_everything():
    records = [honest_record(s) for s in range(3)]
    records[2]["means"] = records[2]["means"] * 50
    assert StatisticsBound(0.0)(records, [60] * 3, SPEC)[1] == 0  # off
    assert StatisticsBound(3.0)(records[2:], [60], SPEC)[1] == 0  # one holder is its own reference
    noisy = [{"cov-diag": np.full((1, D), v)} for v in (-5.0, -3.0, 1.0, 50.0)]  # client-side DP: negative traces
    assert StatisticsBound(3.0)(noisy, [60] * 4, Statistics(second_moments={"cov-diag": DIAGONAL}))[1] == 0


def test_every_method_declares_the_statistics_it_uploads():
    """Every record a method's replies carry besides the model is declared, so the platform bounds it,
    and the registry names the same declaration for the client's side (the fault injection forges
    what is declared: client/faults.py), which reads it without importing the strategy."""
    from promptfcl.strategies.registry import methods, statistics_of, strategy_class

    for name in methods():
        cls = strategy_class(name)
        extra = set(cls.reply_records or ()) - {ARRAYS, METRICS}
        assert extra <= set(cls.statistics), f"{name} uploads {sorted(extra)} but declares {sorted(cls.statistics)}"
        assert cls.reply_records is not None, f"{name}: an open record set cannot be bounded"
        assert statistics_of(name) == cls.statistics, f"{name}: METHOD.statistics is not its strategy's"


STATS_ONLY = {"defences": "on", "update-norm-factor": 0.0, "update-clip": 0.0, "update-min-cosine": -1.0}


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["hgp", "fppl", "powder", "c2prompt", "lorm", "pilora"])
def test_on_an_honest_label_skewed_run_the_bound_changes_no_statistic(method, tmp_path):
    """Dirichlet 0.05 (most classes held almost whole by one client): HGP's mixtures (its counts
    are its weights), FPPL's prototypes and Powder's alphas, as the server holds them after every
    round, are the undefended ones exactly with stats-bound on (the old bound against a class's
    other reporters gave HGP weights 0.60 / 0.20 / 0.20 for counts 480 / 10 / 10)."""
    from promptfcl.server import checkpoint
    from tests.helpers import simulate_in_process

    settings = {"num-clients": 5, "clients-per-round": 5, "dirichlet-beta": 0.05, "keep-checkpoint": True,
                "rounds-per-task": 2}
    states, rounds = {}, {}
    for name, extra in (("off", {"defences": "off"}), ("on", STATS_ONLY)):
        results = simulate_in_process(tmp_path / name, method, **settings, **extra)
        states[name] = checkpoint.load(str(tmp_path / name)).strategy_state
        rounds[name] = results["rounds"]
    assert all(r["defences"]["stats"] == 0 for r in rounds["on"])
    # statistics were there to judge (C2Prompt's class statistics come with a client's first round of a
    # task, Powder's alphas with the rounds that measure: a task's first, and one whose task is unmeasured)
    judged = [bool(r["stats_ratios"]) for r in rounds["on"][1:]]
    assert any(judged) if method in ("c2prompt", "powder") else all(judged)
    if method == "powder":  # a round that measured nothing reports no ratios, not the last exchange's
        assert judged == [False, True, False], judged
    assert states["on"].keys() == states["off"].keys()
    for key, value in states["off"].items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(states["on"][key], value, err_msg=key)


def test_a_covariance_is_judged_against_its_own_class():
    """Classes differ in spread (here 10x); clients of one class do not. Keyed by class, no honest
    covariance is touched, and an inflated one is cut to 3 x its own class's lower median."""
    spec = Statistics(second_moments={"cov-diag": DIAGONAL}, counts=("counts",), keys="classes")

    def record(scale_of_class_1: float) -> dict[str, np.ndarray]:
        return {"classes": np.array([0, 1]), "counts": np.array([20, 20]),
                "cov-diag": np.stack([np.full(D, 1.0), np.full(D, scale_of_class_1)])}

    honest = [record(10.0), record(9.0), record(11.0), record(10.5)]
    out, changed = StatisticsBound(3.0)(honest, [40] * 4, spec)
    assert changed == 0 and all(o["cov-diag"] is h["cov-diag"] for o, h in zip(out, honest))
    assert StatisticsBound(3.0)(honest, [40] * 4, Statistics(second_moments={"cov-diag": DIAGONAL}))[1] > 0
    forged = honest[:3] + [record(1000.0)]
    out, changed = StatisticsBound(3.0)(forged, [40] * 4, spec)
    assert changed == 1 and out[3]["cov-diag"][1].sum() == pytest.approx(3 * 10.0 * D)
