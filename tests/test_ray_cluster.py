"""Simulation on a running Ray cluster: GPU shares reach the client actors, actors land on worker nodes.

A real two-node Ray cluster on loopback, started with Ray's own CLI as a user would
(``ray start --head``, then ``ray start --address`` for the worker): the head offers no CPUs,
so every client actor must run on the worker, which declares one GPU (Ray hands a GPU share
to an actor by setting its CUDA_VISIBLE_DEVICES, whether or not the GPU physically exists,
so GPU placement is testable on this CPU machine). ``promptfcl simulate`` joins the cluster
with ``ray-address``. The processes live in a temp dir of their own (so no other Ray on the
machine finds or joins them) and are stopped by PID, never with ``ray stop``.

Marked ``ray_cluster`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import simulate

pytestmark = [pytest.mark.ray_cluster, pytest.mark.simulation]

RAY = Path(sys.executable).parent / "ray"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_nodes(address: str) -> list[dict]:
    """The alive nodes of the cluster at ``address`` (id and resources), asked by a separate driver."""
    code = (f"import json, ray; ray.init(address={address!r}, logging_level='ERROR'); "
            "print(json.dumps([{'id': n['NodeID'], 'resources': n['Resources']} for n in ray.nodes() if n['Alive']]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPUs and a worker with 2 CPUs and one declared GPU; yields (address, worker node id)."""
    temp = Path(tempfile.mkdtemp(prefix="rayt-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    procs: list[subprocess.Popen] = []

    def start(args: list[str], log: str) -> None:
        with open(temp / log, "wb") as fh:
            procs.append(subprocess.Popen([str(RAY), "start", "--block", *args], stdout=fh, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True))

    try:
        start(["--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=0", "--num-gpus=0",
               f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats"], "head.log")
        _wait_for_port(port, procs[0], temp / "head.log")
        start([f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=1"], "worker.log")
        deadline = time.time() + 120
        while True:
            nodes = ray_nodes(address)
            workers = [n for n in nodes if n["resources"].get("CPU", 0) > 0]
            if workers:
                break
            assert time.time() < deadline, f"the worker did not join: {nodes}\n{(temp / 'worker.log').read_text()[-2000:]}"
            time.sleep(2)
        assert len(nodes) == 2 and workers[0]["resources"].get("GPU") == 1.0, nodes
        yield address, workers[0]["id"]
    finally:
        for proc in reversed(procs):  # `ray start --block` stops the processes it started when signalled
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue


def _wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"ray start exited:\n{log.read_text()[-2000:]}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"the Ray head did not open port {port}:\n{log.read_text()[-2000:]}")


def test_gpu_shares_reach_the_client_actors_on_the_worker(cluster, fedavg_run, tmp_path):
    address, worker = cluster
    single_node, _ = fedavg_run  # the same configuration on a local single-node Ray
    results = simulate(tmp_path / "gpu", lr=0.01, **{"ray-address": address, "client-gpus": "auto"})
    placements = [p for r in results["rounds"] for p in r["placement"]]
    assert len(placements) == sum(r["clients_sampled"] for r in results["rounds"]) == 4 * 3
    # auto: the worker's one GPU shared by the two actors its 2 CPUs fit (0.5 each)
    assert {p["cuda_visible_devices"] for p in placements} == {"0"}
    assert {p["node"] for p in placements} == {worker}, "client actors must run on the worker (the head has no CPUs)"
    assert {p["device"] for p in placements} == {"cpu"}  # a declared GPU that does not exist: torch sees none
    assert sorted(p["client"] for p in results["rounds"][0]["placement"]) == [0, 1, 2]
    assert results["accuracy_matrix"] == single_node["accuracy_matrix"]


def test_no_gpu_share_hides_the_gpu_and_results_match(cluster, fedavg_run, tmp_path):
    address, worker = cluster
    single_node, _ = fedavg_run
    results = simulate(tmp_path / "cpu", lr=0.01, **{"ray-address": address, "client-gpus": 0})
    placements = [p for r in results["rounds"] for p in r["placement"]]
    assert {p["cuda_visible_devices"] for p in placements} == {""}
    assert {p["node"] for p in placements} == {worker}
    assert results["accuracy_matrix"] == single_node["accuracy_matrix"]


def test_gpu_share_on_a_cluster_without_gpus_is_refused_before_training(tmp_path):
    """A local Ray on this GPU-less machine: asking for a GPU share stops with a clear error."""
    args = [sys.executable, "-m", "promptfcl.server.cli", "simulate", "--out", str(tmp_path), "--set", "weights=\"random\"",
            "--set", "client-gpus=0.5"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "client-gpus = 0.5" in proc.stderr and "no GPU" in proc.stderr
    assert not (tmp_path / "results.json").exists()
