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

from promptfcl.server.bench.common import run_simulation_subprocess

log = logging.getLogger("promptfcl")


# ----------------------------------------------------------------------------- deployment
def empty_process_seconds(repeats: int = 3, imports: str = "") -> float:
    """Median wall time of a fresh interpreter that imports what Flower's ``flwr-clientapp``
    process imports (its runner and ``ClientApp``) and nothing of this project: the floor under
    any deployed message's start-up on this machine. ``imports``: more to import (``"torch"``:
    the floor of any ClientApp that trains with torch)."""
    times = []
    code = ("from flwr.supernode.cli import flwr_clientapp; from flwr.clientapp import ClientApp; ClientApp()"
            + (f"; import {imports}" if imports else ""))
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - started)
    return float(statistics.median(times))


def _median_round(results: dict[str, Any], key: str) -> float:
    return float(statistics.median(r[key] for r in results["rounds"]))


def deploy_overhead(out_dir: Path, base: dict[str, Any], nodes: int = 3) -> dict[str, Any]:
    """A loopback deployment (deploy/ scripts: TLS SuperLink, ``nodes`` SuperNodes with their own
    image folders, federated evaluation) and the same configuration simulated; per-round time of
    each, and where a deployed message's fresh process spends its time before training.

    Writes ``deploy.json`` into ``out_dir`` and prints a table.
    """
    from promptfcl.common.startup import PHASES
    from promptfcl.server.loopback import run_deployed

    out_dir.mkdir(parents=True, exist_ok=True)
    same = {**base, "num-clients": nodes, "clients-per-round": nodes, "threads": 1}
    work = out_dir / "deployment"
    if work.exists():
        shutil.rmtree(work)
    deployed = run_deployed(work, {**same, "population": "nodes", "evaluation": "federated", "num-classes": 10,
                                   "class-names": ",".join(str(d) for d in range(10)),
                                   "out-dir": "runs/bench-deploy"}, nodes)
    simulated = run_simulation_subprocess({**same, "out-dir": str(out_dir / "simulation")}, out_dir / "simulation")

    def round_seconds(results: dict[str, Any]) -> float:  # training and evaluation, median over rounds
        return float(statistics.median(r["round_seconds"] + r["eval_seconds"] for r in results["rounds"]))

    overhead = _median_round(deployed, "client_overhead_seconds")
    phases = {p: float(statistics.median(r["client_startup"].get(p, 0.0) for r in deployed["rounds"])) for p in PHASES}
    report = {
        "nodes": nodes,
        "rounds": len(deployed["rounds"]),
        "deployed_round_seconds": round_seconds(deployed),
        "simulated_round_seconds": round_seconds(simulated),
        "deployed_eval_seconds": _median_round(deployed, "eval_seconds"),
        "simulated_eval_seconds": _median_round(simulated, "eval_seconds"),
        "per_message_overhead_seconds": overhead,
        # evaluate messages (to nodes not carrying the counts with training): process start to reply
        "eval_message_seconds": float(statistics.median(
            [r["eval_process_seconds"] for r in deployed["rounds"] if r.get("eval_process_seconds")] or [0.0])),
        # rounds whose evaluation came with the next round's train replies (evaluate-with-train)
        "rounds_evaluated_with_training": sum(1 for r in deployed["rounds"] if r.get("eval_carried")),
        "overhead_breakdown": {**phases, "other": max(0.0, overhead - sum(phases.values()))},
        "empty_clientapp_process_seconds": empty_process_seconds(),
        "torch_clientapp_process_seconds": empty_process_seconds(imports="torch"),
        "client_train_seconds": _median_round(deployed, "client_seconds"),
        "config": deployed["config"],
    }
    report["ratio"] = report["deployed_round_seconds"] / max(report["simulated_round_seconds"], 1e-9)
    (out_dir / "deploy.json").write_text(json.dumps(report, indent=1))
    print(deploy_table(report))
    return report


def deploy_table(report: dict[str, Any]) -> str:
    """Markdown: deployed against simulated rounds, and the start-up breakdown of one message."""
    lines = [
        "| per round (median) | deployed | simulated |",
        "|---|---|---|",
        f"| round, training + evaluation (s) | {report['deployed_round_seconds']:.2f} | "
        f"{report['simulated_round_seconds']:.2f} |",
        f"| of which evaluation (s) | {report['deployed_eval_seconds']:.2f} | {report['simulated_eval_seconds']:.2f} |",
        f"| rounds evaluated with the next round's training | {report['rounds_evaluated_with_training']} of "
        f"{report['rounds']} | |",
        f"| ratio deployed / simulated | {report['ratio']:.2f} | |",
        "",
        "| a deployed message's fresh process, before training | seconds |",
        "|---|---|",
        f"| total (per_message_overhead_seconds, median) | {report['per_message_overhead_seconds']:.2f} |",
    ]
    lines += [f"| {name} | {value:.2f} |" for name, value in report["overhead_breakdown"].items()]
    lines += [
        f"| an evaluate message's whole process (median) | {report['eval_message_seconds']:.2f} |",
        f"| floor: a fresh interpreter importing Flower's ClientApp runner | "
        f"{report['empty_clientapp_process_seconds']:.2f} |",
        f"| floor with torch: the same + `import torch` | {report['torch_clientapp_process_seconds']:.2f} |",
        f"| (training itself, for scale) | {report['client_train_seconds']:.2f} |",
    ]
    return "\n".join(lines)
