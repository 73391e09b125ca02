"""HGP's prompts: a pool of prompts with keys, weighted by normalised cosine scores."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ...common.model import CodaPrompt
from .options import HGPOptions


class HGPPrompt(CodaPrompt):
    """A pool of prompts with keys, weighted by normalised cosine scores (HGP, section 3.2.1).

    Weight of prompt m: ``s_m = cos(q, K_m)`` (no attention vectors), then "these scores are
    then normalized". The paper's formula is the only statement of how, the text says no more,
    and the authors' public code runs one shared prompt with no keys (its key matching, commented
    out, uses the plain cosine), so the normalisation is the project's reading, option
    ``hgp.score-norm``:

    * ``"l1"`` (default): ``alpha_m = s_m / sum_j |s_j|``, signs kept, so that the prompt's
      scale does not grow with the number of active prompts;
    * ``"softmax"``: ``alpha = softmax(s)`` over the active prompts (positive weights summing
      to 1, as attention over keys normalises);
    * ``"none"``: ``alpha_m = s_m``, CODA-P's unnormalised cosine (the authors' commented-out code).

    Task slices, freezing of earlier slices and orthogonal initialisation are CODA-P's, as
    in the shared base.
    """

    kinds = "pk"  # no attention vectors: they are neither trained nor transmitted
    score_norm = "l1"

    def configure(self, options: Mapping[str, Any]) -> None:
        """The ``hgp.score-norm`` of the run (``options``: its namespaced method options)."""

        self.score_norm = HGPOptions.from_options({k[len("hgp."):]: v for k, v in options.items()
                                                   if k.startswith("hgp.")}).score_norm

    def weights(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """alpha (B, M_active): cosine of the query with each key, normalised over the pool
        (``score_norm``)."""
        keys = self._active("k", layer, self.training)
        scores = F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).T
        if self.score_norm == "softmax":
            return scores.softmax(dim=-1)
        if self.score_norm == "none":
            return scores
        return scores / scores.abs().sum(dim=-1, keepdim=True).clamp_min(1e-8)
