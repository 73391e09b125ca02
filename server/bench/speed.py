"""``promptfcl bench perf``: local training speed against the compute bound, seconds per round as the
population grows, peak memory, bytes per round per method, actors per GPU."""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import RecordDict

from ...common.config.experiment import ExperimentConfig
from ...common.data.partitions import client_indices
from ...common.model.prompted import masked_logits
from ...common.model.runtime import _runtime, get_runtime
from ...common.records import ARRAYS, to_array_record
from ...strategies.fedavg.strategy import FedAvgStrategy
from ...strategies.platform.learner import LocalLearner
from ...strategies.registry import methods as registered
from .common import VIT_B16_PARAMETERS, _machine, run_simulation_subprocess

log = logging.getLogger("promptfcl")


# ----------------------------------------------------------------------------- perf
def local_training_speed(cfg: ExperimentConfig, repeats: int = 3) -> dict[str, float]:
    """Images/s of LocalLearner.fit vs the bare prompted forward+backward on the same batches."""

    out: dict[str, float] = {}
    for cached in (True, False):
        run_cfg = cfg.replace(query_cache=cached)
        _runtime.cache_clear()
        rt = get_runtime(run_cfg)
        arrays = FedAvgStrategy.of(run_cfg, rt.data.num_classes).on_task_start(
            0, to_array_record(rt.model.trainable_state())
        )
        index = client_indices(rt.data.train.labels, rt.layout, rt.partition, 0, 0, 0)
        n_images = len(index) * run_cfg.training.local_epochs
        learner = LocalLearner.of(run_cfg, rt)
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
    allowed[rt.layout.classes(0)] = True
    x_all = model.preprocess(torch.from_numpy(rt.data.train.images[index]).to(rt.device))
    with torch.no_grad(), rt.autocast():
        q_all = model.query(x_all).float()
    y_all = torch.as_tensor(rt.data.train.labels[index]).to(rt.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=cfg.training.lr)
    model.train()
    timings = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for _epoch in range(cfg.training.local_epochs):
            for s in range(0, len(index), cfg.training.batch_size):
                with rt.autocast():
                    feats = model.features(x_all[s : s + cfg.training.batch_size],
                                           q_all[s : s + cfg.training.batch_size])
                    logits = masked_logits(model.logits(feats), allowed)
                    loss = F.cross_entropy(logits, y_all[s : s + cfg.training.batch_size])
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
            for s in range(0, len(index), cfg.training.batch_size):
                model.query(x_all[s : s + cfg.training.batch_size])
    out["query_pass_images_per_s"] = repeats * len(index) / (time.perf_counter() - t)
    out["framework_over_bound"] = out["compute_bound_images_per_s"] / out["framework_cached_images_per_s"]
    out["query_cache_speedup"] = out["framework_cached_images_per_s"] / out["framework_uncached_images_per_s"]
    out["client_samples"] = float(len(index))
    return out


