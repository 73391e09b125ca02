"""The run's policies on a round's replies, chosen once from the run's robustness section (by
``PromptStrategy``'s constructor: :func:`run_policies`), applied by the platform.

``PromptStrategy`` holds one :class:`RunPolicies` and applies its members in this order to the
replies that passed the record checks, so no method screens, weighs, bounds or combines replies
its own way (a method only declares what its records hold, ``PromptStrategy.statistics``):

1. :class:`~promptfcl.strategies.platform.screens.UpdateScreen`: the update defences, the
   registered screens in order (strategies/platform/screens/registry.py), each one class with its
   own state (the run's ``Strikes``, ``DirectionHistory``, ``NormHistory``);
2. :class:`~promptfcl.strategies.platform.aggregation.Weighting`: each reply's weight;
3. :class:`~promptfcl.strategies.platform.statistics.StatisticsBound`: the statistics records
   (and those of the exchange before training) bounded before the method sees them;
4. :class:`~promptfcl.strategies.platform.aggregation.Combiner`: how the replies' arrays combine.

The defences (1 and 3) are off where the run is not defended (``defences``, common/config/trust.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .aggregation import Combiner, Weighting, aggregation_policies
from .attack_policy import ColludingAttack
from .screens import UpdateScreen
from .statistics import StatisticsBound

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    import numpy as np

    from ...common.config.experiment import FederationSection, RobustnessSection
    from .rounds import Accepted, Sent


@dataclass(frozen=True)
class RunPolicies:
    """The run's update screen, weighting, statistics bound and combiner (module docstring)."""

    weighting: Weighting
    combiner: Combiner
    screen: UpdateScreen  # its screens' states are the run's history (kept in the checkpoint)
    stats_bound: StatisticsBound
    attack: ColludingAttack = ColludingAttack()  # a simulation's colluding hostile clients (fault injection)

    @property
    def defended(self) -> bool:
        """Whether any defence applies (the round's record then counts what each did)."""
        return self.screen.active or self.stats_bound.active

    def screen_replies(self, replies: Sequence[Accepted], start_of: Callable[[Sent], Mapping[str, np.ndarray] | None]
                       ) -> tuple[list[Accepted], list[tuple[Accepted, str]], dict[str, int]]:
        """The replies that passed the record checks, the colluders' first replaced by their attack
        (a simulation with a colluding fault), then screened (:meth:`UpdateScreen.apply`)."""
        self.attack.apply(replies, start_of)
        return self.screen.apply(replies, start_of)


def run_policies(rob: RobustnessSection, defended: bool, noise_multiplier: float,
                 federation: FederationSection) -> RunPolicies:
    """The policies of a run with robustness section ``rob`` and ``federation``: the screen and the
    statistics bound only where the run is ``defended``; counts capped where the server cannot
    check them (deployed nodes) or does not trust them (``defended``: an honest simulation is
    computed as its paper defines it, uncapped); a simulation's colluding attack."""
    nodes, hostile = federation.population == "nodes", rob.fault_client_ids
    share = (len(hostile) / federation.num_clients if hostile else rob.fault_rate) if rob.fault else 0.0
    weighting, combiner = aggregation_policies(rob.aggregation, rob.trim_fraction,
                                               rob.max_client_weight if nodes or defended else 0.0,
                                               rob.byzantine_clients, share)
    screen = UpdateScreen.configured(rob, defended, noise_multiplier)
    attack = ColludingAttack(rob.fault if not nodes else "", hostile, rob.fault_knowledge, rob.fault_z,
                             rob.fault_epsilon)
    return RunPolicies(weighting, combiner, screen, StatisticsBound(rob.stats_bound if defended else 0.0), attack)
