"""Flower's Krum, Multi-Krum and Bulyan as aggregations (strategies/platform/byzantine.py), the
max-client-weight cap of a defended simulation, and the worst case of ``bench robustness``."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from promptfcl.common.flower_internals import internal
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.platform.aggregation import Combiner
from promptfcl.strategies.platform.byzantine import assumed_malicious, minimum_replies
from tests.conftest import tiny_config
from tests.helpers import NodeList


@pytest.fixture
def toy() -> list[np.ndarray]:
    """Nine replies around 1.0 and one far outlier (100)."""
    rng = np.random.default_rng(0)
    return [1.0 + rng.normal(scale=0.1, size=(3, 4)).astype(np.float32) for _ in range(9)] + \
        [np.full((3, 4), 100.0, dtype=np.float32)]


@pytest.mark.parametrize("mode", ["krum", "multikrum", "bulyan"])
def test_each_is_flowers_own_function_and_drops_a_far_outlier(toy, mode):
    f = 1 if mode == "bulyan" else 2  # Bulyan: n >= 4f + 3
    weights = np.arange(1, 11, dtype=np.float64)
    out = Combiner(mode, byzantine=f)(toy, weights)
    layers = [([v.astype(np.float64)], float(w)) for v, w in zip(toy, weights)]
    if mode == "bulyan":
        expected = internal("aggregate_bulyan")(list(layers), f, internal("aggregate_krum"), to_keep=0)[0]
    else:
        expected = internal("aggregate_krum")(layers, f, 10 - f if mode == "multikrum" else 0)[0]
    np.testing.assert_array_equal(out, np.asarray(expected).astype(np.float32))
    assert out.dtype == np.float32 and out.shape == (3, 4)
    assert np.abs(out - 1.0).max() < 0.5  # the outlier at 100 carries nothing
    if mode == "krum":
        assert any(np.array_equal(out, v) for v in toy[:9])  # one reply chosen


def test_too_few_replies_for_the_assumed_malicious_fall_back_to_the_median(toy, caplog):
    assert minimum_replies("krum", 2) == 7 and minimum_replies("bulyan", 2) == 11
    assert assumed_malicious(0, 0.2, 10) == 2 and assumed_malicious(0, 0.0, 10) == 1 and assumed_malicious(3, 0.2, 10) == 3
    with caplog.at_level(logging.INFO, logger="promptfcl"):
        out = Combiner("bulyan", byzantine=3)(toy[:5], np.ones(5))
    np.testing.assert_array_equal(out, np.median(np.stack(toy[:5]), axis=0).astype(np.float32))
    assert any("bulyan: 5 replies" in m and "fewer than the 15" in m and "median" in m for m in caplog.messages)


def _round(strategy, arrays, updates, counts, flower_identity=None):
    start = from_array_record(arrays)
    msgs = list(strategy.configure_train(1, arrays, ConfigRecord({"task": 0, "round": 0}), NodeList(len(updates))))
    replies = []
    for m in msgs:
        client = int(m.content["config"]["client-id"])
        state = {k: (v + updates[client][k]).astype(v.dtype) for k, v in start.items()}
        replies.append(Message(RecordDict({ARRAYS: to_array_record(state), METRICS: MetricRecord(
            {"num-examples": counts[client], "train-loss": 1.0, "train-seconds": 0.1})}), reply_to=m))
    return strategy.aggregate_round(1, replies), start


def _strategy(**overrides):
    from promptfcl.common.model.prompted import build_model
    from promptfcl.common.model.runtime import model_spec
    from promptfcl.strategies.registry import prompt_class, strategy_class

    cfg = tiny_config(**{"num-tasks": 1, "pool-size": 2, **overrides})
    model, _ = build_model(model_spec(cfg, 10), prompt_class("fedavg"))
    s = strategy_class("fedavg").of(cfg, 10)
    return s, s.on_task_start(0, to_array_record(model.trainable_state()))


#: defended, every screen off: only the aggregator stands between a hostile reply and the model
NO_SCREENS = {"update-norm-factor": 0.0, "update-clip": 0.0, "stats-bound": 0.0, "update-min-cosine": -1.0,
              "update-reversed-norm": 0.0, "update-strikes": 0, "update-mean-cosine": -1.0,
              "update-strike-norm": 0.0}


@pytest.mark.parametrize("mode", ["krum", "multikrum", "bulyan"])
def test_a_platform_round_with_one_hostile_reply_is_not_moved_by_it(flower_identity, mode):
    n = 7 if mode == "bulyan" else 5
    s, arrays = _strategy(aggregation=mode, defences="on", **NO_SCREENS, **{"byzantine-clients": 1, "num-clients": n,
                                                                            "clients-per-round": n})
    rng = np.random.default_rng(1)
    start = from_array_record(arrays)
    honest = {k: rng.normal(scale=0.01, size=v.shape) for k, v in start.items()}
    updates = [{k: h + rng.normal(scale=0.0005, size=h.shape) for k, h in honest.items()} for _ in range(n)]
    # hostile in one array only (the prompt reversed x10), honest in every other: a splice array
    # by array could still take its head; Krum and Bulyan keep or drop the reply whole
    updates[0] = {k: (-10 * h if k == "prompt.p0" else h) for k, h in honest.items()}
    outcome, start = _round(s, arrays, updates, [10] * n)
    assert 0 in outcome.clients  # accepted: no screen took it out, the aggregator alone did
    merged = from_array_record(outcome.arrays)
    for name in ("prompt.p0", "head.weight"):
        moved = merged[name].astype(np.float64) - start[name]
        assert np.abs(moved - honest[name]).max() < 0.005, name  # the honest update, not the hostile one
    mean = sum(u["prompt.p0"] for u in updates) / n  # what the plain mean would have given
    assert np.abs(mean - honest["prompt.p0"]).max() > 0.01


def test_krum_keeps_a_reply_whole_across_its_arrays():
    """Array a's most central reply is 0, array b's is 1: Krum over the whole reply returns one
    reply's a and b together, never a's of one and b's of another (a splice)."""
    from promptfcl.strategies.platform.aggregation import average_replies

    n = 7
    eye = np.eye(n, dtype=np.float32)
    a = [np.zeros(n, np.float32) if i == 0 else eye[i] for i in range(n)]
    b = [np.zeros(n, np.float32) if i == 1 else eye[i] + eye[(i + 1) % n] for i in range(n)]
    records = [to_array_record({"a": a[i], "b": b[i]}) for i in range(n)]
    per_array = [Combiner("krum", byzantine=2)(a, np.ones(n)), Combiner("krum", byzantine=2)(b, np.ones(n))]
    assert np.array_equal(per_array[0], a[0]) and np.array_equal(per_array[1], b[1])  # array by array: a splice
    out = from_array_record(average_replies(records, [0] * n, np.ones(n), "never", None, None,  # type: ignore[arg-type]
                                            Combiner("krum", byzantine=2)))
    assert any(np.array_equal(out["a"], a[i]) and np.array_equal(out["b"], b[i]) for i in range(n))


