"""LoRM on the client: one factor of the current task's adapters trained per round, and the Gram pass.

Per round (the authors' code, ``LoRM.begin_round_client`` / ``observe`` / ``end_round_client``):

1. the client starts from the server's sets (everyone shares A and B) and freezes the factor this
   round does not train (``set_train_matrix``: B on even rounds of a task, A on odd ones);
2. it trains the other factor and the head on cross-entropy over the current task's classes (the
   platform's loss; the code slices the logits to the task's classes, the same thing), at
   ``lorm.lr-a`` / ``lorm.lr-b`` for the factors;
3. a no-grad pass over its samples accumulates, per adapted projection, the diagonal of the input's
   Gram over every token, and the head's full input Gram (``round_end``);
4. it uploads the trained factor's row of the current task, the head and the Grams (``uploaded``:
   the untrained factor and the other tasks' sets do not travel).

With ``lorm.task-grams = "task-end-pass"`` it also answers the platform's task-end exchange
(``answer``; the code's ``LoRM.end_task_client``): the same Gram pass over its samples of the task,
through the server's final set and head, no training, on a view stream of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from ...common.data.partitions import client_indices
from ...common.records import METRICS, arrays_of, config_of, to_array_record, to_torch
from ..platform.exchange import EXCHANGE, TASK_END
from ..platform.learner import LocalLearner
from .merge import pack_triu
from .options import LoRMOptions, trained_factor
from .prompt import LoRMAdapters
from .records import BLOCKS, GRAMS, HEAD_GRAM, SAMPLES, TOKENS, diagonal_name, factor_of

#: the augmentation stream of the Gram pass's views (the training batches use another), and of the
#: task-end pass's (its own views, as the code's extra round draws its own)
GRAM_STREAM, TASK_END_STREAM = 0x6A4, 0x6A5


class LoRMLearner(LocalLearner):
    """LoRM's local learning: the platform's loop with one factor frozen, then the Gram pass."""

    opts: LoRMOptions

    def __init__(self, **inputs: Any) -> None:  # LocalLearner's keyword inputs (made by ``of``)
        super().__init__(**inputs)
        self.factor = "b"  # the factor the current fit trains (set by ``received``)

    def received(self, content: RecordDict, task: int, round_: int, client_id: int) -> ArrayRecord:
        self.factor = trained_factor(self.opts.train_matrix, round_)
        return super().received(content, task, round_, client_id)

    def round_start(self, content: RecordDict, task: int) -> None:
        """Freeze the factor this round leaves alone (restored by :meth:`round_cleanup`)."""
        for name, param in self.rt.model.named_parameters():
            factor = factor_of(name)
            if factor is not None:
                param.requires_grad_(factor == self.factor)

    def round_cleanup(self) -> None:
        for name, param in self.rt.model.named_parameters():
            if factor_of(name) is not None:
                param.requires_grad_(True)

    def learning_rate(self, name: str, task: int) -> float | None:
        """``lorm.lr-a`` / ``lorm.lr-b`` for the factors (-1: the run's lr); the head at the run's lr."""
        rate = {"a": self.opts.lr_a, "b": self.opts.lr_b}.get(factor_of(name) or "", -1.0)
        return None if rate < 0 else rate

    def uploaded(self, state: dict[str, torch.Tensor], task: int) -> dict[str, torch.Tensor]:
        """The head, and of each adapter only the trained factor's row of ``task``: the other factor
        and the other tasks' sets are what the client was sent (the server completes them)."""
        out = {}
        for name, value in state.items():
            factor = factor_of(name)
            if factor is None and not name.startswith("prompt."):
                out[name] = value
            elif factor == self.factor:
                out[name] = value[task : task + 1]
        return out

    @torch.no_grad()
    def gram_pass(self, index: np.ndarray, batch_size: int = 256,
                  stream: int = GRAM_STREAM) -> tuple[dict[tuple[int, str], torch.Tensor], torch.Tensor, int]:
        """Sums over ``lorm.gram-passes`` passes of the samples ``index``: per (block, projection) the
        Gram diagonal of its input, the head's input Gram (D x D), and the tokens per row.

        Through the evaluation forward (``gram-model = "code"``: the earlier tasks' sets at the server's
        filler weights and this client's trained set) or the training one (``"trained"``: W0 + B_t A_t);
        each image through an augmented view of its own stream (``gram-views = "augmented"``, the
        code's training transform) or as stored.
        """
        rt, model = self.rt, self.rt.model
        adapters = model.prompt
        assert isinstance(adapters, LoRMAdapters)
        model.eval()
        if self.opts.gram_model == "trained":
            adapters.train()  # the adapters' training forward; the frozen backbone stays in eval mode
        augment = self.augmentation(stream) if self.opts.gram_views == "augmented" else None
        head = torch.zeros(model.embed_dim, model.embed_dim, dtype=torch.float64, device=rt.device)
        try:
            with adapters.recording() as recorder:
                for _ in range(self.opts.gram_passes):
                    for start in range(0, len(index), batch_size):
                        x = self.inputs(rt.data.train.images[index[start : start + batch_size]], augment)
                        with rt.autocast():
                            features = model.features(x, model.query(x)).double()
                        head += features.T @ features
        finally:
            model.eval()
        tokens = next(iter(recorder.tokens.values()), 0)
        return recorder.sums, head, tokens

    def round_end(self, index: np.ndarray, task: int) -> dict[str, Any]:
        """The round's Gram record (:meth:`gram_record`)."""
        return {GRAMS: self.gram_record(index)}

    def answer(self, content: RecordDict, task: int, round_: int, client_id: int) -> RecordDict:
        """The task-end Gram pass (``lorm.task-grams = "task-end-pass"``): the Gram record of this
        client's samples of ``task`` through the arrays received (the server's final set and head)."""
        if config_of(content).get(EXCHANGE) != TASK_END:
            raise ValueError("LoRM answers only the task-end exchange (a query without exchange = 'task-end')")
        rt = self.rt
        self.seed = [self.run.seed, client_id, task, round_]
        rt.model.load_trainable_state(to_torch(arrays_of(content)))
        rt.model.prompt.set_task(task)
        index = client_indices(rt.data.train.labels, rt.layout, rt.partition, client_id, task, round_)
        metrics = MetricRecord({"num-examples": int(len(index))})
        if self.federation.population == "nodes":  # a node's counts are checked against its declaration
            metrics["train-size"], metrics["test-size"] = len(rt.data.train), len(rt.data.test)
        reply = RecordDict({METRICS: metrics})
        if len(index):
            reply[GRAMS] = self.gram_record(index, TASK_END_STREAM)
        return reply

    def gram_record(self, index: np.ndarray, stream: int = GRAM_STREAM) -> ArrayRecord:
        """The Gram record (records.py): per-sample diagonals of every adapted projection, the head's
        packed Gram, the samples and the tokens."""
        sums, head, tokens = self.gram_pass(index, stream=stream)
        adapters = self.rt.model.prompt
        assert isinstance(adapters, LoRMAdapters)
        views = len(index) * self.opts.gram_passes
        record: dict[str, np.ndarray] = {BLOCKS: np.asarray(adapters.layers, np.int64),
                                         SAMPLES: np.array([len(index)], np.int64),
                                         TOKENS: np.array([tokens], np.int64)}
        for target in adapters.targets:
            rows = [sums[(layer, target)].cpu().numpy() / views for layer in adapters.layers]
            record[diagonal_name(target)] = np.stack(rows).astype(np.float32)
        record[HEAD_GRAM] = pack_triu(head.cpu().numpy() / views)[None, :].astype(np.float32)
        return to_array_record(record)
