"""FedAvg-Prompt's client: the shared local loop as it is (CE over the current task's classes)."""

from __future__ import annotations

from ..platform.learner import LocalLearner
from .options import FedAvgOptions


class FedAvgLearner(LocalLearner):
    """CODA-P local learning: the task's prompt slice and the head, cross-entropy on the current task."""

    opts: FedAvgOptions
