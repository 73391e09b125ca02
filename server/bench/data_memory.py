"""``promptfcl bench data-memory``: a client's peak memory and first round as the dataset grows.

A synthetic 224-px image folder (JPEG files, one folder per class) at each size; for each size
and each way of holding the data (``data-cache`` on: decoded once per machine into the
cache, every process reads the rows it indexes; off: each process decodes the whole dataset
into its own memory, as before), fresh processes:

* decode: ``load_dataset_cached`` into an empty cache (``decode_seconds``);
* client: one client's first round (the real ``LocalLearner.fit`` of FedAvg-Prompt), peak
  resident memory (``client_rss_mb``, the kernel's high-water mark) and seconds from the
  process's start (``first_round_seconds``).

The population grows with the dataset so a client's share stays the same size: what is
measured is whether a client's memory depends on the dataset it is a share of.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import RecordDict

from ...common.config.experiment import ExperimentConfig
from ...common.data.cache import load_dataset_cached
from ...common.data.partitions import client_indices
from ...common.files import write_atomic
from ...common.model.runtime import get_runtime
from ...common.records import ARRAYS, to_array_record
from ...strategies.fedavg.strategy import FedAvgStrategy
from ...strategies.platform.learner import LocalLearner
from .common import _machine

log = logging.getLogger("promptfcl")

CLASSES = 10
SHARE = 200  # images per client (train and test together), whatever the dataset's size


def synthetic_folder(root: Path, images: int, size: int = 224, seed: int = 0) -> Path:
    """``root/class<c>/<i>.jpg``: smooth class-coloured patterns with noise (JPEG keeps them small)."""
    # PIL: only this benchmark's image folder needs it
    from PIL import Image

    done = root / ".complete"
    if done.is_file() and done.read_text() == str(images):
        return root
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    for i in range(images):
        c = i % CLASSES
        base = np.stack([np.sin((c + 1) * xx * 3 + k) * np.cos((c + 2) * yy * 2 - k) for k in range(3)], -1)
        img = ((base + 1) * 110 + rng.normal(0, 12, base.shape)).clip(0, 255).astype(np.uint8)
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(root / f"class{c}" / f"{i:06d}.jpg", quality=90)
    done.write_text(str(images))
    return root


def bench_config(folder: Path, images: int, data_cache: bool, base: dict[str, Any]) -> dict[str, Any]:
    """A run over the folder at 224 px whose clients each hold about ``SHARE`` images."""
    return {**base, "dataset": f"folder:{folder}", "image-size": 224, "patch-size": 16, "weights": "random",
            "num-tasks": 2, "num-clients": max(1, images // SHARE), "clients-per-round": 1, "local-epochs": 1,
            "partition": "iid", "data-cache": data_cache, "query-cache-disk": "off", "backbone-cache-disk": "off"}


def _child(step: str, settings: dict[str, Any], cache: Path) -> dict[str, Any]:
    env = {**os.environ, "PROMPTFCL_CACHE": str(cache)}
    code = "import sys; from promptfcl.server.bench.data_memory import main; main(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, step, json.dumps(settings)],
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench data-memory {step} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def data_memory(out_dir: Path, base: dict[str, Any], sizes: tuple[int, ...] = (2000, 8000)) -> dict[str, Any]:
    """Rows of decode seconds, client peak RSS and first-round seconds per size and data path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for images in sizes:
        log.info("synthetic 224-px dataset of %d images", images)
        folder = synthetic_folder(out_dir / f"images-{images}", images)
        for cached in (True, False):
            settings = bench_config(folder, images, cached, base)
            cache = out_dir / f"cache-{images}-{'cache' if cached else 'in-memory'}"
            decode = _child("decode", settings, cache) if cached else {"seconds": None, "rss_mb": None}
            client = _child("client", settings, cache)
            rows.append({"images": images, "data_cache": cached, "client_rss_mb": round(client["rss_mb"], 1),
                         "decode_seconds": decode["seconds"] if cached else client["decode_seconds"],
                         "decoder_rss_mb": decode["rss_mb"], "first_round_seconds": round(client["seconds"], 2),
                         "client_share": client["share"]})
            log.info("%s", rows[-1])
    mapped = {r["images"]: r["client_rss_mb"] for r in rows if r["data_cache"]}
    ratio = mapped[max(sizes)] / mapped[min(sizes)]
    report = {"rows": rows, "rss_ratio_largest_to_smallest": round(ratio, 3), "target_ratio": 1.25,
              "machine": _machine()}
    write_atomic(out_dir / "data_memory.json", lambda fh: fh.write(json.dumps(report, indent=1).encode()), shared=True)
    print(f"{'images':>7} {'data path':>10} {'client RSS MB':>14} {'decode s':>9} {'first round s':>14}")
    for r in rows:
        seconds = f"{r['decode_seconds']:.1f}" if r["decode_seconds"] is not None else "-"
        print(f"{r['images']:>7} {'cache' if r['data_cache'] else 'in-memory':>10} {r['client_rss_mb']:>14.0f} "
              f"{seconds:>9} {r['first_round_seconds']:>14.1f}")
    print(f"client peak RSS, data cache, {max(sizes)} vs {min(sizes)} images: {ratio:.2f}x (target <= 1.25x)")
    return report


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _run_step(step: str, settings: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()

    cfg = ExperimentConfig.from_dict(settings)
    if step == "decode":
        load_dataset_cached(cfg)
        return {"seconds": round(time.perf_counter() - started, 2), "rss_mb": round(_peak_rss_mb(), 1)}

    t = time.perf_counter()
    data = load_dataset_cached(cfg)
    decode_seconds = round(time.perf_counter() - t, 2)
    rt = get_runtime(cfg)
    arrays = FedAvgStrategy.of(cfg, data.num_classes).on_task_start(0, to_array_record(rt.model.trainable_state()))
    share = len(client_indices(data.train.labels, rt.layout, rt.partition, 0, 0, 0))
    LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
    return {"seconds": time.perf_counter() - started, "rss_mb": _peak_rss_mb(), "share": share,
            "decode_seconds": decode_seconds}


def main(argv: list[str]) -> None:
    """A step in its own process (see _child): ``decode`` or ``client`` with the run settings."""
    print(json.dumps(_run_step(argv[0], json.loads(argv[1]))))
