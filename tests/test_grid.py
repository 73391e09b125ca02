"""A benchmark's grid run one after another, two at once, and on a Ray cluster: the same results per
run; a re-run skips what is done; SIGTERM to the grid leaves no process behind.

Real ``promptfcl bench compare`` commands (each run a real Ray simulation) on a 2-run grid: 2 methods,
one seed, at the tests' tiny settings (a run is mostly its Ray's start-up: each run more costs a minute
per grid; more runs than slots, and seeds, are test_robustness_runs_its_grid_through_the_runner_in_any_order's).
Marked ``simulation`` (about 10 minutes on 2 cores shared with other work); the cluster test also
``ray_cluster``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from promptfcl.server.bench.grid_parts import gpu_slots, slot_settings
from tests.conftest import TINY
from tests.test_ray_cluster import cluster  # noqa: F401  (the two-node loopback Ray cluster, reused)

pytestmark = pytest.mark.simulation

METHODS, SEEDS = ("fedavg", "hgp"), (0,)
RUNS = [f"{m}-default-seed{s}" for m in METHODS for s in SEEDS]


def grid_command(out: Path, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "promptfcl.server.cli", "bench", "compare", "--out", str(out),
            "--methods", ",".join(METHODS), "--seeds", ",".join(map(str, SEEDS)), "--settings", "default",
            "--no-upper-bound", *extra]
    for key, value in TINY.items():
        args += ["--set", f"{key}={json.dumps(value) if isinstance(value, str) else value}"]
    return args


def run_grid(out: Path, *extra: str, timeout: int = 1500) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(grid_command(out, *extra), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def results(out: Path) -> dict[str, dict]:
    return {name: json.loads((out / "runs" / name / "results.json").read_text()) for name in RUNS}


@pytest.fixture(scope="module")
def sequential_grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequential")
    run_grid(out)
    return out


@pytest.fixture(scope="module")
def parallel_grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    return out, run_grid(out, "--parallel", "2")


def assert_same_results(a: dict[str, dict], b: dict[str, dict]) -> None:
    for name in RUNS:
        assert a[name]["final_average_accuracy"] == b[name]["final_average_accuracy"], name
        assert a[name]["accuracy_matrix"] == b[name]["accuracy_matrix"], name
        # what the server sent (the model); the replies' byte counts carry a little metadata of where
        # the clients ran, so C2S differs by some bytes between placements
        assert a[name]["communication"]["bytes_s2c_total"] == b[name]["communication"]["bytes_s2c_total"], name


def test_two_runs_at_once_give_each_run_its_sequential_results(sequential_grid, parallel_grid):
    parallel, proc = parallel_grid
    seq, par = results(sequential_grid), results(parallel)
    assert_same_results(seq, par)
    # the runs were given half the machine each: one client actor at a time, one torch thread
    cores = len(os.sched_getaffinity(0))
    if cores == 2:
        assert {r["config"]["client-cpus"] for r in par.values()} == {str(float(os.cpu_count() or 2))}
    # the table is built from the runs' files: the same whatever order the runs finished in
    table = lambda out: [l for l in (out / "compare.md").read_text().splitlines() if l.startswith("| default")]  # noqa: E731
    assert [l.split("|")[1:6] for l in table(sequential_grid)] == [l.split("|")[1:6] for l in table(parallel)]
    assert f"grid: {len(RUNS)}/{len(RUNS)} runs done" in proc.stderr and "ETA" in proc.stderr


def test_a_rerun_skips_finished_runs_and_reruns_a_missing_one(parallel_grid, tmp_path):
    parallel, _ = parallel_grid
    out = tmp_path / "grid"
    for name in RUNS[:-1]:  # every run done but the last, which never started
        (out / "runs" / name).mkdir(parents=True)
        (out / "runs" / name / "results.json").write_bytes((parallel / "runs" / name / "results.json").read_bytes())
    stamps = {name: (out / "runs" / name / "results.json").stat().st_mtime_ns for name in RUNS[:-1]}
    proc = run_grid(out, "--parallel", "2")
    assert proc.stderr.count("reusing") == len(RUNS) - 1 \
        and f"{RUNS[-1].replace('-default-seed', ', default, seed ')}: starting" \
        in proc.stderr
    assert {n: (out / "runs" / n / "results.json").stat().st_mtime_ns for n in RUNS[:-1]} == stamps
    assert_same_results(results(out), results(parallel))
    table = (out / "compare.md").read_text()  # the reused runs' rows and the new run's
    assert all(f"| default | {m} | {len(SEEDS)} |" in table for m in METHODS), table


def marked(needle: str) -> list[tuple[int, str]]:
    """Live processes whose environment holds ``needle`` (a variable and value, or its start)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(v.startswith(needle.encode())
                                            for v in (entry / "environ").read_bytes().split(b"\0")):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()))
        except (OSError, IndexError):
            continue
    return found


def interrupt_when_running(args: list[str], env: dict[str, str], needle: str, log_path: Path) -> int:
    """Start a grid, SIGTERM it (it alone, as `kill PID` does) once two runs and their Rays are up
    (processes with ``needle`` in their environment); its exit status."""
    with open(log_path, "w") as log:
        grid = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:  # both runs started and their Rays up (a raylet each)
            procs = marked(needle)
            if sum("simulate" in c for _, c in procs) >= 2 and sum("raylet" in c for _, c in procs) >= 2:
                break
            assert grid.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(1)
        grid.send_signal(signal.SIGTERM)
        return grid.wait(timeout=240)
    finally:
        if grid.poll() is None:
            os.killpg(grid.pid, signal.SIGKILL)


