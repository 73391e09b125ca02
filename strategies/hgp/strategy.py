"""HGP: Hierarchical Generative Prototypes ("Reducing Bias in Federated Class-Incremental Learning with
Hierarchical Generative Prototypes", section 3 and Appendix B).

Clients prompt a frozen ViT (a pool of prompts with keys; cosine scores of the query
against the keys, normalised, weigh the prompts; prefix-tuning; one head) and, after
local training, upload for every local class its sample count, mean and covariance
of the prompted features: a *generative prototype*. The server

1. averages prompts and head by sample count (FedAvg, eq. 3);
2. Tier 1: per class, a Gaussian mixture over the clients that hold it, component
   weights proportional to each client's count of that class;
3. Tier 2: a mixture over classes, weights proportional to the class counts;
   mixtures of earlier tasks are kept;
4. samples hierarchically (class -> client component -> feature, covariance scaled
   by a multiplier) and rebalances the whole head (all seen classes) by
   cross-entropy, SGD with momentum 0.9, 5 epochs, cosine schedule (eq. 7);
5. sends the rebalanced head with the averaged prompts back to the clients.

With asynchronous arrival (clients on different tasks in one round) the statistics are kept
per (class, client) under the client and task the server sent, newer replacing older (see
:meth:`HGPStrategy.ingest`), and rebalancing covers CR_old (tasks every client has left) and
CR_cur (tasks some client is on).

The wire format of the ``class-stats`` record (one row per local class) is this folder's
``gaussians.py``: :func:`class_statistics` (client) and :func:`check_class_stats` /
:func:`decode_class_stats` (server), so both sides share it. Covariance encodings, by option
``cov-type``:

* ``full``    packed upper triangle, D(D+1)/2 values per class (lossless);
* ``diag``    the D variances;
* ``lowrank`` a D x r factor F of the top principal directions plus the residual
  diagonal d, Sigma ~ F F^T + diag(d) (exact when the class has <= r+1 samples);

each in float32 or float16 (``cov-dtype``). Means are always float32.

Every component is sampled as ``x = mu + sqrt(m) * (F z1 + s * z2)`` with z1, z2
standard normal: full -> F = Cholesky factor, diag -> s = standard deviations,
lowrank -> both. Covariances are regularised (a ridge relative to their trace, grown
10x/100x/1000x where Cholesky fails, then eigenvalue clamping) so sampling never fails.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict

from ...common.records import ARRAYS, METRICS, arrays_of, as_int, from_array_record, metrics_of, to_array_record
from ..platform.rounds import Accepted, Sent
from ..platform.strategy import PromptStrategy
from .gaussians import (
    FEATURE_BOUND,
    WIRE_ARRAYS,
    ClassMixture,
    _mixture_from_raw,
    build_mixture,
    check_class_stats,
    class_weights,
    decode_class_stats,
    rebalance_head,
    sample_features,
)
from .options import HGPOptions
from .records import STATS

log = logging.getLogger("promptfcl")


class HGPStrategy(PromptStrategy):
    """FedAvg of prompts and head, then classifier rebalancing on hierarchical generative prototypes.

    Parameters
    ----------
    options : HGPOptions, optional
        ``hgp.*`` options.
    """

    per_task = "in-flight"  # asynchronous arrival: a task's slice over the clients on it

    reply_records = frozenset({ARRAYS, METRICS, STATS})
    opts: HGPOptions

    def uploaded_features(self, classes: list[int], seed: int) -> list[dict[str, Any]]:
        """Per class, the Gaussian of the client with most samples of it: its mean and one draw from
        it (covariance unscaled: what the client sent, not the widened sampler of rebalancing)."""
        generator = torch.Generator().manual_seed(seed)
        out = []
        for c in (c for c in classes if c in self.class_stats):
            raw = self.class_stats[c]
            k = int(np.argmax(raw["counts"]))
            row = {name: np.asarray(v)[k : k + 1] for name, v in raw.items()}
            stats = decode_class_stats({**row, "classes": np.zeros(1, np.int64)}, int(row["means"].shape[1]))
            client, meta = int(row["clients"][0]), {"count": int(row["counts"][0]), "covariance": stats.kind}
            out.append({"class": c, "kind": "mean", "vector": stats.means[0].numpy(), "client": client, "meta": meta})
            mixture = build_mixture(c, stats.counts, stats.means, stats.kind, stats.cov, stats.factor, stats.diag,
                                    self.opts.cov_eps)
            if mixture is not None:
                draw, _ = sample_features([mixture], torch.ones(1), 1, 1.0, generator)
                out.append({"class": c, "kind": "gaussian-sample", "vector": draw[0].numpy(), "client": client,
                            "meta": meta})
        return out

    def setup(self) -> None:
        self.task = 0  # the newest task some client has started
        # per class: its clients' statistics as received, one row per client, with the client
        # ("clients") and the server round it arrived in ("rounds") (checkpointed), and the
        # prepared mixture (a cache rebuilt from them)
        self.class_stats: dict[int, dict[str, np.ndarray]] = {}
        self._mixtures: dict[int, ClassMixture | None] = {}
        self.last_rebalance: dict[str, float] = {}

    # ------------------------------------------------------------------ hooks
    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        self.task = task
        return super().on_task_start(task, arrays)

    def averaged_over_all(self, name: str) -> bool:
        """The lab prefix (``prompt-design = "lab-prefix"``) over every reply, whatever task each is on:
        every reply trained all of it."""
        return self.opts.prompt_design == "lab-prefix" and name.startswith("prompt.")

    def stateful_parameters(self, arrays: ArrayRecord) -> dict[str, int]:
        """The exchange as the paper counts it (section 3.2.1, "each client sends its prompts and
        classification head of the current task"; Appendix A, Figure 5: the rebalanced, whole
        classifier goes back): to a client, the current task's prompt slice (components and keys
        of every prompted layer) and the whole head; from a client, the same slice and the head
        rows of the task's classes. Earlier slices are frozen (CODA-P), so a client that kept them
        would not need them again. Platform runs send and receive the whole pool (clients are
        stateless). ``c2s-statistics``: the class statistics a client holding every class of the
        task uploads on top (classes, counts, means and the ``cov-type`` encoding), which the
        paper's figure does not break out."""
        state = from_array_record(arrays)
        # the lab prefix is one prompt every task trains: all of it goes both ways
        per_task = 1 if self.opts.prompt_design == "lab-prefix" else self.layout.components_per_task
        prompts = sum(per_task * int(np.prod(v.shape[1:])) for k, v in state.items() if k.startswith("prompt."))
        head = sum(int(np.prod(v.shape)) for k, v in state.items() if k.startswith("head."))
        dim = int(state["head.weight"].shape[1])
        classes = self.layout.classes_per_task
        covariance = {"full": dim * (dim + 1) // 2, "diag": dim, "lowrank": dim * self.opts.cov_rank + dim}
        return {"s2c": prompts + head, "c2s": prompts + classes * (dim + 1),
                "c2s-statistics": classes * (2 + dim + covariance[self.opts.cov_type])}

    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """The class statistics: well-formed (:func:`check_class_stats`), in the configured encoding,
        for classes of the task the client was sent, counting exactly the reply's samples, with
        values a layer-normed feature can have. A bad record excludes the reply whole."""
        content = reply.content
        if STATS not in content.array_records:
            return f"{STATS!r} is not an array record"
        arrays = from_array_record(arrays_of(content, STATS))
        dim = int(arrays_of(content)["head.weight"].shape[1])  # already checked against what was sent
        try:
            kind = check_class_stats(arrays, dim)
        except ValueError as exc:
            return f"class statistics: {exc}"
        if kind != self.opts.cov_type:
            return f"class statistics carry a {kind} covariance, the run uses {self.opts.cov_type}"
        expected = {"classes", "counts", "means"} | set(WIRE_ARRAYS[kind])
        if set(arrays) != expected:
            return f"class statistics hold {sorted(arrays)}, expected {sorted(expected)}"
        examples = as_int(metrics_of(content)["num-examples"])
        if int(arrays["counts"].sum()) != examples:
            # the counts weigh the mixtures: they must be the samples the client trained on
            return f"class counts sum to {int(arrays['counts'].sum())}, num-examples is {examples}"
        outside = set(arrays["classes"].tolist()) - set(self.layout.classes(sent.task).tolist())
        if outside:
            return f"class statistics for classes {sorted(outside)[:5]} outside the task it was sent"
        for name, bound in (("means", FEATURE_BOUND), *((k, FEATURE_BOUND**2) for k in WIRE_ARRAYS[kind])):
            # in float64: a float16 covariance compared with 1e8 would cast the bound to float16 (inf,
            # with an overflow warning in every DP round)
            if np.abs(np.asarray(arrays[name], dtype=np.float64)).max(initial=0.0) > bound:
                return f"class statistics {name} beyond {bound:g}, impossible for layer-normed features"
        return None

    def consolidate(self, server_round: int, arrays: ArrayRecord, accepted: list[Accepted]) -> ArrayRecord:
        """Update this round's class mixtures from the replies, then rebalance the head."""
        started = time.perf_counter()
        state = from_array_record(arrays)
        self.ingest([a.content for a in accepted], server_round, [(a.client, a.task) for a in accepted])
        in_flight = None if self.schedule.synchronous else self.tasks_in_flight(server_round - 1)
        mixtures = self.rebalance_mixtures(in_flight)
        if not mixtures:
            return arrays
        seed = int(np.random.default_rng([self.run.seed, server_round, 0x46B]).integers(2**31))
        gen = torch.Generator().manual_seed(seed)
        weights = class_weights(mixtures, self.opts.class_weights)
        n = self.opts.samples_per_class * len(mixtures)
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def draw(epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
            if epoch not in cache:
                cache.clear()
                cache[epoch] = sample_features(mixtures, weights, n, self.opts.cov_multiplier, gen)
            return cache[epoch]

        if self.opts.rebalance_logits == "seen":
            newest = self.task if in_flight is None else in_flight[-1]
            allowed = torch.as_tensor(self.layout.seen(newest))
        else:
            allowed = torch.tensor(sorted(m.label for m in mixtures))
        sampled = time.perf_counter()
        w, b = rebalance_head(
            torch.from_numpy(state["head.weight"]), torch.from_numpy(state["head.bias"]), draw, allowed, self.opts, gen
        )
        state["head.weight"] = w.numpy().astype(state["head.weight"].dtype)
        state["head.bias"] = b.numpy().astype(state["head.bias"].dtype)
        self.last_rebalance = {
            "classes": len(mixtures),
            "samples": n,
            "prepare_seconds": sampled - started,
            "seconds": time.perf_counter() - started,
        }
        log.info(
            "hgp round %d: head rebalanced on %d synthetic features of %d classes in %.2fs",
            server_round,
            n,
            len(mixtures),
            self.last_rebalance["seconds"],
        )
        return to_array_record(state)

    # ------------------------------------------------------------------ mixtures
    def ingest(
        self, replies: list[RecordDict], server_round: int = 0, origins: list[tuple[int, int]] | None = None
    ) -> None:
        """Tier 1: keep each (class, client)'s newest statistics.

        Parameters
        ----------
        replies : list of RecordDict
            Accepted replies (``check_records`` has validated their statistics).
        server_round : int
            The round they arrived in.
        origins : list of (client id, task), optional
            The client and task the server sent each reply (``Accepted.client`` / ``.task``);
            None: distinct unknown clients on the newest task.

        A client's statistics for a class replace its older ones. A round's reports of a
        class also replace the statistics of the clients that are still on the class's task
        (their model has moved on since), so a class's mixture holds the freshest report of
        every client that has left its task and this round's reports from the clients still
        on it. With synchronous arrival every client is on the task until it ends, so a
        reported class's mixture is this round's components, as HGP's Tier 1 (section 3)
        builds it from the round's clients. Classes no client reported this round keep their
        mixture (earlier tasks' classes, or classes missing from a partial round).
        """
        if origins is None:
            origins = [(-1 - i, self.task) for i in range(len(replies))]
        fresh: dict[int, list[tuple[dict[str, np.ndarray], int, int]]] = {}
        for (client, task), content in zip(origins, replies):
            if STATS not in content.array_records:
                continue
            allowed = set(self.layout.classes(task).tolist())
            arrays = from_array_record(arrays_of(content, STATS))  # stored as received, decoded when a mixture is built
            for row, c in enumerate(arrays["classes"].tolist()):
                if c in allowed and int(arrays["counts"][row]) > 0:
                    fresh.setdefault(c, []).append((arrays, row, client))
        for c, rows in fresh.items():
            encodings = {
                tuple((k, a[k].dtype.str, a[k].shape[1:]) for k in sorted(a) if k.startswith("cov-"))
                for a, _, _ in rows
            }
            kept = self._kept_rows(c, {client for _, _, client in rows}, server_round)
            if kept is not None:
                encodings.add(
                    tuple((k, v.dtype.str, v.shape[1:]) for k, v in sorted(kept.items()) if k.startswith("cov-"))
                )
            if len(encodings) != 1:
                log.warning("hgp: class %d received mixed covariance encodings; skipped this round", c)
                continue
            new = {k: np.stack([a[k][r] for a, r, _ in rows]) for k in rows[0][0] if k != "classes"}
            new["clients"] = np.array([client for _, _, client in rows], np.int64)
            new["rounds"] = np.full(len(rows), server_round, np.int64)
            self.class_stats[c] = new if kept is None else {k: np.concatenate([kept[k], new[k]]) for k in new}
            self._mixtures.pop(c, None)

    def _kept_rows(self, label: int, reporters: set[int], server_round: int) -> dict[str, np.ndarray] | None:
        """The stored rows of ``label`` that this round's reports leave in place (None: none).

        Dropped: the reporters' own older rows, and those of clients still on the class's task.
        """
        stored = self.class_stats.get(label)
        if stored is None or "clients" not in stored:
            return None
        task = self.layout.task_of(label)  # the stream's tasks own contiguous classes
        keep = np.array(
            [
                c not in reporters and c >= 0 and self.client_position(int(c), server_round - 1) > task
                for c in stored["clients"].tolist()
            ],
            dtype=bool,
        )
        if not keep.any():
            return None
        return {k: v[keep] for k, v in stored.items()}

    def mixture(self, label: int) -> ClassMixture | None:
        """The prepared Tier-1 mixture of ``label`` (None if never reported)."""
        if label not in self._mixtures:
            raw = self.class_stats.get(label)
            self._mixtures[label] = (
                None
                if raw is None
                else _mixture_from_raw(
                    label, {k: v for k, v in raw.items() if k not in ("clients", "rounds")}, self.opts.cov_eps,
                )
            )
        return self._mixtures[label]

    def rebalance_mixtures(self, in_flight: range | None = None) -> list[ClassMixture]:
        """Mixtures of the classes the rebalancing samples.

        CR_old: the classes of the tasks every client has left; CR_cur: the classes of the
        tasks some client is on, ``in_flight`` (None: the current task alone, as with
        synchronous arrival). Together they cover every class any client has reported so far.
        """
        in_flight = range(self.task, self.task + 1) if in_flight is None else in_flight
        labels: list[int] = []
        if self.opts.rebalance_old:
            labels += self.layout.seen(in_flight.start - 1).tolist() if in_flight.start else []
        if self.opts.rebalance_cur:
            labels += [c for t in in_flight for c in self.layout.classes(t).tolist()]
        return [m for m in (self.mixture(c) for c in labels) if m is not None]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Every class's statistics as received (all mixtures, earlier tasks included)."""
        out: dict[str, Any] = {"task": self.task}
        for c, raw in self.class_stats.items():
            out.update({f"class{c}.{k}": v for k, v in raw.items()})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task = int(state.get("task", 0))
        self.class_stats, self._mixtures = {}, {}
        for key, value in state.items():
            if key.startswith("class") and "." in key:
                label, name = key[5:].split(".", 1)
                self.class_stats.setdefault(int(label), {})[name] = np.asarray(value)
        for raw in self.class_stats.values():  # a checkpoint from before per-client rows: clients unknown
            n = len(raw["counts"])
            raw.setdefault("clients", np.arange(-1, -1 - n, -1, dtype=np.int64))
            raw.setdefault("rounds", np.zeros(n, np.int64))
