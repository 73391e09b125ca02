"""HePCo: heterogeneous prompt consolidation by latent generation and distillation at the server.

Paper: "Continual Adaptation of Vision Transformers for Federated Learning"
(Halbe et al., sections 5-6 and Appendix B).

Clients are FedAvg-Prompt clients with the paper's prompt variant (:class:`HePCoPrompt`:
components weighted by the cosine of the query with their keys). The server, every round:

1. provisional model ``w`` = average of the clients' prompts, keys and heads (sec. 5.2);
2. trains a conditional generator ``z = G(eps, y)`` in the D-dimensional *query* space
   for the current task's classes against the clients (eq. 5):
   ``min L_cls - lambda_KL L_KL - lambda_MSE L_MSE``, each a sum over clients weighted by
   their share of the latent's class (sec. 5.2's "weighted sum ... similar to Zhang et al.
   (2022b)"; option ``client-weights``), the logits spanning every class seen so far (the
   whole classifier phi; option ``generator-classes``);
3. trains a second generator for the past tasks' classes against the previous task's
   final server model (the only state the server keeps);
4. latent distillation (sec. 5.3): the provisional model's prompts (keys and components:
   the whole shared pool by default, ``pool-training``; the task's slice with CODA-P's
   ``"task-slices"``) are fitted by MSE of its final prompts to each teacher's (clients on every
   latent, previous-task server on old-class latents only, eq. 6), and its head by
   cross-entropy on the same composite batch (current + ``replay_ratio`` old latents).

With asynchronous arrival (clients on two tasks in one round) the round's replies form one
teacher group per task (:class:`TaskTeachers`): the current-task generator and the
distillation cover the classes of every task trained in the round, a task's share of the
latents is its share of the replies (or of their samples, ``client-weights``), each client
teaches the generator on its own task's latents through its own slices, and the student
trains the slices of all those tasks. The past-task teacher is the server model at the
previous task's nominal end.

Everything runs on ``(B, D)`` latents: the backbone is never needed at the server. The
method's parts: ``options.py``, ``prompt.py``, ``latents.py`` (generator, teachers, student),
``distill.py`` (the server's training), ``diagnostics.py``; its clients are plain prompt
clients (``learner.py``).
Vectorised over clients: teachers are stacked into ``(C, ...)`` tensors and every loss
is a batched einsum; prompt MSEs go through Gram matrices of the prompt components
(:class:`PromptGrams`), so no step forms the C x B x L x D teacher prompts.
Consolidation time per round is logged and returned in the round's MetricRecord
(``consolidation-seconds`` and its parts); the server loop's ``server_seconds`` includes it.

One generator or distillation "epoch" is one batch of pseudo-latents: there is no dataset
to pass over (the authors' code does the same).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message

from ...common.errors import ConfigError
from ...common.model.prompted import resolve_device
from ...common.records import ARRAYS, METRICS, arrays_of, as_int, from_array_record, metrics_of, to_array_record
from ..platform.rounds import Accepted, Sent
from ..platform.strategy import PromptStrategy
from .diagnostics import RealDataProbe, sample_latents, teacher_accuracy
from .distill import distill, train_generator
from .latents import LatentGenerator, LatentStudent, TaskTeachers, Teachers, task_groups
from .options import HePCoOptions
from .records import CLASS_COUNTS, count_matrix

log = logging.getLogger("promptfcl")


class HePCoStrategy(PromptStrategy):
    """HePCo's server: provisional average, latent generation, latent distillation.

    State kept across rounds: only the previous task's final prompts, keys and head
    (``self.previous``), as the paper's storage analysis says (sec. 6.2.2).
    """

    per_task = "in-flight"  # asynchronous arrival: a task's slice over the clients on it

    opts: HePCoOptions

    def setup(self) -> None:
        if self.opts.client_weights == "class-counts":
            self.reply_records = frozenset({ARRAYS, METRICS, CLASS_COUNTS})
        self.device = resolve_device(self.placement.device)
        self.task, self.round = 0, 0
        self.previous: dict[str, np.ndarray] | None = None  # previous task's final P, K (seen slices), head
        self.previous_task = -1
        self.last_report: dict[str, float] = {}
        self._probe: RealDataProbe | None = None

    def averaging_weights(self, accepted: list[Accepted]) -> np.ndarray | None:
        """``averaging = "uniform"``: the provisional model is the replies' plain average (1 each);
        ``"samples"``: the platform's weights."""
        return np.ones(len(accepted)) if self.opts.averaging == "uniform" else None

    def averaged_over_all(self, name: str) -> bool:
        """With ``pool-training = "whole"`` the prompt arrays average over every reply (each trained
        the whole pool) when clients are on several tasks; a task's head rows over its replies."""
        return self.opts.pool_training == "whole" and name.startswith("prompt.")

    def components(self, task: int) -> int:
        """Components of the pool in use up to ``task``: its CODA-P slices, or the whole pool."""
        if self.opts.pool_training == "whole":
            return self.model.pool_size
        return (task + 1) * self.layout.components_per_task

    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """The pool-training choice travels in the prompt's ``whole_pool`` buffer; then CODA-P's new slice."""
        state = from_array_record(arrays)
        state["prompt.whole_pool"] = np.full((1,), float(self.opts.pool_training == "whole"), np.float32)
        return super().on_task_start(task, to_array_record(state))

    # ------------------------------------------------------------------ hooks
    def round_start(self, server_round: int, task: int, round_: int, arrays: ArrayRecord) -> None:
        self.task, self.round = task, round_
        self.last_report = {}

    def round_metrics(self, accepted: list[Accepted]) -> dict[str, float]:
        """Consolidation time and its parts, the generators' and distillation's losses."""
        return {key: float(value) for key, value in self.last_report.items()}

    def consolidate(self, server_round: int, arrays: ArrayRecord, accepted: list[Accepted]) -> ArrayRecord:
        """Provisional average -> generators -> latent distillation; returns the new global arrays."""
        started = time.perf_counter()
        opts, task = self.opts, self.task
        provisional = from_array_record(arrays)  # the platform's average, weighted as ``averaging`` says
        if not (opts.distill_prompts or opts.distill_head):
            self.last_report = {"consolidation-seconds": time.perf_counter() - started}
            return to_array_record(provisional)

        per_task = self.layout.components_per_task
        k = self.layout.classes_per_task
        dev = self.device
        # the tasks this round's replies trained (one, the current task, with synchronous arrival):
        # the current-task generator and the distillation cover all their classes
        groups = self.task_teachers(accepted)
        low, high = int(groups[0].classes[0]) // k, int(groups[-1].classes[-1]) // k
        classes = torch.arange(low * k, (high + 1) * k, device=dev)
        seen = torch.arange((high + 1) * k, device=dev)
        seed = int(np.random.default_rng([self.run.seed, task, self.round, 0x4EC0]).integers(2**31 - 1))
        rng = torch.Generator(device=dev).manual_seed(seed)

        clients = groups[0].teachers if len(groups) == 1 else groups
        trainable = (slice(0, self.model.pool_size) if opts.pool_training == "whole"
                     else slice(low * per_task, (high + 1) * per_task))
        student = LatentStudent(provisional, self.model.layers, trainable, dev)
        dim = int(student.head_w.shape[1])
        report: dict[str, float] = {}

        with torch.random.fork_rng(devices=[]):  # seeded generator init, global RNG untouched
            torch.manual_seed(seed)
            gen = self._new_generator(dim)
            past_gen = self._new_generator(dim) if self._has_past() else None

        t0 = time.perf_counter()
        parts = train_generator(gen, classes, clients, student, opts, opts.generator_epochs, rng)
        report.update({f"gen-{name}": v for name, v in parts.items()})
        t1 = time.perf_counter()
        past = None
        if past_gen is not None:
            old_classes = torch.arange(task * k, device=dev)
            prev = Teachers.stack([self.previous], self.model.layers, self.components(task - 1), dev)  # type: ignore[list-item]
            steps = opts.generator_epochs + opts.past_generator_epochs_per_task * task
            parts = train_generator(past_gen, old_classes, prev, student, opts, steps, rng)
            report.update({f"past-gen-{name}": v for name, v in parts.items()})
            past = (past_gen, old_classes, prev)
        t2 = time.perf_counter()
        report.update(distill(student, opts, (gen, classes, clients), past, seen, rng))
        t3 = time.perf_counter()
        distilled = student.export(provisional)
        report.update(self._diagnose(gen, classes, clients, past, seen, student, provisional, distilled, seed))
        t4 = time.perf_counter()

        report.update({"generator-seconds": t1 - t0, "past-generator-seconds": t2 - t1,
                       "distill-seconds": t3 - t2, "diagnostics-seconds": t4 - t3,
                       "consolidation-seconds": t4 - started})
        self.last_report = report
        log.info("hepco round %d (task %d): consolidation %.2fs (generators %.2fs + %.2fs, distillation %.2fs) | %s",
                 server_round, task, t4 - started, t1 - t0, t2 - t1, t3 - t2,
                 " ".join(f"{name} {v:.3g}" for name, v in report.items() if not name.endswith("seconds")))
        return to_array_record(distilled)

    def task_teachers(self, accepted: list[Accepted]) -> list[TaskTeachers]:
        """The round's client teachers, one group per task they trained (ascending), each stacked
        up to its task's slices; the task of a reply is the one the server sent it."""
        weights = self.client_weights(accepted)
        samples = np.array([a.weight for a in accepted], np.float64)
        groups = []
        for t in sorted({a.task for a in accepted}):
            mine = [i for i, a in enumerate(accepted) if a.task == t]
            states = [from_array_record(arrays_of(accepted[i].content)) for i in mine]
            w = None if weights is None else weights[mine]
            share = (len(mine) if w is None else float(samples[mine].sum()) if w.ndim == 2 else float(w.sum()))
            groups.append(TaskTeachers(torch.as_tensor(self.layout.classes(t), device=self.device),
                                       Teachers.stack(states, self.model.layers, self.components(t), self.device, w),
                                       share))
        return groups

    def client_weights(self, accepted: list[Accepted]) -> np.ndarray | None:
        """Each reply's weight in the sums over clients (eqs. 2-4 and 6), scaled so that a latent's
        weights sum to C (the replies), as with 1 each, and the terms keep their balance with the
        lambdas and with eq. 6's zeta term.

        ``client-weights = "class-counts"`` (sec. 5.2's "weighted sum of classification losses for
        each individual client, similar to Zhang et al. (2022b)", whose weight of client k on
        class y is n_k^y / n^y; the authors' code weighs client j by its count of y): (C, N),
        reply c on a latent of class y weighs C n_c^y / n^y, so a client that holds none of y
        does not judge its latents. Each reply's label counts (records.py) are scaled to its
        ``Accepted.weight`` (its sample count or the platform's capped share).
        ``"samples"``: (C,), C n_c / sum n by the samples each reply trained on.
        ``"uniform"`` (eq. 2 as printed): None, 1 each."""
        if self.opts.client_weights == "uniform":
            return None
        n = np.array([a.weight for a in accepted], np.float64)
        if not n.sum() > 0:
            return None
        if self.opts.client_weights == "samples":
            return (len(n) * n / n.sum()).astype(np.float32)
        counts = count_matrix([from_array_record(arrays_of(a.content, CLASS_COUNTS)) for a in accepted],
                              self.num_classes)
        totals = counts.sum(1, keepdims=True)
        counts = np.divide(counts * n[:, None], totals, out=np.zeros_like(counts), where=totals > 0)
        per_class = counts.sum(0, keepdims=True)
        return np.divide(len(n) * counts, per_class, out=np.zeros_like(counts),
                         where=per_class > 0).astype(np.float32)

    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """With ``client-weights = "class-counts"``: one count per class of the task the client
        was sent, no class twice, non-negative, summing to the reply's ``num-examples``."""
        if self.opts.client_weights != "class-counts":
            return None
        if CLASS_COUNTS not in reply.content.array_records:
            return f"{CLASS_COUNTS!r} is not an array record"
        record = from_array_record(arrays_of(reply.content, CLASS_COUNTS))
        if set(record) != {"classes", "counts"}:
            return f"{CLASS_COUNTS} holds {sorted(record)}, expected ['classes', 'counts']"
        classes, counts = record["classes"], record["counts"]
        if not (np.issubdtype(classes.dtype, np.integer) and np.issubdtype(counts.dtype, np.integer)):
            return f"{CLASS_COUNTS} classes and counts must be integers"
        if classes.ndim != 1 or counts.shape != classes.shape or len(np.unique(classes)) != len(classes):
            return f"{CLASS_COUNTS} must give one count per class, each class once"
        if not np.isin(classes, self.layout.classes(sent.task)).all() or (counts < 0).any():
            return f"{CLASS_COUNTS} counts classes outside the task the client was sent, or negative counts"
        if int(counts.sum()) != as_int(metrics_of(reply.content)["num-examples"]):
            return f"{CLASS_COUNTS} sums to {int(counts.sum())}, the reply's num-examples differ"
        return None

    def _diagnose(self, gen: LatentGenerator, classes: torch.Tensor, clients: Teachers | list[TaskTeachers],
                  past: tuple[LatentGenerator, torch.Tensor, Teachers] | None, seen: torch.Tensor,
                  student: LatentStudent, provisional: dict[str, np.ndarray], distilled: dict[str, np.ndarray],
                  seed: int) -> dict[str, float]:
        """What the round's pseudo-latents are (reported every round; real data only with ``diagnostics``).

        Always (a few hundred latents, no data): ``gen-teacher-acc`` (mean over clients of
        their head's accuracy over the current classes on the current-task generator's
        latents) and ``past-gen-teacher-acc`` (the previous-task server's head over the old
        classes on the past-task generator's latents): are the latents recognisable as the
        classes they were generated for? And the server head over all seen classes on the
        same latents before (``*-provisional-acc``) and after (``*-student-acc``) distillation.
        """
        opts = self.opts
        rng = torch.Generator(device=self.device).manual_seed(seed + 1)  # the training stream stays untouched
        z_new, y_new = sample_latents(gen, classes, opts.diagnostics_per_class, opts.distill_generator_mode, rng)
        accuracies = [teacher_accuracy(g.teachers, z_new[g.holds(y_new)], y_new[g.holds(y_new)], g.classes)
                      for g in task_groups(classes, clients)]  # each client on its own task's latents
        out = {"gen-teacher-acc": float(torch.cat(accuracies).mean())}
        latents = {"new": (z_new, y_new)}
        if past is not None:
            past_gen, old_classes, prev = past
            z_old, y_old = sample_latents(past_gen, old_classes, opts.diagnostics_per_class,
                                          opts.distill_generator_mode, rng)
            out["past-gen-teacher-acc"] = float(teacher_accuracy(prev, z_old, y_old, old_classes)[0])
            latents["old"] = (z_old, y_old)
        heads = {"provisional": Teachers.stack([provisional], [], 0, self.device),
                 "student": Teachers.stack([distilled], [], 0, self.device)}
        for part, (z, y) in latents.items():
            prefix = "gen" if part == "new" else "past-gen"
            for name, head in heads.items():
                out[f"{prefix}-{name}-acc"] = float(teacher_accuracy(head, z, y, seen)[0])
        if opts.diagnostics:
            if self._probe is None:
                if self.server_runtime is None:  # check_run refuses diagnostics without central evaluation
                    raise ConfigError("hepco.diagnostics needs the server's own data (evaluation = central)")
                self._probe = RealDataProbe(self.server_runtime, self.run.seed, opts.diagnostics_per_class)
            old = np.arange(int(classes[0]))  # the stream's earlier tasks hold the classes below
            out.update(self._probe.measure(provisional, distilled, self.task, seen.cpu().numpy(), old, latents))
        return out

    def _has_past(self) -> bool:
        return (self.opts.use_previous and self.task > 0 and self.previous is not None
                and self.previous_task == self.task - 1 and self.opts.replay_ratio > 0)

    def _new_generator(self, dim: int) -> LatentGenerator:
        o = self.opts
        return LatentGenerator(self.num_classes, dim, o.noise_dim, o.label_embed_dim, o.hidden,
                               o.generator_batchnorm).to(self.device)

    def on_task_end(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Keep the task's final prompts and keys (its seen slices) and head: the next task's teacher."""
        if not self.opts.use_previous:
            self.previous, self.previous_task = None, -1  # the ablation keeps nothing
            return arrays
        stop = self.components(task)
        state = from_array_record(arrays)
        kept = {}
        for l in self.model.layers:
            for kind in "pk":
                kept[f"prompt.{kind}{l}"] = np.array(state[f"prompt.{kind}{l}"][:stop], copy=True)
        kept["head.weight"] = np.array(state["head.weight"], copy=True)
        kept["head.bias"] = np.array(state["head.bias"], copy=True)
        self.previous, self.previous_task = kept, task
        return arrays

    def state_dict(self) -> dict[str, Any]:
        """Flat: ``previous-task`` and ``previous.<array name>`` for the previous task's model."""
        state: dict[str, Any] = {"previous-task": self.previous_task}
        for name, arr in (self.previous or {}).items():
            state[f"previous.{name}"] = arr
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous_task = int(state.get("previous-task", -1))
        kept = {k[len("previous."):]: np.asarray(v) for k, v in state.items() if k.startswith("previous.")}
        self.previous = kept or None

    def summary(self) -> None:
        super().summary()
        log.info("hepco: %s", self.opts)
