"""Strikes (``update-strikes``, strategies/platform/screens/strikes.py): a lone disagreement of an honest
label-skewed client is recorded, not punished; a client the screens flag in two rounds is
excluded from then on, and the history survives a resume."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from promptfcl.strategies.platform.screens import (
    CLIP,
    DIRECTION,
    NORM_FILTER,
    STRUCK_OUT,
    DirectionCheck,
    LongReply,
    Strikes,
    UpdateClip,
    UpdateScreen,
)
from tests.conftest import tiny_config
from tests.helpers import NodeList

SHARED = np.array([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])


def _honest(client: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A label-skewed honest update: the shared direction plus the client's own class's column."""
    u = SHARED + 0.1 * rng.normal(size=6)
    u[2 + client % 4] += 1.0
    return {"w": u}


def test_over_many_rounds_a_lone_disagreement_is_kept_and_a_hostile_client_contributes_once():
    """Eight rounds of five clients: client 2 points against the round once (round 3), client 4
    sends its honest update reversed in every round but round 6 (where it plays honest). The
    screen keeps client 2's lone disagreement and every other honest reply; client 4's first
    reversed reply is kept (one strike), its second strikes it out, and from then on even its
    honest-looking reply is excluded."""
    rng = np.random.default_rng(0)
    screen = UpdateScreen.of(DirectionCheck(-0.6, 3.5), UpdateClip(5.0), Strikes(2))
    kept_of: dict[int, list[int]] = {c: [] for c in range(5)}
    for r in range(8):
        updates = [_honest(c, rng) for c in range(5)]
        if r == 3:
            updates[2] = {"w": -updates[2]["w"]}
        if r != 6:
            updates[4] = {"w": -updates[4]["w"]}
        out = screen(updates, [float(np.linalg.norm(u["w"])) for u in updates], [0] * 5, clients=list(range(5)))
        for c in range(5):
            if c not in out.excluded:
                kept_of[c].append(r)
        if r == 1:
            assert out.excluded[4][0] == STRUCK_OUT and "strike 2" in out.excluded[4][1]
        if r >= 2:
            assert out.excluded == {4: out.excluded[4]} and out.excluded[4][0] == STRUCK_OUT
    assert kept_of[2] == list(range(8)) and all(kept_of[c] == list(range(8)) for c in (0, 1, 3))
    assert kept_of[4] == [0]  # its first reversed reply only
    assert screen.get(Strikes).counts == {2: 1, 4: 2}


def test_a_clip_is_not_a_strike():
    """A tight update-clip clips honest replies (half of them at 1 x the lower median): clipping
    a long reply keeps it and leaves its client's record clean, round after round."""
    screen = UpdateScreen.of(DirectionCheck(-0.6, 0.0), UpdateClip(1.0), Strikes(2))
    updates = [{"w": np.array([1.0 + 0.5 * i, 0.1 * i, 0.0])} for i in range(5)]
    for _ in range(3):
        out = screen(updates, [float(np.linalg.norm(u["w"])) for u in updates], [0] * 5, clients=[10, 11, 12, 13, 14])
        assert not out.excluded and set(out.scales) == {3, 4}
    assert screen.get(Strikes).counts == {} and out.counts()[CLIP] == 2


def test_a_reply_longer_than_the_strike_norm_is_excluded_and_struck_and_an_honest_tail_is_only_clipped():
    """update-clip 3 sits in the honest tail, update-strike-norm 5 above it. Six rounds of five
    clients: client 1 is honest and long (3.5 x the others) in every round, clipped and never
    struck; client 4 agrees with the round but sends 8 x an honest length (a scaled update whose
    direction the round's median cannot tell apart): its first reply is excluded and struck (kept
    at 3 x, two such replies of five outweighed the round), its second strikes it out, and from
    then on it is excluded."""
    screen = UpdateScreen.of(DirectionCheck(-0.6, 3.5), UpdateClip(3.0), Strikes(2), LongReply(5.0))
    rng = np.random.default_rng(1)
    for r in range(6):
        updates = [{"w": np.array([1.0, 0.5, 0.0]) + 0.1 * rng.normal(size=3)} for _ in range(5)]
        updates[1] = {"w": 3.5 * updates[1]["w"]}
        updates[4] = {"w": 8.0 * updates[4]["w"]}
        norms = [float(np.linalg.norm(u["w"])) for u in updates]
        out = screen(updates, norms, [0] * 5, clients=list(range(5)))
        assert 1 in out.scales and 1 not in out.excluded  # the honest tail: clipped, kept
        assert 4 not in out.scales
        assert out.excluded[4][0] == (NORM_FILTER if r <= 1 else STRUCK_OUT)  # the second strike: still its own
        assert set(out.excluded) == {4}
    assert screen.get(Strikes).counts == {4: 2}


