"""``promptfcl bench deploy``: a loopback deployment of the deploy/ scripts against the same run simulated."""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...common.flower_internals import INTERNALS, internal
from ...common.node.startup import PHASES
from ..loopback import run_deployed
from .common import run_simulation_subprocess

log = logging.getLogger("promptfcl")


# ----------------------------------------------------------------------------- deployment
def empty_process_seconds(repeats: int = 3, imports: str = "") -> float:
    """Median wall time of a fresh interpreter that imports what Flower's ``flwr-clientapp``
    process imports (its runner and ``ClientApp``) and nothing of this project: the floor under
    any deployed message's start-up on this machine. ``imports``: more to import (``"torch"``:
    the floor of any ClientApp that trains with torch)."""

    internal("clientapp_main")  # fails here, naming it, if Flower moved its runner
    runner = INTERNALS["clientapp_main"]
    times = []
    code = (f"from {runner.module} import {runner.attribute}; from flwr.clientapp import ClientApp; ClientApp()"
            + (f"; import {imports}" if imports else ""))
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - started)
    return float(statistics.median(times))


def _median_round(results: dict[str, Any], key: str) -> float:
    return float(statistics.median(r[key] for r in results["rounds"]))


def _path_figures(deployed: dict[str, Any]) -> dict[str, Any]:
    """One deployed run's per-round figures and its messages' start-up breakdown."""

    overhead = _median_round(deployed, "client_overhead_seconds")
    phases = {p: float(statistics.median(r["client_startup"].get(p, 0.0) for r in deployed["rounds"])) for p in PHASES}
    return {
        "round_seconds": _round_seconds(deployed),
        "eval_seconds": _median_round(deployed, "eval_seconds"),
        "per_message_overhead_seconds": overhead,
        # evaluate messages (to nodes not carrying the counts with training): process start to reply
        "eval_message_seconds": float(statistics.median(
            [r["eval_process_seconds"] for r in deployed["rounds"] if r.get("eval_process_seconds")] or [0.0])),
        # rounds whose evaluation came with the next round's train replies (evaluate-with-train)
        "rounds_evaluated_with_training": sum(1 for r in deployed["rounds"] if r.get("eval_carried")),
        "overhead_breakdown": {**phases, "other": max(0.0, overhead - sum(phases.values()))},
        "client_train_seconds": _median_round(deployed, "client_seconds"),
        "flower_transport_seconds": _transport_seconds(deployed),
        "accuracy_matrix": deployed["accuracy_matrix"],
    }


def _transport_seconds(results: dict[str, Any]) -> float:
    """Per round (median), the server's wait for its replies beyond the slowest message's process
    (process start to reply): Flower's delivery to the node, the process launch before the
    interpreter starts, the reply's encoding and its way back (the SuperNode's and the
    SuperLink's polling included). A round's messages run side by side, so the slowest one bounds it."""
    return float(statistics.median(
        max(0.0, r["round_seconds"] - r["server_seconds"] - r.get("client_process_seconds_max", 0.0))
        for r in results["rounds"]))


def _round_seconds(results: dict[str, Any]) -> float:
    """Training and evaluation, median over rounds."""
    return float(statistics.median(r["round_seconds"] + r["eval_seconds"] for r in results["rounds"]))