def test_a_defended_simulation_caps_a_clients_share_and_an_honest_one_does_not(flower_identity):
    """One client holding most samples carries at most max-client-weight in a defended simulated
    round ("defended" means "untrusted"); an honest simulation keeps FedAvg's sample weights."""
    counts = [900, 50, 30, 20]
    zero = None
    for defences, expected in (("on", 0.5), ("auto", 0.9)):
        s, arrays = _strategy(defences=defences, **{"num-clients": 4, "clients-per-round": 4})
        zero = zero or [{k: np.zeros(np.shape(v)) for k, v in from_array_record(arrays).items()} for _ in range(4)]
        outcome, _ = _round(s, arrays, zero, counts)
        shares = dict(zip(outcome.clients, outcome.shares))
        assert shares[0] == pytest.approx(expected)
        assert s.trust.defended == (defences == "on")


def test_the_worst_case_is_the_lowest_mean_over_the_attacks_per_method_share_and_defence():
    from promptfcl.server.bench.worst_case import worst_case_table, worst_cases

    def row(method, attack, defence, share, seed, a_n):
        return {"method": method, "attack": attack, "defence": defence, "share": share, "seed": seed, "A_N": a_n}

    rows = [row("fedavg", "clean", "off", 0.0, s, 50.0 + s) for s in (0, 1)] + \
        [row("fedavg", "clean", "on", 0.0, s, 49.0 + s) for s in (0, 1)] + \
        [row("fedavg", "alie", "on", 0.2, 0, 45.0), row("fedavg", "alie", "on", 0.2, 1, 47.0),
         row("fedavg", "ipm", "on", 0.2, 0, 40.0), row("fedavg", "ipm", "on", 0.2, 1, 48.0),  # mean 44: the worst
         row("fedavg", "ipm", "on", 0.4, 0, 30.0), row("fedavg", "alie", "on", 0.4, 0, 35.0),
         row("fedavg", "ipm", "krum", 0.2, 0, None), row("fedavg", "alie", "krum", 0.2, 0, 41.0)]
    worst = worst_cases(rows)
    assert [(w["share"], w["defence"], w["attack"], w["worst_A_N"]) for w in worst] == [
        (0.2, "krum", "alie", 41.0), (0.2, "on", "ipm", 44.0), (0.4, "on", "ipm", 30.0)]
    assert worst[1]["clean_A_N"] == 49.5 and worst[1]["clean_off_A_N"] == 50.5 and worst[0]["clean_A_N"] is None
    table = worst_case_table(worst).splitlines()
    assert table[3] == "| fedavg | 0.2 | on | 50.5 | 49.5 | 44.0 (-5.5) | ipm | 40.0, 48.0 |"


@pytest.mark.simulation
def test_bench_robustness_runs_a_colluding_attack_at_each_share_and_writes_the_worst_case(tmp_path):
    """One tiny real run of IPM through ``bench robustness`` (a list of shares): the simulation's
    server replaces the hostile client's reply in every round (its log says so), and the worst
    case names the attack."""
    import json

    from promptfcl.server import bench
    from tests.conftest import TINY

    base = {**TINY, "num-clients": 3, "clients-per-round": 3}
    rows = bench.robustness(tmp_path, base, ["fedavg"], ["ipm"], ["on"], [0], share=[0.3], clean=False)
    assert [(r["attack"], r["share"], r["defence"]) for r in rows] == [("ipm", 0.3, "on")]
    run = tmp_path / "runs" / "fedavg-ipm-on-seed0"
    results = json.loads((run / "results.json").read_text())
    assert results["config"]["fault"] == "ipm" and results["config"]["fault-clients"] == "0"
    replaced = (run / "simulate.log").read_text().count("fault ipm: 1 replies of colluding clients replaced")
    assert replaced == len(results["rounds"]) == 2 and all(0 in r["reply_clients"] for r in results["rounds"])
    worst = json.loads((tmp_path / "worst-case.json").read_text())
    assert [(w["method"], w["share"], w["defence"], w["attack"]) for w in worst] == [("fedavg", 0.3, "on", "ipm")]
    assert "| fedavg | 0.3 | on |" in (tmp_path / "robustness.md").read_text()
