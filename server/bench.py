"""Benchmarks: ``promptfcl bench perf`` (speed, memory, bytes) and ``promptfcl bench compare``.

These print figures; they are not tests. ``perf`` measures
* local training images/s of the real client loop against the compute bound (bare
  forward+backward+step of the same prompted ViT on the same batches), with and without
  the query cache;
* simulation seconds per round for 10, 100 and 1,000 clients at a fixed number sampled;
* peak resident memory of the server process and of one client actor;
* bytes per round per method against the size of a full ViT-B/16.
``compare`` runs every method plus FedAvg-Prompt and the centralised references on
identical task orders and client splits, for several seeds and heterogeneity levels,
and writes a Markdown and CSV table with plots. ``paper-dims`` runs one round of every
paper configuration at the papers' model dimensions (ViT-B/16 with random weights) on a
stand-in dataset with the paper's class count, and reports bytes, memory and time per
method next to the papers' figures. The compare references are one client holding all
data with FedAvg-Prompt's local training: ``upper-bound-incremental`` learns the tasks in
turn (centralised incremental CODA-P) and ``upper-bound-joint`` trains at each task on the
union of every task seen so far (the ceiling; ``centralised-mode``).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import numpy as np

from promptfcl.common.config import ExperimentConfig
from promptfcl.server import checkpoint

log = logging.getLogger("promptfcl")

VIT_B16_PARAMETERS = 85_798_656  # timm vit_base_patch16_224 without its ImageNet head (num_classes=0)

# The papers' datasets: classes, and approximate training / test images per class (for the
# stand-ins of ``paper-dims`` and its extrapolation to a full-size round).
PAPER_DATASETS: dict[str, tuple[int, int, int]] = {
    "hf:cifar100": (100, 500, 100),
    "hf:imagenet-r": (200, 120, 30),  # 30,000 images, 80/20 split as in CODA-P
    "hf:tiny-imagenet": (200, 500, 50),
    "hf:domainnet": (345, 1200, 300),
    "hf:cub200": (200, 30, 29),
}

# What each paper reports about its communication (bytes of one method, or its parameters).
PAPER_COMMUNICATION: dict[str, str] = {
    "hepco": "31.37 MB per exchange, 9.5% of ViT-B/16 (HePCo, Table 1)",
    "fppl": "0.25M parameters per round (FPPL, Table II COMM)",
    "powder": "493.08 MB over the whole run; Fed-CODAP 815.63 MB (Powder, Table 2)",
    "fedcprompt": "not reported",
    "hgp": "not reported",
}


# ----------------------------------------------------------------------------- helpers
def _peak_rss_mb(pid: int) -> float:
    """Peak resident set size (VmHWM) of a live process, in MB (Linux /proc)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _actor_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"ClientAppActor" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def run_simulation_subprocess(settings: dict[str, Any], out: Path, strategy: str = "fedavg",
                              watch_memory: bool = False, timeout: int = 6 * 3600) -> dict[str, Any]:
    """``promptfcl simulate`` in a child process; returns results.json (+ peak memory if watched).

    A run still going after ``timeout`` seconds is interrupted (SIGINT, so Ray shuts down, then
    killed) before TimeoutExpired is raised: a timed-out run never keeps training in the
    background. The default is generous because the joint upper bound trains on every seen task
    (about 3x the incremental run's work on 5 tasks) and benchmarks share small machines.
    """
    if (out / checkpoint.FILENAME).is_file():  # an interrupted earlier benchmark run: continue it, not start over
        settings = {**settings, "resume": True}  # (a different configuration is refused by the run)
    args = [sys.executable, "-m", "promptfcl.server.cli", "simulate", "--strategy", strategy, "--out", str(out)]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value) if isinstance(value, str) else value}"]
    if (out / "results.json").exists():
        (out / "results.json").unlink()
    # The child's output goes to a file, not a pipe: a pipe nobody reads while memory is watched
    # fills up (64 KB of client tracebacks) and blocks the child for ever.
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "simulate.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        server_peak, client_peak = 0.0, 0.0
        deadline = time.monotonic() + timeout
        while watch_memory and proc.poll() is None and time.monotonic() < deadline:
            server_peak = max(server_peak, _peak_rss_mb(proc.pid))
            client_peak = max([client_peak] + [_peak_rss_mb(p) for p in _actor_pids()])
            time.sleep(0.25)
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    if proc.returncode != 0:
        output = log_path.read_text(errors="replace")
        raise RuntimeError(f"simulation failed ({strategy}, {settings}); log {log_path}:\n{output[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    if watch_memory:
        results["peak_memory_mb"] = {"server": server_peak, "client_actor": client_peak}
    return results


# ----------------------------------------------------------------------------- perf
def local_training_speed(cfg: ExperimentConfig, repeats: int = 3) -> dict[str, float]:
    """Images/s of LocalLearner.fit vs the bare prompted forward+backward on the same batches."""
    import torch
    import torch.nn.functional as F
    from flwr.app import RecordDict

    from promptfcl.common.learner import LocalLearner
    from promptfcl.common.data import client_indices, task_classes
    from promptfcl.common.model import masked_logits
    from promptfcl.common.records import ARRAYS, to_array_record
    from promptfcl.common.runtime import _runtime, get_runtime
    from promptfcl.strategies.fedavg.strategy import FedAvgPrompt

    out: dict[str, float] = {}
    for cached in (True, False):
        run_cfg = cfg.replace(query_cache=cached)
        _runtime.cache_clear()
        rt = get_runtime(run_cfg)
        arrays = FedAvgPrompt(run_cfg, rt.data.num_classes).on_task_start(0, to_array_record(rt.model.trainable_state()))
        index = client_indices(rt.data.train.labels, run_cfg, rt.data.num_classes, 0, 0, 0)
        n_images = len(index) * run_cfg.local_epochs
        learner = LocalLearner(rt)
        timings = []
        for r in range(repeats + 1):  # the first call fills the query cache (cold)
            t = time.perf_counter()
            learner.fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
            timings.append(time.perf_counter() - t)
        key = "framework_cached" if cached else "framework_uncached"
        out[key + "_images_per_s"] = n_images / statistics.median(timings[1:])
        if cached:
            out["framework_cold_cache_images_per_s"] = n_images / timings[0]

    # The compute bound: the same batches through the bare prompted model (queries given).
    model = rt.model
    allowed = torch.zeros(rt.data.num_classes, dtype=torch.bool)
    allowed[task_classes(cfg, 0, rt.data.num_classes)] = True
    x_all = model.preprocess(torch.from_numpy(rt.data.train.images[index]).to(rt.device))
    with torch.no_grad(), rt.autocast():
        q_all = model.query(x_all).float()
    y_all = torch.as_tensor(rt.data.train.labels[index]).to(rt.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.lr)
    model.train()
    timings = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for _epoch in range(cfg.local_epochs):
            for s in range(0, len(index), cfg.batch_size):
                with rt.autocast():
                    feats = model.features(x_all[s : s + cfg.batch_size], q_all[s : s + cfg.batch_size])
                    logits = masked_logits(model.head(feats), allowed)
                    loss = F.cross_entropy(logits, y_all[s : s + cfg.batch_size])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        timings.append(time.perf_counter() - t)
    model.eval()
    out["compute_bound_images_per_s"] = n_images / statistics.median(timings[1:])
    # the query pass alone, which the cache removes
    t = time.perf_counter()
    with torch.no_grad(), rt.autocast():
        for _ in range(repeats):
            for s in range(0, len(index), cfg.batch_size):
                model.query(x_all[s : s + cfg.batch_size])
    out["query_pass_images_per_s"] = repeats * len(index) / (time.perf_counter() - t)
    out["framework_over_bound"] = out["compute_bound_images_per_s"] / out["framework_cached_images_per_s"]
    out["query_cache_speedup"] = out["framework_cached_images_per_s"] / out["framework_uncached_images_per_s"]
    out["client_samples"] = float(len(index))
    return out


def perf(out_dir: Path, base: dict[str, Any], populations: tuple[int, ...] = (10, 100, 1000),
         methods: tuple[str, ...] = ()) -> dict[str, Any]:
    """All ``bench perf`` figures; writes ``out_dir/perf.json`` and prints a summary."""
    from promptfcl.strategies.registry import methods as registered

    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = ExperimentConfig.from_dict({**base, "centralised": True})  # one client holding a whole task
    report: dict[str, Any] = {"config": cfg.to_dict(), "machine": _machine()}
    log.info("local training speed ...")
    report["local_training"] = local_training_speed(cfg)
    if torch.cuda.is_available():  # what the GPU gains: bfloat16 autocast, and several actors sharing it
        log.info("local training speed with and without bfloat16 autocast ...")
        report["precision"] = {p: local_training_speed(cfg.replace(precision=p)) for p in ("fp32", "bf16")}
        log.info("client actors sharing one GPU ...")
        report["actors_per_gpu"] = actors_per_gpu(out_dir, base)

    log.info("simulation cost per round vs population ...")
    scale = {}
    for n in populations:
        settings = {**base, "num-clients": n, "clients-per-round": 5, "partition": "stateless",
                    "num-tasks": 5, "rounds-per-task": 4, "local-epochs": 1}
        results = run_simulation_subprocess(settings, out_dir / f"scale-{n}", watch_memory=(n == populations[0]))
        per_round = [r["round_seconds"] for r in results["rounds"]][1:]  # skip the cold start
        scale[str(n)] = {"round_seconds_median": statistics.median(per_round),
                         "round_seconds_mean": float(np.mean(per_round)),
                         "server_seconds_mean": results["timing"]["server_seconds_per_round"]}
        if "peak_memory_mb" in results:
            report["peak_memory_mb"] = results["peak_memory_mb"]
    report["seconds_per_round_by_population"] = scale

    log.info("bytes per round per method ...")
    vit_bytes = 4 * VIT_B16_PARAMETERS
    report["bytes"] = {}
    for name in methods or tuple(sorted(registered())):
        settings = {**base, "num-tasks": 2, "rounds-per-task": 1, "local-epochs": 1}
        results = run_simulation_subprocess(settings, out_dir / f"bytes-{name}", strategy=name)
        comm = results["communication"]
        per_client = comm["bytes_per_client_exchange"]
        report["bytes"][name] = {
            "s2c_per_round": comm["bytes_s2c_per_round"], "c2s_per_round": comm["bytes_c2s_per_round"],
            "per_client_exchange": per_client, "trainable_parameters": comm["trainable_parameters"],
            "share_of_vit_b16_percent": 100.0 * per_client / vit_bytes,
        }
    (out_dir / "perf.json").write_text(json.dumps(report, indent=2))
    print(format_perf(report))
    return report


def actors_per_gpu(out_dir: Path, base: dict[str, Any], counts: Sequence[int] = (1, 2, 4)) -> dict[str, Any]:
    """Training throughput of the simulation with 1, 2 and 4 client actors sharing one GPU.

    Each setting runs 4 clients per round with ``client-gpus = 1/n``; throughput is the
    round's training images (samples x local epochs) over its wall time, first round left out.
    """
    out: dict[str, Any] = {}
    for n in counts:
        settings = {**base, "client-gpus": 1.0 / n, "num-clients": 8, "clients-per-round": 4, "num-tasks": 2,
                    "rounds-per-task": 3, "partition": "iid", "device": "cuda"}
        results = run_simulation_subprocess(settings, out_dir / f"gpu-actors-{n}", watch_memory=True)
        rounds = results["rounds"][1:] or results["rounds"]
        images = sum(r["examples"] for r in rounds) * int(settings.get("local-epochs", 5))
        out[str(n)] = {"images_per_second": images / max(sum(r["round_seconds"] for r in rounds), 1e-9),
                       "round_seconds_median": statistics.median(r["round_seconds"] for r in rounds),
                       "client_device_peak_mb": max(r.get("client_device_peak_mb", 0.0) for r in rounds)}
    return out


def format_perf(report: dict[str, Any]) -> str:
    lt = report["local_training"]
    gpus = ", ".join(report["machine"].get("gpus", [])) or "no GPU"
    lines = [
        "## promptfcl bench perf",
        "",
        f"machine: {report['machine']['cpus']} CPUs, {gpus}; backbone {report['config']['backbone']} "
        f"(embed {report['config']['embed-dim']}, depth {report['config']['depth']}, {report['config']['image-size']} px); "
        f"one client with {int(lt['client_samples'])} samples, batch {report['config']['batch-size']}",
        "",
        "| local training | images/s |",
        "|---|---|",
        f"| compute bound (bare prompted fwd+bwd+step, same batches) | {lt['compute_bound_images_per_s']:.0f} |",
        f"| client loop, query cache warm | {lt['framework_cached_images_per_s']:.0f} |",
        f"| client loop, query cache cold (first round) | {lt['framework_cold_cache_images_per_s']:.0f} |",
        f"| client loop, no query cache | {lt['framework_uncached_images_per_s']:.0f} |",
        f"| query pass alone | {lt['query_pass_images_per_s']:.0f} |",
        "",
        f"framework overhead vs compute bound: x{lt['framework_over_bound']:.2f} "
        f"({100 * (lt['framework_over_bound'] - 1):.0f}% slower); query cache speedup: x{lt['query_cache_speedup']:.2f}",
        "",
        "| total clients (5 sampled per round) | seconds per round (median) | server seconds per round |",
        "|---|---|---|",
    ]
    for n, v in report["seconds_per_round_by_population"].items():
        lines.append(f"| {n} | {v['round_seconds_median']:.2f} | {v['server_seconds_mean']:.3f} |")
    if "peak_memory_mb" in report:
        m = report["peak_memory_mb"]
        lines += ["", f"peak resident memory: server process {m['server']:.0f} MB, one client actor {m['client_actor']:.0f} MB"]
    if "precision" in report:
        lines += ["", "| client loop on the GPU | fp32 images/s | bf16 autocast images/s | gain |", "|---|---|---|---|"]
        fp32, bf16 = report["precision"]["fp32"], report["precision"]["bf16"]
        for key, label in (("compute_bound_images_per_s", "compute bound"),
                           ("framework_cached_images_per_s", "client loop, query cache warm"),
                           ("framework_uncached_images_per_s", "client loop, no query cache")):
            lines.append(f"| {label} | {fp32[key]:.0f} | {bf16[key]:.0f} | x{bf16[key] / fp32[key]:.2f} |")
    if "actors_per_gpu" in report:
        lines += ["", "| client actors per GPU | training images/s | seconds per round | peak GPU MB per client |",
                  "|---|---|---|---|"]
        for n, v in report["actors_per_gpu"].items():
            lines.append(f"| {n} | {v['images_per_second']:.0f} | {v['round_seconds_median']:.2f} | "
                         f"{v['client_device_peak_mb']:.0f} |")
    else:
        lines += ["", "(no CUDA device: mixed precision and actors per GPU not measured)"]
    lines += ["", "| method | bytes S2C / round | bytes C2S / round | per client exchange | share of ViT-B/16 (343 MB) |",
              "|---|---|---|---|---|"]
    for name, b in report["bytes"].items():
        lines.append(f"| {name} | {b['s2c_per_round']:,.0f} | {b['c2s_per_round']:,.0f} | "
                     f"{b['per_client_exchange']:,.0f} | {b['share_of_vit_b16_percent']:.3f}% |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- paper dimensions
def write_stand_in(root: Path, num_classes: int, per_class: int, size: int = 32, seed: int = 0) -> Path:
    """A folder dataset (``root/<class>/<i>.png``) of random images: the papers' class count
    without their data (built once; reused when it already holds what is asked)."""
    from PIL import Image

    marker = root / ".stand-in.json"
    wanted = {"classes": num_classes, "per_class": per_class, "size": size, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return root
    if root.exists():
        shutil.rmtree(root)
    rng = np.random.default_rng(seed)
    for c in range(num_classes):
        folder = root / f"c{c:03d}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    marker.write_text(json.dumps(wanted))
    return root


def paper_dims_settings(config: dict[str, Any], stand_in: Path, train_per_class: int = 2) -> dict[str, Any]:
    """A paper configuration for one round at the paper's dimensions on ``stand_in``: random
    ViT weights (no download), 2 clients with a handful of images each, one local epoch.

    Everything that sets a dimension (backbone, image size, prompt pool, length, layers,
    tasks, classes) and the method's options (server epochs, sample counts) is kept.
    """
    settings = {k: v for k, v in config.items() if k not in ("out-dir", "strategy")}
    settings.update({"dataset": f"folder:{stand_in}", "weights": "random", "data-dir": "",
                     "test-fraction": 1 / 6, "max-test-per-class": 1, "local-epochs": 1, "max-rounds": 1,
                     "clients-per-round": 2, "min-replies": 1})
    if config.get("task-generator") == "random":
        # the schedule needs the paper's clients (each owns its tasks); a task holds
        # task-data-fraction of each class's images, so every image of the stand-in is kept
        return settings
    settings.update({"num-clients": 2, "partition": "iid", "max-train-per-class": train_per_class})
    return settings


def paper_dims(out_dir: Path, configs: Sequence[Path], cpus: int | None = None) -> dict[str, Any]:
    """One round of every configuration in ``configs`` at paper dimensions; writes ``paper_dims.json``.

    Per method: bytes server-to-client and client-to-server per client, trainable parameters,
    peak resident memory of the server process and of one client actor (and, on CUDA, the
    client's peak device memory), client seconds per training image, server seconds (the
    round's configure + aggregate + consolidation), and an extrapolation of one full-size
    round on this hardware.
    """
    from promptfcl.strategies.registry import load_config

    out_dir.mkdir(parents=True, exist_ok=True)
    cpus = cpus or os.cpu_count() or 1
    report: dict[str, Any] = {"machine": _machine(), "methods": {}}
    for path in configs:
        cfg = load_config(str(path), [], None, None)
        if cfg.dataset not in PAPER_DATASETS:
            raise ValueError(f"{path.name}: no stand-in known for dataset {cfg.dataset!r}")
        classes, train_per_class, test_per_class = PAPER_DATASETS[cfg.dataset]
        stand_in = write_stand_in(out_dir / "stand-in" / f"classes-{classes}", classes, per_class=6)
        run_dir = out_dir / "runs" / path.stem
        if run_dir.exists():  # a stopped run keeps its checkpoint; start afresh
            shutil.rmtree(run_dir)
        log.info("paper dimensions: %s (%s, %d classes) ...", path.name, cfg.strategy, classes)
        settings = paper_dims_settings(cfg.to_dict(), stand_in)
        results = run_simulation_subprocess(settings, run_dir, strategy=cfg.strategy, watch_memory=True)
        r = results["rounds"][0]
        replies = max(r["clients_aggregated"], 1)
        s2c, c2s = r["bytes_s2c"] / max(r["clients_sampled"], 1), r["bytes_c2s"] / replies
        per_image = r["client_seconds"] * replies / max(r["examples"], 1)  # one local epoch per image
        # one full-size round on this hardware: each client's share of a task, local-epochs passes,
        # clients in waves of the parallel actors, plus this round's server time
        if cfg.task_generator == "random":
            images = cfg.classes_per_task * train_per_class * cfg.task_data_fraction
        else:
            images = classes / cfg.num_tasks * train_per_class / cfg.num_clients
        sampled = cfg.clients_per_round or max(1, round(cfg.client_fraction * cfg.num_clients))
        waves = math.ceil(sampled / max(1, min(cpus, sampled)))
        round_seconds = waves * images * cfg.local_epochs * per_image + r["server_seconds"]
        report["methods"][cfg.strategy] = {
            "config": path.name,
            "dataset": cfg.dataset,
            "classes": classes,
            "trainable_parameters": results["communication"]["trainable_parameters"],
            "bytes_s2c_per_client": s2c,
            "bytes_c2s_per_client": c2s,
            "share_of_vit_b16_percent": 100.0 * (s2c + c2s) / 2 / (4 * VIT_B16_PARAMETERS),
            "client_peak_memory_mb": results["peak_memory_mb"]["client_actor"],
            "client_peak_device_memory_mb": r.get("client_device_peak_mb", 0.0),
            "server_peak_memory_mb": results["peak_memory_mb"]["server"],
            "client_seconds_per_image": per_image,
            "server_seconds": r["server_seconds"],
            "eval_seconds": r["eval_seconds"],
            "paper_communication": PAPER_COMMUNICATION.get(cfg.strategy, ""),
            "extrapolated_round_seconds": round_seconds,
            "extrapolated_images_per_client": images,
            "run_bytes_total_extrapolated": (s2c + c2s) * sampled * _paper_rounds(cfg),
            "device": r["placement"][0]["device"] if r.get("placement") else None,
        }
        (out_dir / "paper_dims.json").write_text(json.dumps(report, indent=2))
    print(format_paper_dims(report))
    return report


def _paper_rounds(cfg: ExperimentConfig) -> int:
    return cfg.num_rounds if cfg.task_generator == "random" else cfg.num_tasks * cfg.rounds_per_task


def _machine() -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                            "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def format_paper_dims(report: dict[str, Any]) -> str:
    m = report["machine"]
    where = ", ".join(m.get("gpus", [])) or f"{m['cpus']} CPUs, no GPU"
    lines = [
        "## promptfcl bench paper-dims",
        "",
        f"One round of each paper configuration at its model dimensions (timm vit_base_patch16_224 with random "
        f"weights, 224 px, the paper's prompt pool, length, layers, tasks and class count) on a stand-in dataset; "
        f"2 clients with a handful of images each; {where}.",
        "",
        "| method (config) | trainable params | MB S2C / client | MB C2S / client | share of ViT-B/16 | paper reports "
        "| client peak MB | server peak MB | client s / image | server s | full round s (extrapolated) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in report["methods"].items():
        paper = v["paper_communication"]
        if name == "powder":
            paper += f"; ours over the paper's run ≈ {v['run_bytes_total_extrapolated'] / 1e6:,.0f} MB (extrapolated)"
        peak = f"{v['client_peak_memory_mb']:,.0f}"
        if v.get("client_peak_device_memory_mb"):
            peak += f" (+{v['client_peak_device_memory_mb']:,.0f} on GPU)"
        lines.append(
            f"| {name} ({v['config']}) | {v['trainable_parameters'] / 1e6:.2f}M | {v['bytes_s2c_per_client'] / 1e6:.2f} | "
            f"{v['bytes_c2s_per_client'] / 1e6:.2f} | {v['share_of_vit_b16_percent']:.1f}% | {paper} | {peak} | "
            f"{v['server_peak_memory_mb']:,.0f} | {v['client_seconds_per_image']:.2f} | {v['server_seconds']:.1f} | "
            f"{v['extrapolated_round_seconds']:,.0f} |")
    lines += ["", "Full round (extrapolated): each sampled client's share of one task of the real dataset "
              "x local epochs x the measured seconds per image, clients in waves of the cores, plus the "
              "measured server time; evaluation not included. ViT-B/16 holds "
              f"{VIT_B16_PARAMETERS / 1e6:.1f}M parameters ({4 * VIT_B16_PARAMETERS / 1e6:.0f} MB)."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- deployment
def empty_process_seconds(repeats: int = 3, imports: str = "") -> float:
    """Median wall time of a fresh interpreter that imports what Flower's ``flwr-clientapp``
    process imports (its runner and ``ClientApp``) and nothing of this project: the floor under
    any deployed message's start-up on this machine. ``imports``: more to import (``"torch"``:
    the floor of any ClientApp that trains with torch)."""
    times = []
    code = ("from flwr.supernode.cli import flwr_clientapp; from flwr.clientapp import ClientApp; ClientApp()"
            + (f"; import {imports}" if imports else ""))
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - started)
    return float(statistics.median(times))


def _median_round(results: dict[str, Any], key: str) -> float:
    return float(statistics.median(r[key] for r in results["rounds"]))


def deploy_overhead(out_dir: Path, base: dict[str, Any], nodes: int = 3) -> dict[str, Any]:
    """A loopback deployment (deploy/ scripts: TLS SuperLink, ``nodes`` SuperNodes with their own
    image folders, federated evaluation) and the same configuration simulated; per-round time of
    each, and where a deployed message's fresh process spends its time before training.

    Writes ``deploy.json`` into ``out_dir`` and prints a table.
    """
    from promptfcl.server.loopback import run_deployed
    from promptfcl.common.startup import PHASES

    out_dir.mkdir(parents=True, exist_ok=True)
    same = {**base, "num-clients": nodes, "clients-per-round": nodes, "threads": 1}
    work = out_dir / "deployment"
    if work.exists():
        shutil.rmtree(work)
    deployed = run_deployed(work, {**same, "population": "nodes", "evaluation": "federated", "num-classes": 10,
                                   "class-names": ",".join(str(d) for d in range(10)),
                                   "out-dir": "runs/bench-deploy"}, nodes)
    simulated = run_simulation_subprocess({**same, "out-dir": str(out_dir / "simulation")}, out_dir / "simulation")

    def round_seconds(results: dict[str, Any]) -> float:  # training and evaluation, median over rounds
        return float(statistics.median(r["round_seconds"] + r["eval_seconds"] for r in results["rounds"]))

    overhead = _median_round(deployed, "client_overhead_seconds")
    phases = {p: float(statistics.median(r["client_startup"].get(p, 0.0) for r in deployed["rounds"])) for p in PHASES}
    report = {
        "nodes": nodes,
        "rounds": len(deployed["rounds"]),
        "deployed_round_seconds": round_seconds(deployed),
        "simulated_round_seconds": round_seconds(simulated),
        "deployed_eval_seconds": _median_round(deployed, "eval_seconds"),
        "simulated_eval_seconds": _median_round(simulated, "eval_seconds"),
        "per_message_overhead_seconds": overhead,
        # evaluate messages (to nodes not carrying the counts with training): process start to reply
        "eval_message_seconds": float(statistics.median(
            [r["eval_process_seconds"] for r in deployed["rounds"] if r.get("eval_process_seconds")] or [0.0])),
        # rounds whose evaluation came with the next round's train replies (evaluate-with-train)
        "rounds_evaluated_with_training": sum(1 for r in deployed["rounds"] if r.get("eval_carried")),
        "overhead_breakdown": {**phases, "other": max(0.0, overhead - sum(phases.values()))},
        "empty_clientapp_process_seconds": empty_process_seconds(),
        "torch_clientapp_process_seconds": empty_process_seconds(imports="torch"),
        "client_train_seconds": _median_round(deployed, "client_seconds"),
        "config": deployed["config"],
    }
    report["ratio"] = report["deployed_round_seconds"] / max(report["simulated_round_seconds"], 1e-9)
    (out_dir / "deploy.json").write_text(json.dumps(report, indent=1))
    print(deploy_table(report))
    return report


def deploy_table(report: dict[str, Any]) -> str:
    """Markdown: deployed against simulated rounds, and the start-up breakdown of one message."""
    lines = ["| per round (median) | deployed | simulated |", "|---|---|---|",
             f"| round, training + evaluation (s) | {report['deployed_round_seconds']:.2f} | "
             f"{report['simulated_round_seconds']:.2f} |",
             f"| of which evaluation (s) | {report['deployed_eval_seconds']:.2f} | {report['simulated_eval_seconds']:.2f} |",
             f"| rounds evaluated with the next round's training | {report['rounds_evaluated_with_training']} of "
             f"{report['rounds']} | |",
             f"| ratio deployed / simulated | {report['ratio']:.2f} | |", "",
             "| a deployed message's fresh process, before training | seconds |", "|---|---|",
             f"| total (per_message_overhead_seconds, median) | {report['per_message_overhead_seconds']:.2f} |"]
    lines += [f"| {name} | {value:.2f} |" for name, value in report["overhead_breakdown"].items()]
    lines += [f"| an evaluate message's whole process (median) | {report['eval_message_seconds']:.2f} |",
              f"| floor: a fresh interpreter importing Flower's ClientApp runner | "
              f"{report['empty_clientapp_process_seconds']:.2f} |",
              f"| floor with torch: the same + `import torch` | {report['torch_clientapp_process_seconds']:.2f} |",
              f"| (training itself, for scale) | {report['client_train_seconds']:.2f} |"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- robustness
#: the defences ``bench robustness`` compares, as run-config changes
DEFENCES: dict[str, dict[str, Any]] = {
    "none": {"update-norm-factor": 0.0, "aggregation": "mean"},
    "norm-filter": {"aggregation": "mean"},  # update-norm-factor as configured (default 10)
    "median": {"update-norm-factor": 0.0, "aggregation": "median"},
    "trimmed-mean": {"update-norm-factor": 0.0, "aggregation": "trimmed-mean"},
}


def robustness(out_dir: Path, base: dict[str, Any], method: str, attacks: Sequence[str], defences: Sequence[str],
               seeds: Sequence[int], share: float = 0.2) -> list[dict[str, Any]]:
    """A_N of ``method`` when a fixed ``share`` of the client population is hostile (``fault`` =
    each attack, ``fault-clients`` = that many client ids), under each defence, and of the
    clean run under each defence (what a defence costs when nobody attacks); writes
    ``robustness.{json,md}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    population = int(ExperimentConfig.from_dict(base).num_clients)
    hostile = max(1, round(share * population))
    fault_clients = ",".join(str(c) for c in range(hostile))
    rows: list[dict[str, Any]] = []
    for attack, defence in [("clean", d) for d in defences] + [(a, d) for a in attacks for d in defences]:
        for seed in seeds:
            settings = {**base, **DEFENCES[defence], "seed": seed}
            if attack != "clean":
                settings.update({"fault": attack, "fault-clients": fault_clients})
            run_dir = out_dir / "runs" / f"{method}-{attack}-{defence}-seed{seed}"
            results = finished_run(run_dir, {**settings, "strategy": method})
            if results is None:
                log.info("%s, attack %s, defence %s, seed %d", method, attack, defence, seed)
                results = run_simulation_subprocess(settings, run_dir, strategy=method)
            rounds = results["rounds"]
            rows.append({"attack": attack, "defence": defence, "seed": seed,
                         "A_N": results["final_average_accuracy"], "forgetting": results["average_forgetting"],
                         "replies_excluded": sum(1 for r in rounds for x in r["rejected"]
                                                 if x["reason"] != "no training examples"),
                         "replies_aggregated": sum(r["clients_aggregated"] for r in rounds)})
            (out_dir / "robustness.json").write_text(json.dumps(rows, indent=1))
    table = robustness_table(rows, f"{hostile} of {population} clients")
    (out_dir / "robustness.md").write_text(table + "\n")
    print(table)
    return rows


def robustness_table(rows: list[dict[str, Any]], hostile: str) -> str:
    lines = [f"| attack ({hostile} hostile) | defence | seeds | A_N | forgetting | replies excluded / aggregated |",
             "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["attack"], r["defence"]), []).append(r)
    for (attack, defence), rs in groups.items():
        a_n = np.array([np.nan if r["A_N"] is None else r["A_N"] for r in rs], dtype=float)
        fg = np.array([np.nan if r["forgetting"] is None else r["forgetting"] for r in rs], dtype=float)
        lines.append(f"| {attack} | {defence} | {len(rs)} | {np.mean(a_n):.1f} ± {np.std(a_n):.1f} | "
                     f"{np.mean(fg):.1f} ± {np.std(fg):.1f} | "
                     f"{sum(r['replies_excluded'] for r in rs)} / {sum(r['replies_aggregated'] for r in rs)} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- compare
#: the centralised references of ``compare``: name -> centralised-mode
UPPER_BOUNDS = {"upper-bound-incremental": "incremental", "upper-bound-joint": "joint"}


def compare(out_dir: Path, base: dict[str, Any], methods: list[str], seeds: list[int],
            settings: list[dict[str, Any]], upper_bound: bool = True) -> list[dict[str, Any]]:
    """Every method (+ the two centralised references, ``UPPER_BOUNDS``) x heterogeneity setting x seed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    references = list(UPPER_BOUNDS) if upper_bound else []
    runs = [(m, s, h) for h in settings for m in methods + references for s in seeds]
    for i, (method, seed, setting) in enumerate(runs, 1):
        label = _setting_label(setting)
        strategy, options = parse_method(method)
        run_settings = {**base, **setting, **options, "seed": seed}
        run_dir = out_dir / "runs" / f"{method.replace('/', '+')}-{label}-seed{seed}"
        if method in UPPER_BOUNDS:  # one client with all data: the partition plays no part, one run per seed
            strategy = "fedavg"
            run_settings = {**base, "seed": seed, "centralised": True, "centralised-mode": UPPER_BOUNDS[method]}
            run_dir = out_dir / "runs" / f"{method}-seed{seed}"
        results = finished_run(run_dir, {**run_settings, "strategy": strategy})
        if results is not None:
            log.info("[%d/%d] %s, %s, seed %d: reusing %s", i, len(runs), method, label, seed, run_dir)
        else:
            log.info("[%d/%d] %s, %s, seed %d", i, len(runs), method, label, seed)
            try:
                results = run_simulation_subprocess(run_settings, run_dir, strategy=strategy)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # one broken run must not cost the others
                log.error("[%d/%d] %s, %s, seed %d FAILED; going on with the rest:\n%s",
                          i, len(runs), method, label, seed, str(exc)[-1500:])
                failed.append(f"{method}, {label}, seed {seed} (log: {run_dir})")
                _write_compare(out_dir, rows, failed)
                continue
        comm, timing = results["communication"], results["timing"]
        rows.append({
            "method": method, "setting": label, "seed": seed,
            "A_N": results["final_average_accuracy"], "AIA": results["average_incremental_accuracy"],
            "forgetting": results["average_forgetting"],
            "bytes_s2c_per_round": comm["bytes_s2c_per_round"], "bytes_c2s_per_round": comm["bytes_c2s_per_round"],
            "client_seconds_per_round": timing["client_seconds_per_round"],
            "server_seconds_per_round": timing["server_seconds_per_round"],
        })
        if results.get("asynchronous"):  # random tasks: Powder's section 5.1 metrics
            a = results["asynchronous"]
            rows[-1].update({"FM": a["forgetting_measure"], "FT": a.get("forward_transfer", np.nan),
                             "BT": a["backward_transfer"], "CT": a.get("combined_transfer", np.nan),
                             "bytes_s2c_total": comm["bytes_s2c_total"], "bytes_c2s_total": comm["bytes_c2s_total"]})
        _write_compare(out_dir, rows, failed)
    print(summary_table(rows))
    if failed:
        print("failed runs (left out of the table):\n  " + "\n  ".join(failed))
    return rows


def finished_run(run_dir: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The results of an earlier run in ``run_dir`` with exactly these settings, else None.

    An interrupted ``bench compare`` started again redoes only the runs it lacks; a run
    whose configuration differs (other code defaults, other --set values) is redone.
    """
    path = run_dir / "results.json"
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())
        done = ExperimentConfig.from_dict(results["config"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s unreadable (%s): running again", path, exc)
        return None
    wanted = ExperimentConfig.from_dict({**settings, "out-dir": str(run_dir)})
    return results if done.digest() == wanted.digest() else None


def parse_method(spec: str) -> tuple[str, dict[str, Any]]:
    """``"powder/dual=false/k=1"`` -> ("powder", {"powder.dual": False, "powder.k": 1}): a method
    with some of its options changed (an ablation), compared as a method of its own."""
    from promptfcl.common.config import parse_overrides

    name, *pairs = spec.split("/")
    return name, {f"{name}.{k}": v for k, v in parse_overrides(pairs).items()}


def _setting_label(setting: dict[str, Any]) -> str:
    if not setting:
        return "default"
    part = setting.get("partition", "dirichlet")
    if part == "dirichlet":
        return f"dirichlet-{setting.get('dirichlet-beta', 0.5)}"
    if part == "quantity":
        return f"quantity-{setting.get('classes-per-client', 1)}"
    if part == "quantity-skew":
        return f"quantity-skew-{setting.get('dirichlet-beta', 0.5)}"
    return part


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: mean +- std over seeds for each (setting, method)."""
    keys = ["A_N", "AIA", "forgetting"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["setting"], r["method"]), []).append(r)
    if all("CT" in r for r in rows):  # random tasks: Powder's Table 2 / Table 5 columns
        lines = ["| setting | method | seeds | AIA | FM | FT | BT | CT | MB S2C total | MB C2S total |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for (setting, method), rs in groups.items():
            cells = [f"{np.mean([r[k] for r in rs]):.2f} ± {np.std([r[k] for r in rs]):.2f}"
                     for k in ("AIA", "FM", "FT", "BT", "CT")]
            lines.append(f"| {setting} | {method} | {len(rs)} | " + " | ".join(cells) +
                         f" | {np.mean([r['bytes_s2c_total'] for r in rs]) / 1e6:.2f}"
                         f" | {np.mean([r['bytes_c2s_total'] for r in rs]) / 1e6:.2f} |")
        return "\n".join(lines)
    lines = ["| setting | method | seeds | A_N | AIA | forgetting | KB S2C/round | KB C2S/round | client s/round | server s/round |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (setting, method), rs in groups.items():
        cells = []
        for k in keys:
            v = np.array([r[k] for r in rs])
            cells.append(f"{v.mean():.1f} ± {v.std():.1f}")
        mean = {k: float(np.mean([r[k] for r in rs])) for k in
                ("bytes_s2c_per_round", "bytes_c2s_per_round", "client_seconds_per_round", "server_seconds_per_round")}
        lines.append(f"| {setting} | {method} | {len(rs)} | " + " | ".join(cells) +
                     f" | {mean['bytes_s2c_per_round'] / 1000:.0f} | {mean['bytes_c2s_per_round'] / 1000:.0f} | "
                     f"{mean['client_seconds_per_round']:.2f} | {mean['server_seconds_per_round']:.3f} |")
    return "\n".join(lines)


def _write_compare(out_dir: Path, rows: list[dict[str, Any]], failed: Sequence[str] = ()) -> None:
    if not rows:
        return
    with open(out_dir / "compare.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    failures = "".join(f"\n* failed, left out: {f}" for f in failed)
    (out_dir / "compare.md").write_text(summary_table(rows) + "\n" + failures + ("\n" if failed else ""))
    _plot_compare(out_dir, rows)


def _plot_compare(out_dir: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({r["setting"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(methods), 1)
    for ax, key in zip(axes, ("A_N", "forgetting")):
        for j, m in enumerate(methods):
            means = [np.mean([r[key] for r in rows if r["method"] == m and r["setting"] == s] or [np.nan]) for s in settings]
            stds = [np.std([r[key] for r in rows if r["method"] == m and r["setting"] == s] or [np.nan]) for s in settings]
            ax.bar(np.arange(len(settings)) + j * width, means, width, yerr=stds, label=m, capsize=2)
        ax.set_xticks(np.arange(len(settings)) + width * (len(methods) - 1) / 2, settings, fontsize=8)
        ax.set_ylabel(key + " (%)")
        ax.set_title(key)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "compare.png", dpi=120)
    plt.close(fig)
