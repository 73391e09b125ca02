"""Per-task breakdown of finished runs: forgetting of each task and strategy metrics per task.

``promptfcl bench compare`` reports A_N and the average forgetting; this script opens the
runs behind a comparison (``<out>/runs/<method>-<setting>-seed<k>/results.json``) or any
run directories and prints, per method variant (seeds pooled):

* the accuracy on each task when it was learnt and at the end, and its forgetting
  (largest earlier accuracy minus the final one, ``common.metrics.task_forgetting``);
* with ``--metrics PREFIX,...``, the mean over each task's rounds of every strategy metric
  (results.json ``rounds[*].strategy_metrics``) whose name starts with a prefix: e.g. HePCo's
  latent diagnostics (``gen-``, ``past-gen-``, ``real-``, ``latent-``; see strategies/hepco.py).

Usage::

    python scripts/run_breakdown.py runs/bench-hepco                 # a bench compare output
    python scripts/run_breakdown.py runs/a runs/b --metrics real-,past-gen-
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from promptfcl.common.metrics import task_forgetting  # noqa: E402


def find_runs(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """results.json of every run under ``paths``, grouped by run name without its ``-seed<k>``
    (prefixed by the path it was found under when there are several)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        files = [path / "results.json"] if (path / "results.json").is_file() else sorted(path.glob("**/results.json"))
        for f in files:
            name = re.sub(r"-seed\d+$", "", f.parent.name)
            groups[f"{path.name}: {name}" if len(paths) > 1 else name].append(json.loads(f.read_text()))
    return dict(groups)


def mean_std(values: list[float]) -> str:
    v = np.asarray(values, dtype=float)
    return f"{np.nanmean(v):.1f} ± {np.nanstd(v):.1f}" if len(v) else "-"


def forgetting_table(groups: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: per run group, each task's accuracy when learnt, at the end, and its forgetting."""
    lines = []
    for name, runs in groups.items():
        mats = [np.array(r["accuracy_matrix"], dtype=float) for r in runs if r.get("accuracy_matrix")]
        if not mats:
            continue
        n = mats[0].shape[0]
        lines += [f"### {name} ({len(mats)} seeds): A_N {mean_std([r['final_average_accuracy'] for r in runs])}, "
                  f"forgetting {mean_std([r['average_forgetting'] for r in runs])}", "",
                  "| task | learnt | final | forgetting |", "|---|---|---|---|"]
        drops = np.stack([task_forgetting(m) for m in mats])
        for i in range(n):
            lines.append(f"| {i + 1} | {mean_std([m[i, i] for m in mats])} | {mean_std([m[i, -1] for m in mats])} | "
                         + (mean_std(list(drops[:, i])) if i < n - 1 else "-") + " |")
        lines.append("")
    return "\n".join(lines)


def metrics_table(groups: dict[str, list[dict[str, Any]]], prefixes: list[str]) -> str:
    """Markdown: per run group and metric, its mean over each task's rounds (seeds pooled)."""
    lines = []
    for name, runs in groups.items():
        per: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        n = max((r["rounds"][-1]["task"] + 1 for r in runs if r["rounds"]), default=0)
        for r in runs:
            for rec in r["rounds"]:
                for key, value in rec.get("strategy_metrics", {}).items():
                    if any(key.startswith(p) for p in prefixes):
                        per[key][rec["task"]].append(float(value))
        if not per:
            continue
        lines += [f"### {name}: strategy metrics, mean over each task's rounds", "",
                  "| metric | " + " | ".join(f"task {t + 1}" for t in range(n)) + " |",
                  "|---|" + "---|" * n]
        for key in sorted(per):
            lines.append(f"| {key} | " + " | ".join(f"{np.mean(per[key][t]):.2f}" if per[key][t] else "-"
                                                  for t in range(n)) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="bench compare outputs or run directories")
    parser.add_argument("--metrics", default="", help="comma-separated prefixes of strategy metrics to tabulate")
    args = parser.parse_args(argv)
    groups = find_runs(args.paths)
    if not groups:
        parser.error("no results.json under " + ", ".join(map(str, args.paths)))
    print(forgetting_table(groups))
    prefixes = [p for p in args.metrics.split(",") if p]
    if prefixes:
        print(metrics_table(groups, prefixes))


if __name__ == "__main__":
    main()
