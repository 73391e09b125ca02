"""HGP's prompts: a pool of prompts with keys, weighted by normalised cosine scores."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...common.model.prompted import CodaPrompt
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

    ``hgp.prompt-design = "lab-prefix"`` makes it the authors' lab network instead (fed-mammoth
    ``VitHGP``, ``n_prompts = 1``, ``prompt_pool = False``): per prompted block one prompt
    ``p<layer>`` (1, L, D) and no keys, the same prompt for every image (no query is read),
    shared by every task and never frozen (a new task neither re-initialises nor detaches it).
    It is drawn once, uniformly in [0, 1) as the pool's components are; ``pool-size`` is unused.
    """

    kinds = "pk"  # no attention vectors: they are neither trained nor transmitted
    score_norm = "l1"
    design = "pool"

    def configure(self, options: Mapping[str, Any]) -> None:
        """The ``hgp.score-norm`` and ``hgp.prompt-design`` of the run (``options``: its namespaced
        method options)."""
        opts = HGPOptions.from_options({k[len("hgp."):]: v for k, v in options.items() if k.startswith("hgp.")})
        self.score_norm, self.design = opts.score_norm, opts.prompt_design
        if self.design == "lab-prefix":
            self.kinds, self.uses_query = "p", False
            for layer in self.layers:
                old = getattr(self, f"p{layer}")
                delattr(self, f"k{layer}")
                delattr(self, f"p{layer}")
                prompt = nn.Parameter(torch.empty(1, self.length, self.embed_dim, device=old.device))
                nn.init.uniform_(prompt)
                self.register_parameter(f"p{layer}", prompt)

    def init_task_slice(self, task: int, generator: torch.Generator, orthogonal: bool = True) -> None:
        """A new task's slice (the pool); the lab prefix is drawn once and kept across tasks."""
        if self.design != "lab-prefix":
            super().init_task_slice(task, generator, orthogonal)

    def _active(self, kind: str, layer: int, train: bool) -> torch.Tensor:
        """The pool's slices 0..task (earlier ones detached while training); the whole lab prefix."""
        if self.design == "lab-prefix":
            return getattr(self, f"{kind}{layer}")
        return super()._active(kind, layer, train)

    def forward(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """Prompt (B, L, D) for ``layer``: the pool's weighted sum, or the lab prefix for every image."""
        if self.design == "lab-prefix":
            prompt = getattr(self, f"p{layer}")
            return prompt.expand(len(query), -1, -1)
        return super().forward(query, layer)

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
