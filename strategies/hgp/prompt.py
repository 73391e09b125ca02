"""HGP's prompts: a pool of prompts with keys, weighted by normalised cosine scores."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from promptfcl.common.model import CodaPrompt


class HGPPrompt(CodaPrompt):
    """A pool of prompts with keys, weighted by normalised cosine scores (paper 3.2.1).

    Weight of prompt m: ``s_m = cos(q, K_m)`` (no attention vectors), normalised to
    ``alpha_m = s_m / sum_j |s_j|`` so that the prompt's scale does not grow with the
    pool ("these scores are then normalized"; the paper does not say how, and the
    authors' public code does not use keys at all). Task slices, freezing of earlier
    slices and orthogonal initialisation are CODA-P's, as in the shared base.
    """

    kinds = "pk"  # no attention vectors: they are neither trained nor transmitted

    def weights(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """alpha (B, M_active): cosine of the query with each key, L1-normalised over the pool."""
        keys = self._active("k", layer, self.training)
        scores = F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).T
        return scores / scores.abs().sum(dim=-1, keepdim=True).clamp_min(1e-8)
