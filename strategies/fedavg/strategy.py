"""FedAvg-Prompt's server: the platform's sample-weighted average, nothing more."""

from __future__ import annotations

from ..platform.strategy import PromptStrategy
from .options import FedAvgOptions


class FedAvgStrategy(PromptStrategy):
    """FedAvg over CODA-P prompt components, keys, attention vectors and the head.

    Clients train their task's prompt slice and the head with cross-entropy over the
    current task's classes; the server averages by sample count. No extra state.
    """

    opts: FedAvgOptions
