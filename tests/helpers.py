"""Test helpers shared by several test modules.

``InProcessGrid`` is a Flower grid without Flower's infrastructure: it runs the real
ClientApp (``client.app.app``, or the same functions behind other mods) for each message in
this process, one Context per node, so the real server loop, strategies and clients run
end to end in seconds where a Ray simulation is not what is being tested.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from promptfcl.common.config.experiment import ExperimentConfig

#: a Flower mod: (message, context, call_next) -> reply
Mod = Callable[[Message, Context, Callable[[Message, Context], Message]], Message]


def simulate(out: Path, strategy: str = "fedavg", timeout: int = 600, **overrides: Any) -> dict[str, Any]:
    """Run ``promptfcl simulate`` (a real Ray simulation, in a subprocess) with the tiny test
    configuration, 2 rounds per task and 3 clients all taking part; return results.json."""
    from tests.conftest import TINY

    settings = {**TINY, "rounds-per-task": 2, "num-clients": 3, "clients-per-round": 3, **overrides}
    args = [sys.executable, "-m", "promptfcl.server.cli", "simulate", "--strategy", strategy, "--out", str(out)]
    for key, value in settings.items():
        args += ["--set", f"{key}={json.dumps(value) if isinstance(value, str) else value}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def simulate_in_process(out: Path, strategy: str = "fedavg", **overrides: Any) -> dict[str, Any]:
    """:func:`simulate`'s run (same configuration, loaded and checked the same way) with the
    ClientApps in this process (:class:`InProcessGrid`, one node per client of a round): the
    same server loop, strategies and ClientApp, without Ray's start-up; results.json."""
    from promptfcl.strategies.platform.run_checks import load_config
    from tests.conftest import TINY, flower_task_identity

    settings = {**TINY, "rounds-per-task": 2, "num-clients": 3, "clients-per-round": 3, **overrides}
    pairs = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in settings.items()]
    cfg = load_config(None, pairs, strategy, str(out))
    with flower_task_identity():  # what Flower's run sets up around a ServerApp
        run_in_process(cfg, nodes=cfg.federation.clients_per_round)
    return json.loads((out / "results.json").read_text())


class NodeList:
    """The one Grid query ``configure_train`` makes: which nodes are connected (ids 100, 101, ...)."""

    def __init__(self, n: int) -> None:
        self.ids = list(range(100, 100 + n))

    def get_node_ids(self) -> list[int]:
        return self.ids


def operated_by_the_test(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """In-process nodes are the test's own, as Ray-simulated nodes are their operator's: they read
    the run's data location and obey its fault switch (client/node_policy.py)."""
    from promptfcl.client.node_policy import trust_run

    trust_run(context)
    return call_next(msg, context)


def client_app(mods: list[Mod] | None = None, operated: bool = True) -> ClientApp:
    """The project's ClientApp functions behind ``mods`` (outermost first), then its own mods;
    ``operated``: the nodes are the test's own (:func:`operated_by_the_test`), as in a simulation."""
    from promptfcl.client.app import app as real
    from promptfcl.client.app import evaluate, query, train

    app = ClientApp(mods=([operated_by_the_test] if operated else []) + list(mods or []) + list(real._mods))
    app.train()(train)
    app.query()(query)
    app.evaluate()(evaluate)
    return app


class PushPullGrid:
    """``push_messages`` / ``pull_messages`` (what the server loop calls, ``server.messaging.send_and_receive``)
    for a test grid that answers a batch of messages at once in ``send_and_receive``."""

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        raise NotImplementedError

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        messages = list(messages)
        for msg in messages:
            if not msg.metadata.message_id:
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as Flower's grids do when sending
        self._replies = {r.metadata.reply_to_message_id: r for r in self.send_and_receive(messages)}
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]


