"""``promptfcl bench edge``: one client round at ViT-B/16 dimensions within a node's memory budget.

Each configuration (the frozen backbone's precision and the node's ``memory-budget-mb``) trains
one client round in a fresh process: timm's ``vit_base_patch16_224`` with random weights read
from the node's backbone cache (memory-mapped, as a deployed node reads it), CODA-P prompts at
the papers' sizes (blocks 0-4, a pool of 100, length 8, 10 tasks of 100 classes), one step of
the paper configuration's batch of random 224-px images. The node plans the round as a deployed
node does (client/memory.py). Per row: the process's peak resident memory (the kernel's
high-water mark), images per second of the round (queries included), the largest difference of
its uploaded arrays from the float32 round without a budget, and the plan it chose.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict

from ...client.memory import apply_plan, plan_metrics
from ...client.message_context import MessageContext
from ...client.node_policy import BACKBONE_PRECISION_ENV
from ...common.config.experiment import ExperimentConfig
from ...common.data.sources import ArraySplit, Dataset
from ...common.model.backbone import build_backbone
from ...common.model.evaluation import accuracies, correct_counts
from ...common.model.runtime import backbone_of, get_runtime
from ...common.node.memory_plan import resident_mb
from ...common.records import ARRAYS, arrays_of, from_array_record, to_array_record
from ...strategies.fedavg.strategy import FedAvgStrategy
from ...strategies.platform.learner import FitConditions, LocalLearner
from ...strategies.registry import prompt_class
from .. import checkpoint
from .common import _machine, run_simulation_subprocess
from .comparison import finished_run

log = logging.getLogger("promptfcl")

#: (name, backbone precision, memory budget in MB (0: none), batch (0: the bench's)): the configurations
#: of interest; the first of a batch size is the reference of the others' updates.
ROWS: list[tuple[str, str, float, int]] = [
    ("fp32", "fp32", 0.0, 0),
    ("fp32-1500", "fp32", 1500.0, 0),
    ("fp32-1350", "fp32", 1350.0, 0),
    ("fp32-1250", "fp32", 1250.0, 0),  # near the float32 floor (about 1,230 MB): blocks recomputed
    ("bf16-1500", "bf16", 1500.0, 0),
    ("int8-1500", "int8", 1500.0, 0),
    ("int8-1200", "int8", 1200.0, 0),
]

#: the papers' model at CODA-P's prompt sizes (configs/*-cifar100.toml), random weights
PAPER_MODEL: dict[str, Any] = {
    "backbone": "vit_base_patch16_224", "image-size": 224, "patch-size": 16, "embed-dim": 768, "depth": 12,
    "num-heads": 12, "weights": "random", "prompt-mode": "prefix", "prompt-layers": "0,1,2,3,4",
    "pool-size": 100, "prompt-length": 8, "num-tasks": 10, "num-classes": 100, "num-clients": 1,
    "clients-per-round": 1, "partition": "iid", "local-epochs": 1, "lr": 0.001, "backbone-cache-disk": "on",
    "query-cache-disk": "off", "population": "nodes", "device": "cpu",
}


def edge_config(batch_size: int, threads: int) -> Any:
    return ExperimentConfig.from_dict({**PAPER_MODEL, "batch-size": batch_size, "threads": threads})


def stand_in(batch_size: int, num_classes: int = 100, per_task: int = 10, seed: int = 0) -> Any:
    """One step's worth of random 224-px images in task 0's classes (and a few test images)."""

    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (batch_size + per_task, 3, 224, 224), dtype=np.uint8)
    labels = np.arange(batch_size + per_task, dtype=np.int64) % per_task
    train = ArraySplit(images[:batch_size], labels[:batch_size])
    test = ArraySplit(images[batch_size:], labels[batch_size:])
    return Dataset("edge-stand-in", train, test, num_classes, [f"c{i}" for i in range(num_classes)],
                   f"edge-stand-in-{batch_size}-{seed}")


def train_one_round(precision: str, budget_mb: float, batch_size: int, threads: int, arrays_out: Path) -> dict:
    """The child's work: one client round in this process; its figures (and its arrays to ``arrays_out``)."""

    imports = resident_mb()  # the interpreter, torch, Flower and promptfcl: what the node's zygote holds
    cfg = edge_config(batch_size, threads)
    runtime = get_runtime(cfg, data=stand_in(batch_size), precision=precision)
    node = MessageContext.of(cfg, {"memory-budget-mb": budget_mb, "backbone-precision": precision})
    learner = LocalLearner.of(cfg, runtime, node.options, node.privacy)
    plan = apply_plan(node, runtime)
    strategy = FedAvgStrategy.of(cfg, runtime.data.num_classes)
    arrays = strategy.on_task_start(0, to_array_record(runtime.model.trainable_state()))
    started, cpu = time.perf_counter(), time.process_time()
    reply = learner.fit(RecordDict({ARRAYS: arrays}), 0, 0, 0, FitConditions(plan))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    sent, trained = from_array_record(arrays), from_array_record(arrays_of(reply))
    np.savez(arrays_out, **{name: trained[name] - sent[name] for name in trained})
    return {**plan_metrics(plan, runtime), "images_per_second": batch_size / seconds, "seconds": seconds,
            "cpu_seconds_per_image": cpu / batch_size, "imports_mb": imports,
            "threads": threads}


