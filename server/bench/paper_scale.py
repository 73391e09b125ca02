"""``promptfcl bench paper-dims``: one round of every paper configuration at the papers' model
dimensions on a stand-in dataset with the paper's class count."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...common.data.schedule import task_schedule
from ...strategies.platform.run_checks import load_config
from .common import (
    PAPER_COMMUNICATION,
    PAPER_DATASETS,
    VIT_B16_PARAMETERS,
    _machine,
    run_simulation_subprocess,
)

log = logging.getLogger("promptfcl")


# ----------------------------------------------------------------------------- paper dimensions
def write_stand_in(root: Path, num_classes: int, per_class: int, size: int = 32, seed: int = 0) -> Path:
    """A folder dataset (``root/<class>/<i>.png``) of random images: the papers' class count
    without their data (built once; reused when it already holds what is asked)."""
    # PIL: only this benchmark's image folder needs it
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

    out_dir.mkdir(parents=True, exist_ok=True)
    cpus = cpus or os.cpu_count() or 1
    report: dict[str, Any] = {"machine": _machine(), "methods": {}}
    for path in configs:
        cfg = load_config(str(path), [], None, None)
        if cfg.data.dataset not in PAPER_DATASETS:
            raise ValueError(f"{path.name}: no stand-in known for dataset {cfg.data.dataset!r}")
        classes, train_per_class, test_per_class = PAPER_DATASETS[cfg.data.dataset]
        stand_in = write_stand_in(out_dir / "stand-in" / f"classes-{classes}", classes, per_class=6)
        run_dir = out_dir / "runs" / path.stem
        if run_dir.exists():  # a stopped run keeps its checkpoint; start afresh
            shutil.rmtree(run_dir)
        log.info("paper dimensions: %s (%s, %d classes) ...", path.name, cfg.run.strategy, classes)
        settings = paper_dims_settings(cfg.to_dict(), stand_in)
        results = run_simulation_subprocess(settings, run_dir, strategy=cfg.run.strategy, watch_memory=True)
        r = results["rounds"][0]
        replies = max(r["clients_aggregated"], 1)
        s2c, c2s = r["bytes_s2c"] / max(r["clients_sampled"], 1), r["bytes_c2s"] / replies
        per_image = r["client_seconds"] * replies / max(r["examples"], 1)  # one local epoch per image
        # one full-size round on this hardware: each client's share of a task, local-epochs passes,
        # clients in waves of the parallel actors, plus this round's server time
        if cfg.data.task_generator == "random":
            images = cfg.data.classes_per_task * train_per_class * cfg.data.task_data_fraction
        else:
            images = classes / cfg.data.num_tasks * train_per_class / cfg.federation.num_clients
        sampled = cfg.federation.sampled_per_round
        waves = math.ceil(sampled / max(1, min(cpus, sampled)))
        round_seconds = waves * images * cfg.training.local_epochs * per_image + r["server_seconds"]
        report["methods"][cfg.run.strategy] = {
            "config": path.name,
            "dataset": cfg.data.dataset,
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
            "paper_communication": PAPER_COMMUNICATION.get(cfg.run.strategy, ""),
            # what one exchange would carry if clients kept what they hold (FPPL's count), else None
            "stateful_parameters_per_exchange": results["communication"].get("stateful_parameters_per_exchange"),
            "extrapolated_round_seconds": round_seconds,
            "extrapolated_images_per_client": images,
            "run_bytes_total_extrapolated": (s2c + c2s) * sampled * task_schedule(cfg.data, cfg.federation,
                                                                                  cfg.run.seed).total_rounds,
            "device": r["placement"][0]["device"] if r.get("placement") else None,
        }
        (out_dir / "paper_dims.json").write_text(json.dumps(report, indent=2))
    print(format_paper_dims(report))
    return report


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
        stateful = v.get("stateful_parameters_per_exchange")
        if isinstance(stateful, dict):  # the directions differ (HGP: the whole head goes back)
            paper += "; stateful-equivalent " + ", ".join(
                f"{part.upper() if part in ('s2c', 'c2s') else part} {n / 1e6:.3f}M params ({4 * n / 1e6:.2f} MB)"
                for part, n in stateful.items())
        elif stateful:
            paper += f"; stateful-equivalent {stateful / 1e6:.3f}M params ({4 * stateful / 1e6:.2f} MB) per direction"
        if name == "powder":
            paper += f"; ours over the paper's run ≈ {v['run_bytes_total_extrapolated'] / 1e6:,.0f} MB (extrapolated)"
        peak = f"{v['client_peak_memory_mb']:,.0f}"
        if v.get("client_peak_device_memory_mb"):
            peak += f" (+{v['client_peak_device_memory_mb']:,.0f} on GPU)"
        lines.append(
            f"| {name} ({v['config']}) | {v['trainable_parameters'] / 1e6:.2f}M "
            f"| {v['bytes_s2c_per_client'] / 1e6:.2f} | "
            f"{v['bytes_c2s_per_client'] / 1e6:.2f} | {v['share_of_vit_b16_percent']:.1f}% | {paper} | {peak} | "
            f"{v['server_peak_memory_mb']:,.0f} | {v['client_seconds_per_image']:.2f} | {v['server_seconds']:.1f} | "
            f"{v['extrapolated_round_seconds']:,.0f} |"
        )
    lines += [
        "",
        "Full round (extrapolated): each sampled client's share of one task of the real dataset "
        "x local epochs x the measured seconds per image, clients in waves of the cores, plus the "
        "measured server time; evaluation not included. ViT-B/16 holds "
        f"{VIT_B16_PARAMETERS / 1e6:.1f}M parameters ({4 * VIT_B16_PARAMETERS / 1e6:.0f} MB).",
    ]
    return "\n".join(lines)
