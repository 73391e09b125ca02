"""C2Prompt's prompts: CODA-P's pool with keys (the discriminative prompts, figure (d)), and room
for a class's compensation prompt (figure (c)) while a client trains."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ...common.model import CodaPrompt
from .options import C2PromptOptions


class C2PromptPrompt(CodaPrompt):
    """CODA-P's decomposed prompts with keys and attention vectors, unchanged (the figure's
    discriminative prompts chosen by matching q(x) with keys; the selection rule is the project's
    reading: CODA-P's weights), plus compensation prompts attached by :meth:`compensated`.

    A compensation prompt is per class and per prompted block, lives on the client only (never in
    ``state_dict``: it does not travel and the server's model never has one, so evaluation is the
    plain prompted forward) and, by ``c2prompt.comp-attach`` (the project's reading):

    * ``"concat"``: its tokens follow the discriminative prompt's (prompt-tuning: more tokens after
      CLS; prefix-tuning: each half, keys and values, gets its own half of them);
    * ``"add"``: it is added to the discriminative prompt (same length).
    """

    attach = "concat"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._compensation: Mapping[int, torch.Tensor] | None = None  # block -> (B, Lc, D)
        self._halves = False

    def configure(self, options: Mapping[str, Any]) -> None:
        """The run's ``c2prompt.comp-attach`` (``options``: its namespaced method options)."""
        self.attach = C2PromptOptions.from_options({k[len("c2prompt."):]: v for k, v in options.items()
                                                    if k.startswith("c2prompt.")}).comp_attach

    @contextmanager
    def compensated(self, prompts: Mapping[int, torch.Tensor], halves: bool) -> Iterator[None]:
        """Forward passes inside attach ``prompts`` (block -> (B, Lc, D), row i for image i);
        ``halves``: the prompts are prefixes split into key and value halves."""
        self._compensation, self._halves = prompts, halves
        try:
            yield
        finally:
            self._compensation = None

    def forward(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """The discriminative prompt (B, L, D) of ``layer``, with the attached compensation prompt."""
        prompt = super().forward(query, layer)
        extra = None if self._compensation is None else self._compensation.get(layer)
        if extra is None:
            return prompt
        extra = extra.to(prompt.dtype)
        if self.attach == "add":
            return prompt + extra
        if not self._halves:
            return torch.cat([prompt, extra], dim=1)
        half, extra_half = prompt.shape[1] // 2, extra.shape[1] // 2
        return torch.cat([prompt[:, :half], extra[:, :extra_half], prompt[:, half:], extra[:, extra_half:]], dim=1)
