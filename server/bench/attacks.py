"""``promptfcl bench robustness``: attacks by hostile clients against the defences."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...client.faults import STATISTICS_ATTACKS
from ...common.config.experiment import ExperimentConfig
from ...common.records import ARRAYS, METRICS
from ...strategies.registry import strategy_class
from .comparison import finished_run, parse_method
from .grid import run_grid
from .grid_parts import SEQUENTIAL, GridRun, Outcome, Placement
from .worst_case import worst_case_table, worst_cases

log = logging.getLogger("promptfcl")


# ----------------------------------------------------------------------------- robustness
#: the defences ``bench robustness`` compares, as run-config changes. "off" is the undefended run
#: (each paper's aggregation), "on" the defended one with the configured parameters (the
#: defaults unless --set changes them); the others force ``defences = "on"`` and name every
#: parameter, so that each means the same whatever the defaults are.
_ON = {"defences": "on", "aggregation": "mean"}
_NONE = {**_ON, "update-norm-factor": 0.0, "update-clip": 0.0, "stats-bound": 0.0, "update-min-cosine": -1.0,
         "update-reversed-norm": 0.0, "update-strikes": 0, "update-mean-cosine": -1.0, "update-strike-norm": 0.0,
         "update-norm-rounds": 1}
_NORM_FILTER = {**_NONE, "update-norm-factor": 10.0}
DEFENCES: dict[str, dict[str, Any]] = {
    "off": {"defences": "off"},
    "on": {"defences": "on"},
    "none": _NONE,  # defended, every parameter off: the always-on record checks only
    "norm-filter": _NORM_FILTER,  # exclude updates above 10 x the lower median norm
    # the defaults of #31: clip at 1 x the lower median, direction check at cosine 0, statistics at
    # 3 x the lower median over a class's reporters (that bound no longer exists: stats-bound now
    # bounds against the round's pooled rows)
    "directed-clip1": {**_NORM_FILTER, "update-clip": 1.0, "stats-bound": 3.0, "update-min-cosine": 0.0},
    "median": {**_NONE, "aggregation": "median"},
    "trimmed-mean": {**_NONE, "aggregation": "trimmed-mean"},
    # Flower's Byzantine-robust aggregators (strategies/platform/byzantine.py), f from the hostile share
    "krum": {**_NONE, "aggregation": "krum"},
    "multikrum": {**_NONE, "aggregation": "multikrum"},
    "bulyan": {**_NONE, "aggregation": "bulyan"},
}


def robustness(out_dir: Path, base: dict[str, Any], methods: Sequence[str], attacks: Sequence[str],
               defences: Sequence[str], seeds: Sequence[int], share: float | Sequence[float] = 0.2,
               clean: bool = True, placement: Placement = SEQUENTIAL) -> list[dict[str, Any]]:
    """A_N of each method when a fixed ``share`` of the client population is hostile (``fault`` =
    each attack, ``fault-clients`` = that many client ids; several shares: each), under each
    defence, and of the clean run under each defence ("off": each paper's aggregation; what a
    defence costs when nobody attacks; ``clean`` False: attacks only, against clean runs measured
    elsewhere); writes ``robustness.{json,md}`` with the worst case over the attacks of each
    method, share and defence (:mod:`.worst_case`); the runs where ``placement`` says
    (:func:`.grid.run_grid`), a failed run named in robustness.md and left out of the tables."""
    out_dir.mkdir(parents=True, exist_ok=True)
    population = int(ExperimentConfig.from_dict(base).federation.num_clients)
    shares = [float(share)] if isinstance(share, (int, float)) else [float(s) for s in share]
    hostile = {s: max(1, round(s * population)) for s in shares}
    # attacks meet every defence but "off" (undefended, a reply reversed x10 is taken as it is); the
    # clean runs once (no hostile share), each attack at each share
    cases = [("clean", d, 0.0) for d in defences if clean] + [(a, d, s) for s in shares for a in attacks
                                                            for d in defences if d != "off"]
    cells, runs = [], []
    for method in methods:
        for attack, defence, s in cases:
            if attack in STATISTICS_ATTACKS and not uploads_statistics(method):
                continue  # nothing for the attack to forge
            for seed in seeds:
                settings = {**base, **DEFENCES[defence], "seed": seed}
                name, folder = f"{method}, attack {attack}, defence {defence}", f"{method}-{attack}-{defence}"
                if attack != "clean":
                    settings.update({"fault": attack, "fault-clients": ",".join(map(str, range(hostile[s])))})
                    if len(shares) > 1:
                        name, folder = f"{name}, share {s:g}", f"{folder}-share{s:g}"
                cells.append((method, attack, defence, seed, s))
                runs.append(GridRun(f"{name}, seed {seed}", method, settings,
                                    out_dir / "runs" / f"{folder}-seed{seed}"))

    def write(outcomes: dict[int, Outcome]) -> list[dict[str, Any]]:
        rows = [_row(*cells[i], outcomes[i][0]) for i in sorted(outcomes)  # type: ignore[arg-type]
                if outcomes[i][0] is not None]
        (out_dir / "robustness.json").write_text(json.dumps(rows, indent=1))
        return rows

    outcomes = run_grid(runs, placement, lambda run: finished_run(run.run_dir, {**run.settings,
                                                                               "strategy": run.strategy}),
                        on_result=write)
    rows = write(outcomes)
    worst = worst_cases(rows)
    (out_dir / "worst-case.json").write_text(json.dumps(worst, indent=1))
    failed = [f"{runs[i].name} (log: {runs[i].run_dir})" for i in sorted(outcomes) if outcomes[i][0] is None]
    label = ", ".join(f"{hostile[s]} of {population}" for s in shares)
    table = robustness_table(rows, f"{label} clients")
    for defence in (d for d in defences if d != "off"):
        table += "\n\n" + robustness_summary([r for r in rows if r["share"] in (0.0, shares[0])], defence)
    table += "\n\n" + worst_case_table(worst)
    failures = "".join(f"\n* failed, left out: {f}" for f in failed)
    (out_dir / "robustness.md").write_text(table + "\n" + failures + ("\n" if failed else ""))
    print(table + failures)
    return rows


def _row(method: str, attack: str, defence: str, seed: int, share: float, results: dict[str, Any]) -> dict[str, Any]:
    """A run's line of robustness.json (``share``: of hostile clients, 0 for a clean run)."""
    rounds = results["rounds"]
    return {"method": method, "attack": attack, "defence": defence, "seed": seed, "share": share,
            "A_N": results["final_average_accuracy"], "forgetting": results["average_forgetting"],
            "replies_excluded": sum(1 for r in rounds for x in r["rejected"] if x["reason"] != "no training examples"),
            "replies_aggregated": sum(r["clients_aggregated"] for r in rounds),
            # what each defence did over the run (defended runs): replies excluded by the norm filter
            # and the direction check, replies clipped, statistics rows bounded
            "defences": {k: sum(r.get("defences", {}).get(k, 0) for r in rounds)
                         for k in ("norm-filter", "direction", "struck-out", "clip", "stats")}}


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


