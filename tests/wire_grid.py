"""A grid whose nodes run in processes of their own, messages crossing as Flower's wire objects.

``WireGrid`` gives the server loop what a deployed ServerApp gets from Flower's grid: each
message leaves as its deflated objects (what ``push_messages`` uploads), each reply comes back
as a fresh object tree inflated from its objects' bytes (what ``pull_messages`` builds), and
the ClientApps run in forked worker processes, one per node, so the memory of this process is
the ServerApp's own: its peak (VmHWM) is what a deployed ServerApp reaches, without a SuperLink.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any

from flwr.app import Context, Error, Message, RecordDict

from promptfcl.common.config.experiment import ExperimentConfig
from promptfcl.common.flower_internals import internal
from tests.helpers import PushPullGrid, client_app


def to_wire(msg: Message) -> tuple[str, dict[str, bytes]]:
    """A message as its object id and its objects' deflated bytes (what a grid pushes)."""
    objects = internal("nested_objects")(msg)
    return msg.object_id, {object_id: obj.deflate() for object_id, obj in objects.items()}


def send(conn: Connection, msg: Message) -> str:
    """Send ``msg`` as its objects, one at a time (a grid pushes object by object: no copy of the
    whole message is made to send it); its object id."""
    objects = internal("nested_objects")(msg)
    conn.send((msg.object_id, list(objects)))
    for obj in objects.values():
        conn.send_bytes(obj.deflate())
    return str(msg.object_id)


def receive(conn: Connection) -> Message:
    """The message :func:`send` sent, inflated from its objects' bytes as a grid's pull inflates it."""
    object_id, ids = conn.recv()
    return from_wire(object_id, {i: conn.recv_bytes() for i in ids})


def from_wire(object_id: str, contents: dict[str, bytes]) -> Message:
    """The message inflated from its objects' bytes (what a grid's pull builds), its id set."""
    msg = internal("inflate_object")(object_id, contents)
    msg.metadata.__dict__["_message_id"] = object_id
    return msg


def _node(conn: Connection, node_id: int, run_config: dict[str, Any], node_config: dict[str, Any]) -> None:
    """One node's worker: inflate each message, run the ClientApp, send the reply's objects back."""
    app = client_app()
    context = Context(run_id=1, node_id=node_id, node_config=node_config, state=RecordDict(), run_config=run_config)
    while True:
        if not conn.poll(None) or conn.recv() != "message":
            return
        msg = receive(conn)
        try:
            reply = app(msg, context)
        except Exception as exc:  # Flower turns a ClientApp exception into an error reply
            reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
        send(conn, reply)


class WireGrid(PushPullGrid):
    """``nodes`` nodes (ids 2001, ...), each a forked worker process running the project's ClientApp."""

    def __init__(self, cfg: ExperimentConfig, nodes: int,
                 node_configs: dict[int, dict[str, Any]] | None = None) -> None:
        self.node_ids = [2001 + i for i in range(nodes)]
        ctx = mp.get_context("fork")
        self.conns: dict[int, Connection] = {}
        self.workers = []
        for node in self.node_ids:
            here, there = ctx.Pipe()
            worker = ctx.Process(target=_node, args=(there, node, cfg.to_dict(), dict((node_configs or {}).get(node, {}))),
                                 daemon=True)
            worker.start()
            self.conns[node], self.workers = here, self.workers + [worker]

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            conn = self.conns[msg.metadata.dst_node_id]
            conn.send("message")
            msg.metadata.__dict__["_message_id"] = send(conn, msg)  # as Flower's grids do when sending
            replies.append(receive(conn))
        return replies

    def close(self) -> None:
        for conn, worker in zip(self.conns.values(), self.workers):
            conn.send(None)
            worker.join(timeout=30)