def perf(
    out_dir: Path, base: dict[str, Any], populations: tuple[int, ...] = (10, 100, 1000), methods: tuple[str, ...] = ()
) -> dict[str, Any]:
    """All ``bench perf`` figures; writes ``out_dir/perf.json`` and prints a summary."""

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
        settings = {
            **base,
            "num-clients": n,
            "clients-per-round": 5,
            "partition": "stateless",
            "num-tasks": 5,
            "rounds-per-task": 4,
            "local-epochs": 1,
        }
        results = run_simulation_subprocess(settings, out_dir / f"scale-{n}", watch_memory=(n == populations[0]))
        per_round = [r["round_seconds"] for r in results["rounds"]][1:]  # skip the cold start
        scale[str(n)] = {
            "round_seconds_median": statistics.median(per_round),
            "round_seconds_mean": float(np.mean(per_round)),
            "server_seconds_mean": results["timing"]["server_seconds_per_round"],
        }
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
            "s2c_per_round": comm["bytes_s2c_per_round"],
            "c2s_per_round": comm["bytes_c2s_per_round"],
            "per_client_exchange": per_client,
            "trainable_parameters": comm["trainable_parameters"],
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
        settings = {
            **base,
            "client-gpus": 1.0 / n,
            "num-clients": 8,
            "clients-per-round": 4,
            "num-tasks": 2,
            "rounds-per-task": 3,
            "partition": "iid",
            "device": "cuda",
        }
        results = run_simulation_subprocess(settings, out_dir / f"gpu-actors-{n}", watch_memory=True)
        rounds = results["rounds"][1:] or results["rounds"]
        images = sum(r["examples"] for r in rounds) * int(settings.get("local-epochs", 5))
        out[str(n)] = {
            "images_per_second": images / max(sum(r["round_seconds"] for r in rounds), 1e-9),
            "round_seconds_median": statistics.median(r["round_seconds"] for r in rounds),
            "client_device_peak_mb": max(r.get("client_device_peak_mb", 0.0) for r in rounds),
        }
    return out


def format_perf(report: dict[str, Any]) -> str:
    lt = report["local_training"]
    gpus = ", ".join(report["machine"].get("gpus", [])) or "no GPU"
    lines = [
        "## promptfcl bench perf",
        "",
        f"machine: {report['machine']['cpus']} CPUs, {gpus}; backbone {report['config']['backbone']} "
        f"(embed {report['config']['embed-dim']}, depth {report['config']['depth']}, "
        f"{report['config']['image-size']} px); "
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
        f"({100 * (lt['framework_over_bound'] - 1):.0f}% slower); "
        f"query cache speedup: x{lt['query_cache_speedup']:.2f}",
        "",
        "| total clients (5 sampled per round) | seconds per round (median) | server seconds per round |",
        "|---|---|---|",
    ]
    for n, v in report["seconds_per_round_by_population"].items():
        lines.append(f"| {n} | {v['round_seconds_median']:.2f} | {v['server_seconds_mean']:.3f} |")
    if "peak_memory_mb" in report:
        m = report["peak_memory_mb"]
        lines += [
            "",
            f"peak resident memory: server process {m['server']:.0f} MB, one client actor {m['client_actor']:.0f} MB",
        ]
    if "precision" in report:
        lines += ["", "| client loop on the GPU | fp32 images/s | bf16 autocast images/s | gain |", "|---|---|---|---|"]
        fp32, bf16 = report["precision"]["fp32"], report["precision"]["bf16"]
        for key, label in (
            ("compute_bound_images_per_s", "compute bound"),
            ("framework_cached_images_per_s", "client loop, query cache warm"),
            ("framework_uncached_images_per_s", "client loop, no query cache"),
        ):
            lines.append(f"| {label} | {fp32[key]:.0f} | {bf16[key]:.0f} | x{bf16[key] / fp32[key]:.2f} |")
    if "actors_per_gpu" in report:
        lines += [
            "",
            "| client actors per GPU | training images/s | seconds per round | peak GPU MB per client |",
            "|---|---|---|---|",
        ]
        for n, v in report["actors_per_gpu"].items():
            lines.append(
                f"| {n} | {v['images_per_second']:.0f} | {v['round_seconds_median']:.2f} | "
                f"{v['client_device_peak_mb']:.0f} |"
            )
    else:
        lines += ["", "(no CUDA device: mixed precision and actors per GPU not measured)"]
    lines += [
        "",
        "| method | bytes S2C / round | bytes C2S / round | per client exchange | share of ViT-B/16 (343 MB) |",
        "|---|---|---|---|---|",
    ]
    for name, b in report["bytes"].items():
        lines.append(
            f"| {name} | {b['s2c_per_round']:,.0f} | {b['c2s_per_round']:,.0f} | "
            f"{b['per_client_exchange']:,.0f} | {b['share_of_vit_b16_percent']:.3f}% |"
        )
    return "\n".join(lines)