def assert_none_left(needle: str) -> None:
    left = marked(needle)
    for pid, _ in left:  # leave the machine clean even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert left == [], left


def test_sigterm_to_the_grid_stops_every_run_and_its_ray(tmp_path):
    needle = f"GRID_TEST_MARK={uuid.uuid4().hex}"  # every descendant of the grid inherits it
    env = {**os.environ, "GRID_TEST_MARK": needle.split("=")[1]}
    status = interrupt_when_running(grid_command(tmp_path / "grid", "--parallel", "2"), env, needle,
                                    tmp_path / "grid.log")
    assert_none_left(needle)
    assert status == 128 + signal.SIGTERM
    text = (tmp_path / "grid.log").read_text()
    assert f"grid interrupted: 0 of {len(RUNS)} runs done" in text and "not done: fedavg, default, seed 0; " in text
    assert "FAILED" not in text  # stopped runs are not failures


@pytest.mark.ray_cluster
def test_sigterm_to_a_grid_on_a_ray_cluster_stops_its_tasks_runs(cluster, tmp_path):  # noqa: F811
    """The runs live under the cluster's workers, not under the grid: their processes carry the
    grid's mark (server/bench/grid_ray.py), and none may outlive the interrupted grid."""
    address, _ = cluster
    needle = "PROMPTFCL_BENCH_GRID="
    assert marked(needle) == []  # no other cluster grid runs on this machine
    status = interrupt_when_running(grid_command(tmp_path / "grid", "--ray-address", address), dict(os.environ),
                                    needle, tmp_path / "grid.log")
    assert_none_left(needle)
    assert status == 128 + signal.SIGTERM, (tmp_path / "grid.log").read_text()[-3000:]
    assert f"grid interrupted: 0 of {len(RUNS)} runs done" in (tmp_path / "grid.log").read_text()
    assert not list(Path(tempfile.gettempdir()).glob("promptfcl-grid-*"))  # the runs' folders on the node


@pytest.mark.ray_cluster
def test_the_grid_on_a_ray_cluster_gives_the_same_results(cluster, parallel_grid, tmp_path):  # noqa: F811
    """The runs as Ray tasks on the loopback cluster: the results of the grid run here (parallel_grid's
    are the sequential grid's, test above)."""
    address, worker = cluster
    proc = run_grid(tmp_path / "grid", "--ray-address", address)
    on_cluster = results(tmp_path / "grid")
    assert_same_results(on_cluster, results(parallel_grid[0]))
    assert proc.stderr.count(f"ran on node {worker[:12]}") == len(RUNS)  # the head has no CPUs: every task on the worker
    assert {r["config"]["out-dir"] for r in on_cluster.values()} == {str(tmp_path / "grid" / "runs" / n) for n in RUNS}
    assert all((tmp_path / "grid" / "runs" / n / "simulate.log").is_file() for n in RUNS)


def test_a_slot_gets_its_share_and_keeps_what_the_user_chose():
    base = {**TINY, "threads": 0, "num-clients": 4, "clients-per-round": 4}
    assert slot_settings(base, cores=1, ray_cpus=8)["client-cpus"] == "8.0"  # one actor at a time
    half = slot_settings(base, cores=4, ray_cpus=8)
    assert half["client-cpus"] == "2.0" and half["threads"] == 1  # four actors of one thread
    few = slot_settings({**base, "clients-per-round": 2}, cores=4, ray_cpus=8)
    assert few["client-cpus"] == "4.0" and few["threads"] == 2  # two actors, two threads each
    chosen = slot_settings({**base, "client-cpus": "1", "threads": 3}, cores=1, ray_cpus=8)
    assert chosen["client-cpus"] == "1" and chosen["threads"] == 3


def test_gpus_are_split_between_slots(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert gpu_slots(2) == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert gpu_slots(2) == ["5", "5"]  # fewer GPUs than runs: shared
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_slots(2) == [None, None]


def test_robustness_runs_its_grid_through_the_runner_in_any_order(tmp_path, monkeypatch):
    """Runs finishing out of order (two at once, the first slowest) and one failing: the table is in
    grid order, the failure named, the rest kept."""
    import threading

    from promptfcl.server import bench

    order, lock = [], threading.Lock()

    def fake_run(settings, out, strategy="fedavg", env=None, **_):
        if settings["seed"] == 0 and strategy == "fedavg":
            time.sleep(1.5)  # finishes after the runs started later
        with lock:
            order.append((strategy, settings["seed"]))
        if strategy == "hgp" and settings["seed"] == 1:
            raise RuntimeError("simulation failed (hgp): boom")
        return {"final_average_accuracy": 40.0 + settings["seed"], "average_forgetting": 1.0,
                "rounds": [{"rejected": [], "clients_aggregated": 2}]}

    monkeypatch.setattr("promptfcl.server.bench.grid_parts.run_simulation_subprocess", fake_run)
    rows = bench.robustness(tmp_path, dict(TINY), ["fedavg", "hgp"], [], ["off"], [0, 1],
                            placement=bench.Placement(parallel=2))
    assert order[0] != ("fedavg", 0)  # the first run finished after others
    assert [(r["method"], r["seed"], r["A_N"]) for r in rows] == [("fedavg", 0, 40.0), ("fedavg", 1, 41.0),
                                                                   ("hgp", 0, 40.0)]
    assert "failed, left out: hgp, attack clean, defence off, seed 1" in (tmp_path / "robustness.md").read_text()