def robustness_summary(rows: list[dict[str, Any]], defence: str) -> str:
    """One line per method: A_N of the clean run undefended and under ``defence`` (its cost), and
    under each attack with ``defence`` (its change against the defended clean run), means over
    the seeds both share; what the defence touched in the clean runs (replies excluded, clipped,
    statistics rows bounded)."""
    by: dict[tuple[str, str, str], dict[int, float]] = {}
    touched: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["A_N"] is not None:
            by.setdefault((r["method"], r["attack"], r["defence"]), {})[r["seed"]] = float(r["A_N"])
        if r["attack"] == "clean" and r["defence"] == defence:
            acc = touched.setdefault(r["method"], {})
            for k, v in r.get("defences", {}).items():
                acc[k] = acc.get(k, 0) + v
    attacks = list(dict.fromkeys(r["attack"] for r in rows if r["attack"] != "clean"))
    lines = [f"| method | clean, off | clean, {defence} (cost) | clean: touched | "
             + " | ".join(attacks) + " |", "|---" * (4 + len(attacks)) + "|"]

    def change(a: dict[int, float], b: dict[int, float]) -> str:
        seeds = sorted(set(a) & set(b))
        if not seeds:  # no clean run here to compare with (--no-clean): the attacked A_N alone
            return f"{np.mean(list(a.values())):.1f}" if a else "-"
        return f"{np.mean([a[s] for s in seeds]):.1f} ({np.mean([a[s] - b[s] for s in seeds]):+.1f})"

    for method in dict.fromkeys(r["method"] for r in rows):
        off = by.get((method, "clean", "off"), {})
        on = by.get((method, "clean", defence), {})
        t = touched.get(method, {})
        cells = [change(by.get((method, a, defence), {}), on) for a in attacks]
        lines.append(f"| {method} | {f'{np.mean(list(off.values())):.1f}' if off else '-'} | {change(on, off)} | "
                     f"{t.get('norm-filter', 0) + t.get('direction', 0) + t.get('struck-out', 0)} excluded, "
                     f"{t.get('clip', 0)} clipped, "
                     f"{t.get('stats', 0)} rows | " + " | ".join(cells) + " |")
    return "\n".join(lines)
