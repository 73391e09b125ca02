"""Outputs of a run: results.json, a readable table, and two plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..common.files import write_atomic
from ..strategies.registry import cite


def write_json_atomic(path: Path, obj: Any) -> int:
    """Write then rename, so a crash never leaves a half-written file. Non-finite numbers
    become null (strict JSON has no NaN); returns how many there were."""
    clean, replaced = json_safe(obj)
    text = json.dumps(clean, indent=2, allow_nan=False).encode()
    write_atomic(path, lambda fh: fh.write(text), shared=True)
    return replaced


def json_safe(obj: Any) -> tuple[Any, int]:
    """``obj`` with NaN / inf as None and NumPy scalars and arrays as Python values, and the
    number of non-finite values replaced."""

    if isinstance(obj, dict):
        out, n = {}, 0
        for k, v in obj.items():
            out[str(k)], m = json_safe(v)
            n += m
        return out, n
    if isinstance(obj, (list, tuple, np.ndarray)):
        items = [json_safe(v) for v in (obj.tolist() if isinstance(obj, np.ndarray) else obj)]
        return [v for v, _ in items], sum(m for _, m in items)
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, 1
    return obj, 0


def write_outputs(results: dict[str, Any], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    results = dict(results)
    # every round says how many of its values were not finite (stored as null)
    results["rounds"] = [{**r, "non_finite_values": json_safe(r)[1]} for r in results.get("rounds", [])]
    results["non_finite_values"] = json_safe(results)[1]
    write_json_atomic(out / "results.json", results)
    plot(results, out)
    (out / "table.md").write_text(table(results) + "\n")
    return out / "results.json"


def table(results: dict[str, Any]) -> str:
    """Markdown table: the accuracy matrix (random tasks: each task's timeline), then the summary metrics."""
    if results.get("asynchronous"):
        return asynchronous_table(results)
    if results.get("accuracy_matrix") is None:  # random tasks stopped early (max-rounds): rounds only
        return rounds_table(results)
    acc = results["accuracy_matrix"]
    n = len(acc)
    head = "| task \\ after | " + " | ".join(f"T{t + 1}" for t in range(n)) + " |"
    sep = "|---" * (n + 1) + "|"
    rows = [head, sep]
    for i, row in enumerate(acc):
        cells = ["" if v is None else f"{v:.1f}" for v in row]
        rows.append(f"| T{i + 1} | " + " | ".join(cells) + " |")
    rows.append("| **A_t** | " + " | ".join(f"{v:.1f}" for v in results["average_accuracy_per_task"] or []) + " |")
    comm, timing = results["communication"], results["timing"]
    cfg = results["config"]
    rows += [
        "",
        "| metric | value |",
        "|---|---|",
        f"| strategy | {cite(cfg['strategy'])} |",
        (
            f"| dataset | {cfg['dataset']} ({n} tasks, {cfg['partition']} partition, {cfg['num-clients']} clients) |"
            if cfg.get("population", "virtual") != "nodes"
            # deployment: each node brings its data
            else f"| dataset | each node's own ({n} tasks, {_nodes_taking_part(results)}, "
                 f"{cfg.get('evaluation')} evaluation) |"
        ),
        f"| final average accuracy A_N | {_number(results['final_average_accuracy'])} |",
        f"| average incremental accuracy | {_number(results['average_incremental_accuracy'])} |",
        f"| average forgetting | {_number(results['average_forgetting'])} |",
        # results.json written before backward transfer was reported has no such key
        f"| backward transfer (BWT) | {_number(results.get('backward_transfer'))} |",
        f"| bytes S2C / C2S per round | {comm['bytes_s2c_per_round']:,.0f} / {comm['bytes_c2s_per_round']:,.0f} |",
        f"| trainable parameters | {comm['trainable_parameters']:,} |",
        f"| client / server seconds per round | {timing['client_seconds_per_round']:.2f} / "
        f"{timing['server_seconds_per_round']:.3f} |",
        f"| total run time | {timing['total_seconds']:.1f} s |",
    ]
    privacy = results.get("privacy") or {}
    if privacy.get("enabled"):  # common/privacy.py: the guarantee of the whole run
        rows.append(
            f"| differential privacy | epsilon {_number(privacy['epsilon'])} at delta {privacy['delta']:g} "
            f"(clip {privacy['clip']:g}, noise multiplier {privacy['noise_multiplier']:g}, "
            f"q {_rate(privacy)}, {privacy['rounds']} rounds); against the server "
            f"{_number(privacy.get('epsilon_against_server'))} |"
        )
    if results.get("stopped_after_round") is not None:
        rows.append(
            f"| stopped early (max-rounds) | after round {results['stopped_after_round']}; "
            "metrics cover the finished tasks |"
        )
    return "\n".join(rows)


def rounds_table(results: dict[str, Any]) -> str:
    """Per-round accuracy, bytes and seconds (a run stopped before any task ended everywhere)."""
    rows = ["| round | accuracy | bytes S2C | bytes C2S | client s | server s |", "|---|---|---|---|---|---|"]
    for r in results["rounds"]:
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.1f}"  # not evaluated (evaluate-every)
        rows.append(
            f"| {r['server_round']} | {acc} | {r['bytes_s2c']:,} | {r['bytes_c2s']:,} | "
            f"{r['client_seconds']:.2f} | {r['server_seconds']:.3f} |"
        )
    if results.get("stopped_after_round") is not None:
        rows.append(f"\nstopped after round {results['stopped_after_round']} (max-rounds)")
    return "\n".join(rows)


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _rate(privacy: dict[str, Any]) -> str:
    """The sampling rate of the privacy row: the highest a round had, and the nominal one if it differs."""
    highest, nominal = privacy["sample_rate"], privacy.get("sample_rate_nominal", privacy["sample_rate"])
    return f"{highest:.3g}" if abs(highest - nominal) < 1e-12 else f"up to {highest:.3g} (nominal {nominal:.3g})"


