"""The loopback deployment the deployed tests share (deploy/README.md): a SuperLink with TLS and
SuperNode authentication, three SuperNodes each with its own image folder and one hostile node
(tests/hostile_app.py), started by the deploy/ scripts exactly as the README says, the nodes
talking through a recording TLS proxy (tests/wiretap.py); and the helpers its tests use.

tests/test_deploy.py runs the fixture's own run and checks it, the wire, the node-facing gate and a
server killed mid-run; tests/test_deploy_methods.py submits the methods' runs to a federation of
its own (a file each: pytest's loadfile gives them to the two workers side by side).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from promptfcl.client.node_data import export_digits
from promptfcl.common.data.tasks import class_order
from promptfcl.server.loopback import (
    ROOT,
    Ports,
    Processes,
    descendants,
    make_credentials,
    register_node,
    script_env,
    start_node,
    start_superlink,
    submit,
    toml_file,
    wait_for_node,
)
from tests.conftest import TINY

NUM_HONEST = 3  # nodes with a share of the digits each
NUM_NODES = NUM_HONEST + 1  # and one hostile node (tests/hostile_app.py): inflated counts, bounded by the server
HOSTILE = NUM_NODES  # node<HOSTILE> is the hostile one

# The tiny two-task run the deployed federation executes (deploy/run.toml's keys, tiny sizes).
RUN = {
    **{k: v for k, v in TINY.items() if k not in ("num-clients", "clients-per-round")},
    "population": "nodes", "evaluation": "federated", "num-classes": 10,
    "class-names": ",".join(str(d) for d in range(10)), "num-clients": NUM_NODES, "clients-per-round": NUM_NODES,
    # one task of two rounds: round 1 is evaluated with round 2's training (evaluate-with-train),
    # round 2 by evaluate messages; several tasks over the wire: test_random_tasks_run_on_deployed_nodes
    "num-tasks": 1, "rounds-per-task": 2, "out-dir": "runs/deployed", "round-timeout": 600.0,
}


# ----------------------------------------------------------------------------- the deployed federation
@dataclass
class Deployment:
    root: Path
    ports: Ports  # the SuperLink's: node-facing (Fleet API only) and control (the operator's)
    tap_port: int
    results: dict
    submit_output: str
    exchanges: list
    started: float
    finished: float
    processes: Processes
    superlink: subprocess.Popen  # the SuperLink now serving ``port`` ...
    superlink_log: Path  # ... and its log
    forged: dict  # finding 1 of issue 54, pushed during the run with the hostile node's key: name -> (status, answer)


def federation(tmp_path_factory: pytest.TempPathFactory, first_run: bool = True) -> Iterator[Deployment]:
    """The deployed federation (a module fixture's body: it yields once, and stops every process it
    started afterwards, even when a test failed). ``first_run``: submit RUN once the nodes are up,
    with a node's forged pushes replayed meanwhile, and hand over its results; else the federation
    alone."""
    import shutil

    from tests.wiretap import WireTap

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the TLS certificates (deploy/make-certs.sh)")

    root = tmp_path_factory.mktemp("deploy")
    env = script_env(FLWR_HOME=str(root / "cli-home"))
    # Each node's data directory: a disjoint share of the digits as PNG folders.
    export_digits(root / "data", NUM_HONEST)
    app = hostile_app_dir(root / "app")
    make_credentials(root, env, [f"node{i}" for i in range(1, NUM_NODES + 1)] + ["stranger"])
    run_toml = toml_file(root / "run.toml", RUN)

    procs = Processes()
    tap = None
    try:
        ports = Ports.free()
        link = start_superlink(root, procs, env, ports)
        for i in range(1, NUM_NODES + 1):
            register_node(root, env, ports.control, f"node{i}")

        # Every node talks to the SuperLink's node-facing address through the recording proxy.
        tap = WireTap(("127.0.0.1", ports.fleet), str(root / "certs/server.pem"), str(root / "certs/server.key"),
                      str(root / "certs/ca.crt"))
        tap_port = tap.start()
        nodes = []
        for i in range(1, NUM_NODES + 1):
            node_env = script_env(PROMPTFCL_CACHE=str(root / f"cache{i}"),
                                  PROMPTFCL_TEST_HOSTILE="1" if i == HOSTILE else "0")
            data = f"data/node{i - 1}" if i != HOSTILE else "data/node0"  # a copy of someone's data
            extra = ["--threads", "1"] + (["--device", "cpu"] if i == 1 else [])  # the others: device auto
            nodes.append(start_node(root, procs, node_env, f"127.0.0.1:{tap_port}", f"node{i}", data, run_toml,
                                    extra, wait=False))
        for i, node in enumerate(nodes, start=1):
            wait_for_node(root, f"node{i}", node)

        forged: dict = {}
        if not first_run:  # the federation alone: its tests submit runs of their own
            yield Deployment(root, ports, tap_port, {}, "", [], time.time(), time.time(), procs, link,
                             root / "superlink.log", forged)
            return
        forger = forge_during_the_run(root, ports.fleet, forged)
        started = time.time()
        submitted = submit(root, env, ports.control, run_toml, app)
        finished = time.time()
        forger.join(timeout=60)
        procs.remember_descendants()
        output = submitted.stdout + submitted.stderr
        superlink_log = (root / "superlink.log").read_text(errors="replace")
        assert submitted.returncode == 0, f"{output[-4000:]}\n--- superlink.log (tail) ---\n{superlink_log[-6000:]}"
        results_path = root / "server" / RUN["out-dir"] / "results.json"
        assert results_path.is_file(), f"no results.json; submit output:\n{output[-4000:]}"
        yield Deployment(root, ports, tap_port, json.loads(results_path.read_text()), output, list(tap.exchanges),
                         started, finished, procs, link, root / "superlink.log", forged)
    finally:
        if tap is not None:
            tap.stop()
        procs.stop_all()



def node_id_of(root: Path, name: str) -> int:
    """The Flower node id a SuperNode started as ``name`` was given (its log says)."""
    import re

    return int(re.search(r"SuperNode ID:? *(\d+)", (root / f"{name}.log").read_text(errors="replace")).group(1))


def post(port: int, cafile: Path, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """One HTTPS POST of ``body`` to 127.0.0.1:``port``; (status, answer)."""
    import http.client
    import ssl

    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ssl.create_default_context(cafile=str(cafile)),
                                       timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/protobuf", **headers})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def forge_during_the_run(root: Path, fleet: int, out: dict) -> threading.Thread:
    """Finding 1 of issue 54, replayed with the hostile node's own key and signed headers while the
    run is running (once its SuperNode has its first train message): a train message "from the
    server" (src = the SuperLink, no reply_to) to node1, and an error message "from the server" to
    the ServerApp (dst = the SuperLink). ``out``: name -> (status, answer), or "error"."""
    import re

    from promptfcl.common.flower_internals import internal
    from tests.test_fleet_gate import push_body

    def forge() -> None:
        log, deadline = root / f"node{HOSTILE}.log", time.time() + 1200
        while "Receiving: train message" not in log.read_text(errors="replace"):
            if time.time() > deadline:
                out["error"] = "the hostile node never received a train message"
                return
            time.sleep(0.2)
        run_id = int(re.search(r"\[RUN (\d+)", log.read_text(errors="replace")).group(1))
        own, victim, superlink = node_id_of(root, f"node{HOSTILE}"), node_id_of(root, "node1"), \
            internal("superlink_node_id")
        messages = {"a train message from the server to node1": push_body(own, superlink, victim, run_id),
                    "an error to the ServerApp": push_body(own, superlink, superlink, run_id,
                                                           error=f"forged by node{HOSTILE}")}
        for name, body in messages.items():
            out[name] = post(fleet, root / "certs" / "ca.crt", "/v1/fleet/push-messages", body,
                             node_headers(root / "keys" / f"node{HOSTILE}"))

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    return thread


def hostile_app_dir(out: Path) -> Path:
    """This app with tests/hostile_app.py as its ClientApp (every node runs it; only the node whose
    environment says so misbehaves). The app's code is the installed ``promptfcl`` on every machine;
    the bundle carries the configuration and the test's own ClientApp."""
    import shutil

    (out / "tests").mkdir(parents=True)
    for name in ("__init__.py", "helpers.py", "hostile_app.py"):
        if (ROOT / "tests" / name).exists():
            shutil.copy(ROOT / "tests" / name, out / "tests" / name)
    text = (ROOT / "pyproject.toml").read_text()
    (out / "pyproject.toml").write_text(text.replace('clientapp = "promptfcl.client.app:app"', 'clientapp = "tests.hostile_app:app"'))
    return out


