"""C2Prompt on the server ("C²Prompt: Class-aware Client Knowledge Interaction for Federated
Continual Learning", the abstract and the framework figure; everything else the project's
reading, docs/methods.md lists each).

* Global class distribution estimation (figure (a)): the first round a client trains a task the
  server asks it (``c2prompt-upload-stats``) for the count, mean and diagonal variance of the
  frozen backbone's q(x) of each class it holds; the server keeps every (class, client, task)
  report and pools them per class (count-weighted mean, law of total variance: the union of every
  report's samples) and sends the pooled Gaussians of a client's task classes with every message
  (``c2prompt-global``) for its LCDC. The paper's separate round 0 is the project's reading folded
  into the task's first training round, whose reply carries the statistics: the replies are then
  one release, bounded by the platform's statistics bound and by differential privacy.
* Class-aware prompt aggregation (figure (b)): each round, per task the server sent (replies of
  clients on different tasks are grouped by it) and per prompted block, the task's slice of every
  prompt array (components, keys, attention vectors) is combined by the correlation of the
  clients' selection histograms (``cpa.py``); the head and the earlier slices are the platform's
  average (per task slice with several tasks in flight). ``cpa = false``: FedAvg of the prompts.
  CPA is a weighted mean: under a robust combiner (``aggregation`` median or trimmed mean) the
  run's combiner is kept instead, so a defended run is not weakened.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from ...common.records import ARRAYS, METRICS, arrays_of, as_int, from_array_record, metrics_of, to_array_record
from ..platform.rounds import Accepted, Sent
from ..platform.strategy import PromptStrategy
from .cpa import class_aware_aggregate, cpa_matrix
from .distributions import pool_statistics
from .options import C2PromptOptions
from .prompt import C2PromptPrompt
from .records import CLASS_STATS, GLOBAL_STATS, HISTOGRAM, PRIVATE_RECORDS, STATISTICS, UPLOAD_STATS

log = logging.getLogger("promptfcl")

#: q(x) leaves the backbone's final LayerNorm: honest means are of order 1-10, variances that squared
FEATURE_BOUND = 1e4


class C2PromptStrategy(PromptStrategy):
    """Global class distributions of q(x), then class-aware aggregation of the task's prompt slice."""

    name = "c2prompt"
    prompt_class = C2PromptPrompt
    options_class = C2PromptOptions
    opts: C2PromptOptions
    per_task = "in-flight"  # clients on several tasks: each task's slice and head rows over its clients
    reply_records = frozenset({ARRAYS, METRICS, CLASS_STATS, HISTOGRAM})
    statistics = STATISTICS  # what the platform bounds where the run is defended (records.py)
    private_records = PRIVATE_RECORDS  # (records.py: the client's side reads them there)

    def setup(self) -> None:
        # class -> (client, task) -> (count, mean, variance) as received (checkpointed)
        self.reported: dict[int, dict[tuple[int, int], tuple[int, np.ndarray, np.ndarray]]] = defaultdict(dict)
        self.received: set[tuple[int, int]] = set()  # (client, task) whose statistics arrived
        self._global: dict[int, ArrayRecord] = {}  # this round's record per task (a cache)
        self.self_weight: float | None = None  # CPA: mean weight a copy keeps of itself (1: no sharing)

    def summary(self) -> None:
        super().summary()
        log.info("c2prompt: %s", self.opts.to_dict())

    # ------------------------------------------------------------------ global class distributions
    def global_distribution(self, label: int) -> tuple[float, np.ndarray, np.ndarray] | None:
        """(N, mean, variance) of class ``label`` over every report so far (None: none)."""
        reports = self.reported.get(label)
        if not reports:
            return None
        counts, means, var = zip(*reports.values())
        return pool_statistics(np.array(counts), np.stack(means), np.stack(var))

    def global_record(self, task: int) -> ArrayRecord | None:
        """The pooled Gaussians of ``task``'s classes that have any report (None: none has)."""
        if task not in self._global:
            rows = [(c, g) for c in self.layout.classes(task).tolist()
                    if (g := self.global_distribution(c)) is not None]
            if not rows:
                return None
            self._global[task] = to_array_record({
                "classes": np.array([c for c, _ in rows], np.int64),
                "means": np.stack([g[1] for _, g in rows]).astype(np.float32),
                "var": np.stack([g[2] for _, g in rows]).astype(np.float32)})
        return self._global[task]

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

    def payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict:
        """The arrays, the request for statistics (a (client, task) not reported yet) and, for LCDC,
        the global distributions of the task's classes."""
        sent.config[UPLOAD_STATS] = (sent.client, sent.task) not in self.received
        content = super().payload(sent, arrays)
        assert content is not None
        record = self.global_record(sent.task) if self.opts.lcdc else None
        if record is not None:
            content[GLOBAL_STATS] = record
        return content

    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """Statistics: as asked (none unless asked), of the task's classes, counting exactly the
        reply's samples, finite and within what a LayerNormed feature can be; histogram: one
        (components x classes) table per prompted block, finite."""
        content = reply.content
        for name in (CLASS_STATS, HISTOGRAM):
            if name not in content.array_records:
                return f"{name!r} is not an array record"
        stats = from_array_record(arrays_of(content, CLASS_STATS))
        if set(stats) != {"classes", "counts", "means", "var"}:
            return f"class statistics hold {sorted(stats)}, expected ['classes', 'counts', 'means', 'var']"
        classes, counts = stats["classes"], stats["counts"]
        dim = int(arrays_of(content)["head.weight"].shape[1])  # already checked against what was sent
        n = len(classes)
        if classes.ndim != 1 or counts.shape != (n,) or any(stats[k].shape != (n, dim) for k in ("means", "var")):
            return f"class statistics shapes do not fit {n} classes of dim {dim}"
        if not (np.issubdtype(classes.dtype, np.integer) and np.issubdtype(counts.dtype, np.integer)):
            return "class statistics classes and counts must be integers"
        asked = bool(sent.config.get(UPLOAD_STATS, False))
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
        hist = from_array_record(arrays_of(content, HISTOGRAM))
        shape = (len(self.cfg.layers), self.layout.components_per_task, len(self.layout.classes(sent.task)))
        if set(hist) != {"hist"} or hist["hist"].shape != shape:
            return f"the histogram must be one array 'hist' of shape {shape}"
        if not np.issubdtype(hist["hist"].dtype, np.floating) or not np.isfinite(hist["hist"]).all():
            return "the histogram must be finite floating point"
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
            rows = self.layout.slice_of(task)
            weights = np.array([a.weight if self.opts.cpa_weighting == "samples" else 1.0 for a in group])
            hists = np.stack([from_array_record(arrays_of(a.content, HISTOGRAM))["hist"] for a in group])
            replies = [from_array_record(arrays_of(a.content)) for a in group]
            for i, layer in enumerate(self.cfg.layers):
                kept.append(np.diag(cpa_matrix(hists[:, i], weights, self.opts.cpa_scope)).mean())
                for kind in self.prompt_class.kinds:
                    name = f"prompt.{kind}{layer}"
                    merged, _ = class_aware_aggregate(np.stack([r[name][rows] for r in replies]), hists[:, i], weights,
                                                      self.opts.cpa_scope, self.opts.cpa_collapse)
                    state[name][rows] = merged.astype(state[name].dtype)
        self.self_weight = float(np.mean(kept)) if kept else None
        return to_array_record(state)

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
        return {"stats.keys": np.array([r[:4] for r in rows], np.int64).reshape(-1, 4),
                "stats.means": np.array([r[4] for r in rows], np.float64).reshape(-1, dim),
                "stats.var": np.array([r[5] for r in rows], np.float64).reshape(-1, dim),
                "received": np.array(sorted(self.received), np.int64).reshape(-1, 2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.setup()
        keys = np.asarray(state.get("stats.keys", np.zeros((0, 4), np.int64))).reshape(-1, 4)
        for (c, client, task, n), mu, var in zip(keys.tolist(), np.asarray(state.get("stats.means", [])),
                                                  np.asarray(state.get("stats.var", []))):
            self.reported[int(c)][(int(client), int(task))] = (int(n), np.asarray(mu), np.asarray(var))
        received = np.asarray(state.get("received", np.zeros((0, 2)))).reshape(-1, 2)
        self.received = {(int(a), int(b)) for a, b in received}

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
