"""LoRM on the server: the closed-form merges of each round and of each task.

Per round (the authors' code, ``LoRM.end_round_server``; the paper's "closed-form merging"):

* the trained factor of the current task's set, per adapted projection, in closed form from the
  clients' factors and Gram diagonals (merge.py: ``merge_b`` on a B-round with A shared,
  ``merge_a`` on an A-round with B shared), or their sample-weighted mean (``lorm.merge = fedavg``);
* the head's weight by RegMean over the pre-logit features' Grams (``alpha-head`` 0.5), only the
  rows some client changed (the others are every client's as sent), and its bias by the platform's
  sample-weighted mean.

Per task (``on_task_start`` / ``on_task_end``):

* the new task's set is drawn (A Kaiming-uniform from the run's seeded generator, B zero) and the
  evaluation's column weights of sets 0..t become the code's in-task "filler", the running mean
  ``1 / (t + 1)`` of the tasks' deltas;
* at the task's end the column weights become RegMean across tasks with each task's Gram diagonals,
  ``w_tau = d_tau / sum d`` (merge.py: ``task_weights``), and the server loop evaluates the merged
  model (server/run.py: ``end_task`` scores the arrays ``on_task_end`` returns), so A_N reads it.

The task's Grams are those of its last round, summed over its clients (``lorm.task-grams =
"last-round"``: the project's choice), or (``"task-end-pass"``: the authors' code,
``LoRM.end_task_client`` / ``end_task_server``) those of the platform's task-end exchange: after
the task's last round is merged and before ``on_task_end``, each client that trained the task
answers with the Grams of its data through the server's final set and head, no training
(learner.py: ``answer``); they differ from the last round's by the clients' last local update.

A robust combiner (``aggregation`` = median or trimmed mean) replaces the closed form of the round
(a weighted least-squares solve has no median form): the factors and the head are then the run's
combination of the replies, and only the task merge uses the Grams.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from ...common.records import ARRAYS, CONFIG, METRICS, arrays_of, as_int, from_array_record, metrics_of, to_array_record
from ..platform.exchange import TASK_END
from ..platform.rounds import Accepted, Sent
from ..platform.strategy import PromptStrategy
from .merge import merge_a, merge_b, regmean_head, task_weights, unpack_triu
from .options import LoRMOptions, trained_factor
from .prompt import LoRMAdapters
from .records import BLOCKS, GRAMS, HEAD_GRAM, SAMPLES, TOKENS, diagonal_name, factor_of

log = logging.getLogger("promptfcl")


class LoRMStrategy(PromptStrategy):
    """LoRM's server: closed-form merges of the trained factor and the head each round, RegMean of the
    tasks' deltas at each task's end (module docstring).

    State a checkpoint holds (:meth:`state_dict`): the Gram diagonals of the last round and of every
    finished task, per adapted projection.
    """

    opts: LoRMOptions
    reply_records = frozenset({ARRAYS, METRICS, GRAMS})

    def setup(self) -> None:
        self.task, self.factor = 0, "b"
        #: summed Gram diagonal per adapter (``qkv0``: target and block) of the last round's replies
        self.round_grams: dict[str, np.ndarray] = {}
        #: per adapter, the Gram diagonals of the finished tasks (tasks x in)
        self.task_grams: dict[str, np.ndarray] = {}
        self._expected: tuple[ArrayRecord | None, ArrayRecord | None] = (None, None)
        self._warned_combiner = False

    def summary(self) -> None:
        super().summary()
        log.info("lorm: rank %d adapters on %s of blocks %s; rounds train %s; merge %s, task merge %s",
                 self.opts.rank, ",".join(LoRMAdapters.targets), self.model.layers, self.opts.train_matrix,
                 self.opts.merge, self.opts.task_merge)

    @staticmethod
    def adapters(state: dict[str, np.ndarray]) -> list[tuple[str, int, str]]:
        """(key, block, target) of every adapter in ``state`` (key: ``qkv0``)."""
        out = []
        for name in state:
            if name.startswith("prompt.lora_") and name.endswith("_a"):
                key = name[len("prompt.lora_"):-2]
                target = next(t for t in LoRMAdapters.targets if key.startswith(t) and key[len(t):].isdigit())
                out.append((key, int(key[len(target):]), target))
        return out

    # ------------------------------------------------------------------ tasks
    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """The new task's set (A drawn, B zero) and the in-task filler weights of sets 0..task."""
        self.task = task
        state = from_array_record(super().on_task_start(task, arrays))
        filler = 1.0 if self.opts.task_merge == "sum" else 1.0 / (task + 1)
        for key, _, _ in self.adapters(state):
            w = state[f"prompt.lora_{key}_w"]
            w[: task + 1] = filler
        self.round_grams = {}
        return to_array_record(state)

    def on_task_end(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Column weights of sets 0..task from the tasks' Gram diagonals (``lorm.task-merge``); the
        server loop evaluates what this returns."""
        state = from_array_record(arrays)
        for key, _, _ in self.adapters(state):
            w = state[f"prompt.lora_{key}_w"]
            diagonal = self.round_grams.get(key)
            if diagonal is None:  # no round of the task was aggregated: every column its own
                log.warning("lorm: no Grams for %s in task %d; its columns weigh alike", key, task + 1)
                diagonal = np.ones(w.shape[1])
            seen = self.task_grams.get(key, np.zeros((0, w.shape[1])))[:task]
            self.task_grams[key] = np.concatenate([seen, diagonal[None, :]])
            w[: task + 1] = task_weights(self.task_grams[key], self.opts.task_merge).astype(w.dtype)
        return to_array_record(state)

    # ------------------------------------------------------------------ messages
    def round_start(self, server_round: int, task: int, round_: int, arrays: ArrayRecord) -> None:
        self.task, self.factor = task, trained_factor(self.opts.train_matrix, round_)

    def payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict:
        """Every array goes out; the reply must hold the head and the trained factor's row of the task
        alone (``sent.expected``, made once a round)."""
        content = super().payload(sent, arrays)
        assert content is not None
        if self._expected[0] is not arrays:
            state = from_array_record(arrays)
            t = sent.task
            self._expected = (arrays, to_array_record({name: value[t : t + 1] if factor_of(name) else value
                                                       for name, value in state.items()
                                                       if factor_of(name) == self.factor or name.startswith("head.")}))
        sent.expected = self._expected[1]
        return content

    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """A finite, non-negative Gram record of the run's blocks, of no more samples than the reply claims."""
        return self.gram_problem(reply.content, sent)

    # ------------------------------------------------------------------ the task-end Gram pass
    def uses_task_end_exchange(self) -> bool:
        return self.opts.task_grams == "task-end-pass"

    def exchange_payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict | None:
        """The task's final set and head (every array: the pass runs the client's evaluation forward)."""
        return RecordDict({ARRAYS: arrays, CONFIG: sent.config})

    def check_exchange(self, reply: Message, sent: Sent) -> str | None:
        """A task-end answer: exactly the Gram record and the metrics, the Grams as a round's."""
        if self.exchange_phase != TASK_END:
            return "LoRM has no exchange before training"
        if set(reply.content.keys()) != {GRAMS, METRICS}:
            return f"records {sorted(reply.content.keys())}, expected {sorted({GRAMS, METRICS})}"
        return self.gram_problem(reply.content, sent)

    def use_exchange(self, server_round: int, answers: list[Accepted]) -> None:
        """The task's Grams become the pass's, summed over its answers (each per-sample row times the
        answer's weight: its samples, capped where the run caps them); with no usable answer the last
        round's stay, said in the log."""
        if not answers:
            log.warning("lorm: no usable answer to task %d's end Gram pass; its merge uses the last round's Grams",
                        self.task + 1)
            return
        rows = {layer: i for i, layer in enumerate(self.model.layers)}
        grams = [from_array_record(arrays_of(a.content, GRAMS)) for a in answers]
        assert self.round_arrays is not None
        self.round_grams = {
            key: np.sum([a.weight * np.asarray(g[diagonal_name(target)][rows[layer]], np.float64)
                         for g, a in zip(grams, answers)], axis=0)
            for key, layer, target in self.adapters(from_array_record(self.round_arrays))}

    def gram_problem(self, content: RecordDict, sent: Sent) -> str | None:
        """Why a Gram record (a round's reply or a task-end answer) cannot be used (None: it can)."""
        if GRAMS not in content.array_records:
            return f"{GRAMS!r} is not an array record"
        record = from_array_record(arrays_of(content, GRAMS))
        state = from_array_record(sent.arrays) if sent.arrays is not None else {}
        dim = int(state["head.weight"].shape[1])
        widths = {t: int(state[f"prompt.lora_{t}{self.model.layers[0]}_a"].shape[-1]) for t in LoRMAdapters.targets}
        expected = {BLOCKS: (len(self.model.layers),), SAMPLES: (1,), TOKENS: (1,), HEAD_GRAM: (1,
                                                                                                dim * (dim + 1) // 2),
                    **{diagonal_name(t): (len(self.model.layers), w) for t, w in widths.items()}}
        if set(record) != set(expected):
            return f"{GRAMS} holds {sorted(record)}, expected {sorted(expected)}"
        for name, shape in expected.items():
            if record[name].shape != shape:
                return f"{GRAMS} {name} has shape {record[name].shape}, expected {shape}"
            if not np.isfinite(record[name]).all():
                return f"{GRAMS} {name} has non-finite values"
        if record[BLOCKS].tolist() != list(self.model.layers):
            return f"{GRAMS} blocks {record[BLOCKS].tolist()}, the run adapts {list(self.model.layers)}"
        samples, tokens = int(record[SAMPLES][0]), int(record[TOKENS][0])
        # (a node may claim more examples than it sums, within what it declared: its Gram weighs by its
        # capped claim, as its factors do; a Gram of more samples than claimed is refused)
        if not 0 < samples <= as_int(metrics_of(content)["num-examples"]) or tokens < samples:
            examples = metrics_of(content)["num-examples"]
            return f"{GRAMS} counts {samples} samples and {tokens} tokens for {examples} examples"
        if any((record[diagonal_name(t)] < 0).any() for t in widths) or \
                (np.diag(unpack_triu(record[HEAD_GRAM][0], dim)) < 0).any():
            return f"{GRAMS} has a negative diagonal (a Gram is positive semi-definite)"
        return None

    # ------------------------------------------------------------------ the round's merge
    def consolidate(self, server_round: int, arrays: ArrayRecord, accepted: list[Accepted]) -> ArrayRecord:
        """The round's arrays: the arrays sent with the replies' part in place, its trained factor and
        head weight merged in closed form (module docstring)."""
        assert self.round_arrays is not None
        state = from_array_record(self.round_arrays)
        state = {name: np.array(value) for name, value in state.items()}
        averaged = from_array_record(arrays)  # the platform's combination of the replies' part
        t = self.task
        for name, value in averaged.items():
            if factor_of(name):
                state[name][t] = value[0]
            else:
                state[name] = value
        replies = [from_array_record(arrays_of(a.content)) for a in accepted]
        grams = [from_array_record(arrays_of(a.content, GRAMS)) for a in accepted]
        counts = [a.weight for a in accepted]  # a client's Gram is its samples x its per-sample Gram
        closed = self.policies.combiner.mode == "mean"
        if not closed and not self._warned_combiner:
            log.warning("lorm: aggregation = %s replaces the closed-form merge of the factors and the head "
                        "(a least-squares solve has no robust form); the task merge still uses the Grams",
                        self.policies.combiner.mode)
            self._warned_combiner = True
        rows = {layer: i for i, layer in enumerate(self.model.layers)}
        self.round_grams = {}
        for key, layer, target in self.adapters(state):
            diagonals = [n * np.asarray(g[diagonal_name(target)][rows[layer]], np.float64)
                         for g, n in zip(grams, counts)]
            self.round_grams[key] = np.sum(diagonals, axis=0)
            if not closed or self.opts.merge != "closed-form":
                continue  # the platform's (sample-weighted) combination stands
            a_name, b_name = f"prompt.lora_{key}_a", f"prompt.lora_{key}_b"
            if self.factor == "b":
                merged = merge_b(state[a_name][t], [r[b_name][0] for r in replies], diagonals)
                state[b_name][t] = merged.astype(state[b_name].dtype)
            else:
                sent_a = from_array_record(self.round_arrays)[a_name][t]
                merged = merge_a([r[a_name][0] for r in replies], diagonals, keep=sent_a)
                state[a_name][t] = merged.astype(state[a_name].dtype)
        if closed:
            self._merge_head(state, replies, grams, counts)
        return to_array_record(state)

    def _merge_head(self, state: dict[str, np.ndarray], replies: list[dict[str, np.ndarray]],
                    grams: list[dict[str, np.ndarray]], counts: list[float]) -> None:
        """RegMean of the head's weight rows some client changed (the rest are every client's as sent)."""
        assert self.round_arrays is not None
        sent = from_array_record(self.round_arrays)["head.weight"]
        changed = np.zeros(len(sent), dtype=bool)
        for r in replies:
            changed |= (r["head.weight"] != sent).any(axis=1)
        if not changed.any():
            return
        dim = sent.shape[1]
        head_grams = [n * unpack_triu(np.asarray(g[HEAD_GRAM][0], np.float64), dim) for g, n in zip(grams, counts)]
        merged = regmean_head([r["head.weight"][changed] for r in replies], head_grams, self.opts.alpha_head)
        state["head.weight"][changed] = merged.astype(sent.dtype)

    # ------------------------------------------------------------------ checkpoint and counts
    def state_dict(self) -> dict[str, Any]:
        return {"round-grams": dict(self.round_grams), "task-grams": dict(self.task_grams)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round_grams = {k: np.asarray(v, np.float64) for k, v in state.get("round-grams", {}).items()}
        self.task_grams = {k: np.asarray(v, np.float64) for k, v in state.get("task-grams", {}).items()}

    def stateful_parameters(self, arrays: ArrayRecord) -> dict[str, int]:
        """What one exchange carries when clients keep what they hold: down, the current task's A and
        B and the head; up, one factor's row and the head (``c2s``, the larger factor: B), and the
        Grams (``c2s-statistics``: one diagonal per adapted projection and the head's packed Gram)."""
        state = from_array_record(arrays)
        head = int(state["head.weight"].size + state["head.bias"].size)
        adapters = self.adapters(state)
        a = sum(int(np.prod(state[f"prompt.lora_{k}_a"].shape[1:])) for k, _, _ in adapters)
        b = sum(int(np.prod(state[f"prompt.lora_{k}_b"].shape[1:])) for k, _, _ in adapters)
        diagonals = sum(int(state[f"prompt.lora_{k}_a"].shape[-1]) for k, _, _ in adapters)
        dim = int(state["head.weight"].shape[1])
        return {"s2c": a + b + head, "c2s": max(a, b) + head, "c2s-statistics": diagonals + dim * (dim + 1) // 2 + 3}
