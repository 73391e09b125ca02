"""``promptfcl-superexec``: Flower's SuperExec for a node's ClientApp tasks, whose executor forks
each task from a warm zygote (client/zygote.py) instead of starting a fresh interpreter.

Flower 1.41-1.42's SuperExec takes an executor (an object with ``launch(spec)``,
``get_eligible_capacity``, ``wait_for_capacity``, ``reconcile``, ``close``); its stock
``SubprocessExecutor`` runs ``flwr-clientapp --token ...`` as a new process per task. The
``ForkingExecutor`` below launches ClientApp tasks through the zygote and everything else
(and every task when fork cannot be used) through the stock executor. It runs beside
``flower-supernode --isolation process``, which leaves the SuperExec to the operator
(deploy/start-client.sh starts both; ``--no-warm`` starts Flower's own).

Failure handling: a zygote that has died or stopped answering is restarted, with a log line,
and the task is launched by the new one; if no zygote can be started, this task and every
later one go through Flower's stock path, so no task is lost either way. A zygote whose
installed code has changed (promptfcl's files, torch's or Flower's version) is rebuilt before
the next task.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from logging import ERROR, INFO, WARNING
from typing import Any

from ..common.flower_internals import internal, replace_internal
from ..common.node.memory_plan import processes_line
from .zygote import BLAS_THREADS_ENV, DEFAULT_RUNNER, installed_fingerprint

# Flower's logger: these lines appear with the SuperExec's own, in the node's log
log = logging.getLogger("flwr").log

#: seconds a new zygote may take to import torch, Flower and promptfcl
START_TIMEOUT = 180.0
#: seconds a running zygote may take to answer one request (a fork)
ANSWER_TIMEOUT = 30.0


class ZygoteError(RuntimeError):
    """The zygote could not be started or did not answer as it should."""


class Zygote:
    """One warm zygote process and the socket to it."""

    def __init__(self, runner: str = DEFAULT_RUNNER) -> None:
        mine, theirs = socket.socketpair()
        try:
            env = dict(os.environ)
            env[BLAS_THREADS_ENV] = env.get("OPENBLAS_NUM_THREADS", "")
            env["OPENBLAS_NUM_THREADS"] = "1"  # no BLAS worker threads in the zygote (see client/zygote.py)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "promptfcl.client.zygote", "--fd", str(theirs.fileno()), "--runner", runner],
                pass_fds=[theirs.fileno()], env=env,
            )
        finally:
            theirs.close()
        self.channel = mine
        self.reader = mine.makefile("r", encoding="utf-8")
        hello = self._read(START_TIMEOUT, "starting")
        if not hello.get("ready"):
            raise ZygoteError(f"the zygote did not start: {hello}")
        self.pid = int(hello["pid"])
        self.fingerprint = str(hello["fingerprint"])
        self.preload_seconds = float(hello["preload_seconds"])

    def _read(self, timeout: float, what: str) -> dict[str, Any]:
        self.channel.settimeout(timeout)
        try:
            line = self.reader.readline()
        except (OSError, TimeoutError) as exc:
            raise ZygoteError(f"no answer from the zygote while {what} ({type(exc).__name__}: {exc})") from exc
        if not line:
            raise ZygoteError(f"the zygote closed its socket while {what} (exit code {self.process.poll()})")
        return dict(json.loads(line))

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request, one answer."""
        try:
            self.channel.sendall((json.dumps(request) + "\n").encode())
        except OSError as exc:
            raise ZygoteError(f"cannot reach the zygote ({type(exc).__name__}: {exc})") from exc
        return self._read(ANSWER_TIMEOUT, "answering")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Close the socket (the zygote's signal to exit); terminate it if it lingers.
        Children already forked run their tasks to the end."""
        try:
            self.reader.close()
            self.channel.close()
        finally:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def spec_fields(spec: Any) -> dict[str, Any]:
    """What a forked child needs of Flower's ExecutionSpec (the arguments of ``flwr-clientapp``)."""
    return {
        "runtime_api_address": spec.runtime_api_address,
        "token": spec.token,
        "insecure": bool(spec.insecure),
        "root_certificates_path": spec.root_certificates_path,
        "parent_pid": spec.parent_pid,
        "task_id": spec.task_id,
    }


class ForkingExecutor:
    """Flower's SuperExec executor with ClientApp tasks forked from a warm zygote.

    Parameters
    ----------
    runner : str
        ``module:function`` a forked child runs with the task's spec; Flower's ClientApp runner
        by default (tests name a stand-in to count forks without a SuperNode).
    """

    def __init__(self, runner: str = DEFAULT_RUNNER) -> None:
        self.runner = runner
        self.stock = internal("subprocess_executor")()
        self.zygote: Zygote | None = None
        self.fallback = False
        self.counts = {"forked": 0, "stock": 0, "restarts": 0}

    # ------------------------------------------------------------------ Flower's executor contract
    def get_eligible_capacity(self, supported_task_types: set[Any], *, insecure: bool = False,
                              root_certificates_path: str | None = None) -> tuple[set[Any], set[str]]:
        return self.stock.get_eligible_capacity(  # type: ignore[no-any-return]
            supported_task_types, insecure=insecure, root_certificates_path=root_certificates_path)

    def wait_for_capacity(self, task_type: Any = None, *, fab_hash: str | None = None, insecure: bool = False,
                          root_certificates_path: str | None = None) -> None:
        self.stock.wait_for_capacity(task_type, fab_hash=fab_hash, insecure=insecure,
                                     root_certificates_path=root_certificates_path)

    def launch(self, spec: Any) -> Any:
        """Fork a ClientApp task from the zygote; anything else, or any task once no zygote can
        be had, through Flower's stock subprocess executor."""
        launch_result = internal("launch_result")
        if (spec.task_type != internal("task_type").CLIENT_APP or spec.runtime_dependency_install
                or self.fallback):
            self.counts["stock"] += 1
            return self.stock.launch(spec)
        for attempt in (1, 2):
            try:
                zygote = self._ready_zygote()
                answer = zygote.ask({"spec": spec_fields(spec)})
                if "pid" not in answer:
                    raise ZygoteError(str(answer.get("error", answer)))
                self.counts["forked"] += 1
                return launch_result.accepted()
            except ZygoteError as exc:
                log(WARNING, "promptfcl-superexec: warm zygote could not launch task %d (%s)%s", spec.task_id, exc,
                    "; restarting it" if attempt == 1 else "")
                self._drop_zygote()
        log(ERROR, "promptfcl-superexec: no warm zygote can be started; task %d and every later task run on "
            "Flower's stock subprocess executor", spec.task_id)
        self.fallback = True
        self.counts["stock"] += 1
        return self.stock.launch(spec)

    def reconcile(self) -> None:
        """Between polls: replace a zygote that has died, so the next task does not wait for it."""
        if self.zygote is not None and not self.zygote.alive() and not self.fallback:
            log(WARNING, "promptfcl-superexec: warm zygote (pid %d) exited with code %s; restarting it",
                self.zygote.pid, self.zygote.process.returncode)
            self._drop_zygote()
            try:
                self._ready_zygote()
            except ZygoteError as exc:
                log(WARNING, "promptfcl-superexec: restarting the warm zygote failed (%s); the next task tries "
                    "again", exc)
                self._drop_zygote()
        self.stock.reconcile()

    def close(self) -> None:
        self._drop_zygote()
        self.stock.close()

    # ------------------------------------------------------------------ the zygote
    def _ready_zygote(self) -> Zygote:
        if self.zygote is not None and not self.zygote.alive():
            log(WARNING, "promptfcl-superexec: warm zygote (pid %d) exited with code %s; restarting it",
                self.zygote.pid, self.zygote.process.returncode)
            self._drop_zygote()
        if self.zygote is not None and installed_fingerprint() != self.zygote.fingerprint:
            log(INFO, "promptfcl-superexec: promptfcl, torch or Flower changed on disk; rebuilding the warm zygote")
            self._drop_zygote()
        if self.zygote is None:
            try:
                self.zygote = Zygote(self.runner)
            except OSError as exc:
                raise ZygoteError(f"cannot start the zygote ({type(exc).__name__}: {exc})") from exc
            self.counts["restarts"] += 1
            log(INFO, "promptfcl-superexec: warm zygote %d ready (torch, Flower and promptfcl imported in %.1f s); "
                "this node's processes before any message: %s", self.zygote.pid, self.zygote.preload_seconds,
                processes_line(node_processes(self.zygote.pid)))
        return self.zygote

    def _drop_zygote(self) -> None:
        if self.zygote is not None:
            zygote, self.zygote = self.zygote, None
            zygote.stop()


def node_processes(zygote: int, argv: list[str] | None = None) -> list[tuple[str, int]]:
    """The node's long-lived processes, (name, pid): its SuperNode (the ``--parent-pid`` this
    SuperExec was started with, where given), this executor and its zygote. A message's process
    (forked from the zygote) adds its own, bounded by ``memory-budget-mb`` where the node sets one."""
    args = sys.argv if argv is None else argv
    out = []
    if "--parent-pid" in args[:-1]:
        parent = args[args.index("--parent-pid") + 1]
        if parent.isdigit():
            out.append(("SuperNode", int(parent)))
    return out + [("executor", os.getpid()), ("zygote", zygote)]


def main() -> None:
    """``promptfcl-superexec``: Flower's ``flower-superexec`` (same arguments), with the
    ``subprocess`` executor replaced by the :class:`ForkingExecutor`."""
    if not hasattr(os, "fork") or sys.platform != "linux":
        sys.exit("promptfcl-superexec forks ClientApp tasks and runs on Linux only (macOS's system frameworks "
                 "are not fork-safe); use Flower's flower-superexec (deploy/start-client.sh --no-warm)")
    stock_factory = internal("superexec_get_executor")
    subprocess_type = internal("executor_type").SUBPROCESS

    def make_executor(executor_type: Any, executor_config: Any = None, **kwargs: Any) -> Any:
        if executor_type != subprocess_type:
            return stock_factory(executor_type, executor_config, **kwargs)
        return ForkingExecutor()

    replace_internal("superexec_get_executor", make_executor)
    internal("superexec_main")()


if __name__ == "__main__":
    main()
