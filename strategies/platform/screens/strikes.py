"""Strikes (``update-strikes``): every reply the norm filter, the long-reply bound or the direction
check flags is a strike against its client, kept for the run. A client whose strikes reach the
limit is excluded from then on, the reply that reached it included. An honest label-skewed client
disagrees with the round now and then, a hostile one in most rounds: so a lone disagreement is
recorded, not punished, and a hostile client's second strike ends its part in the run (a clip
alone is no strike)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .base import STRUCK_OUT, Screen, ScreenRound

if TYPE_CHECKING:
    from typing import Self

    from ....common.config.sections import RobustnessSection

log = logging.getLogger("promptfcl")


@dataclass
class Strikes(Screen):
    """Each client's strikes over the run: replies the norm filter or the direction check flagged.

    A client whose strikes reach ``limit`` (``update-strikes``) is excluded from then on; 0: off,
    nothing is counted and a direction flag excludes its reply at once. Its screen excludes the
    replies of clients struck out in earlier rounds and makes the round's later screens' flags
    strikes (:meth:`ScreenRound.strike`). Kept in the checkpoint."""

    key = "strikes"

    limit: int = 0
    counts: dict[int, int] = field(default_factory=dict)  # client id -> strikes so far

    @classmethod
    def of(cls, rob: RobustnessSection, noisy: bool) -> Self:
        return cls(rob.update_strikes)

    def struck_out(self, client: int) -> bool:
        return self.limit > 0 and self.counts.get(client, 0) >= self.limit

    def add(self, client: int) -> bool:
        """Record a strike; whether the client is now struck out (never where strikes are off)."""
        if self.limit <= 0:
            return False
        self.counts[client] = self.counts.get(client, 0) + 1
        if self.counts[client] == self.limit:
            log.warning("client %d struck out: %d of its updates were too long or pointed against the round "
                        "(update-strikes = %d); its replies are excluded from now on",
                        client, self.limit, self.limit)
        return self.struck_out(client)

    def screen(self, r: ScreenRound) -> None:
        r.strikes = self
        for i, client in enumerate(r.clients):
            if self.struck_out(client):
                r.out.excluded[i] = (STRUCK_OUT, f"client {client} struck out earlier in the run "
                                                 f"(update-strikes = {self.limit})")

    def to_dict(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(self.counts.items())}

    def load(self, counts: Mapping[str, int]) -> None:
        self.counts = {int(k): int(v) for k, v in counts.items()}