def test_a_long_reply_the_direction_check_flagged_is_excluded_with_one_strike():
    """With update-reversed-norm off, a reply reversed and 8 x long is flagged by the direction
    check (its strike) and excluded for its length, without a second strike for the same reply."""
    screen = UpdateScreen.of(DirectionCheck(-0.6, 0.0), UpdateClip(3.0), Strikes(2), LongReply(5.0))
    updates = [{"w": np.array([1.0, 0.1 * i])} for i in range(4)] + [{"w": np.array([-8.0, 0.0])}]
    out = screen(updates, [float(np.linalg.norm(u["w"])) for u in updates], [0] * 5, clients=list(range(5)))
    assert set(out.excluded) == {4} and out.excluded[4][0] == NORM_FILTER and not out.scales
    assert screen.get(Strikes).counts == {4: 1}


def test_the_long_reply_bound_grows_with_the_sample_count_like_the_clip():
    """A client holding most of a class sends a long honest reply (PILoRA at Dirichlet 0.1: 187
    samples against 8 at the median, 4.7 x the lower median norm). With the count allowance, 6 x
    on 187 samples is neither excluded nor struck (its bound is 5 x sqrt(187 / 8) = 24 x), while 6 x
    on the median count is; without it (update-clip-by-count false) both are (the lower median norm
    is 1.2)."""
    counts = [8, 63, 3, 187, 8]
    updates = [{"w": np.array([n, 0.0])} for n in [1.0, 1.2, 1.0, 6.5, 6.5]]
    norms = [float(u["w"][0]) for u in updates]
    by_count = UpdateScreen.of(UpdateClip(3.0, by_count=True), Strikes(2), LongReply(5.0))
    out = by_count(updates, norms, [0] * 5, clients=list(range(5)), counts=counts)
    assert set(out.excluded) == {4} and out.excluded[4][0] == NORM_FILTER and 3 not in out.scales
    assert by_count.get(Strikes).counts == {4: 1}
    flat = UpdateScreen.of(UpdateClip(3.0), Strikes(2), LongReply(5.0))
    assert set(flat(updates, norms, [0] * 5, clients=list(range(5)), counts=counts).excluded) == {3, 4}


def test_the_clip_allows_a_client_holding_more_samples_sqrt_n_more_and_never_less():
    """PILoRA at Dirichlet 0.1 (seed 0, round 7): a client holding 187 of the task's 269 samples sent
    4.7 x the lower median norm (its clients held 8 samples each) and was clipped to 3 x; its
    prototype rows stayed short and the run lost 5.4 points. With the bound x sqrt(n / lower median
    n) it is kept whole (its bound is 14.5 x), while a client on the median count is clipped at 3 x
    as before, and one on fewer samples at 3 x too (never below). A scaled-up reply of a large
    client is still clipped at its own bound."""
    norms, counts = [1.0, 1.6, 1.0, 4.7, 1.0], [8, 63, 3, 187, 8]
    by_count, flat = UpdateClip(3.0, by_count=True), UpdateClip(3.0)
    assert flat.scales(norms, 1.0, counts, 8)[3] == pytest.approx(3.0 / 4.7)
    assert by_count.scales(norms, 1.0, counts, 8) == [1.0] * 5
    long_small = [1.0, 1.0, 1.0, 4.0, 1.0]  # the long reply is the 3-sample client's: bound 3 x
    assert by_count.scales(long_small, 1.0, [8, 8, 8, 3, 8], 8)[3] == pytest.approx(3.0 / 4.0)
    scaled = by_count.scales([1.0, 1.0, 1.0, 40.0, 1.0], 1.0, counts, 8)[3]
    assert 40.0 * scaled == pytest.approx(3.0 * (187 / 8) ** 0.5)
    # the screen reads the reference count from the replies the norm filter kept
    screen = UpdateScreen.of(UpdateClip(3.0, by_count=True))
    updates = [{"w": np.array([n, 0.0])} for n in norms]
    assert screen(updates, norms, [0] * 5, counts=counts).scales == {}
    assert set(UpdateScreen.of(UpdateClip(3.0))(updates, norms, [0] * 5, counts=counts).scales) == {3}


