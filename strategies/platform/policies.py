"""The run's policies on a round's replies, chosen once from the run config (by ``PromptStrategy``'s
constructor: ``aggregation_policies``, ``update_screen``), applied by the platform.

``PromptStrategy`` holds one :class:`RunPolicies` and applies its members in this order to the
replies that passed the record checks, so no method screens, weighs, bounds or combines replies
its own way (a method only declares what its records hold, ``PromptStrategy.statistics``):

1. :class:`~promptfcl.strategies.platform.defences.UpdateScreen`: the update defences, each one
   class (``NormFilter``, ``DirectionCheck``, ``UpdateClip``) with the run's ``Strikes``;
2. :class:`~promptfcl.strategies.platform.aggregation.Weighting`: each reply's weight;
3. :class:`~promptfcl.strategies.platform.statistics.StatisticsBound`: the statistics records
   (and those of the exchange before training) bounded before the method sees them;
4. :class:`~promptfcl.strategies.platform.aggregation.Combiner`: how the replies' arrays combine.

The defences (1 and 3) are off where the run is not defended (``defences``, common/trust.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .aggregation import Combiner, Weighting
from .defences import UpdateScreen
from .statistics import StatisticsBound


@dataclass(frozen=True)
class RunPolicies:
    """The run's update screen, weighting, statistics bound and combiner (module docstring)."""

    weighting: Weighting
    combiner: Combiner
    screen: UpdateScreen  # its strikes are the run's history (kept in the checkpoint)
    stats_bound: StatisticsBound

    @property
    def defended(self) -> bool:
        """Whether any defence applies (the round's record then counts what each did)."""
        return self.screen.active or self.stats_bound.active

