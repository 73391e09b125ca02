"""A grid's runs as Ray tasks on a running Ray cluster (``--ray-address``): Ray's scheduler places
them, Ray retries one whose worker was lost, and each task sends its run's files back to the
grid's folder. Every run computes in a temporary folder of the node it lands on (its own local
Ray, sized to the task's CPUs), so nodes need the same install and data paths, not a shared disk.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

from .. import checkpoint
from ..report import write_json_atomic
from ..simulation import connect_ray
from .common import kill_marked
from .grid_parts import GridRun, Outcome, Placement, attempt, raise_on_sigterm, slot_settings

log = logging.getLogger("promptfcl")

#: the run's files a task sends back (the checkpoint only where the run did not finish)
RETURNED = ("results.json", "simulate.log", checkpoint.FILENAME)
#: seconds a cancelled task gets to stop its run (SIGINT to the simulation, Ray's shutdown) before
#: Ray kills its worker
CANCEL_GRACE = 60.0


#: the environment variable that marks every process of a cluster grid's runs (with the grid's token)
GRID_MARK = "PROMPTFCL_BENCH_GRID"


def run_remote(run: GridRun, settings: dict[str, Any], saved: bytes | None, grid: str) -> dict[str, Any]:
    """The body of one run's Ray task, on whichever node Ray chose: the run in a temporary folder
    (resumed from ``saved``, a checkpoint, if given), sized to the CPUs Ray gave the task, its
    processes marked with the ``grid`` token (:func:`reap`); returns its outcome and files."""
    import ray

    cores = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    # the run starts a Ray of its own on this node: nothing of this worker's Ray may leak into it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env[GRID_MARK] = grid
    with tempfile.TemporaryDirectory(prefix=f"promptfcl-grid-{grid}-") as tmp:
        out = Path(tmp) / run.run_dir.name
        out.mkdir()
        if saved is not None:
            (out / checkpoint.FILENAME).write_bytes(saved)
        results, error = attempt(run, slot_settings(settings, cores, os.cpu_count() or cores), env, out)
        files = {name: (out / name).read_bytes() for name in RETURNED if (out / name).is_file()}
    return {"results": results, "error": error, "files": files, "node": ray.get_runtime_context().get_node_id()}


def run_on_cluster(runs: Sequence[GridRun], todo: list[int],
                   placement: Placement) -> Generator[tuple[int, Outcome], None, None]:
    """Submit the runs ``todo`` as Ray tasks to the cluster at ``placement.ray_address``; yield each
    outcome as its task ends, its files already in its run_dir. ``placement.parallel`` > 1 divides
    the cluster's CPUs (and GPUs) between that many runs; otherwise each run gets one CPU."""
    import ray

    if not todo:
        return
    nodes = connect_ray(placement.ray_address)
    raise_on_sigterm()
    try:
        cluster_cpus, cluster_gpus = sum(n.cpus for n in nodes), sum(n.gpus for n in nodes)
        largest = max((n.cpus for n in nodes), default=0.0)
        at_once = placement.parallel if placement.parallel > 1 else max(1, int(cluster_cpus))
        cpus = float(max(1, min(int(cluster_cpus) // at_once, int(largest))))
        gpus = min(1.0, math.floor(cluster_gpus / at_once * 1e4) / 1e4) if cluster_gpus else 0.0
        log.info("grid on the Ray cluster at %s (%g CPUs, %g GPUs): %d runs as Ray tasks of %g CPU(s) and "
                 "%g GPU(s)", placement.ray_address, cluster_cpus, cluster_gpus, len(todo), cpus, gpus)
        task = ray.remote(run_remote).options(num_cpus=cpus, num_gpus=gpus, max_retries=2)
        grid, refs = uuid.uuid4().hex[:16], {}
        for i in todo:
            saved = runs[i].run_dir / checkpoint.FILENAME
            refs[task.remote(runs[i], runs[i].settings, saved.read_bytes() if saved.is_file() else None, grid)] = i
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
                for ref in done:
                    yield refs[ref], _collect(runs[refs[ref]], ref)
        finally:
            if pending:
                _cancel(pending, grid)
    finally:
        ray.shutdown()


def _collect(run: GridRun, ref: Any) -> Outcome:
    """A finished task's outcome, its files written into the run's folder."""
    import ray

    try:
        reply = ray.get(ref)
    except ray.exceptions.RayError as exc:  # the task itself failed (its worker lost more often than retried)
        log.error("%s FAILED on the cluster: %s", run.name, exc)
        return None, f"{type(exc).__name__}: {str(exc)[-300:]}"
    run.run_dir.mkdir(parents=True, exist_ok=True)
    if reply["results"] is not None:  # a finished run's checkpoint is no longer current
        (run.run_dir / checkpoint.FILENAME).unlink(missing_ok=True)
    for name, data in reply["files"].items():
        if name == "results.json":  # where the run's files are, as if it had run here
            results = json.loads(data)
            results["config"]["out-dir"] = str(run.run_dir)
            reply["results"] = results
            write_json_atomic(run.run_dir / name, results)
        else:
            (run.run_dir / name).write_bytes(data)
    log.info("%s: ran on node %s, files in %s", run.name, reply["node"][:12], run.run_dir)
    return reply["results"], reply["error"]


def _cancel(pending: list[Any], grid: str) -> None:
    """Stop the tasks still going: a cancel (the task's run stops its simulation and its Ray), then,
    on every node, a task that ends whatever process of this grid is left (a cancelled task's
    worker may be killed before its run has finished stopping) and removes its temporary folders."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    log.info("stopping %d run(s) on the cluster", len(pending))
    for ref in pending:
        ray.cancel(ref)
    ray.wait(pending, num_returns=len(pending), timeout=CANCEL_GRACE)
    reaper = ray.remote(reap)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    reaped = ray.get([reaper.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                      .remote(grid) for node in nodes], timeout=CANCEL_GRACE)
    log.info("stopped; %d leftover process(es) of the grid ended on %d node(s)", sum(reaped), len(nodes))


def reap(grid: str) -> int:
    """On this node: give a cancelled run's processes (marked with ``grid``) a few seconds to end,
    kill those left, remove the grid's temporary folders; returns how many were killed."""
    killed = kill_marked(grid, GRID_MARK, wait=10.0)
    for folder in Path(tempfile.gettempdir()).glob(f"promptfcl-grid-{grid}-*"):
        shutil.rmtree(folder, ignore_errors=True)
    return killed
