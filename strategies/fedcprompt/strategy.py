"""Fed-CPrompt ("Fed-CPrompt: Contrastive Prompt for Rehearsal-Free Federated Continual Learning",
sections 2-3, Appendices C-D): asynchronous prompt learning + C2L.

Clients run CODA-P (decomposed prompts, task slices of the pool). While a client is on
task m it uses the server's slices of every *other known* task frozen -- past ones
(1..m-1) and future ones (m+1..n, learnt by clients that are ahead) -- and trains its
own slice and the head (eq. 2). Its loss is CE + lambda * C2L (eq. 3-4), see
``client/fedcprompt.py``.

The server averages *per task slice*: for every task m trained this round, slice m of
every prompt array (P, K, A of each prompted block) and the head rows of task m's
classes are the sample-weighted average over the clients that trained m; slices and
head rows nobody trained keep the server's values. When all clients are on the same
task (the platform's synchronous schedule) this equals FedAvg on what they trained.
The task a reply trained is the one the server assigned in that client's message
config (kept per message in ``configure_train``), never what the client claims.

Wire additions: every train message's config carries ``known-tasks`` (the number of
tasks whose slices the server has initialised), so a client knows which future
slices exist.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from promptfcl.common.config import ConfigError, ExperimentConfig, MethodOptions
from promptfcl.common.model import CodaPrompt
from promptfcl.common.records import ARRAYS, CONFIG, METRICS, from_array_record, to_array_record
from promptfcl.strategies.platform.strategy import PromptStrategy, aggregate_per_task

log = logging.getLogger("promptfcl")

#: config key of a train message: how many task slices the server knows (0..known-1)
KNOWN_TASKS = "known-tasks"
C2L_PARAMS = ("p", "pka")
C2L_FIRST_TASK = ("drift", "off")


# ---------------------------------------------------------------------------- options
@dataclass(frozen=True)
class FedCPromptOptions(MethodOptions):
    """Fed-CPrompt's options (run-config keys ``fedcprompt.<key>``, kebab-case).

    The paper gives ranges, not values: gamma > 0, alpha in [0, 1], lambda in [0, 1].
    """

    prefix = "fedcprompt"

    # weight of the distance to the nearest other task's prompt (eq. 3). At 1 the hinge never
    # opens once another task is known (orthogonal slices sit ~sqrt(2 * rows) apart, far more
    # than a round's drift); 0.1 keeps C2L active (the authors' code weighs the two terms 1e3 : 1e1).
    gamma: float = 0.1
    alpha: float = 0.5  # margin of the hinge (eq. 3)
    lambda_: float = 1.0  # run-config key "lambda": weight of C2L in the loss (eq. 4)
    c2l: bool = True  # false = CE only (the paper's "w/o C2L" ablation, Table 4)
    c2l_params: str = "p"  # C2L on the prompt components P (eq. 3) or on P, K and A ("pka", eq. 4's w)
    prox_mu: float = 0.0  # FedProx proximal term mu/2 ||w - w_global||^2 (Table 4: c2l=false, prox-mu>0)
    # C2L while no other task's slice is known (the first task of a synchronous run), where
    # eq. 3's min over the other tasks is over an empty set. "drift": that term is dropped and
    # C2L = ||P_c^m - P_s^m(r-1)|| + alpha, the paper's first goal (restrict the change from the
    # previous round's server prompt) without the second; "off": the empty min read as
    # +infinity, so the hinge is closed and the loss is CE alone until a second task is known.
    c2l_first_task: str = "drift"

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError("fedcprompt." + msg)

        need(np.isfinite(self.gamma) and self.gamma > 0, f"gamma must be > 0, got {self.gamma}")
        need(np.isfinite(self.alpha) and self.alpha >= 0, f"alpha must be >= 0 (paper: [0, 1]), got {self.alpha}")
        need(np.isfinite(self.lambda_) and self.lambda_ >= 0, f"lambda must be >= 0 (paper: [0, 1]), got {self.lambda_}")
        need(self.c2l_params in C2L_PARAMS, f"c2l-params must be one of {C2L_PARAMS}, got {self.c2l_params!r}")
        need(np.isfinite(self.prox_mu) and self.prox_mu >= 0, f"prox-mu must be >= 0, got {self.prox_mu}")
        need(self.c2l_first_task in C2L_FIRST_TASK,
             f"c2l-first-task must be one of {C2L_FIRST_TASK}, got {self.c2l_first_task!r}")


# ---------------------------------------------------------------------------- prompting
class FedCPromptPrompt(CodaPrompt):
    """CODA-P prompts that also use the known *future* task slices, frozen (eq. 2).

    ``known_tasks`` is the number of task slices the server has initialised (set by
    the client from the server's message; None = only slices 0..task, plain CODA-P).
    While training task m: slices < m and m < slices < known_tasks are used detached,
    slice m is trained, slices >= known_tasks are unused. Evaluation uses every known slice.
    """

    def __init__(self, embed_dim: int, layers: list[int], pool_size: int, length: int, num_tasks: int) -> None:
        super().__init__(embed_dim, layers, pool_size, length, num_tasks)
        self.known_tasks: int | None = None

    def known_stop(self) -> int:
        """End (exclusive) of the pool rows in use: the last known slice, at least the current one."""
        known = self.task + 1 if self.known_tasks is None else max(int(self.known_tasks), self.task + 1)
        return min(known, self.num_tasks) * self.per_task

    def _active(self, kind: str, layer: int, train: bool) -> torch.Tensor:
        param = getattr(self, f"{kind}{layer}")
        stop = self.known_stop()
        if not train:
            return param[:stop]
        s = self.slice_of(self.task)
        return torch.cat([param[: s.start].detach(), param[s], param[s.stop : stop].detach()], dim=0)


# ---------------------------------------------------------------------------- strategy
class FedCPromptStrategy(PromptStrategy):
    """Fed-CPrompt's server: FedAvg per task slice (in parallel over the tasks clients are on).

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's configuration.
    num_classes : int
        Classes of the whole stream.
    options : dict, optional
        ``fedcprompt.*`` options (validated here; the clients read the loss options).
    """

    name = "fedcprompt"
    prompt_class = FedCPromptPrompt
    options_class = FedCPromptOptions  # the CLI validates ``fedcprompt.*`` options with it before training

    def __init__(self, cfg: ExperimentConfig, num_classes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(cfg, num_classes, options)
        self.opts = FedCPromptOptions.from_options(self.options)
        self.known_tasks = 0  # task slices initialised so far (0..known_tasks-1)
        self.sent: list[tuple[Message, int, int]] = []  # this round's (message, client id, task)
        self.client_tasks: dict[int, int] = {}  # client id -> task it was sent this round
        self.last_tasks: dict[int, int] = {}  # task -> clients aggregated for it, last round

    def summary(self) -> None:
        super().summary()
        log.info("fedcprompt: %s", self.opts.to_dict())

    # ------------------------------------------------------------------ hooks
    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        self.known_tasks = max(self.known_tasks, task + 1)
        return super().on_task_start(task, arrays)

    def client_payload(self, client_id: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        task = int(config["task"])
        if task >= self.known_tasks:
            raise RuntimeError(f"client {client_id} assigned task {task}, whose slice was never initialised "
                               f"(known tasks: {self.known_tasks}); call on_task_start first")
        config[KNOWN_TASKS] = self.known_tasks
        return super().client_payload(client_id, arrays, config)

    def state_dict(self) -> dict[str, Any]:
        return {"known-tasks": int(self.known_tasks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.known_tasks = int(state.get("known-tasks", 0))

    # ------------------------------------------------------------------ Flower contract
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The base messages; remembers which task each message (client) was given."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.sent = []
        for m in messages:
            sent_config = m.content[CONFIG]
            self.sent.append((m, int(sent_config["client-id"]), int(sent_config["task"])))
        self.client_tasks = {client: task for _, client, task in self.sent}
        return messages

    def task_of_reply(self, msg: Message) -> int | None:
        """The task the server assigned to the client that sent ``msg`` (None: unknown).

        Matched by message id; if the sent messages carry no ids, by node, provided that node
        was given a single task this round (``sent_candidates``).
        """
        tasks = {self.sent[i][2] for i in self.sent_candidates(msg)}
        return tasks.pop() if len(tasks) == 1 else None

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies (the base's checks), then FedAvg per task slice, then consolidate."""
        replies = list(replies)
        if self.sent_arrays is None:
            raise RuntimeError("aggregate_train before configure_train: no server arrays to start from")
        tasks_by_content = {id(m.content): self.task_of_reply(m) for m in replies if m.has_content()}
        accepted: list[tuple[int, RecordDict]] = []
        dropped: list[tuple[int, str]] = []
        for content, msg in zip(*self._accepted_with_messages(replies)):
            task = tasks_by_content.get(id(content))
            if task is None or not 0 <= task < self.cfg.num_tasks:
                dropped.append((msg.metadata.src_node_id, "cannot tell which task this reply trained "
                                "(no matching message sent this round)"))
                continue
            accepted.append((task, content))
        for node, reason in dropped:
            log.warning("reply from node %s excluded: %s", node, reason)
        self.rejected += dropped
        if len(accepted) < self.cfg.min_replies:
            log.warning("round %d: %d usable replies, fewer than min-replies = %d; the global model is unchanged",
                        server_round, len(accepted), self.cfg.min_replies)
            return None, None
        weights = self.reply_weights([c for _, c in accepted])
        merged = aggregate_per_task(
            self.cfg, from_array_record(self.sent_arrays),
            [(task, from_array_record(c[ARRAYS]), w) for (task, c), w in zip(accepted, weights)],
            self.num_classes,
        )
        contents = [c for _, c in accepted]
        arrays = self.consolidate(server_round, to_array_record(merged), contents)
        self.last_tasks = {}
        for task, _ in accepted:
            self.last_tasks[task] = self.last_tasks.get(task, 0) + 1
        metrics = MetricRecord({
            "num-examples": int(sum(int(c[METRICS]["num-examples"]) for c in contents)),
            "clients": len(accepted),
            "tasks-aggregated": len(self.last_tasks),
            "train-loss": float(np.average([float(c[METRICS]["train-loss"]) for c in contents], weights=weights)),
        })
        return arrays, metrics

    def _accepted_with_messages(self, replies: list[Message]) -> tuple[list[RecordDict], list[Message]]:
        """The base's ``accept_replies`` (same checks, same ``rejected`` list), with each reply's message."""
        accepted = self.accept_replies(replies)
        by_content = {id(m.content): m for m in replies if m.has_content()}
        return accepted, [by_content[id(c)] for c in accepted]


__all__ = ["FedCPromptOptions", "FedCPromptPrompt", "FedCPromptStrategy", "KNOWN_TASKS"]
