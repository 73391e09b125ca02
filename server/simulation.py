"""Run the ServerApp and ClientApp in Flower's Ray-backed simulation, in this process.

``flwr run .`` works too (it reads the defaults in pyproject.toml); this launcher
exists so ``promptfcl simulate`` can pass a fully resolved configuration, size the
Ray actors for the machine or cluster, and return when the run has finished.

Where the client actors run (run-config keys, none of which changes results):

* ``ray-address``: "" starts a local Ray for this run only (``address="local"``, so a
  cluster someone started on this machine with ``ray start`` is never joined by
  accident); "auto" or "HOST:PORT" joins that running cluster, and Ray's scheduler
  spreads the actors over its nodes.
* ``client-cpus`` / ``client-gpus``: Ray resources of one client actor. Ray hides the GPUs
  from an actor that asked for none (``CUDA_VISIBLE_DEVICES=""``), so on a GPU machine
  ``client-gpus`` decides whether clients train on the GPU; "auto" divides the GPUs Ray
  sees among the clients that train at once.

Flower hands each simulated node the run config fused from the app directory's
pyproject.toml, so the launcher writes the resolved configuration into a small
app directory of its own and points Flower at it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict

from ..client.app import app as client_app
from ..common.config.experiment import ConfigError, ExperimentConfig, FederationSection, PlacementSection
from ..common.config.files import toml_value
from ..common.flower_internals import internal
from .app import app as server_app

log = logging.getLogger("promptfcl")


@dataclass(frozen=True)
class RayNode:
    """Resources of one Ray node that can host client actors."""

    node_id: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class SimulationPlan:
    """How many Flower nodes run, and the Ray resources of each client actor."""

    supernodes: int
    client_cpus: float
    client_gpus: float
    nodes: tuple[RayNode, ...]  # the Ray cluster's nodes (one for a local Ray)
    address: str  # "" for a local Ray

    @property
    def cluster_cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)

    @property
    def cluster_gpus(self) -> float:
        return sum(n.gpus for n in self.nodes)

    @property
    def parallel_clients(self) -> int:
        """Client actors that fit on the cluster at once (Flower sizes its actor pool the same way)."""
        fit = 0
        for node in self.nodes:
            n = _fits(node.cpus, self.client_cpus)
            if self.client_gpus > 0:
                n = min(n, _fits(node.gpus, self.client_gpus))
            fit += n
        return min(fit, self.supernodes)

    def backend_config(self) -> dict[str, Any]:
        """Flower's Ray backend config (Ray itself is initialised by :func:`connect_ray`)."""
        return {"client_resources": {"num_cpus": self.client_cpus, "num_gpus": self.client_gpus}}

    def describe(self) -> str:
        where = f"Ray cluster at {self.address}" if self.address else "local Ray"
        return (f"{where}: {len(self.nodes)} node(s), {self.cluster_cpus:g} CPUs, {self.cluster_gpus:g} GPUs; "
                f"{self.supernodes} supernodes, each client actor {self.client_cpus:g} CPU(s) and "
                f"{self.client_gpus:g} GPU(s), {self.parallel_clients} training at once")


def _fits(available: float, each: float) -> int:
    """How many shares of ``each`` fit in ``available`` (Ray counts resources in 1e-4 units)."""
    return int(available / each + 1e-6)


