"""What every benchmark shares: the papers' figures, peak memory, a simulation in a subprocess, the machine."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from ...common.node.memory_plan import proc_status_kb
from .. import checkpoint

log = logging.getLogger("promptfcl")


VIT_B16_PARAMETERS = 85_798_656  # timm vit_base_patch16_224 without its ImageNet head (num_classes=0)

# The papers' datasets: classes, and approximate training / test images per class (for the
# stand-ins of ``paper-dims`` and its extrapolation to a full-size round).
PAPER_DATASETS: dict[str, tuple[int, int, int]] = {
    "hf:cifar100": (100, 500, 100),
    "hf:imagenet-r": (200, 120, 30),  # 30,000 images, 80/20 split as in CODA-P
    "hf:tiny-imagenet": (200, 500, 50),
    "hf:domainnet": (345, 1200, 300),
    "hf:cub200": (200, 30, 29),
}

# What each paper reports about its communication (bytes of one method, or its parameters).
PAPER_COMMUNICATION: dict[str, str] = {
    "hepco": "31.37 MB per exchange, 9.5% of ViT-B/16 (HePCo, Table 1)",
    "fppl": "0.25M parameters per round (FPPL, Table II COMM)",
    "powder": "493.08 MB over the whole run; Fed-CODAP 815.63 MB (Powder, Table 2)",
    "fedcprompt": "not reported",
    "hgp": "not reported",
    "c2prompt": "not read (the paper's text could not be read)",
    "lorm": "not read (only the paper's abstract is held here)",
    "pilora": "not reported (the paper's tables could not be read)",
}


# ----------------------------------------------------------------------------- helpers
def _peak_rss_mb(pid: int) -> float:
    """Peak resident set size (VmHWM) of a live process, in MB (Linux /proc)."""
    return proc_status_kb("VmHWM", pid) / 1024.0


def _actor_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"ClientAppActor" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


#: the environment variable that marks every process a benchmark run starts (the simulation, its
#: Ray head, raylet and workers inherit it), so that stopping a run finds them all, even those
#: Ray's daemons have left to init
RUN_MARK = "PROMPTFCL_BENCH_RUN"


def run_simulation_subprocess(settings: dict[str, Any], out: Path, strategy: str = "fedavg",
                              watch_memory: bool = False, timeout: int = 6 * 3600,
                              env: dict[str, str] | None = None) -> dict[str, Any]:
    """``promptfcl simulate`` in a child process; returns results.json (+ peak memory if watched).

    A run still going after ``timeout`` seconds, or whose caller is interrupted (Ctrl-C, SIGTERM
    turned into an exception, a cancelled Ray task), is stopped with every process it started
    (:func:`stop_run`) before the exception goes on: a run never keeps training in the
    background. The default is generous because the joint upper bound trains on every seen task
    (about 3x the incremental run's work on 5 tasks) and benchmarks share small machines.
    ``env``: the child's environment (default: this process's).
    """
    if (out / checkpoint.FILENAME).is_file():  # an interrupted earlier benchmark run: continue it, not start over
        settings = {**settings, "resume": True}  # (a different configuration is refused by the run)
    args = [sys.executable, "-m", "promptfcl.server.cli", "simulate", "--strategy", strategy, "--out", str(out)]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value) if isinstance(value, str) else value}"]
    if (out / "results.json").exists():
        (out / "results.json").unlink()
    # The child's output goes to a file, not a pipe: a pipe nobody reads while memory is watched
    # fills up (64 KB of client tracebacks) and blocks the child for ever.
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "simulate.log"
    mark = uuid.uuid4().hex
    child_env = {**(os.environ if env is None else env), RUN_MARK: mark}
    with log_path.open("w") as log_file:
        # a session of its own: a Ctrl-C at the terminal reaches the benchmark, which stops its runs
        # in order (SIGINT first, so that Ray shuts down), instead of reaching every child at once
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=child_env,
                                start_new_session=True)
        server_peak, client_peak = 0.0, 0.0
        deadline = time.monotonic() + timeout
        try:
            while watch_memory and proc.poll() is None and time.monotonic() < deadline:
                server_peak = max(server_peak, _peak_rss_mb(proc.pid))
                client_peak = max([client_peak] + [_peak_rss_mb(p) for p in _actor_pids()])
                time.sleep(0.25)
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except BaseException:  # timeout, KeyboardInterrupt, an interrupted grid, a cancelled Ray task
            stop_run(proc, mark)
            raise
        stop_run(proc, mark, grace=0.0)  # a finished run's stray processes (a Ray worker slow to exit)
    if proc.returncode != 0:
        output = log_path.read_text(errors="replace")
        raise RuntimeError(f"simulation failed ({strategy}, {settings}); log {log_path}:\n{output[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    if watch_memory:
        results["peak_memory_mb"] = {"server": server_peak, "client_actor": client_peak}
    return results


def interruptible_when_benchmarked() -> bool:
    """In a simulation a benchmark started (it carries :data:`RUN_MARK`), take SIGINT as Ctrl-C
    even if it arrived ignored: a benchmark started in the background (``&``, ``nohup``) hands its
    children SIGINT ignored, and :func:`stop_run` stops a run with SIGINT first (so that Ray shuts
    down and the checkpoint is kept) before its SIGKILL. Returns whether it restored it."""
    if RUN_MARK not in os.environ or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True


def stop_run(proc: subprocess.Popen[str], mark: str, grace: float = 30.0) -> None:
    """Stop a simulation child and every process carrying its ``mark``: SIGINT first (Ray shuts
    down, the run keeps its checkpoint), SIGKILL for whatever is left after ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = kill_marked(mark, RUN_MARK, wait=min(grace, 10.0))
    if left:
        log.info("stopped %d leftover process(es) of the run in pid %d", left, proc.pid)


def kill_marked(mark: str, variable: str, wait: float) -> int:
    """Give the processes marked ``variable=mark`` ``wait`` seconds to end on their own (Ray's end
    once their driver is gone), then kill them until two scans half a second apart find none (a
    Ray daemon may start a process while it is being killed); returns how many were killed."""
    deadline = time.monotonic() + wait
    while marked_processes(mark, variable) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed, quiet, deadline = set(), 0, time.monotonic() + 10.0
    while quiet < 2 and time.monotonic() < deadline:
        found = marked_processes(mark, variable)
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed.update(found)
        quiet = 0 if found else quiet + 1
        time.sleep(0.5)
    return len(killed)


def marked_processes(mark: str, variable: str = RUN_MARK) -> list[int]:
    """Live processes whose environment carries ``variable=mark`` (Linux /proc; zombies left out)."""
    needle = f"{variable}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return pids


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                            "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