def test_without_strikes_a_flag_excludes_at_once_and_nothing_is_remembered():
    screen = UpdateScreen.of(DirectionCheck(-0.6, 0.0))  # update-strikes 0
    updates = [{"w": np.array([1.0, 0.1 * i])} for i in range(4)] + [{"w": np.array([-1.0, 0.0])}]
    for _ in range(3):
        out = screen(updates, [float(np.linalg.norm(u["w"])) for u in updates], [0] * 5, clients=list(range(5)))
        assert set(out.excluded) == {4} and out.excluded[4][0] == DIRECTION
    assert screen.get(Strikes).counts == {}


def _replies(s: FedAvgStrategy, server_round: int, reversed_client: int) -> list[Message]:
    sent = to_array_record({"head.weight": np.zeros((3, 2), np.float32)})
    msgs = list(s.configure_train(server_round, sent, ConfigRecord({"task": 0, "round": server_round - 1}),
                                  NodeList(5)))
    out = []
    for m in msgs:
        client = s._sent_round.match(Message(RecordDict(), reply_to=m), consume=False).client
        w = np.full((3, 2), 1.0, np.float32)
        w[1 + client % 2, client % 2] += 1.0  # label skew
        if client == reversed_client:
            w = -w
        out.append(Message(RecordDict({ARRAYS: to_array_record({"head.weight": w}), METRICS: MetricRecord(
            {"num-examples": 10, "train-loss": 1.0, "train-seconds": 0.1})}), reply_to=m))
    return out


def test_strikes_are_kept_across_a_resume_and_logged_once(flower_identity, caplog):
    """A deployed run (defended) whose client 3 sends reversed updates: after two rounds it is
    struck out (one warning naming it); a strategy restored from the checkpoint's platform state
    excludes it from its first round on."""
    cfg = tiny_config(num_clients=5, clients_per_round=5, defences="on", update_min_cosine=-0.6)
    s = FedAvgStrategy.of(cfg, 10)
    assert s.policies.screen.get(Strikes).limit == 2
    with caplog.at_level("WARNING", logger="promptfcl"):
        for server_round in (1, 2):
            outcome = s.aggregate_round(server_round, _replies(s, server_round, reversed_client=3))
    assert outcome.defences[STRUCK_OUT] == 1 and len(outcome.accepted) == 4
    assert [r.getMessage() for r in caplog.records if "struck out" in r.getMessage()] == [
        "client 3 struck out: 2 of its updates were too long or pointed against the round "
        "(update-strikes = 2); its replies are excluded from now on"]
    state = s.platform_state()
    assert state["strikes"] == {"3": 2}
    restored = FedAvgStrategy.of(cfg, 10)
    restored.load_platform_state(state)
    outcome = restored.aggregate_round(3, _replies(restored, 3, reversed_client=-1))  # it plays honest now
    arrays = outcome.arrays
    assert len(outcome.accepted) == 4 and "struck out earlier" in outcome.rejected[0][1]
    assert from_array_record(arrays)["head.weight"].min() >= 1.0  # only the honest four averaged


@pytest.mark.parametrize("bad", [-1, -3])
def test_a_negative_strike_limit_is_refused(bad):
    from promptfcl.common.config.experiment import ConfigError

    with pytest.raises(ConfigError, match="update-strikes must be >= 0"):
        tiny_config(update_strikes=bad)
