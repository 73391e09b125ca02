"""Trust as a run setting (common/config/trust.py): the hostile-client defences apply to deployed nodes
and to runs with fault injection, never to a simulation of this project's own clients."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.config.trust import resolve_trust
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from tests.conftest import tiny_config
from tests.helpers import NodeList


@pytest.mark.parametrize("setting, population, fault, defended, reason", [
    ("auto", "virtual", "", False, "simulation"),
    ("auto", "nodes", "", True, "deployed nodes"),
    ("auto", "virtual", "poison", True, "fault injection"),
    ("on", "virtual", "", True, "'on'"),
    ("off", "nodes", "poison", False, "'off'"),
])
def test_defences_resolve_from_the_run(setting, population, fault, defended, reason):
    trust = resolve_trust(setting, population, fault)
    assert trust.defended is defended and reason in trust.why
    assert trust.to_dict() == {"resolved": "on" if defended else "off", "why": trust.why}


def test_a_bad_defences_value_stops_the_run_before_anything_loads():
    with pytest.raises(ConfigError, match="defences must be one of"):
        tiny_config(defences="maybe")


def _round(defences: str, **extra) -> FedAvgStrategy:
    """Four honest replies moving every weight by +1 and one reversed x10: aggregated once."""
    s = FedAvgStrategy.of(tiny_config(num_clients=5, clients_per_round=5, defences=defences, **extra), 10)
    sent = to_array_record({"head.weight": np.zeros((3, 2), np.float32)})
    msgs = list(s.configure_train(1, sent, ConfigRecord({"task": 0, "round": 0}), NodeList(5)))
    replies = [Message(RecordDict({ARRAYS: to_array_record({"head.weight": np.full((3, 2), v, np.float32)}),
                                   METRICS: MetricRecord({"num-examples": 10, "train-loss": 1.0,
                                                          "train-seconds": 0.1})}), reply_to=m)
               for v, m in zip([1.0, 1.0, 1.0, 1.0, -10.0], msgs)]
    s.outcome = s.aggregate_round(1, replies)
    return s


def test_an_undefended_run_averages_every_reply_as_the_paper_does(flower_identity):
    s = _round("auto")  # a simulation without fault injection: off
    assert not s.trust.defended and not s.policies.defended
    np.testing.assert_allclose(from_array_record(s.outcome.arrays)["head.weight"], (4 - 10) / 5, rtol=1e-6)
    assert not s.outcome.rejected and s.outcome.defences == {}


def test_a_defended_run_screens_the_same_replies(flower_identity):
    s = _round("auto", fault="poison", fault_clients="4")  # fault injection: on
    assert s.trust.defended and s.policies.screen.active
    np.testing.assert_allclose(from_array_record(s.outcome.arrays)["head.weight"], 1.0, rtol=1e-6)
    assert s.outcome.defences["direction"] == 1 and len(s.outcome.rejected) == 1


def test_a_client_alone_on_its_task_is_not_clipped_as_its_single_task_reference_is_not(flower_identity):
    """Norms are compared among the replies on one task: with tasks in flight, a long update alone
    on its task (random tasks: every task has one owner, and Powder's transfer reference trains it
    alone, unclipped) keeps its length, while the same length among three replies on another task
    is clipped to update-clip x their lower median."""
    from promptfcl.strategies.platform.screens import UpdateClip, UpdateScreen

    screen = UpdateScreen.of(UpdateClip(5.0))
    updates = [{"w": np.full(4, v)} for v in (1.0, 1.1, 9.0, 9.0)]
    out = screen(updates, [float(np.linalg.norm(u["w"])) for u in updates], tasks=[0, 0, 0, 1])
    assert set(out.scales) == {2}  # the long one among task 0's replies, not the lone task-1 reply
    assert out.scales[2] == pytest.approx(5.0 * 1.1 / 9.0)


@pytest.mark.e2e
def test_a_defended_runs_records_count_what_each_defence_did(tmp_path):
    """Fault injection turns the defences on by itself; every round's record says what each one
    did, and results.json says why the run was defended."""
    from tests.helpers import simulate_in_process

    results = simulate_in_process(tmp_path, "fedavg", **{"num-clients": 4, "clients-per-round": 4,
                                                          "fault": "poison", "fault-clients": "0"})
    assert results["defences"]["resolved"] == "on" and "fault injection" in results["defences"]["why"]
    rounds = results["rounds"]
    assert all(set(r["defences"]) == {"norm-filter", "direction", "clip", "struck-out", "stats"} for r in rounds)
    assert sum(r["defences"]["norm-filter"] + r["defences"]["direction"] for r in rounds) >= 1
    assert all(len(r["update_cosines"]) == r["clients_aggregated"] for r in rounds)
    # whose each recorded reply is: the clients sent to, less those left out (client 0, once struck out)
    for r in rounds:
        sent = [p["client"] for p in r["placement"]]
        assert len(r["reply_clients"]) == r["clients_aggregated"] and set(r["reply_clients"]) <= set(sent)
    assert 0 not in rounds[-1]["reply_clients"] and 0 in [p["client"] for p in rounds[-1]["placement"]]


@pytest.mark.e2e
def test_a_defended_honest_run_is_the_undefended_run_bit_for_bit(tmp_path):
    """Where no screen triggers (honest clients within the defaults' bounds), a defended run
    computes exactly what the paper's aggregation computes: same accuracy matrix, same rounds.
    The max-client-weight cap, which a defended simulation applies (tests/test_byzantine.py), is
    lifted (1.0) here: one of these four clients holds more than half of some round's samples."""
    from tests.helpers import simulate_in_process

    runs = {d: simulate_in_process(tmp_path / d, "fedavg", **{"num-clients": 4, "clients-per-round": 4,
                                                               "defences": d, "max-client-weight": 1.0})
            for d in ("off", "on")}
    assert runs["on"]["defences"]["resolved"] == "on" and runs["off"]["defences"]["resolved"] == "off"
    assert all(not any(r["defences"].values()) for r in runs["on"]["rounds"])  # nothing excluded or clipped
    assert runs["on"]["accuracy_matrix"] == runs["off"]["accuracy_matrix"]
    assert [r["update_norms"] for r in runs["on"]["rounds"]] == [r["update_norms"] for r in runs["off"]["rounds"]]
