"""Run the ServerApp and ClientApp in Flower's Ray-backed simulation, in this process.

``flwr run .`` works too (it reads the defaults in pyproject.toml); this launcher
exists so ``promptfcl simulate`` can pass a fully resolved configuration, size the
Ray actors for the machine, and return when the run has finished.

Flower hands each simulated node the run config fused from the app directory's
pyproject.toml, so the launcher writes the resolved configuration into a small
app directory of its own and points Flower at it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from common.config import ExperimentConfig

log = logging.getLogger("promptfcl")


def resources(cfg: ExperimentConfig, cpus: int | None = None) -> tuple[int, int, int]:
    """(supernodes, ray CPUs, CPUs per client actor) for this machine.

    The population is virtual (clients are ids the server assigns), so only as many
    Flower nodes as clients sampled per round are needed; per-round cost does not
    grow with the population.
    """
    total = cpus or os.cpu_count() or 1
    sampled = 1 if cfg.centralised else (cfg.clients_per_round or max(1, round(cfg.client_fraction * cfg.num_clients)))
    parallel = max(1, min(total, sampled))
    if cfg.population == "nodes":  # every node is one client (partition-id of num-partitions = num-clients)
        return cfg.num_clients, total, max(1, total // parallel)
    return sampled, total, max(1, total // parallel)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_app_dir(cfg: ExperimentConfig, root: Path) -> Path:
    """A minimal Flower app directory whose pyproject carries ``cfg`` as its run config."""
    lines = [
        "[project]", 'name = "promptfcl-run"', 'version = "0.0.0"', "",
        "[tool.flwr.app]", 'publisher = "promptfcl"', "",
        "[tool.flwr.app.components]", 'serverapp = "server.app:app"', 'clientapp = "client.app:app"', "",
        "[tool.flwr.app.config]",
    ]
    lines += [f'"{key}" = {_toml_value(value)}' for key, value in cfg.to_dict().items()]
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return root


def run_simulation(cfg: ExperimentConfig, supernodes: int | None = None, cpus_per_client: int | None = None,
                   verbose: bool = False) -> None:
    """Run ``cfg`` to the end in Flower's Ray simulation (blocking)."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from flwr.app import Context, RecordDict
    from flwr.supercore.telemetry import EventType
    from flwr.simulation.run_simulation import _run_simulation

    from client.app import app as client_app
    from server.app import app as server_app

    nodes, ray_cpus, per_client = resources(cfg)
    nodes = supernodes or nodes
    per_client = cpus_per_client or per_client
    backend_config = {
        "client_resources": {"num_cpus": per_client, "num_gpus": 0.0},
        "init_args": {"num_cpus": ray_cpus, "include_dashboard": False},
    }
    log.info("Flower simulation (Ray): %d supernodes, %d CPU(s) per client actor, %d CPUs",
             nodes, per_client, ray_cpus)
    with tempfile.TemporaryDirectory(prefix="promptfcl-app-") as tmp:
        app_dir = write_app_dir(cfg, Path(tmp))
        context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=cfg.to_dict())
        _run_simulation(
            num_supernodes=nodes,
            client_app=client_app,
            server_app=server_app,
            backend_name="ray",
            backend_config=backend_config,
            server_app_context=context,
            app_dir=str(app_dir),
            is_app=True,  # makes Flower fuse each node's run config from app_dir/pyproject.toml
            verbose_logging=verbose,
            exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
        )
