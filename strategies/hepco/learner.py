"""HePCo's client: the shared local loop as it is (sec. 5.1: no extra client cost).

Clients train their task's slice of :class:`~promptfcl.strategies.hepco.prompt.HePCoPrompt`
(components weighted by the cosine with their keys) and the head with cross-entropy over the
current task's classes; all consolidation happens on the server.
"""

from __future__ import annotations

from ..platform.learner import LocalLearner
from .options import HePCoOptions


class HePCoLearner(LocalLearner):
    """Plain prompt learning (the paper's clients upload keys, prompts and head only)."""

    options_class = HePCoOptions
    opts: HePCoOptions
