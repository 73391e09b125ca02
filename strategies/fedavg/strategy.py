"""FedAvg-Prompt: CODA-P clients and sample-weighted averaging, the papers' common baseline."""

from __future__ import annotations

from promptfcl.strategies.platform.strategy import PromptStrategy


class FedAvgPrompt(PromptStrategy):
    """FedAvg over CODA-P prompt components, keys, attention vectors and the head.

    Clients train their task's prompt slice and the head with cross-entropy over the
    current task's classes; the server averages by sample count. No extra state.
    """

    name = "fedavg"
