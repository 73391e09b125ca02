"""C2Prompt's prompts: CODA-P's pool with keys (the discriminative prompts, figure (d)), and room
for a class's compensation prompt (figure (c)) while a client trains."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ...common.model.prompted import CodaPrompt
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
    * ``"add"``: it is added to the discriminative prompt (same length);
    * alone (``compensated(..., alone=True)``, figure (c)'s token row: the class tokens with the
      frozen backbone, no discriminative prompt): the compensation prompt is the block's prompt.

    With ``c2prompt.cpa-pool = "keep-all"`` a client trains only its part of its task's slice
    (:meth:`restrict`: the earlier slices whole, the current one's part), as the figures' client
    holds its own N prompts; unrestricted (the server, evaluation) every part of every slice is used.
    """

    attach = "concat"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._compensation: Mapping[int, torch.Tensor] | None = None  # block -> (B, Lc, D)
        self._halves = False
        self._alone = False
        self.own: slice | None = None  # rows of the current task's slice this client trains (None: all)

    def configure(self, options: Mapping[str, Any]) -> None:
        """The run's ``c2prompt.comp-attach`` (``options``: its namespaced method options)."""
        self.attach = C2PromptOptions.from_options({k[len("c2prompt."):]: v for k, v in options.items()
                                                    if k.startswith("c2prompt.")}).comp_attach

    def restrict(self, rows: slice | None) -> None:
        """Train (and weigh) only ``rows`` of the current task's slice (None: all of it)."""
        s = self.slice_of(self.task)
        if rows is not None and not (s.start <= rows.start < rows.stop <= s.stop):
            raise ValueError(f"rows {rows} are not part of task {self.task}'s slice {s}")
        self.own = rows

    def task_columns(self) -> slice:
        """The columns of :meth:`weights` that are the current task's components (its part)."""
        s = self.slice_of(self.task)
        own = self.own or s
        return slice(s.start, s.start + own.stop - own.start)

    def _active(self, kind: str, layer: int, train: bool) -> torch.Tensor:
        if self.own is None:
            return super()._active(kind, layer, train)
        param = getattr(self, f"{kind}{layer}")
        earlier = param[: self.slice_of(self.task).start]
        return torch.cat([earlier.detach() if train else earlier, param[self.own]], dim=0)

    @contextmanager
    def compensated(self, prompts: Mapping[int, torch.Tensor], halves: bool, alone: bool = False) -> Iterator[None]:
        """Forward passes inside attach ``prompts`` (block -> (B, Lc, D), row i for image i);
        ``halves``: the prompts are prefixes split into key and value halves; ``alone``: the
        compensation prompts replace the discriminative ones (figure (c))."""
        self._compensation, self._halves, self._alone = prompts, halves, alone
        try:
            yield
        finally:
            self._compensation, self._alone = None, False

    def forward(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """The discriminative prompt (B, L, D) of ``layer``, with the attached compensation prompt."""
        extra = None if self._compensation is None else self._compensation.get(layer)
        if extra is not None and self._alone:
            return extra
        prompt = super().forward(query, layer)
        if extra is None:
            return prompt
        extra = extra.to(prompt.dtype)
        if self.attach == "add":
            return prompt + extra
        if not self._halves:
            return torch.cat([prompt, extra], dim=1)
        half, extra_half = prompt.shape[1] // 2, extra.shape[1] // 2
        return torch.cat([prompt[:, :half], extra[:, :extra_half], prompt[:, half:], extra[:, extra_half:]], dim=1)