def asynchronous_table(results: dict[str, Any]) -> str:
    """Powder's benchmark (random tasks): per task its client, rounds and accuracies, then section 5.1's metrics."""
    a, comm, cfg = results["asynchronous"], results["communication"], results["config"]
    single = a["single_task_accuracy"] or [None] * len(a["tasks"])
    by_round = [r["task_accuracies"] for r in results["rounds"]]
    rows = ["| task | client | rounds | single-task | at its last round | final |", "|---|---|---|---|---|---|"]
    for g, (t, s) in enumerate(zip(a["tasks"], single)):
        at_finish, final = by_round[t["last_round"] - 1][g], by_round[-1][g]
        rows.append(
            f"| T{g + 1} | {t['client']} | {t['first_round']}-{t['last_round']} | "
            f"{'' if s is None else f'{s:.1f}'} | {at_finish:.1f} | {final:.1f} |"
        )

    def value(key: str) -> str:
        return "n/a (no single-task reference)" if a.get(key) is None else f"{a[key]:.2f}"

    rows += [
        "",
        "| metric (Powder, section 5.1) | value |",
        "|---|---|",
        f"| strategy | {cite(cfg['strategy'])} |",
        f"| tasks | {len(a['tasks'])} random tasks of {cfg['classes-per-task']} {cfg['dataset']} classes over "
        f"{cfg['num-clients']} clients, {len(by_round)} rounds |",
        f"| AIA | {value('average_incremental_accuracy')} |",
        f"| FM | {value('forgetting_measure')} |",
        f"| FT | {value('forward_transfer')} |",
        f"| BT | {value('backward_transfer')} |",
        f"| CT | {value('combined_transfer')} |",
        f"| final accuracy (mean over tasks) | {value('final_accuracy')} |",
        f"| S2C / C2S total | {comm['bytes_s2c_total'] / 1e6:,.2f} MB / {comm['bytes_c2s_total'] / 1e6:,.2f} MB |",
        f"| evaluation rounds (R) | {', '.join(str(r) for r in a['evaluation_rounds'])} |",
        f"| total run time | {results['timing']['total_seconds']:.1f} s |",
    ]
    return "\n".join(rows)


def plot(results: dict[str, Any], out: Path) -> None:
    # matplotlib is slow to import: only the plots need it
    import matplotlib

    matplotlib.use("Agg")
    # matplotlib is slow to import: only the plots need it
    import matplotlib.pyplot as plt

    every = results["rounds"]
    rounds = [r for r in every if r["task_accuracies"] is not None]  # the evaluated ones (evaluate-every)
    n = max(len(r["task_accuracies"]) for r in rounds)
    x = [r["server_round"] for r in rounds]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i in range(n):
        xs = [r["server_round"] for r in rounds if len(r["task_accuracies"]) > i]
        ys = [r["task_accuracies"][i] for r in rounds if len(r["task_accuracies"]) > i]
        ax.plot(xs, ys, marker=".", label=f"task {i + 1}")
    ax.plot(x, [r["accuracy"] for r in rounds], color="black", linewidth=2, label="average (seen)")
    for r in every if not results.get("asynchronous") else []:
        if r["round"] == 0 and r["task"] > 0:
            ax.axvline(r["server_round"] - 0.5, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("server round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"{results['config']['strategy']} on {results['config']['dataset']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "accuracy_over_rounds.png", dpi=120)
    plt.close(fig)
    if results["accuracy_matrix"] is None:  # random tasks: no matrix
        return

    acc = np.array([[np.nan if v is None else v for v in row] for row in results["accuracy_matrix"]])
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * n, 0.8 + 0.6 * n))
    im = ax.imshow(acc, vmin=0, vmax=100, cmap="viridis")
    for i in range(n):
        for t in range(n):
            if not np.isnan(acc[i, t]):
                ax.text(
                    t,
                    i,
                    f"{acc[i, t]:.0f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if acc[i, t] < 60 else "black",
                )
    ax.set_xticks(range(n), [f"T{t + 1}" for t in range(n)])
    ax.set_yticks(range(n), [f"T{t + 1}" for t in range(n)])
    ax.set_xlabel("after learning task")
    ax.set_ylabel("accuracy on task")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(out / "accuracy_matrix.png", dpi=120)
    plt.close(fig)


def _nodes_taking_part(results: dict[str, Any]) -> str:
    """How many nodes the run waited for, and how many were connected at its last round's sampling
    where that differs (a node dropped or joined): the table must not say 3 nodes after one left."""
    waited = int(results["config"]["num-clients"])
    rounds = results.get("rounds") or []
    rates = rounds[-1].get("sample_rates") if rounds else None
    sampled = len(rounds[-1].get("placement") or []) if rounds else 0
    if not rates or not rates[-1] or not sampled:
        return f"{waited} nodes"
    connected = round(sampled / rates[-1])
    return f"{waited} nodes" if connected == waited else f"{waited} nodes at the start, {connected} at the end"
