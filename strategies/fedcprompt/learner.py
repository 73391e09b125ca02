"""Fed-CPrompt's client: CODA-P with frozen past and future slices, CE + lambda * C2L.

The shared loop (strategies/platform/learner.py) trains the current task's slice and the head with
CE over the current task's classes; this learner

* reads ``known-tasks`` from the server's message, so the prompt module uses every
  known slice other than the current one frozen (eq. 2, see FedCPromptPrompt);
* keeps the incoming global prompt as the server's previous-round prompt
  P_s^m(r-1) and the server's other task slices P_s^i;
* adds, per batch, lambda * C2L (eq. 3):

      C2L = max(||P_c^m - P_s^m(r-1)|| - gamma * min_{i != m, i known} ||P_c^m - P_s^i|| + alpha, 0)

  with P^m the task's slice of the prompt components of every prompted block, as one
  vector (option ``c2l-params = "pka"``: components, keys and attention vectors). With
  no other known task (the first task of a synchronous run) the min is over an empty set:
  option ``c2l-first-task`` = "drift" (default) drops the term, leaving the drift penalty
  ||P_c^m - P_s^m(r-1)|| + alpha; "off" reads the empty min as +infinity, so C2L = 0;
* optionally adds FedProx's mu/2 ||w - w_global||^2 over the trainable parameters;
* holds out a fixed validation share of the task's samples for early stopping
  (``early-stopping``): with ``early-stopping-scope = "task"`` it scores the global model it
  received on that share and reports the score (``val-loss``, the mean cross-entropy over the
  seen classes, or ``val-correct``, per ``early-stopping-metric``) with ``val-total``, from which
  the server stops the task; with ``"local"`` it scores its model after each local epoch and
  stops after ``patience`` epochs without a gain, replying the last or the best epoch's
  parameters (``early-stopping-keep``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict

from ...common.records import CONFIG, as_int, config_of
from ..platform.learner import Batch, LocalLearner
from .options import FedCPromptOptions, improves, split_held_out
from .prompt import FedCPromptPrompt
from .records import KNOWN_TASKS


def c2l_loss(current: torch.Tensor, previous: torch.Tensor, others: torch.Tensor,
             gamma: float, alpha: float, first_task: str = "drift") -> torch.Tensor:
    """Eq. 3 for one client: hinge of (drift from the previous round - gamma * nearest other + alpha).

    Parameters
    ----------
    current : (V,) tensor
        The client's prompt of task m (trainable).
    previous : (V,) tensor
        The server's prompt of task m from the previous round.
    others : (n, V) tensor
        The server's prompts of the other known tasks (n may be 0).
    first_task : {"drift", "off"}
        With n = 0, the min term is dropped ("drift": C2L = drift + alpha) or read as
        +infinity ("off": C2L = 0).
    """
    drift = torch.linalg.vector_norm(current - previous)
    if others.shape[0] > 0:
        nearest = torch.linalg.vector_norm(current[None, :] - others, dim=1).min()
    elif first_task == "off":
        return torch.zeros((), dtype=current.dtype, device=current.device)
    else:
        nearest = torch.zeros((), dtype=current.dtype, device=current.device)
    return torch.clamp(drift - gamma * nearest + alpha, min=0.0)


class FedCPromptLearner(LocalLearner):
    """FedAvg-Prompt local learning with Fed-CPrompt's prompt use and loss.

    Parameters
    ----------
    runtime : Runtime
        Data, model (with :class:`FedCPromptPrompt`), device and query cache.
    options : FedCPromptOptions
        ``fedcprompt.*`` options.
    """

    opts: FedCPromptOptions

    def __init__(self, **inputs: Any) -> None:  # LocalLearner's keyword inputs (made by ``of``)
        super().__init__(**inputs)
        self.server_params: dict[str, torch.Tensor] = {}  # the incoming global trainable parameters
        self.previous: torch.Tensor | None = None  # P_s^m(r-1), flattened
        self.others: torch.Tensor | None = None  # P_s^i, i != m known, (n, V)
        self.last_c2l: float | None = None  # C2L of the last batch (diagnostics, tests)
        # local early stopping: the best score and (early-stopping-keep = "best") its parameters
        self.best: tuple[float, dict[str, torch.Tensor]] | None = None
        self.stale = 0  # epochs since the best
        self.epochs_run = 0  # local epochs of the last fit (diagnostics, tests)
        self.validation_report: dict[str, int | float] | None = None  # task scope: the received model's score

    # ------------------------------------------------------------------ helpers
    @property
    def prompt(self) -> FedCPromptPrompt:
        prompt = self.rt.model.prompt
        if not isinstance(prompt, FedCPromptPrompt):
            raise TypeError(f"Fed-CPrompt needs the model built with FedCPromptPrompt, got {type(prompt).__name__}")
        return prompt

    def task_vector(self, params: dict[str, torch.Tensor], task: int) -> torch.Tensor:
        """Task ``task``'s slice of the C2L parameters (every prompted block) as one vector."""
        s = self.prompt.slice_of(task)
        return torch.cat([params[f"{kind}{layer}"][s].reshape(-1)
                          for layer in self.prompt.layers for kind in self.opts.c2l_params])

    # ------------------------------------------------------------------ hooks
    def round_cleanup(self) -> None:
        """The shared model back to plain use of its slices; no reference or best state kept."""
        self.prompt.known_tasks = None
        self.server_params, self.previous, self.others = {}, None, None
        self.best, self.stale = None, 0
        self.validation_report = None

    def round_start(self, content: RecordDict, task: int) -> None:
        """Known tasks from the server; the incoming global prompt as the C2L/FedProx reference."""
        prompt = self.prompt
        known = as_int(config_of(content).get(KNOWN_TASKS, task + 1)) if CONFIG in content.config_records else task + 1
        if not task < known <= self.data.num_tasks:
            raise ValueError(f"known-tasks = {known} is inconsistent with task {task} of {self.data.num_tasks}")
        prompt.known_tasks = known
        # The shared loop loaded the global arrays just before this hook: they are the model's values now.
        self.server_params = {name: p.detach().clone() for name, p in prompt.named_parameters()}
        head = {f"head.{name}": p.detach().clone() for name, p in self.rt.model.head.named_parameters()}
        self.previous = self.task_vector(self.server_params, task)
        others = [self.task_vector(self.server_params, i) for i in range(known) if i != task]
        self.others = torch.stack(others) if others else self.previous.new_zeros((0, self.previous.numel()))
        self.server_params.update(head)

    def c2l(self, task: int) -> torch.Tensor:
        """C2L of the model's current prompt for ``task`` (eq. 3)."""
        current = self.task_vector(dict(self.prompt.named_parameters()), task)
        assert self.previous is not None and self.others is not None  # set by round_start
        return c2l_loss(current, self.previous, self.others, self.opts.gamma, self.opts.alpha,
                        self.opts.c2l_first_task)

    def proximal(self) -> torch.Tensor:
        """FedProx: 1/2 ||w - w_global||^2 over the prompt and head (untrained slices contribute 0)."""
        model = self.rt.model
        current = {n: p for n, p in self.prompt.named_parameters()}
        current |= {f"head.{n}": p for n, p in model.head.named_parameters()}
        return 0.5 * torch.stack([((p - self.server_params[n]) ** 2).sum() for n, p in current.items()]).sum()

    @property
    def task_scope(self) -> bool:
        return self.opts.early_stopping and self.opts.early_stopping_scope == "task"

    def held_out(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Early stopping's validation share of the task's samples: the same every round (seeded by
        client and task), at least one sample and never all of them (``split_held_out``).

        Task scope: the model holds the global arrays it received (the loop loads them before this
        hook); its score on the share is the reply's ``val-loss`` or ``val-correct``, with
        ``val-total``. Under differential privacy it is not released (it is outside the Gaussian
        mechanism)."""
        if not self.opts.early_stopping or len(index) < 2:
            return index, index[:0]
        trained, validation = split_held_out(index, self.opts.validation_fraction, self.seed[:3])
        if self.task_scope and len(validation) and not self.privacy.enabled:
            task = self.rt.model.prompt.task
            score: dict[str, int | float] = (
                {"val-loss": self.validation_loss(validation, task)} if self.opts.early_stopping_metric == "loss"
                else {"val-correct": self.correct(validation, task)})
            self.validation_report = {**score, "val-total": len(validation)}
        return trained, validation

    def reply_metrics(self) -> dict[str, int | float]:
        """Task scope: the received model's score on the held-out share."""
        return dict(self.validation_report or {})

    def epoch_end(self, epoch: int, validation: np.ndarray, task: int) -> bool:
        """Local scope: score the model on the validation share (``early-stopping-metric``), keep the
        best epoch's parameters where ``early-stopping-keep = "best"``; stop after ``patience``
        epochs without a gain."""
        self.epochs_run = epoch + 1
        if not len(validation) or self.task_scope:
            return False
        metric = self.opts.early_stopping_metric
        score = self.validation_loss(validation, task) if metric == "loss" else self.accuracy(validation, task)
        if self.best is None or improves(metric, score, self.best[0]):
            keep = self.opts.early_stopping_keep == "best"
            state = {k: v.clone() for k, v in self.rt.model.trainable_state().items()} if keep else {}
            self.best, self.stale = (score, state), 0
            return False
        self.stale += 1
        return self.stale >= self.opts.patience

    def round_end(self, index: np.ndarray, task: int) -> dict[str, Any]:
        """Local early stopping with ``early-stopping-keep = "best"``: the reply carries the best
        epoch's parameters ("last": those of the epoch it stopped after)."""
        if self.best is not None and self.best[1]:
            self.rt.model.load_trainable_state(self.best[1])
        return {}

    def extra_loss(self, batch: Batch, task: int) -> torch.Tensor | None:
        total = None
        if self.opts.c2l and self.opts.lambda_ > 0:
            c2l = self.c2l(task)
            self.last_c2l = float(c2l.detach())
            total = self.opts.lambda_ * c2l
        if self.opts.prox_mu > 0:
            prox = self.opts.prox_mu * self.proximal()
            total = prox if total is None else total + prox
        return total


__all__ = ["FedCPromptLearner", "c2l_loss"]
