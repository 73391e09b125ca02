"""FedAvg-Prompt's options: none of its own (the run config's keys are the whole method)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...common.options import MethodOptions


@dataclass(frozen=True)
class FedAvgOptions(MethodOptions):
    """No ``fedavg.*`` keys."""

    prefix: ClassVar[str] = "fedavg"