def run_row(name: str, precision: str, budget_mb: float, batch_size: int, threads: int, out_dir: Path) -> dict:
    """One configuration in a fresh process (its peak memory is its own)."""
    arrays = out_dir / f"{name}.npz"
    spec = json.dumps({"precision": precision, "budget_mb": budget_mb, "batch_size": batch_size,
                       "threads": threads, "arrays": str(arrays)})
    done = subprocess.run([sys.executable, "-m", "promptfcl.server.bench.edge", spec], capture_output=True,
                          text=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    if done.returncode != 0:
        raise RuntimeError(f"bench edge {name} failed:\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return {"name": name, "precision": precision, "budget_mb": budget_mb, **figures, "arrays": arrays}


def edge_rounds(out_dir: Path, batch_size: int = 64, threads: int = 1,
         rows: list[tuple[str, str, float, int]] | None = None) -> dict[str, Any]:
    """Every row of ``rows`` (default :data:`ROWS`); writes ``edge.json``.

    A row's update is compared with the first row of its batch size (float32 without a budget).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = rows or ROWS
    prepare_cache(batch_size, threads)
    # rows of an earlier invocation stay (a row measured again replaces its own), and so do their
    # reference updates: one float32 update per batch size, kept as <name>.npz
    earlier = merge_report(out_dir, {})
    results: list[dict[str, Any]] = list(earlier.get("rows", []))
    references: dict[str, str] = dict(earlier.get("references", {}))
    for r in results:  # an earlier invocation's first row of its batch size
        references.setdefault(str(r.get("batch_size")), f"{r['name']}.npz")
    report: dict[str, Any] = {}
    for name, precision, budget, batch in rows:
        batch = batch or batch_size
        log.info("bench edge: %s (backbone %s, budget %s MB, batch %d) ...", name, precision, budget or "none", batch)
        row = run_row(name, precision, budget, batch, threads, out_dir)
        current = _load(row.pop("arrays"))
        reference = _load(out_dir / references.setdefault(str(batch), f"{name}.npz"))
        row.update({"batch_size": batch,
                    "max_abs_update_diff": float(max(np.abs(current[k] - reference[k]).max() for k in reference)),
                    "max_abs_update": float(max(np.abs(reference[k]).max() for k in reference))})
        results = [r for r in results if r["name"] != name] + [row]
        report = merge_report(out_dir, {"machine": _machine(), "batch_size": batch_size, "threads": threads,
                                        "rows": results, "references": references})
    print(format_edge(report))
    return report


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as arrays:
        return {k: arrays[k] for k in arrays.files}


def accuracy(out_dir: Path, seeds: list[int], precisions: list[str], strategy: str = "fedavg",
             base: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A_N of ``strategy`` on the offline benchmark (the default run: digits, Dirichlet 0.5, 10 clients,
    undefended as ``bench compare`` runs it) per frozen-backbone precision and seed; merged into
    ``edge.json`` (``accuracy``).

    Every simulated client trains with the precision, taken from its environment
    (``PROMPTFCL_BACKBONE_PRECISION``) as an operator would set it; the server's evaluation keeps
    its float32 backbone (``a_n``: what a float32 evaluator sees of prompts trained on edge nodes),
    and the final model is evaluated again with the clients' precision (``a_n_node_eval``: what the
    edge nodes themselves would score).
    """

    rows: list[dict[str, Any]] = []
    for precision in precisions:
        for seed in seeds:
            run_dir = out_dir / "accuracy" / f"{strategy}-{precision}-seed{seed}"
            settings = {"defences": "off", **(base or {}), "seed": seed, "keep-checkpoint": True}
            results = finished_run(run_dir, {**settings, "strategy": strategy})
            if results is None:
                log.info("bench edge: A_N of %s with a %s backbone, seed %d ...", strategy, precision, seed)
                saved = os.environ.get(BACKBONE_PRECISION_ENV)
                os.environ[BACKBONE_PRECISION_ENV] = precision
                try:
                    results = run_simulation_subprocess(settings, run_dir, strategy=strategy)
                finally:
                    if saved is None:
                        os.environ.pop(BACKBONE_PRECISION_ENV, None)
                    else:
                        os.environ[BACKBONE_PRECISION_ENV] = saved
            rows.append({"strategy": strategy, "precision": precision, "seed": seed,
                         "a_n": float(results["final_average_accuracy"]),
                         "a_n_node_eval": final_accuracy(run_dir, precision)})
            merge_report(out_dir, {"accuracy": rows})
    return rows


def final_accuracy(run_dir: Path, precision: str) -> float | None:
    """A_N of the run's final model (its kept checkpoint) evaluated with a ``precision`` backbone
    (None: the run kept no checkpoint)."""

    ckpt = checkpoint.load(run_dir)
    if ckpt is None:
        return None
    cfg = ExperimentConfig.from_dict(ckpt.config)
    runtime = get_runtime(cfg, prompt_class(cfg.run.strategy), precision=precision)
    runtime.model.load_trainable_state({k: torch.from_numpy(np.array(v)) for k, v in ckpt.arrays.items()})
    return float(np.mean(accuracies(*correct_counts(runtime, cfg.data.num_tasks - 1))))


def merge_report(out_dir: Path, part: dict[str, Any]) -> dict[str, Any]:
    """``edge.json`` with ``part``'s keys replaced (the memory rows and the accuracy rows are written apart)."""
    path = out_dir / "edge.json"
    report = json.loads(path.read_text()) if path.is_file() else {"machine": _machine()}
    report.update(part)
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return report


def prepare_cache(batch_size: int, threads: int) -> None:
    """Build the backbone cache file once (timm, random weights) in a process of its own, so every
    row maps the same file and none pays timm's build in its peak memory."""
    spec = json.dumps({"prepare": True, "batch_size": batch_size, "threads": threads})
    subprocess.run([sys.executable, "-m", "promptfcl.server.bench.edge", spec], check=True, capture_output=True)


def format_edge(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "## promptfcl bench edge",
        "",
        f"One client round at ViT-B/16 dimensions (random weights, 224 px, CODA-P prompts at blocks 0-4), one "
        f"step of the batch, {report['threads']} thread(s) of {m['cpus']} CPUs, torch {m['torch']}.",
        "",
        "| name | precision | budget MB | batch | imports MB | held MB | peak RSS MB | images/s | CPU s / image "
        "| max abs update diff | micro-batch | checkpointed blocks | backbone mapped MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['name']} | {r['precision']} | {r['budget_mb'] or 'none'} | {r['batch_size']} | "
                     f"{_mb(r, 'imports_mb')} | {_mb(r, 'held-mb')} | {r['peak-rss-mb']:,.0f} | "
                     f"{r['images_per_second']:.2f} | {r['cpu_seconds_per_image']:.2f} | "
                     f"{r['max_abs_update_diff']:.2e} | {r['micro-batch']} | {r['checkpointed-blocks']} | "
                     f"{r['backbone-mapped-mb']:.0f} |")
    return "\n".join(lines)


def _mb(row: dict[str, Any], key: str) -> str:
    """A row's figure in MB, or "-" for a row measured before the bench recorded it."""
    return f"{row[key]:,.0f}" if key in row else "-"


def main() -> None:
    """The child: ``python -m promptfcl.server.bench.edge '<spec json>'``; prints its figures as one JSON line."""
    spec = json.loads(sys.argv[1])
    if spec.get("prepare"):
        build_backbone(backbone_of(edge_config(int(spec["batch_size"]), int(spec["threads"]))))
        return
    figures = train_one_round(spec["precision"], float(spec["budget_mb"]), int(spec["batch_size"]),
                              int(spec["threads"]), Path(spec["arrays"]))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