def deploy_overhead(out_dir: Path, base: dict[str, Any], nodes: int = 3) -> dict[str, Any]:
    """A loopback deployment (deploy/ scripts: TLS SuperLink, ``nodes`` SuperNodes with their own
    image folders, federated evaluation) run twice, with the warm forking executor (the default)
    and with Flower's stock one (``--no-warm``), and the same configuration simulated; per-round
    time of each, and where a deployed message's process spends its time before training.

    Writes ``deploy.json`` into ``out_dir`` (top-level figures: the warm path; ``stock``: the
    stock path's) and prints a table.
    """

    out_dir.mkdir(parents=True, exist_ok=True)
    same = {**base, "num-clients": nodes, "clients-per-round": nodes, "threads": 1}
    run = {**same, "population": "nodes", "evaluation": "federated", "num-classes": 10,
           "class-names": ",".join(str(d) for d in range(10)), "out-dir": "runs/bench-deploy"}
    paths = {}
    for path, use_warm in (("warm", True), ("stock", False)):
        work = out_dir / f"deployment-{path}"
        if work.exists():
            shutil.rmtree(work)
        log.info("bench deploy: the %s path (%d nodes)", path, nodes)
        paths[path] = _path_figures(run_deployed(work, run, nodes, warm=use_warm))
    simulated = run_simulation_subprocess({**same, "out-dir": str(out_dir / "simulation")}, out_dir / "simulation")
    warm, stock = paths["warm"], paths["stock"]
    report = {
        "nodes": nodes,
        "rounds": len(simulated["rounds"]),
        **{k: v for k, v in warm.items() if k not in ("round_seconds", "eval_seconds")},
        "deployed_round_seconds": warm["round_seconds"],
        "deployed_eval_seconds": warm["eval_seconds"],
        "simulated_round_seconds": _round_seconds(simulated),
        "simulated_eval_seconds": _median_round(simulated, "eval_seconds"),
        "stock": stock,
        "same_accuracy_matrix": warm["accuracy_matrix"] == stock["accuracy_matrix"],
        "empty_clientapp_process_seconds": empty_process_seconds(),
        "torch_clientapp_process_seconds": empty_process_seconds(imports="torch"),
        "config": run,
    }
    report["ratio"] = report["deployed_round_seconds"] / max(report["simulated_round_seconds"], 1e-9)
    stock["ratio"] = stock["round_seconds"] / max(report["simulated_round_seconds"], 1e-9)
    (out_dir / "deploy.json").write_text(json.dumps(report, indent=1))
    print(deploy_table(report))
    return report


#: the breakdown's rows as the table names them (common/node/startup.py's phases)
PHASE_NAMES = {
    "imports": "imports (process start to the ClientApp imported)",
    "flower_receive": "Flower hands the process its message",
    "context": "context (run config, options, node policy; the node's checks, memory plan, learner)",
    "model_build": "model build", "weights": "backbone weights", "data": "data", "query_cache": "query cache",
    "reply": "reply (privatised, its metrics)", "other": "other (none of the above)",
}


def deploy_table(report: dict[str, Any]) -> str:
    """Markdown: deployed (warm and stock) against simulated rounds, and each path's start-up breakdown."""
    stock = report["stock"]
    lines = [
        "| per round (median) | deployed, warm executor | deployed, Flower's stock executor | simulated |",
        "|---|---|---|---|",
        f"| round, training + evaluation (s) | {report['deployed_round_seconds']:.2f} | {stock['round_seconds']:.2f} | "
        f"{report['simulated_round_seconds']:.2f} |",
        f"| of which evaluation (s) | {report['deployed_eval_seconds']:.2f} | {stock['eval_seconds']:.2f} | "
        f"{report['simulated_eval_seconds']:.2f} |",
        f"| rounds evaluated with the next round's training | {report['rounds_evaluated_with_training']} of "
        f"{report['rounds']} | {stock['rounds_evaluated_with_training']} of {report['rounds']} | |",
        f"| ratio deployed / simulated | {report['ratio']:.2f} | {stock['ratio']:.2f} | |",
        f"| accuracy matrix equal to the other path's | {report['same_accuracy_matrix']} | | |",
        "",
        "| a deployed message, phase by phase (median s) | warm | stock |",
        "|---|---|---|",
        f"| start-up total: process start to reply, less training and evaluation (per_message_overhead_seconds) | "
        f"{report['per_message_overhead_seconds']:.2f} | {stock['per_message_overhead_seconds']:.2f} |",
    ]
    lines += [f"| {PHASE_NAMES.get(name, name)} | {value:.2f} | {stock['overhead_breakdown'][name]:.2f} |"
              for name, value in report["overhead_breakdown"].items()]
    lines += [
        f"| training (train-seconds) | {report['client_train_seconds']:.2f} | {stock['client_train_seconds']:.2f} |",
        f"| Flower transport: the round's wait beyond the slowest message's process | "
        f"{report['flower_transport_seconds']:.2f} | {stock['flower_transport_seconds']:.2f} |",
        f"| an evaluate message's whole process | {report['eval_message_seconds']:.2f} | "
        f"{stock['eval_message_seconds']:.2f} |",
        "",
        f"Floor of a fresh process (stock path): an interpreter importing Flower's ClientApp runner "
        f"{report['empty_clientapp_process_seconds']:.2f} s, with `import torch` "
        f"{report['torch_clientapp_process_seconds']:.2f} s; a message's start-up above the first: "
        f"{report['per_message_overhead_seconds'] - report['empty_clientapp_process_seconds']:.2f} s (warm), "
        f"{stock['per_message_overhead_seconds'] - report['empty_clientapp_process_seconds']:.2f} s (stock).",
    ]
    return "\n".join(lines)