class InProcessGrid(PushPullGrid):
    """The part of Flower's ``Grid`` the server loop uses, running ClientApps in this process.

    Parameters
    ----------
    cfg : ExperimentConfig
        The run config every node receives.
    nodes : int
        How many nodes are connected (ids 1001, 1002, ...).
    apps : dict, optional
        A node id -> ClientApp for nodes that run something else (a hostile mod); the rest
        run the project's ClientApp.
    node_configs : dict, optional
        A node id -> its ``node_config``.
    dead : dict, optional
        A node id -> how it is dead: "silent" (no reply, as at a timeout) or "lost" (an error
        reply made by the SuperLink, from and to the SuperLink's node id 1, as Flower's
        ``create_message_error_unavailable_res_message`` reports a node that disappeared).
    """

    def __init__(self, cfg: ExperimentConfig, nodes: int, apps: dict[int, ClientApp] | None = None,
                 node_configs: dict[int, dict[str, Any]] | None = None, dead: dict[int, str] | None = None) -> None:
        self.node_ids = [1001 + i for i in range(nodes)]
        self.dead = dict(dead or {})
        self.default_app = client_app()
        self.apps = dict(apps or {})
        self.contexts = {n: Context(run_id=1, node_id=n, node_config=dict((node_configs or {}).get(n, {})),
                                    state=RecordDict(), run_config=cfg.to_dict()) for n in self.node_ids}
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            if not msg.metadata.message_id:
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as Flower's grids do when sending
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            if self.dead.get(node) == "silent":
                continue
            if self.dead.get(node) == "lost":
                from promptfcl.common.flower_internals import internal

                reply = Message(Error(code=0, reason="node lost"), reply_to=msg)
                superlink = internal("superlink_node_id")  # made by the SuperLink, as Flower makes it
                reply.metadata.__dict__["_src_node_id"] = reply.metadata.__dict__["_dst_node_id"] = superlink
                replies.append(reply)
                continue
            app = self.apps.get(node, self.default_app)
            try:
                reply = app(msg, self.contexts[node])
            except Exception as exc:  # Flower turns a ClientApp exception into an error reply
                reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            replies.append(reply)
        return replies


def run_in_process(cfg: ExperimentConfig, nodes: int = 2, apps: dict[int, ClientApp] | None = None,
                   dead: dict[int, str] | None = None, node_configs: dict[int, dict[str, Any]] | None = None,
                   grid_class: type[InProcessGrid] | None = None) -> dict[str, Any]:
    """The ServerApp's work (``run_experiment`` + outputs) over an :class:`InProcessGrid` (or
    ``grid_class``, one of its kind); results."""
    from promptfcl.server.report import write_outputs
    from promptfcl.server.run import finish, run_experiment

    grid = (grid_class or InProcessGrid)(cfg, nodes, apps, node_configs=node_configs, dead=dead)
    results = run_experiment(grid, cfg)  # type: ignore[arg-type]
    write_outputs(results, cfg.output.out_dir)
    finish(cfg.output.out_dir, cfg.output.keep_checkpoint, results)
    return results


def make_ckpt(server_round: int) -> Any:
    """A small valid checkpoint of the tiny configuration at ``server_round``."""
    import numpy as np

    from promptfcl.server import checkpoint
    from tests.conftest import tiny_config

    return checkpoint.Checkpoint(
        config=tiny_config().to_dict(), task=0, round=server_round - 1, server_round=server_round,
        task_finished=False, arrays={"head.weight": np.ones((2, 2), np.float32) * server_round},
        strategy_state={}, accuracy_matrix=np.full((2, 2), np.nan), rounds=[], rng=checkpoint.capture_rng(),
        elapsed_seconds=1.0)


def accepted_of(contents: list[RecordDict], tasks: list[int] | int = 0, clients: list[int] | None = None,
                weights: list[float] | None = None) -> list:
    """Accepted replies as the platform hands them to a method's hooks (``aggregate``, ``consolidate``,
    ``round_metrics``): reply ``i`` from client ``clients[i]`` (default ``i``), trained on ``tasks[i]``
    (one int: every reply's task), with weight ``weights[i]`` (default its sample count)."""
    from flwr.app import ConfigRecord, MessageType

    from promptfcl.common.records import METRICS
    from promptfcl.strategies.platform.rounds import Accepted, Sent
    from tests.conftest import flower_task_identity

    tasks = [tasks] * len(contents) if isinstance(tasks, int) else list(tasks)
    clients = list(range(len(contents))) if clients is None else list(clients)
    out = []
    with flower_task_identity():
        for i, content in enumerate(contents):
            config = ConfigRecord({"task": tasks[i], "round": 0, "client-id": clients[i]})
            request = Message(content=RecordDict({"config": config}), dst_node_id=1000 + i,
                              message_type=MessageType.TRAIN)
            sent = Sent(clients[i], tasks[i], 0, clients[i], config, message=request)
            weight = weights[i] if weights is not None else float(content[METRICS]["num-examples"]) \
                if METRICS in content.metric_records else 0.0
            out.append(Accepted(sent, Message(content=content, reply_to=request), weight=weight))
    return out


class Built(Exception):
    """What building the server's model raises in a test: the run got past the server's checks."""


def refuse_to_build_the_server(monkeypatch: Any) -> None:
    """server/run.py's model and runtime builders raise :class:`Built`: a test sees whether a run is
    refused before anything is built, without building it."""
    import promptfcl.server.run as server_run

    def build(*args: Any, **kwargs: Any) -> None:
        raise Built

    monkeypatch.setattr(server_run, "initial_trainable_state", build)
    monkeypatch.setattr(server_run, "get_runtime", build)
