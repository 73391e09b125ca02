"""FedAvg-Prompt's options: none of its own (the run config's keys are the whole method)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...common.config.options import ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY, RANDOM_TASKS, MethodOptions


@dataclass(frozen=True)
class FedAvgOptions(MethodOptions):
    """No ``fedavg.*`` keys."""

    prefix: ClassVar[str] = "fedavg"
    COMPATIBILITY = frozenset({ASYNCHRONOUS_TASKS, RANDOM_TASKS, DIFFERENTIAL_PRIVACY})
