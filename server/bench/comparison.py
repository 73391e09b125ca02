"""``promptfcl bench compare``: every method on identical splits, seeds and heterogeneity, with the
centralised references; Markdown and CSV tables and plots."""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...common.config.experiment import ExperimentConfig
from ...common.config.files import parse_overrides
from ...strategies.registry import check_method, methods
from .grid import run_grid
from .grid_parts import SEQUENTIAL, GridRun, Outcome, Placement

log = logging.getLogger("promptfcl")


# ----------------------------------------------------------------------------- compare
#: the centralised references of ``compare``: name -> centralised-mode
UPPER_BOUNDS = {"upper-bound-incremental": "incremental", "upper-bound-joint": "joint"}


def compare(out_dir: Path, base: dict[str, Any], methods: list[str], seeds: list[int],
            settings: list[dict[str, Any]], upper_bound: bool = True,
            placement: Placement = SEQUENTIAL) -> list[dict[str, Any]]:
    """Every method (+ the two centralised references, ``UPPER_BOUNDS``) x heterogeneity setting x seed,
    each computed as its paper defines it: ``defences = "off"`` unless ``base`` says otherwise; the
    runs where ``placement`` says (:func:`.grid.run_grid`), the tables from their results in grid order."""
    base = {"defences": "off", **base}
    out_dir.mkdir(parents=True, exist_ok=True)
    references = list(UPPER_BOUNDS) if upper_bound else []
    cells = [(m, s, h) for h in settings for m in methods + references for s in seeds]
    runs = []
    for method, seed, setting in cells:
        label = _setting_label(setting)
        strategy, options = parse_method(method)
        run_settings = {**base, **setting, **options, "seed": seed}
        run_dir = out_dir / "runs" / f"{method.replace('/', '+')}-{label}-seed{seed}"
        if method in UPPER_BOUNDS:  # one client with all data: the partition plays no part, one run per seed
            strategy = "fedavg"
            run_settings = {**base, "seed": seed, "centralised": True, "centralised-mode": UPPER_BOUNDS[method]}
            run_dir = out_dir / "runs" / f"{method}-seed{seed}"
        runs.append(GridRun(f"{method}, {label}, seed {seed}", strategy, run_settings, run_dir))

    def tables(outcomes: dict[int, Outcome]) -> tuple[list[dict[str, Any]], list[str]]:
        rows = [_row(method, _setting_label(setting), seed, outcomes[i][0])  # type: ignore[arg-type]
                for i, (method, seed, setting) in enumerate(cells) if i in outcomes and outcomes[i][0] is not None]
        failed = [f"{runs[i].name} (log: {runs[i].run_dir})" for i in sorted(outcomes) if outcomes[i][0] is None]
        _write_compare(out_dir, rows, failed)
        return rows, failed

    outcomes = run_grid(runs, placement, lambda run: finished_run(run.run_dir, {**run.settings,
                                                                               "strategy": run.strategy}),
                        on_result=tables)
    rows, failed = tables(outcomes)
    print(summary_table(rows))
    if failed:
        print("failed runs (left out of the table):\n  " + "\n  ".join(failed))
    return rows


def _row(method: str, label: str, seed: int, results: dict[str, Any]) -> dict[str, Any]:
    """A run's line of the comparison table."""
    comm, timing = results["communication"], results["timing"]
    row = {
        "method": method, "setting": label, "seed": seed,
        "A_N": results["final_average_accuracy"], "AIA": results["average_incremental_accuracy"],
        "forgetting": results["average_forgetting"],
        "bytes_s2c_per_round": comm["bytes_s2c_per_round"], "bytes_c2s_per_round": comm["bytes_c2s_per_round"],
        "client_seconds_per_round": timing["client_seconds_per_round"],
        "server_seconds_per_round": timing["server_seconds_per_round"],
    }
    if results.get("asynchronous"):  # random tasks: Powder's section 5.1 metrics
        a = results["asynchronous"]
        row.update({"FM": a["forgetting_measure"], "FT": a.get("forward_transfer", np.nan),
                    "BT": a["backward_transfer"], "CT": a.get("combined_transfer", np.nan),
                    "bytes_s2c_total": comm["bytes_s2c_total"], "bytes_c2s_total": comm["bytes_c2s_total"]})
    return row


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
    with some of its options changed (an ablation), compared as a method of its own; a part
    without ``=`` names one of the method's variants (``"hepco/baseline"``)."""

    name, *parts = spec.split("/")
    options: dict[str, Any] = {}
    for part in parts:
        if "=" in part:
            options.update(parse_overrides([part]))
        elif name not in UPPER_BOUNDS:
            check_method(name)
            options.update(methods()[name].variant(part))
    return name, {f"{name}.{k}": v for k, v in options.items()}


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
    lines = [
        "| setting | method | seeds | A_N | AIA | forgetting | KB S2C/round | KB C2S/round "
        "| client s/round | server s/round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (setting, method), rs in groups.items():
        cells = []
        for k in keys:
            v = np.array([r[k] for r in rs])
            cells.append(f"{v.mean():.1f} ± {v.std():.1f}")
        mean = {
            k: float(np.mean([r[k] for r in rs]))
            for k in (
                "bytes_s2c_per_round",
                "bytes_c2s_per_round",
                "client_seconds_per_round",
                "server_seconds_per_round",
            )
        }
        lines.append(
            f"| {setting} | {method} | {len(rs)} | "
            + " | ".join(cells)
            + f" | {mean['bytes_s2c_per_round'] / 1000:.0f} | {mean['bytes_c2s_per_round'] / 1000:.0f} | "
            f"{mean['client_seconds_per_round']:.2f} | {mean['server_seconds_per_round']:.3f} |"
        )
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
    # matplotlib is slow to import: only the figure needs it
    import matplotlib

    matplotlib.use("Agg")
    # matplotlib is slow to import: only the figure needs it
    import matplotlib.pyplot as plt

    settings = sorted({r["setting"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(methods), 1)
    for ax, key in zip(axes, ("A_N", "forgetting")):
        for j, m in enumerate(methods):
            means = [
                np.mean([r[key] for r in rows if r["method"] == m and r["setting"] == s] or [np.nan]) for s in settings
            ]
            stds = [
                np.std([r[key] for r in rows if r["method"] == m and r["setting"] == s] or [np.nan]) for s in settings
            ]
            ax.bar(np.arange(len(settings)) + j * width, means, width, yerr=stds, label=m, capsize=2)
        ax.set_xticks(np.arange(len(settings)) + width * (len(methods) - 1) / 2, settings, fontsize=8)
        ax.set_ylabel(key + " (%)")
        ax.set_title(key)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "compare.png", dpi=120)
    plt.close(fig)
