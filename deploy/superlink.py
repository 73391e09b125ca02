"""Flower's SuperLink on two listeners: nodes reach the Fleet API only (start-server.sh).

Flower 1.41-1.42 serves every SuperLink API from one HTTP app on one address: the Fleet API
(``/v1/fleet/*``, what SuperNodes call), the Control API (``/v1/control/*``: submit and stop
runs, register node keys, read logs) and the ServerApp runtime (``/v1/runtime/*``). The
Control API has no authentication in this distribution, so on a shared address any node
machine could register more node keys, submit a run (code that then runs on the SuperLink and
every node), stop runs or read their logs.

This launcher runs Flower's own SuperLink (``flower_superlink``, unchanged) and serves its app
twice from one process:

* the *control* listener, Flower's ``--host/--port``: the Control API and the ServerApp runtime,
  for the operator (``flwr run``, ``flwr supernode register``) and the SuperLink's own SuperExec
  and ServerApp; loopback by default. :class:`ControlOnly` refuses the Fleet API there (403): no
  node uses that address, and Flower's own Fleet handling reads a whole body before it knows
  who sent it (8 anonymous 50 MB bodies took the SuperLink from 848 to 1,286 MB);
* the *node-facing* listener, ``--fleet-host/--fleet-port``: the same app behind
  :class:`~promptfcl.deploy.fleet_gate.FleetOnly` (deploy/fleet_gate.py), which passes the Fleet
  API only, and only what a node may send: its own replies, within its bounds, after its
  signed headers are checked.

Both use the SuperLink's TLS certificate. Flower's lifespan (its state, its SuperExec) runs
once, on the control listener; the node-facing one starts after it and stops with it.

Both listeners keep idle HTTP connections for 75 s. uvicorn's default (5 s) equals the
keep-alive expiry of the httpx clients SuperNodes and the ServerApp use, so a client could
reuse a connection in the instant the server closed it, read an EOF, and Flower's retry
policy gives up on any error that mentions SSL ("[SSL: UNEXPECTED_EOF_WHILE_READING]", seen
once in CI under load). When the server keeps connections longer, the client closes first.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from promptfcl.deploy.fleet_gate import DEFAULT_MAX_OBJECT_BYTES, FleetOnly, log, log_refusal, respond

#: longer than httpx's default keep-alive expiry (5 s), the only HTTP client Flower uses
KEEP_ALIVE_SECONDS = 75
#: the Fleet API's paths: served to nodes on the node-facing listener only
FLEET_PREFIX = "/v1/fleet/"


class ControlOnly:
    """ASGI app: Flower's app on the control listener, without the Fleet API (403, logged).

    Nothing of the project's calls the Fleet API there: SuperNodes use the node-facing address,
    the SuperLink's SuperExec and ServerApp the runtime API, ``flwr`` and register-node.sh the
    Control API. Lifespan events pass (Flower's state and SuperExec start here)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith(FLEET_PREFIX):
            log_refusal(scope, "the Fleet API is served on the node-facing address only", where="control address")
            await respond(send, 403, "the Fleet API is served on the SuperLink's node-facing address only")
            return
        await self.app(scope, receive, send)


def serve_two_listeners(fleet_host: str, fleet_port: int,  # noqa: ANN201 (uvicorn.run's signature)
                        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES, max_node_bytes: int | None = None):
    """A stand-in for ``uvicorn.run`` that serves Flower's app on its own address through
    :class:`ControlOnly` and, through :class:`FleetOnly`, on ``fleet_host:fleet_port``."""
    import uvicorn

    def run(app: Any, *, host: str, port: int, **options: Any) -> None:
        options.pop("workers", None)
        options.pop("reload", None)
        control = uvicorn.Server(uvicorn.Config(ControlOnly(app), host=host, port=port,
                                                timeout_keep_alive=KEEP_ALIVE_SECONDS, **options))
        fleet = uvicorn.Server(uvicorn.Config(FleetOnly(app, max_object_bytes, max_node_bytes), host=fleet_host,
                                              port=fleet_port, lifespan="off", timeout_keep_alive=KEEP_ALIVE_SECONDS,
                                              **options))
        print(f"promptfcl SuperLink: Fleet API for nodes on {fleet_host}:{fleet_port}; Control API and "
              f"ServerApp runtime on {host}:{port}", file=sys.stderr, flush=True)
        asyncio.run(_serve_both(control, fleet))

    return run


async def _serve_both(control: Any, fleet: Any) -> None:
    """Control first (it runs Flower's lifespan and owns the signal handlers); the node-facing
    listener once control is up, and down when control goes down."""

    async def fleet_when_ready() -> None:
        while not control.started:
            if control.should_exit:
                return
            await asyncio.sleep(0.05)
        await fleet._serve()  # serve() would take over the signal handlers control installed

    async def stop_with_control() -> None:
        while not control.should_exit:
            await asyncio.sleep(0.2)
        fleet.should_exit = True

    await asyncio.gather(control.serve(), fleet_when_ready(), stop_with_control())


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--fleet-host", required=True)
    parser.add_argument("--fleet-port", type=int, required=True)
    parser.add_argument("--max-object-bytes", type=int, default=DEFAULT_MAX_OBJECT_BYTES)
    parser.add_argument("--max-node-bytes", type=int, default=None)  # default: one largest object push
    ours, flower_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    from promptfcl.common.flower_internals import internal

    flower_superlink = internal("superlink_main")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s promptfcl-superlink: %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    if ours.max_object_bytes < 1:
        parser.error("--max-object-bytes must be positive")
    if ours.max_node_bytes is not None and ours.max_node_bytes < ours.max_object_bytes:
        parser.error("--max-node-bytes must be at least --max-object-bytes (a node must be able to push its "
                     "largest object)")
    # flower_superlink calls uvicorn.run (checked by the door: superlink_uvicorn)
    internal("superlink_uvicorn").run = serve_two_listeners(ours.fleet_host, ours.fleet_port, ours.max_object_bytes,
                                                            ours.max_node_bytes)
    sys.argv = ["flower-superlink", *flower_args]
    return flower_superlink()


if __name__ == "__main__":
    sys.exit(main())
