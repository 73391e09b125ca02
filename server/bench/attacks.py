"""``promptfcl bench robustness``: attacks by hostile clients against the defences."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from promptfcl.client.faults import STATISTICS_ATTACKS
from promptfcl.common.config import ExperimentConfig
from promptfcl.common.records import ARRAYS, METRICS
from promptfcl.server.bench.common import run_simulation_subprocess
from promptfcl.server.bench.comparison import finished_run, parse_method
from promptfcl.strategies.registry import strategy_class

log = logging.getLogger("promptfcl")


# ----------------------------------------------------------------------------- robustness
#: the defences ``bench robustness`` compares, as run-config changes; each names all of its keys,
#: so that a defence means the same whatever the defaults are
_OFF = {"update-norm-factor": 0.0, "update-clip": 0.0, "stats-bound": 0.0, "update-min-cosine": -1.0,
        "aggregation": "mean"}
_NORM_FILTER = {**_OFF, "update-norm-factor": 10.0}
_DIRECTED = {**_NORM_FILTER, "update-clip": 1.0, "stats-bound": 3.0, "update-min-cosine": 0.0}
DEFENCES: dict[str, dict[str, Any]] = {
    "default": {},  # the configuration as given: the code's defaults unless --set changes them
    "none": _OFF,
    "norm-filter": _NORM_FILTER,  # the default before #31: exclude updates above 10 x the lower median norm
    "clip": {**_NORM_FILTER, "update-clip": 1.0},  # the norm filter, then norm bounding at the median
    # norm bounding of updates and bounded influence of statistics (strategies/platform/statistics.py)
    "bounded": {**_NORM_FILTER, "update-clip": 1.0, "stats-bound": 3.0},
    # bounded, and updates pointing against their task's median update excluded
    "directed": _DIRECTED,
    # directed with a looser clip (2 x the lower median): most honest updates left untouched
    "directed-clip2": {**_DIRECTED, "update-clip": 2.0},
    "median": {**_OFF, "aggregation": "median"},
    "trimmed-mean": {**_OFF, "aggregation": "trimmed-mean"},
}


def robustness(out_dir: Path, base: dict[str, Any], methods: Sequence[str], attacks: Sequence[str],
               defences: Sequence[str], seeds: Sequence[int], share: float = 0.2) -> list[dict[str, Any]]:
    """A_N of each method when a fixed ``share`` of the client population is hostile (``fault`` =
    each attack, ``fault-clients`` = that many client ids), under each defence, and of the
    clean run under each defence (what a defence costs when nobody attacks); writes
    ``robustness.{json,md}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    population = int(ExperimentConfig.from_dict(base).num_clients)
    hostile = max(1, round(share * population))
    fault_clients = ",".join(str(c) for c in range(hostile))
    rows: list[dict[str, Any]] = []
    cases = [("clean", d) for d in defences] + [(a, d) for a in attacks for d in defences]
    for method in methods:
        for attack, defence in cases:
            if attack in STATISTICS_ATTACKS and not uploads_statistics(method):
                continue  # nothing for the attack to forge
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
                rows.append({"method": method, "attack": attack, "defence": defence, "seed": seed,
                             "A_N": results["final_average_accuracy"], "forgetting": results["average_forgetting"],
                             "replies_excluded": sum(1 for r in rounds for x in r["rejected"]
                                                     if x["reason"] != "no training examples"),
                             "replies_aggregated": sum(r["clients_aggregated"] for r in rounds)})
                (out_dir / "robustness.json").write_text(json.dumps(rows, indent=1))
    table = robustness_table(rows, f"{hostile} of {population} clients")
    (out_dir / "robustness.md").write_text(table + "\n")
    print(table)
    return rows


def uploads_statistics(method: str) -> bool:
    """Whether ``method``'s replies carry statistics besides the model (records the statistics
    attacks forge: HGP's Gaussians, FPPL's prototypes, Powder's alphas)."""
    records = strategy_class(parse_method(method)[0]).reply_records
    return records is None or bool(set(records) - {ARRAYS, METRICS})


def robustness_table(rows: list[dict[str, Any]], hostile: str) -> str:
    lines = [f"| method | attack ({hostile} hostile) | defence | seeds | A_N | forgetting | replies excluded / "
             "aggregated |", "|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get("method", ""), r["attack"], r["defence"]), []).append(r)
    for (method, attack, defence), rs in groups.items():
        a_n = np.array([np.nan if r["A_N"] is None else r["A_N"] for r in rs], dtype=float)
        fg = np.array([np.nan if r["forgetting"] is None else r["forgetting"] for r in rs], dtype=float)
        lines.append(f"| {method} | {attack} | {defence} | {len(rs)} | {np.mean(a_n):.1f} ± {np.std(a_n):.1f} | "
                     f"{np.mean(fg):.1f} ± {np.std(fg):.1f} | "
                     f"{sum(r['replies_excluded'] for r in rs)} / {sum(r['replies_aggregated'] for r in rs)} |")
    return "\n".join(lines)
