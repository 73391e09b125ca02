"""C2Prompt on the server ("C²Prompt: Class-aware Client Knowledge Interaction for Federated
Continual Learning": the abstract, the framework figure's two drafts and a paper note; the rest
the project's reading, docs/methods.md lists whose each is).

* Global class distribution estimation (figures (a), round 0 of each stage): with ``stats-round =
  "exchange"`` a round whose sampled clients include some on a task they have not reported
  starts with a statistics-only exchange (the platform's exchange before training: no arrays
  out, the per-class count, mean and diagonal variance of the frozen backbone's q(x) back), so
  every class has its global distribution from its task's first training round; with
  ``"first-training"`` that round's reply carries them (one release, the one ``dp.*`` bounds).
  The server keeps every (class, client, task) report and pools them per class (count-weighted
  mean, law of total variance: Eq. (1)-(2)), and sends the pooled Gaussians of a client's task
  classes with every train message (``c2prompt-global``) for its LCDC. With ``comp-schedule =
  "once"`` the pool a client's compensation is trained on is frozen, per (client, task), at its
  first train message after its own report: the reports then in it are kept (``frozen``).
* Class-aware prompt aggregation (figures (b)): each round, per task the server sent (replies of
  clients on different tasks are grouped by it) and per prompted block, W_g^t from the clients'
  selection histograms (``cpa.py``) combines every client's components, keys and attention
  vectors of the task (``cpa-scope = "all"``: the figures' whole matrix); ``cpa-pool = "merge"``
  folds the K N rows of W P back into the slice's N, ``"keep-all"`` writes each client's rows into
  its part of the slice (K N components kept, the figures' P_g^{t*}). The head and the earlier
  slices are the platform's average. ``cpa = false``: FedAvg of the prompts. CPA is a weighted
  mean: under a robust combiner (``aggregation`` median or trimmed mean) the run's combiner is
  kept instead, so a defended run is not weakened.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from ...common.records import (
    ARRAYS,
    CONFIG,
    METRICS,
    arrays_of,
    as_int,
    from_array_record,
    metrics_of,
    to_array_record,
)
from ..platform.replies import check_metrics
from ..platform.rounds import Accepted, Sent
from ..platform.strategy import PromptStrategy
from .cpa import collapse_weights, cpa_copies, cpa_matrix
from .distributions import pool_statistics
from .options import C2PromptOptions
from .prompt import C2PromptPrompt
from .records import (
    CLASS_STATS,
    EXCHANGE_METRICS,
    GLOBAL_STATS,
    HISTOGRAM,
    PART,
    UPLOAD_STATS,
)

log = logging.getLogger("promptfcl")

#: q(x) leaves the backbone's final LayerNorm: honest means are of order 1-10, variances that squared
FEATURE_BOUND = 1e4

Reporter = tuple[int, int]  # (client, task) of a report of class statistics


class C2PromptStrategy(PromptStrategy):
    """Global class distributions of q(x), then class-aware aggregation of the task's prompt slice."""

    opts: C2PromptOptions
    per_task = "in-flight"  # clients on several tasks: each task's slice and head rows over its clients
    reply_records = frozenset({ARRAYS, METRICS, CLASS_STATS, HISTOGRAM})

    def setup(self) -> None:
        # class -> (client, task) -> (count, mean, variance) as received (checkpointed)
        self.reported: dict[int, dict[tuple[int, int], tuple[int, np.ndarray, np.ndarray]]] = defaultdict(dict)
        self.received: set[tuple[int, int]] = set()  # (client, task) whose statistics arrived
        # comp-schedule = "once": the reports a (client, task)'s global distributions pool (checkpointed)
        self.frozen: dict[Reporter, tuple[Reporter, ...]] = {}
        self._global: dict[tuple[int, tuple[Reporter, ...] | None], ArrayRecord] = {}  # this round's records (a cache)
        self.self_weight: float | None = None  # CPA: mean weight a copy keeps of itself (1: no sharing)

    def summary(self) -> None:
        super().summary()
        log.info("c2prompt: %s", self.opts.to_dict())

    # ------------------------------------------------------------------ global class distributions
    def global_distribution(self, label: int, reporters: tuple[Reporter, ...] | None = None
                            ) -> tuple[float, np.ndarray, np.ndarray] | None:
        """(N, mean, variance) of class ``label`` over every report so far, or over those of
        ``reporters`` (None: no report)."""
        reports = [v for k, v in self.reported.get(label, {}).items() if reporters is None or k in reporters]
        if not reports:
            return None
        counts, means, var = zip(*reports)
        return pool_statistics(np.array(counts), np.stack(means), np.stack(var))

    def global_record(self, task: int, reporters: tuple[Reporter, ...] | None = None) -> ArrayRecord | None:
        """The pooled Gaussians of ``task``'s classes that have any report (of ``reporters``, where
        given; None: no class has)."""
        key = (task, reporters)
        if key not in self._global:
            rows = [(c, g) for c in self.layout.classes(task).tolist()
                    if (g := self.global_distribution(c, reporters)) is not None]
            if not rows:
                return None
            self._global[key] = to_array_record({
                "classes": np.array([c for c, _ in rows], np.int64),
                "means": np.stack([g[1] for _, g in rows]).astype(np.float32),
                "var": np.stack([g[2] for _, g in rows]).astype(np.float32)})
        return self._global[key]

    def record_for(self, sent: Sent) -> ArrayRecord | None:
        """The global distributions a train message carries: the reports of its task's classes so
        far; with ``comp-schedule = "once"``, those of the client's first message after its own
        report, kept from then on, so its compensation prompts of the task stay the same."""
        key = (sent.client, sent.task)
        if self.opts.comp_schedule == "once" and key not in self.frozen and key in self.received:
            self.frozen[key] = tuple(sorted({r for c in self.layout.classes(sent.task).tolist()
                                             for r in self.reported.get(int(c), {})}))
        return self.global_record(sent.task, self.frozen.get(key))

    def ingest(self, accepted: list[Accepted]) -> None:
        """Keep each reply's class statistics under (class, its client, the task it was sent)."""
        for a in accepted:
            rec = from_array_record(arrays_of(a.content, CLASS_STATS))
            if not len(rec["classes"]):
                continue
            self.received.add((a.client, a.task))
            for row, c in enumerate(rec["classes"].tolist()):
                if int(rec["counts"][row]) > 0:
                    self.reported[int(c)][(a.client, a.task)] = (
                        int(rec["counts"][row]), np.asarray(rec["means"][row], np.float64),
                        np.asarray(rec["var"][row], np.float64))
        self._global.clear()

    # ------------------------------------------------------------------ hooks
    def round_start(self, server_round: int, task: int, round_: int, arrays: ArrayRecord) -> None:
        self._global.clear()

    def asks_statistics(self, sent: Sent) -> bool:
        """Whether the client reports its class statistics of its task: not yet reported, LCDC on."""
        return self.opts.lcdc and (sent.client, sent.task) not in self.received

    def payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict:
        """The arrays, the request for statistics (``stats-round = "first-training"``), the client's
        part of its task's slice (``keep-all``) and, for LCDC, the global distributions."""
        sent.config[UPLOAD_STATS] = self.opts.stats_round == "first-training" and self.asks_statistics(sent)
        if self.opts.cpa_pool == "keep-all":
            sent.config[PART] = sent.slot
        content = super().payload(sent, arrays)
        assert content is not None
        record = self.record_for(sent) if self.opts.lcdc else None
        if record is not None:
            content[GLOBAL_STATS] = record
        return content

    def uses_exchange(self) -> bool:
        return self.opts.lcdc and self.opts.stats_round == "exchange"

    def exchange_payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict | None:
        """Figures (a), round 0: a statistics-only message (its config alone: q(x) is the frozen
        backbone's) to a client on a task it has not reported; the others get none."""
        if not self.asks_statistics(sent):
            return None
        sent.config[UPLOAD_STATS] = True
        return RecordDict({CONFIG: sent.config})

    def check_exchange(self, reply: Message, sent: Sent) -> str | None:
        """An answer holds the class statistics and their sample count, nothing else."""
        content = reply.content
        if set(content.keys()) != {CLASS_STATS, METRICS}:
            return f"records {sorted(content.keys())}, expected {sorted({CLASS_STATS, METRICS})}"
        reason = check_metrics(content[METRICS], EXCHANGE_METRICS)
        if reason is not None:
            return reason
        assert self.round_arrays is not None
        dim = int(self.round_arrays["head.weight"].shape[1])  # q(x)'s width: the head's input
        return self.check_statistics(content, sent, True, dim)

    def use_exchange(self, server_round: int, answers: list[Accepted]) -> None:
        """The answers' statistics join the reports before the round's train messages are made."""
        self.ingest(answers)

    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """Statistics as asked (none unless asked: ``check_statistics``); histogram: one (components
        the client trained x classes) table per prompted block, finite."""
        content = reply.content
        for name in (CLASS_STATS, HISTOGRAM):
            if name not in content.array_records:
                return f"{name!r} is not an array record"
        dim = int(arrays_of(content)["head.weight"].shape[1])  # already checked against what was sent
        reason = self.check_statistics(content, sent, bool(sent.config.get(UPLOAD_STATS, False)), dim)
        if reason is not None:
            return reason
        hist = from_array_record(arrays_of(content, HISTOGRAM))
        shape = (len(self.model.layers), self.opts.components_per_client(self.model, self.data, self.federation),
                 len(self.layout.classes(sent.task)))
        if set(hist) != {"hist"} or hist["hist"].shape != shape:
            return f"the histogram must be one array 'hist' of shape {shape}"
        if not np.issubdtype(hist["hist"].dtype, np.floating) or not np.isfinite(hist["hist"]).all():
            return "the histogram must be finite floating point"
        return None

    def check_statistics(self, content: RecordDict, sent: Sent, asked: bool, dim: int) -> str | None:
        """The class statistics of a train reply or an exchange answer: as asked (none unless
        ``asked``), of the task's classes, counting exactly its samples, finite and within what a
        LayerNormed feature of width ``dim`` can be."""
        stats = from_array_record(arrays_of(content, CLASS_STATS))
        if set(stats) != {"classes", "counts", "means", "var"}:
            return f"class statistics hold {sorted(stats)}, expected ['classes', 'counts', 'means', 'var']"
        classes, counts = stats["classes"], stats["counts"]
        n = len(classes)
        if classes.ndim != 1 or counts.shape != (n,) or any(stats[k].shape != (n, dim) for k in ("means", "var")):
            return f"class statistics shapes do not fit {n} classes of dim {dim}"
        if not (np.issubdtype(classes.dtype, np.integer) and np.issubdtype(counts.dtype, np.integer)):
            return "class statistics classes and counts must be integers"
        if n and not asked:
            return "class statistics the server did not ask for"
        if asked:
            if len(np.unique(classes)) != n or not np.isin(classes, self.layout.classes(sent.task)).all():
                return "class statistics repeat a class or hold classes outside the task the client was sent"
            if (counts < 1).any() or int(counts.sum()) != as_int(metrics_of(content)["num-examples"]):
                return "class counts are not the reply's samples (each >= 1, summing to num-examples)"
        for name in ("means", "var"):
            values = np.asarray(stats[name], dtype=np.float64)
            if not np.isfinite(values).all():
                return f"class statistics {name} have non-finite values"
            bound = FEATURE_BOUND if name == "means" else FEATURE_BOUND**2
            if np.abs(values).max(initial=0.0) > bound:
                return f"class statistics {name} beyond {bound:g}, impossible for layer-normed features"
        return None

    def aggregate(self, accepted: list[Accepted]) -> ArrayRecord:
        """The platform's average, then each task's slice by CPA over the replies sent that task."""
        arrays = super().aggregate(accepted)
        self.self_weight = None
        if not self.opts.cpa or self.policies.combiner.mode != "mean":
            return arrays
        state = from_array_record(arrays)
        kept = []
        groups: dict[int, list[Accepted]] = defaultdict(list)
        for a in accepted:
            groups[a.task].append(a)
        for task, group in sorted(groups.items()):
            rows = self.client_rows(task, group)
            weights = np.array([a.weight if self.opts.cpa_weighting == "samples" else 1.0 for a in group])
            hists = np.stack([from_array_record(arrays_of(a.content, HISTOGRAM))["hist"] for a in group])
            replies = [from_array_record(arrays_of(a.content)) for a in group]
            for i, layer in enumerate(self.model.layers):
                matrix = cpa_matrix(hists[:, i], weights, self.opts.cpa_scope, self.opts.cpa_similarity,
                                    self.opts.cpa_tau)
                kept.append(np.diag(matrix).mean())
                pi = collapse_weights(hists[:, i], weights, self.opts.cpa_collapse)  # (N, K): merge only
                for kind in C2PromptPrompt.kinds:  # its pool's parameter kinds
                    name = f"prompt.{kind}{layer}"
                    copies = cpa_copies(np.stack([r[name][own] for r, own in zip(replies, rows)]), matrix)
                    if self.opts.cpa_pool == "keep-all":  # each client's rows of W P in its part
                        for own, copy in zip(rows, copies):
                            state[name][own] = copy.astype(state[name].dtype)
                    else:
                        state[name][rows[0]] = np.einsum("nk,kn...->n...", pi, copies).astype(state[name].dtype)
        self.self_weight = float(np.mean(kept)) if kept else None
        return to_array_record(state)

    def client_rows(self, task: int, group: list[Accepted]) -> list[slice]:
        """Each reply's rows of ``task``'s slice: the whole slice, or its client's part (keep-all)."""
        whole = self.layout.slice_of(task)
        if self.opts.cpa_pool != "keep-all":
            return [whole] * len(group)
        n = self.opts.components_per_client(self.model, self.data, self.federation)
        parts = [as_int(a.sent.config[PART]) for a in group]
        if len(set(parts)) != len(parts):  # the virtual population's slots are its client ids
            raise RuntimeError(f"task {task}: two replies trained the same part of its slice ({parts})")
        return [slice(whole.start + k * n, whole.start + (k + 1) * n) for k in parts]

    def consolidate(self, server_round: int, arrays: ArrayRecord, accepted: list[Accepted]) -> ArrayRecord:
        """The round's class statistics join the reports (global distributions of the next round)."""
        self.ingest(accepted)
        return arrays

    def round_metrics(self, accepted: list[Accepted]) -> dict[str, float]:
        """``cpa-self-weight``: the mean weight a client's copy keeps of itself in CPA (1: no sharing,
        1/K: K clients share equally); ``global-classes``: classes with a global distribution."""
        out = {"global-classes": float(len(self.reported))}
        if self.self_weight is not None:
            out["cpa-self-weight"] = self.self_weight
        return out

    # ------------------------------------------------------------------ checkpoint and audit
    def state_dict(self) -> dict[str, Any]:
        """Every (class, client, task) report of q(x) statistics and the (client, task) pairs received."""
        rows = [(c, client, task, n, mu, var) for c, reports in sorted(self.reported.items())
                for (client, task), (n, mu, var) in sorted(reports.items())]
        dim = len(rows[0][4]) if rows else 0
        frozen = [(*key, *r) for key, reporters in sorted(self.frozen.items()) for r in reporters]
        return {"stats.keys": np.array([r[:4] for r in rows], np.int64).reshape(-1, 4),
                "stats.means": np.array([r[4] for r in rows], np.float64).reshape(-1, dim),
                "stats.var": np.array([r[5] for r in rows], np.float64).reshape(-1, dim),
                "received": np.array(sorted(self.received), np.int64).reshape(-1, 2),
                "frozen": np.array(frozen, np.int64).reshape(-1, 4)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.setup()
        keys = np.asarray(state.get("stats.keys", np.zeros((0, 4), np.int64))).reshape(-1, 4)
        for (c, client, task, n), mu, var in zip(keys.tolist(), np.asarray(state.get("stats.means", [])),
                                                  np.asarray(state.get("stats.var", []))):
            self.reported[int(c)][(int(client), int(task))] = (int(n), np.asarray(mu), np.asarray(var))
        received = np.asarray(state.get("received", np.zeros((0, 2)))).reshape(-1, 2)
        self.received = {(int(a), int(b)) for a, b in received}
        frozen: dict[Reporter, list[Reporter]] = defaultdict(list)
        for client, task, r_client, r_task in np.asarray(state.get("frozen", np.zeros((0, 4)))).reshape(-1, 4).tolist():
            frozen[(int(client), int(task))].append((int(r_client), int(r_task)))
        self.frozen = {key: tuple(sorted(reporters)) for key, reporters in frozen.items()}

    def uploaded_features(self, classes: list[int], seed: int) -> list[dict[str, Any]]:
        """Per class, the q(x) mean of the report with most samples (what the audit inverts)."""
        out = []
        for c in classes:
            reports = self.reported.get(c)
            if reports:
                (client, task), (n, mu, _) = max(reports.items(), key=lambda kv: kv[1][0])
                out.append({"class": c, "kind": "q(x) mean", "vector": mu.astype(np.float32), "client": client,
                            "meta": {"count": n, "task": task}})
        return out

    def audit_notes(self) -> dict[str, Any]:
        return {"c2prompt": {
            "classes_with_statistics": sorted(self.reported),
            "note": ("C2Prompt's server keeps every client's per-class mean and diagonal variance of the frozen "
                     "backbone's q(x), and each round's histograms of which prompt components each class selects; "
                     "the compensation prompts never leave the clients"),
        }}