def seen_test_images(data_root: Path, task: int, seed: int = 0) -> int:
    """Held-out images of the classes seen up to ``task`` across the honest nodes' folders."""
    per_task = 10 // RUN["num-tasks"]
    seen = class_order(10, seed)[: (task + 1) * per_task]  # original digits of remapped classes seen so far
    return sum(len(list((data_root / f"node{i}" / "test" / str(d)).glob("*.png")))
               for i in range(NUM_HONEST) for d in seen)


def hostile_node_id(deployment: Deployment) -> int:
    """The Flower node id of the hostile SuperNode (its log names it)."""
    import re

    text = (deployment.root / f"node{HOSTILE}.log").read_text(errors="replace")
    return int(re.search(r"SuperNode ID:? *(\d+)", text).group(1))

def node_headers(private_key_file: Path) -> dict[str, str]:
    """The node-authentication headers a SuperNode holding ``private_key_file`` sends (a signed
    fresh timestamp), made as flwr's NodeAuthHttpInterceptor makes them."""
    import base64
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = serialization.load_ssh_private_key(private_key_file.read_bytes(), password=None)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    stamp = datetime.datetime.now(datetime.UTC).isoformat()
    return {"flwr-public-key": base64.b64encode(public).decode(), "flwr-timestamp": stamp,
            "flwr-signature": base64.b64encode(key.sign(stamp.encode(), ec.ECDSA(hashes.SHA256()))).decode()}

