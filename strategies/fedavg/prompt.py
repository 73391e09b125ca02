"""FedAvg-Prompt's prompts: CODA-P's decomposed prompts, unchanged."""

from __future__ import annotations

from ...common.model.prompted import CodaPrompt


class FedAvgPrompt(CodaPrompt):
    """CODA-P ("CODA-Prompt: COntinual Decomposed Attention-based Prompting for Rehearsal-Free
    Continual Learning"): components, keys and attention vectors per prompted block, one slice
    per task, earlier slices frozen."""
