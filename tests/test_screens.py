"""The update defences as a pipeline of screens (strategies/platform/screens/): a registered screen
runs in its place among the others, sees what the screens before it made of the round, is built
from the robustness section, and its state is its own checkpoint entry, kept through a real
checkpoint file; the entries of the built-in screens keep the names earlier checkpoints have."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from promptfcl.server import checkpoint
from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from promptfcl.strategies.platform.screens import (
    DIRECTION,
    NORM_FILTER,
    SCREENS,
    NormFilter,
    NormHistory,
    Screen,
    ScreenRound,
    Strikes,
    UpdateScreen,
    registry,
)
from tests.conftest import tiny_config
from tests.helpers import make_ckpt
from tests.test_strikes import _replies


@dataclass
class ReplyCap(Screen):
    """A toy screen: a client's replies are excluded once it has sent ``limit`` that reached it
    (``update-strikes`` doubles as its setting). It records what it saw in each round."""

    key = "reply-cap"

    limit: int = 0
    sent: dict[int, int] = field(default_factory=dict)  # client -> replies that reached this screen
    seen: list[list[int]] = field(default_factory=list)  # each round: the replies it saw (indices)
    cosines_seen: list[list[float | None]] = field(default_factory=list)

    @classmethod
    def of(cls, rob: Any, noisy: bool) -> ReplyCap:
        return cls(rob.update_strikes)

    @property
    def active(self) -> bool:
        return self.limit > 0

    def screen(self, r: ScreenRound) -> None:
        live = r.remaining()
        self.seen.append(live)
        self.cosines_seen.append(list(r.out.cosines))
        for i in live:
            client = r.clients[i]
            if self.limit and self.sent.get(client, 0) >= self.limit:
                r.out.excluded[i] = ("reply-cap", f"client {client} sent {self.limit} replies")
            self.sent[client] = self.sent.get(client, 0) + 1

    def to_dict(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(self.sent.items())}

    def load(self, state: dict[str, int]) -> None:
        self.sent = {int(k): int(v) for k, v in state.items()}


@pytest.fixture
def with_reply_cap(monkeypatch):
    """ReplyCap registered after the norm filter, before the direction check (one line, as a new screen)."""
    at = SCREENS.index(NormFilter) + 1
    monkeypatch.setattr(registry, "SCREENS", (*SCREENS[:at], ReplyCap, *SCREENS[at:]))


def test_a_registered_screen_runs_in_its_place(with_reply_cap):
    """Five replies on one task: one 30 x long (the norm filter, before the toy, excludes it: the toy
    never sees it), one reversed and 5 x long (the direction check, after the toy, excludes it: the
    toy saw it). The toy reads the cosines measured before it."""
    rob = tiny_config(defences="on", update_strikes=2).robustness
    screen = UpdateScreen.configured(rob, defended=True, dp_noise=0.0)
    assert [type(s) for s in screen.screens].index(ReplyCap) == [type(s) for s in screen.screens].index(NormFilter) + 1
    updates = [{"w": np.array([1.0, 0.1 * i])} for i in range(3)] + [{"w": np.array([30.0, 0.0])},
                                                                      {"w": np.array([-5.0, 0.0])}]
    out = screen(updates, [float(np.linalg.norm(u["w"])) for u in updates], [0] * 5, clients=[10, 11, 12, 13, 14])
    toy = screen.get(ReplyCap)
    assert toy.seen == [[0, 1, 2, 4]]
    assert out.excluded[3][0] == NORM_FILTER and out.excluded[4][0] == DIRECTION
    assert toy.cosines_seen[0][4] is not None and toy.cosines_seen[0][4] < 0
    assert toy.sent == {10: 1, 11: 1, 12: 1, 14: 1}


def test_a_registered_screens_state_survives_a_checkpoint_file(with_reply_cap, tmp_path, flower_identity):
    """A defended run with the toy (limit 2): two rounds, a checkpoint file written and read back,
    and a strategy restored from it excludes every client in its first round (each has sent two);
    a fresh strategy excludes none. Its exclusions are counted under its own name."""
    cfg = tiny_config(num_clients=5, clients_per_round=5, defences="on", update_strikes=2)
    s = FedAvgStrategy.of(cfg, 10)
    assert s.policies.screen.get(ReplyCap).limit == 2 and s.policies.defended
    for server_round in (1, 2):
        outcome = s.aggregate_round(server_round, _replies(s, server_round, reversed_client=-1))
        assert len(outcome.accepted) == 5
    state = s.platform_state()
    assert state["reply-cap"] == {str(c): 2 for c in range(5)}
    checkpoint.save(replace(make_ckpt(2), platform_state=state), tmp_path)
    restored = FedAvgStrategy.of(cfg, 10)
    restored.load_platform_state(checkpoint.load(tmp_path).platform_state)
    assert restored.policies.screen.get(ReplyCap).sent == {c: 2 for c in range(5)}
    outcome = restored.aggregate_round(3, _replies(restored, 3, reversed_client=-1))
    assert not outcome.accepted and outcome.defences["reply-cap"] == 5
    fresh = FedAvgStrategy.of(cfg, 10)
    assert len(fresh.aggregate_round(3, _replies(fresh, 3, reversed_client=-1)).accepted) == 5


def test_the_checkpoint_keeps_the_entries_earlier_checkpoints_have(tmp_path, flower_identity):
    """A defended run's platform state has the entries of earlier versions (strikes, direction-history,
    norm-history) and no other, and a state written by them loads."""
    cfg = tiny_config(num_clients=5, clients_per_round=5, defences="on")
    s = FedAvgStrategy.of(cfg, 10)
    for server_round in (1, 2):
        s.aggregate_round(server_round, _replies(s, server_round, reversed_client=3))
    state = s.platform_state()
    assert set(state) == {"node-sizes", "schedule-slots", "strikes", "direction-history", "norm-history"}
    assert state["strikes"] == {"3": 2}
    earlier = {"node-sizes": {}, "schedule-slots": {}, "strikes": {"3": 2}, "direction-history": {"3": [-1.5, 2, 0.0]},
               "norm-history": {"0": [[[1.0, 10.0], [1.2, 10.0]]]}}
    checkpoint.save(replace(make_ckpt(2), platform_state=earlier), tmp_path)
    restored = FedAvgStrategy.of(cfg, 10)
    restored.load_platform_state(checkpoint.load(tmp_path).platform_state)
    assert restored.platform_state() == earlier
    assert restored.policies.screen.get(Strikes).struck_out(3)
    assert restored.policies.screen.get(NormHistory).kept == {0: [[(1.0, 10.0), (1.2, 10.0)]]}


def test_bad_pipelines_are_refused():
    with pytest.raises(ValueError, match="same checkpoint entry"):
        UpdateScreen([Strikes(), Strikes()])
    with pytest.raises(ValueError, match="not registered screens: \\['ReplyCap'\\]"):
        UpdateScreen.of(ReplyCap())