def kill_hard(proc: subprocess.Popen) -> list[str]:
    """SIGKILL ``proc``, its process group and every descendant at once, as a dying machine would;
    return their command lines. Descendants are listed first: once their parent dies, nothing
    links them to it (SuperExec and ServerApp run in sessions of their own)."""
    pids = [proc.pid, *descendants(proc.pid)]
    commands = []
    for pid in pids:
        try:
            commands.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    return commands


def train_messages_received(root: Path) -> list[int]:
    """Per node, the training messages its SuperNode has pulled so far (its log)."""
    return [(root / f"node{i}.log").read_text(errors="replace").count("Receiving: train message")
            for i in range(1, NUM_NODES + 1)]


def upload(port: int, cafile: Path, path: str, size: int, headers: dict[str, str], chunked: bool = False,
           body: bytes | None = None) -> int:
    """POST ``size`` bytes (zeros, or ``body``) to ``path`` on 127.0.0.1:``port`` (TLS) in 1 MiB
    chunks until the server stops reading; the status it answered (0: none readable, the
    connection was cut)."""
    import socket
    import ssl

    zeros = b"\0" * (1 << 20)
    total = size if body is None else len(body)
    context = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(("127.0.0.1", port), timeout=60) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
        length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
        head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/protobuf", length,
                *(f"{k}: {v}" for k, v in headers.items())]
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            for start in range(0, total, 1 << 20):  # bounded: the whole body at most
                chunk = zeros[:total - start] if body is None else body[start:start + (1 << 20)]
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
        except OSError:  # the server answered and closed without reading the rest
            pass
        try:
            reply = conn.recv(4096)
        except OSError:
            return 0
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


class PeakRss:
    """A process's resident MB now (``idle``) and, while the block runs, its highest (``peak``),
    sampled every 20 ms from /proc (the SuperLink's memory under hostile uploads)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.done = pid, threading.Event()
        self.idle = self.peak = self.now()
        self.sampler = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> float:
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024

    def _sample(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.02)

    def __enter__(self) -> PeakRss:
        self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.sampler.join()
