"""HePCo's client: the shared local loop as it is (sec. 5.1: no extra client cost).

Clients train :class:`~promptfcl.strategies.hepco.prompt.HePCoPrompt` (components weighted by
the cosine with their keys: the whole pool, or their task's slice) and the head with
cross-entropy over the current task's classes; all consolidation happens on the server. With
``client-weights = "class-counts"`` a reply also carries the client's label counts (records.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..platform.learner import LocalLearner
from .options import HePCoOptions
from .records import CLASS_COUNTS, class_counts


class HePCoLearner(LocalLearner):
    """Plain prompt learning (the paper's clients upload keys, prompts and head, and the
    server's per-class teacher weights need their label counts)."""

    opts: HePCoOptions

    def round_end(self, index: np.ndarray, task: int) -> dict[str, Any]:
        if self.opts.client_weights != "class-counts":
            return {}
        return {CLASS_COUNTS: class_counts(self.labels_of(index, task))}
