"""The worst case of ``bench robustness``: for each method, hostile share and defence, the lowest
A_N over the attacks (mean over the seeds), the attack that did it, beside the clean A_N under
the same defence (and undefended), as the robust-aggregation benchmarks report it (ByzFL, FLPoison)."""

from __future__ import annotations

from typing import Any

import numpy as np


def worst_cases(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (method, share, defence) attacked in ``rows`` (robustness.json's lines): the
    attack of the lowest mean A_N over its seeds, that mean, the seeds' A_N, and the clean run's
    mean A_N under the defence and undefended ("off"; None where not measured)."""
    means: dict[tuple[str, float, str, str], list[float]] = {}
    for r in rows:
        if r["A_N"] is not None:
            means.setdefault((r["method"], float(r.get("share", 0.0)), r["defence"], r["attack"]), []).append(
                float(r["A_N"]))

    def clean(method: str, defence: str) -> float | None:
        values = [v for (m, _, d, a), vs in means.items() if (m, d, a) == (method, defence, "clean") for v in vs]
        return float(np.mean(values)) if values else None

    worst: dict[tuple[str, float, str], tuple[str, list[float]]] = {}
    for (method, share, defence, attack), values in means.items():
        if attack == "clean":
            continue
        key = (method, share, defence)
        if key not in worst or np.mean(values) < np.mean(worst[key][1]):
            worst[key] = (attack, values)
    return [{"method": m, "share": s, "defence": d, "attack": a, "worst_A_N": float(np.mean(v)), "seeds_A_N": v,
             "clean_A_N": clean(m, d), "clean_off_A_N": clean(m, "off")}
            for (m, s, d), (a, v) in sorted(worst.items(), key=lambda kv: kv[0])]


def worst_case_table(worst: list[dict[str, Any]]) -> str:
    """:func:`worst_cases` as markdown: the worst A_N, its change from the defended clean run, the attack."""
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = ["| method | hostile share | defence | clean, off | clean | worst A_N (change) | worst attack | seeds |",
             "|---|---|---|---|---|---|---|---|"]
    for w in worst:
        change = "" if w["clean_A_N"] is None else f" ({w['worst_A_N'] - w['clean_A_N']:+.1f})"
        lines.append(f"| {w['method']} | {w['share']:g} | {w['defence']} | {num(w['clean_off_A_N'])} | "
                     f"{num(w['clean_A_N'])} | {w['worst_A_N']:.1f}{change} | {w['attack']} | "
                     f"{', '.join(f'{v:.1f}' for v in w['seeds_A_N'])} |")
    return "\n".join(lines)


__all__ = ["worst_case_table", "worst_cases"]
