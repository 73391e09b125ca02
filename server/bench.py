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
and writes a Markdown and CSV table with plots. The references are one client holding all
data with FedAvg-Prompt's local training: ``upper-bound-incremental`` learns the tasks in
turn (centralised incremental CODA-P) and ``upper-bound-joint`` trains at each task on the
union of every task seen so far (the ceiling; ``centralised-mode``).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import numpy as np

from common.config import ExperimentConfig

log = logging.getLogger("promptfcl")

VIT_B16_PARAMETERS = 85_798_656  # timm vit_base_patch16_224 without its ImageNet head (num_classes=0)


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
    args = [sys.executable, "-m", "server.cli", "simulate", "--strategy", strategy, "--out", str(out)]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value) if isinstance(value, str) else value}"]
    if (out / "results.json").exists():
        (out / "results.json").unlink()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server_peak, client_peak = 0.0, 0.0
    if watch_memory:
        while proc.poll() is None:
            server_peak = max(server_peak, _peak_rss_mb(proc.pid))
            client_peak = max([client_peak] + [_peak_rss_mb(p) for p in _actor_pids()])
            time.sleep(0.25)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"simulation failed ({strategy}, {settings}):\n{output[-3000:]}")
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

    from client.learner import LocalLearner
    from common.data import client_indices, task_classes
    from common.model import masked_logits
    from common.records import ARRAYS, to_array_record
    from common.runtime import _runtime, get_runtime
    from strategies.fedavg import FedAvgPrompt

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
    from strategies import METHODS

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = ExperimentConfig.from_dict({**base, "centralised": True})  # one client holding a whole task
    report: dict[str, Any] = {"config": cfg.to_dict(), "machine": {"cpus": os.cpu_count()}}
    log.info("local training speed ...")
    report["local_training"] = local_training_speed(cfg)

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
    for name in methods or tuple(sorted(METHODS)):
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


def format_perf(report: dict[str, Any]) -> str:
    lt = report["local_training"]
    lines = [
        "## promptfcl bench perf",
        "",
        f"machine: {report['machine']['cpus']} CPUs; backbone {report['config']['backbone']} "
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
    lines += ["", "| method | bytes S2C / round | bytes C2S / round | per client exchange | share of ViT-B/16 (343 MB) |",
              "|---|---|---|---|---|"]
    for name, b in report["bytes"].items():
        lines.append(f"| {name} | {b['s2c_per_round']:,.0f} | {b['c2s_per_round']:,.0f} | "
                     f"{b['per_client_exchange']:,.0f} | {b['share_of_vit_b16_percent']:.3f}% |")
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
    from common.config import parse_overrides

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
