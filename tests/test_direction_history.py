"""The direction history (``update-mean-cosine``, strategies/platform/screens/direction.py): a client whose
updates point against the round on average is excluded while they do, however its single rounds
read; an honest label-skewed client's early disagreements keep it out only until its mean is back
above the threshold; the history survives a resume."""

from __future__ import annotations

import math

import numpy as np
import pytest

from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from promptfcl.strategies.platform.screens import (
    DIRECTION,
    DirectionCheck,
    DirectionHistory,
    Strikes,
    UpdateClip,
    UpdateScreen,
)
from tests.conftest import tiny_config

# per-round cosines with the round's median update, as recorded on the offline benchmark: a
# sign-flipping Fed-CPrompt client (seed 0, client 0: never below update-min-cosine = -0.6) and an
# honest label-skewed FPPL client (seed 1, client 9, the lowest honest means recorded)
HOSTILE = [0.26, -0.47, -0.45, 0.22, -0.55, -0.46, -0.43, 0.31, -0.5, -0.4]
HONEST = [-0.36, -0.02, 0.87, 0.5, -0.3, 0.6, 0.4, 0.7, 0.1, 0.3]
# an honest client holding the minority class of its tasks at Dirichlet 0.1 (LoRM, seed 1, client 9,
# undefended): its first replies point against the round, its later ones with it
SKEWED = [-0.24, -0.5, 0.09, 0.52, 0.64, 0.86, 0.6, 0.7]


def _at(cosine: float) -> dict[str, np.ndarray]:
    """A unit update whose cosine with (1, 0) is ``cosine``."""
    return {"w": np.array([cosine, math.sqrt(1 - cosine * cosine)])}


def _round(screen: UpdateScreen, hostile: float, honest: float):
    # three clients exactly on (1, 0): the coordinate-wise median of the five updates is (1, 0)
    updates = [_at(1.0), _at(1.0), _at(1.0), _at(honest), _at(hostile)]
    return screen(updates, [1.0] * 5, [0] * 5, clients=[0, 1, 2, 3, 4])


def test_a_client_pointing_against_the_round_on_average_is_excluded_from_its_third_reply_on():
    """The defended defaults (update-min-cosine -0.6, update-strikes 2, update-mean-cosine 0 after 3):
    the hostile client's cosines never cross -0.6, so neither the direction check nor the strikes
    ever see it; its mean over three replies (-0.22) does. The honest client's two disagreements
    (-0.36, -0.02) are not held against it: its mean at its third reply is +0.16."""
    screen = UpdateScreen.of(DirectionCheck(-0.6, 3.5), UpdateClip(5.0), Strikes(2), DirectionHistory(0.0, 3))
    for r, (hostile, honest) in enumerate(zip(HOSTILE, HONEST)):
        out = _round(screen, hostile, honest)
        assert out.cosines[4] is None or out.cosines[4] == pytest.approx(hostile)
        if r < 2:
            assert out.excluded == {}
        else:  # its mean is below 0 from its third reply on (-0.220 there): it stays out
            assert set(out.excluded) == {4} and out.excluded[4][0] == DIRECTION
            total, count = screen.get(DirectionHistory).sums[4]
            assert count == r + 1 and f"mean cosine {total / count:.3f}" in out.excluded[4][1]
            assert r > 2 or "mean cosine -0.220" in out.excluded[4][1]
    assert screen.get(Strikes).counts == {}  # no single round flagged either
    assert screen.get(DirectionHistory).excluded == {4} and screen.get(DirectionHistory).sums[3][1] == len(HONEST)
    assert screen.get(DirectionHistory).sums[4][1] == len(HOSTILE)  # still judged while excluded
    assert screen.get(DirectionHistory).sums[3][0] / len(HONEST) > 0.2


def test_a_label_skewed_client_is_readmitted_once_its_mean_is_back_above_the_threshold(caplog):
    """Its mean is below 0 at its third and fourth replies (-0.22, -0.03) and above from its fifth on
    (+0.10): two replies left out, not the rest of the run (it was excluded for good before, and
    LoRM lost 5.5 points of A_N at Dirichlet 0.1, seed 1)."""
    screen = UpdateScreen.of(DirectionCheck(-0.6, 3.5), Strikes(2), DirectionHistory(0.0, 3))
    kept = []
    with caplog.at_level("INFO", logger="promptfcl"):
        for skewed in SKEWED:
            kept.append(4 not in _round(screen, skewed, 1.0).excluded)
    assert kept == [True, True, False, False, True, True, True, True]
    assert screen.get(DirectionHistory).excluded == set() and screen.get(Strikes).counts == {}
    assert "client 4 readmitted" in caplog.text and caplog.text.count("point against the round on average") == 1


def test_off_it_remembers_nothing_and_under_dp_noise_it_is_not_applied(caplog):
    screen = UpdateScreen.of(DirectionCheck(-0.6, 3.5), Strikes(2))  # history off
    for hostile, honest in zip(HOSTILE, HONEST):
        assert _round(screen, hostile, honest).excluded == {}
    assert screen.get(DirectionHistory).sums == {}
    with caplog.at_level("INFO", logger="promptfcl"):
        rob = tiny_config(update_norm_factor=10.0, update_clip=5.0, update_min_cosine=-0.6, update_reversed_norm=3.5,
                          update_strikes=2, update_mean_cosine=0.0, update_mean_cosine_after=3).robustness
        noisy = UpdateScreen.configured(rob, defended=True, dp_noise=1.0)
    assert not noisy.get(DirectionHistory).active and "update-mean-cosine" in caplog.text


def test_the_history_survives_a_resume():
    cfg = tiny_config(num_clients=5, clients_per_round=5, defences="on")
    s = FedAvgStrategy.of(cfg, 10)
    assert s.policies.screen.get(DirectionHistory) == DirectionHistory(0.0, 3)  # on where defended, by default
    for hostile, honest in zip(HOSTILE[:2], HONEST[:2]):
        _round(s.policies.screen, hostile, honest)
    restored = FedAvgStrategy.of(cfg, 10)
    restored.load_platform_state(s.platform_state())
    out = _round(restored.policies.screen, HOSTILE[2], HONEST[2])  # its third reply, after the resume
    assert out.excluded[4][0] == DIRECTION
    again = FedAvgStrategy.of(cfg, 10)
    again.load_platform_state(restored.platform_state())
    assert again.policies.screen.get(DirectionHistory).excluded == {4}
    assert FedAvgStrategy.of(tiny_config(defences="off"), 10).policies.screen.get(DirectionHistory).active is False


@pytest.mark.parametrize("key,bad", [("update_mean_cosine", 1.0), ("update_mean_cosine", -1.5),
                                     ("update_mean_cosine_after", 0)])
def test_bad_settings_are_refused(key, bad):
    from promptfcl.common.config.experiment import ConfigError

    with pytest.raises(ConfigError, match=key.replace("_", "-")):
        tiny_config(**{key: bad})
