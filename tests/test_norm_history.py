"""The pooled norm reference (``update-norm-rounds``, strategies/platform/screens/clip.py): a task's
reference norm and count are the lower of the round's own and those read over its kept replies of
the last rounds, so a round whose replies on a task are mostly hostile does not set its own
reference, nor does a task's early rounds' larger norms set a later round's; the history stays
bounded and survives a resume."""

from __future__ import annotations

import numpy as np
import pytest

from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from promptfcl.strategies.platform.screens import NORM_FILTER, LongReply, NormHistory, Strikes, UpdateClip, UpdateScreen
from tests.conftest import tiny_config

# FPPL under poison at Dirichlet 0.1 (seed 0): task 0's rounds had 3, 4 and 3 replies; in the third,
# hostile clients 0 and 1 were 2 of the 3 (norms 14.5 and 23.1 against the honest 1.4), so they set
# the round's lower median themselves, were kept whole and the round's accuracy fell from 96.6 to 51.1
HONEST_ROUNDS = [[1.28, 1.22, 1.25], [1.22, 3.46, 3.01]]
HOSTILE_ROUND = [14.46, 23.14, 1.38]


def _screen(rounds: int) -> UpdateScreen:
    return UpdateScreen.of(UpdateClip(3.0, by_count=True), Strikes(2), LongReply(5.0), NormHistory(rounds))


def _play(screen: UpdateScreen, norms: list[float], task: int = 0, clients: list[int] | None = None):
    updates = [{"w": np.array([n, 0.0])} for n in norms]  # one direction: only the norms differ
    return screen(updates, norms, [task] * len(norms), clients=clients or list(range(2, 2 + len(norms))),
                  counts=[8.0] * len(norms))


def test_a_hostile_majority_of_one_round_is_measured_against_the_tasks_earlier_rounds():
    pooled, alone = _screen(3), _screen(1)
    for norms in HONEST_ROUNDS:
        assert not _play(pooled, norms).excluded and not _play(alone, norms).excluded
    out = _play(pooled, HOSTILE_ROUND, clients=[0, 1, 9])
    assert set(out.excluded) == {0, 1} and {r[0] for r in out.excluded.values()} == {NORM_FILTER}
    assert "14.5 above update-strike-norm = 5 x its task's lower median 1.38" in out.excluded[0][1]
    # read over the round alone, the hostile pair sets the reference (14.5) and both are kept whole
    out = _play(alone, HOSTILE_ROUND, clients=[0, 1, 9])
    assert not out.excluded and not out.scales


def test_where_honest_norms_shrink_over_a_task_the_rounds_own_lower_reference_is_kept():
    """PILoRA's honest norms shrink about 10x over a task's rounds. A 10x reply of a later round
    reads as ordinary against the pooled rounds (lower median 2.0 of these), so the reference is the
    lower of the round's own (0.2) and the pooled one: the reply is excluded."""
    screen = _screen(3)
    for _ in range(2):
        _play(screen, [3.0, 3.0, 3.0])
    out = _play(screen, [0.2, 0.2, 0.2, 2.0], clients=[5, 6, 7, 1])
    assert set(out.excluded) == {3} and "lower median 0.2" in out.excluded[3][1]


def test_the_history_is_per_task_and_bounded_and_a_lone_reply_is_not_compared_with_it():
    screen = _screen(3)
    for r in range(20):  # twenty rounds on task 0, every fifth also one reply on task 1
        _play(screen, [1.0 + 0.01 * r, 1.1, 0.9])
        if r % 5 == 0:
            _play(screen, [1.0], task=1)
    assert [len(rounds) for rounds in screen.get(NormHistory).kept.values()] == [2, 2]  # rounds - 1 earlier rounds
    assert screen.get(NormHistory).kept[0][-1] == [(1.19, 8.0), (1.1, 8.0), (0.9, 8.0)]
    # a client alone on task 1 sending 20 x its history is not judged by norm (nothing to compare with)
    assert not _play(screen, [20.0], task=1).excluded
    # the same reply beside another one on task 1 is
    assert set(_play(screen, [20.0, 1.0], task=1, clients=[5, 6]).excluded) == {0}


def test_the_norm_history_survives_a_resume():
    cfg = tiny_config(num_clients=5, clients_per_round=5, defences="on")
    s = FedAvgStrategy.of(cfg, 10)
    assert s.policies.screen.get(NormHistory).rounds == 3  # on where defended, by default
    for norms in HONEST_ROUNDS:
        _play(s.policies.screen, norms)
    restored = FedAvgStrategy.of(cfg, 10)
    restored.load_platform_state(s.platform_state())
    assert restored.policies.screen.get(NormHistory).kept == s.policies.screen.get(NormHistory).kept
    assert set(_play(restored.policies.screen, HOSTILE_ROUND, clients=[0, 1, 9]).excluded) == {0, 1}
    assert FedAvgStrategy.of(tiny_config(defences="off"), 10).policies.screen.get(NormHistory).rounds == 1


def test_bad_settings_are_refused():
    from promptfcl.common.config.experiment import ConfigError

    with pytest.raises(ConfigError, match="update-norm-rounds"):
        tiny_config(update_norm_rounds=0)
