"""A deployment on this machine, started with the project's own deploy/ scripts.

Real processes, as deploy/README.md runs them on separate machines: a CA and server
certificate (``make-certs.sh``), a SuperLink with TLS and node authentication
(``start-server.sh``), N registered SuperNodes each with its own image folder
(``start-client.sh``), and a run submitted with ``submit-run.sh``. Used by
``promptfcl bench deploy`` and by the deploy tests (which add a recording proxy and a
hostile node on top of the same pieces). Linux only (process trees are read from /proc).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client.node_data import export_digits
from ..common.config.files import toml_value

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VENV_BIN = Path(sys.executable).parent


def toml_file(path: Path, values: dict[str, Any]) -> Path:
    """A flat run-config TOML file (``deploy/run.toml``'s format) holding ``values``."""

    path.write_text("".join(f'"{k}" = {toml_value(v)}\n' for k, v in values.items()))
    return path


def free_port() -> int:
    """A TCP port nothing listens on now (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def script_env(**extra: str) -> dict[str, str]:
    """This environment with the project's interpreter first on PATH and telemetry off."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env.update(extra)
    return env


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), children first found first."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class Processes:
    """Processes started here; ``stop_all`` stops them and every descendant they started."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    known: set[int] = field(default_factory=set)

    def start(self, args: list[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
        with open(log, "wb") as fh:
            proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def remember_descendants(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.known.update(descendants(p.pid))

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM to the process's group (its SuperExec and ClientApp children), then SIGKILL."""
        self.known.update(descendants(proc.pid))
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)  # started with start_new_session: group id == pid
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def run_to_exit(self, args: list[str], log: Path, env: dict[str, str], cwd: Path,
                    timeout: float) -> tuple[int, str]:
        """Run until the process itself exits (output to a file: children may keep pipes open)."""
        proc = self.start(args, log, env, cwd)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.stop(proc)  # leftover children (a SuperExec waiting for its parent to go)
        out = log.read_text(errors="replace")
        if code is None:
            raise TimeoutError(f"{args[:2]} still running after {timeout:.0f} s:\n{out[-3000:]}")
        return code, out

    def stop_all(self) -> None:
        self.remember_descendants()
        for p in reversed(self.procs):
            self.stop(p)
        deadline = time.time() + 10
        for pid in self.known:  # SuperExec / ClientApp processes in sessions of their own
            while time.time() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.2)
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def wait_for_log(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``text`` appears in ``log``; an error if ``proc`` exits first or time runs out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}) before '{text}':\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise TimeoutError(f"'{text}' not in {log} after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def run_script(name: str, *args: str, env: dict[str, str], cwd: Path,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """One of deploy/'s scripts, to completion."""
    return subprocess.run(
        ["bash", str(DEPLOY / name), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


@dataclass(frozen=True)
class Ports:
    """The SuperLink's two addresses on loopback: nodes use ``fleet``, the operator ``control``."""

    fleet: int
    control: int

    @classmethod
    def free(cls) -> Ports:
        fleet = free_port()
        control = free_port()
        while control == fleet:
            control = free_port()
        return cls(fleet, control)


def superlink_command(ports: Ports) -> list[str]:
    """deploy/start-server.sh as the README runs it, state in <root>/server (the same on a restart)."""
    return [
        "bash",
        str(DEPLOY / "start-server.sh"),
        "--certs",
        "certs",
        "--state",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(ports.fleet),
        "--control-port",
        str(ports.control),
    ]


def checked(done: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


def make_credentials(root: Path, env: dict[str, str], nodes: list[str]) -> None:
    """A CA and server certificate for 127.0.0.1 (certs/) and a key pair per node (keys/)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is needed to make the TLS certificates (deploy/make-certs.sh)")
    checked(run_script("make-certs.sh", "--out", "certs", "127.0.0.1", env=env, cwd=root), "make-certs.sh")
    for name in nodes:
        checked(run_script("make-node-key.sh", "--out", "keys", name, env=env, cwd=root), f"make-node-key.sh {name}")


def start_superlink(
    root: Path, procs: Processes, env: dict[str, str], ports: Ports, log: str = "superlink.log"
) -> subprocess.Popen:
    """The SuperLink (TLS, node authentication) on ``ports``, once both listeners accept connections."""
    link = procs.start(superlink_command(ports), root / log, env, cwd=root)
    wait_for_log(root / log, f"Uvicorn running on https://127.0.0.1:{ports.fleet}", link, timeout=180)
    return link


def register_node(root: Path, env: dict[str, str], control_port: int, name: str) -> None:
    """deploy/register-node.sh on the SuperLink's machine (the control address)."""
    done = run_script(
        "register-node.sh",
        "--superlink",
        f"127.0.0.1:{control_port}",
        "--ca",
        "certs/ca.crt",
        "--name",
        name,
        f"keys/{name}.pub",
        env=env,
        cwd=root,
    )
    if done.returncode != 0 or "registered successfully" not in done.stdout:
        raise RuntimeError(f"registering {name} failed:\n{done.stdout}{done.stderr}")


def start_node(
    root: Path,
    procs: Processes,
    env: dict[str, str],
    superlink: str,
    name: str,
    data: str,
    run_toml: Path,
    extra: list[str] | None = None,
    wait: bool = True,
) -> subprocess.Popen:
    """A SuperNode started with deploy/start-client.sh, once it has its node id (``wait`` False:
    at once; :func:`wait_for_node` then waits, so that several nodes start side by side)."""
    args = [
        "bash",
        str(DEPLOY / "start-client.sh"),
        "--superlink",
        superlink,
        "--ca",
        "certs/ca.crt",
        "--key",
        f"keys/{name}",
        "--data-dir",
        data,
        "--config",
        str(run_toml),
        "--state",
        name,
        "--port",
        str(free_port()),
        *(extra or []),
    ]
    node = procs.start(args, root / f"{name}.log", env, cwd=root)
    if wait:
        wait_for_node(root, name, node)
    return node


def wait_for_node(root: Path, name: str, node: subprocess.Popen) -> None:
    """Until SuperNode ``name`` (started by :func:`start_node`) has its node id."""
    wait_for_log(root / f"{name}.log", "SuperNode ID", node, timeout=240)


def submit(
    root: Path, env: dict[str, str], control_port: int, run_toml: Path, app: Path | None = None, timeout: float = 1500
) -> subprocess.CompletedProcess:
    """deploy/submit-run.sh against the SuperLink's control address; returns when the run has ended."""
    args = ["--superlink", f"127.0.0.1:{control_port}", "--ca", "certs/ca.crt", "--config", str(run_toml)]
    if app is not None:
        args += ["--app", str(app)]
    return run_script("submit-run.sh", *args, env=env, cwd=root, timeout=timeout)


def run_deployed(
    root: Path, run: dict[str, Any], nodes: int, threads: int = 1, timeout: float = 1500, warm: bool = True,
    node_args: dict[int, list[str]] | None = None,
) -> dict[str, Any]:
    """A whole loopback deployment of ``run`` (run-config keys) on ``nodes`` SuperNodes, each with a
    disjoint share of the digits as image folders; returns the run's results.json. ``warm``: the
    nodes' default executor (forking from a warm zygote); False: Flower's stock one (``--no-warm``).
    ``node_args``: more deploy/start-client.sh arguments of node i (1-based), e.g. ``--node KEY=VAL``."""

    root = root.resolve()  # the scripts run inside it
    root.mkdir(parents=True, exist_ok=True)
    env = script_env(FLWR_HOME=str(root / "cli-home"))
    names = [f"node{i}" for i in range(1, nodes + 1)]
    export_digits(root / "data", nodes)
    make_credentials(root, env, names)
    run_toml = toml_file(root / "run.toml", run)
    procs = Processes()
    try:
        ports = Ports.free()
        start_superlink(root, procs, env, ports)
        for name in names:
            register_node(root, env, ports.control, name)
        # the nodes start side by side, as on separate machines (each start-up is mostly imports);
        # the machine's own cache (PROMPTFCL_CACHE or ~/.cache/promptfcl): weights, decoded
        # images and queries, as a node that has run before has them
        started = [
            start_node(
                root,
                procs,
                script_env(),
                f"127.0.0.1:{ports.fleet}",
                name,
                f"data/node{i}",
                run_toml,
                ["--threads", str(threads)] + ([] if warm else ["--no-warm"]) + (node_args or {}).get(i + 1, []),
                wait=False,
            )
            for i, name in enumerate(names)
        ]
        for name, node in zip(names, started):
            wait_for_node(root, name, node)
        done = submit(root, env, ports.control, run_toml, timeout=timeout)
        procs.remember_descendants()
        checked(done, "submit-run.sh")
        results = root / "server" / str(run["out-dir"]) / "results.json"
        if not results.is_file():
            raise RuntimeError(f"the deployed run wrote no results.json:\n{(done.stdout + done.stderr)[-3000:]}")
        return json.loads(results.read_text())
    finally:
        procs.stop_all()
