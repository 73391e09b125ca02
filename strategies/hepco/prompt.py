"""HePCo's prompts: components weighted by the cosine of the query with their keys (sec. 5.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from promptfcl.common.model import CodaPrompt


class HePCoPrompt(CodaPrompt):
    """The paper's decomposed prompting (sec. 5.1): ``p = sum_m cos(q, K_m) P_m``.

    CODA-P without attention vectors (the paper's client weights are ``{P, K}``, so
    none are created and none travel); task slices, freezing of earlier slices and
    orthogonal initialisation are CODA-P's, as the paper adapts L2P "as noted by
    Smith et al. (2022)".
    """

    kinds = "pk"  # no attention vectors

    def weights(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """alpha (B, M_active): cosine of the query with each active key."""
        keys = self._active("k", layer, self.training)
        return F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).T