def plan_simulation(federation: FederationSection, placement: PlacementSection, nodes: list[RayNode],
                    supernodes: int | None = None, address: str = "") -> SimulationPlan:
    """Size the client actors of a run (its ``federation`` and ``placement``) for ``nodes`` (the Ray
    cluster's schedulable resources).

    The population is virtual (clients are ids the server assigns), so only as many
    Flower nodes as clients sampled per round are needed and per-round cost does not grow
    with the population; with ``population = "nodes"`` every simulated node is one client.

    Raises
    ------
    ConfigError
        GPUs asked for where Ray sees none, ``device = "cuda"`` without a GPU share, or a
        client actor that fits on no node.
    """
    sampled = federation.sampled_per_round
    count = supernodes or (federation.num_clients if federation.population == "nodes" else sampled)
    total_cpus = sum(n.cpus for n in nodes)
    total_gpus = sum(n.gpus for n in nodes)
    largest = max((n.cpus for n in nodes), default=0.0)
    cpus = placement.client_cpus_value
    if cpus is None:  # the cores shared by the clients that train at once, whole cores, one node's worth at most
        parallel = max(1, min(int(total_cpus), sampled))
        cpus = float(max(1, min(int(total_cpus) // parallel, int(largest))))
    gpus = placement.client_gpus_value
    if gpus is None:
        if total_gpus == 0:
            gpus = 0.0
        else:  # every actor that can run at once gets an equal share, never more than one GPU
            fit = sum(_fits(n.cpus, cpus) for n in nodes)
            parallel = max(1, min(fit, sampled))
            gpus = min(1.0, math.floor(total_gpus / parallel * 1e4) / 1e4)
    plan = SimulationPlan(count, cpus, gpus, tuple(nodes), address)
    where = f"the Ray cluster at {address}" if address else "this machine's Ray"
    if gpus > 0 and total_gpus == 0:
        raise ConfigError(f"client-gpus = {placement.client_gpus} but {where} has no GPU "
                          f"({total_cpus:g} CPUs, 0 GPUs); set client-gpus = 0 or add GPU nodes")
    if placement.device == "cuda" and gpus == 0:
        raise ConfigError("device = cuda, but the client actors get no GPU (client-gpus = 0 or no GPU found): "
                          "Ray hides GPUs from actors that ask for none")
    if plan.parallel_clients == 0:
        raise ConfigError(f"no node of {where} can host a client actor of {cpus:g} CPU(s) and {gpus:g} GPU(s) "
                          f"(nodes: {[(n.cpus, n.gpus) for n in nodes]}); lower client-cpus / client-gpus")
    if total_gpus > 0 and gpus == 0:
        log.warning("Ray sees %g GPU(s) but client-gpus = 0: the clients train on the CPU", total_gpus)
    return plan


def write_app_dir(run_config: dict[str, Any], root: Path) -> Path:
    """A minimal Flower app directory whose pyproject carries ``run_config`` (``ExperimentConfig.to_dict``)
    as its run config."""
    lines = [
        "[project]",
        'name = "promptfcl-run"',
        'version = "0.0.0"',
        "",
        "[tool.flwr.app]",
        'publisher = "promptfcl"',
        "",
        "[tool.flwr.app.components]",
        'serverapp = "promptfcl.server.app:app"',
        'clientapp = "promptfcl.client.app:app"',
        "",
        "[tool.flwr.app.config]",
    ]
    lines += [f'"{key}" = {toml_value(value)}' for key, value in run_config.items()]
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return root


def connect_ray(address: str, cpus: int | None = None) -> list[RayNode]:
    """Start a local Ray (``address`` "") or join a running cluster; return its alive nodes.

    Flower's backend then finds Ray initialised and uses it as it is. Workers get this
    process's ``sys.path`` as PYTHONPATH, as Flower's own initialisation does, so actors
    import the same code (on other machines the same install path must exist).
    """

    # Ray is heavy and starts only for a simulation
    import ray

    # Ray's notice that a future version will stop hiding GPUs from actors that ask for none;
    # the ClientApp does not rely on it (client/app.py: no GPU share, no GPU)
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
    pythonpath = os.pathsep.join(p for p in sys.path if p)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    common: dict[str, Any] = {
        "runtime_env": {"env_vars": {"PYTHONPATH": pythonpath}},
        "include_dashboard": False,
        "logging_level": logging.WARNING,
    }
    try:
        if address:
            ray.init(address=address, **common)
        else:  # "local": never attach to a cluster started on this machine by someone else
            ray.init(address="local", num_cpus=cpus or os.cpu_count() or 1, **common)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"cannot {'join the Ray cluster at ' + address if address else 'start a local Ray'}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive", False):
            continue
        res = node.get("Resources", {})
        nodes.append(RayNode(str(node["NodeID"]), float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0))))
    return nodes


def run_simulation(cfg: ExperimentConfig, supernodes: int | None = None, verbose: bool = False) -> None:
    """Run ``cfg`` to the end in Flower's Ray simulation (blocking)."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray is heavy and starts only for a simulation
    import ray

    try:
        plan = plan_simulation(cfg.federation, cfg.placement, connect_ray(cfg.placement.ray_address), supernodes,
                               cfg.placement.ray_address)
        log.info("Flower simulation: %s", plan.describe())
        with tempfile.TemporaryDirectory(prefix="promptfcl-app-") as tmp:
            app_dir = write_app_dir(cfg.to_dict(), Path(tmp))
            context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=cfg.to_dict())
            internal("run_simulation")(
                num_supernodes=plan.supernodes,
                client_app=client_app,
                server_app=server_app,
                backend_name="ray",
                backend_config=plan.backend_config(),
                server_app_context=context,
                app_dir=str(app_dir),
                is_app=True,  # makes Flower fuse each node's run config from app_dir/pyproject.toml
                verbose_logging=verbose,
                exit_event=internal("simulation_exit_event").PYTHON_API_RUN_SIMULATION_LEAVE,
            )
    finally:
        if ray.is_initialized():  # Flower shuts Ray down when it ran; not when we stopped before it
            ray.shutdown()
