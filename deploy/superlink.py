"""Flower's SuperLink on two listeners: nodes reach the Fleet API only (start-server.sh).

Flower 1.41 serves every SuperLink API from one HTTP app on one address: the Fleet API
(``/v1/fleet/*``, what SuperNodes call), the Control API (``/v1/control/*``: submit and stop
runs, register node keys, read logs) and the ServerApp runtime (``/v1/runtime/*``). The
Control API has no authentication in this distribution, so on a shared address any node
machine could register more node keys, submit a run (code that then runs on the SuperLink and
every node), stop runs or read their logs.

This launcher runs Flower's own SuperLink (``flower_superlink``, unchanged) and serves its app
twice from one process:

* the *control* listener, Flower's ``--host/--port``: everything, for the operator (``flwr
  run``, ``flwr supernode register``) and the SuperLink's own SuperExec; loopback by default;
* the *node-facing* listener, ``--fleet-host/--fleet-port``: the same app behind
  :class:`FleetOnly`, which passes ``/v1/fleet/<call>`` and ``/health`` and refuses every
  other path with 403 (logged with the caller's address).

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
import re
import sys
from typing import Any

from promptfcl.common.text import printable

#: longer than httpx's default keep-alive expiry (5 s), the only HTTP client Flower uses
KEEP_ALIVE_SECONDS = 75
#: what a SuperNode calls (flwr/supernode/fleet_http_client.py) and the health probe
FLEET_PATH = re.compile(r"/v1/fleet/[a-z][a-z-]*|/health")

log = logging.getLogger("promptfcl.superlink")


class FleetOnly:
    """ASGI app: Flower's app for Fleet API paths, 403 for anything else.

    The path must match :data:`FLEET_PATH` exactly (no dot segments, no doubled slashes, no
    query-string tricks: the query is not part of ``scope["path"]``).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and FLEET_PATH.fullmatch(path) and not scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        # the path is the caller's (%0a decodes to a newline): escaped, so it cannot forge log lines
        log.warning("node-facing address: refused %s %s from %s:%s (only the Fleet API is served here)",
                    printable(str(scope.get("method", scope["type"])), 20), printable(path, 200),
                    printable(str(client[0]), 64), client[1])
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            return
        body = b"only the Fleet API (/v1/fleet/*) is served on this address\n"
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def serve_two_listeners(fleet_host: str, fleet_port: int):  # noqa: ANN201 (uvicorn.run's signature)
    """A stand-in for ``uvicorn.run`` that serves Flower's app on its own address (control) and,
    through :class:`FleetOnly`, on ``fleet_host:fleet_port``."""
    import uvicorn

    def run(app: Any, *, host: str, port: int, **options: Any) -> None:
        options.pop("workers", None)
        options.pop("reload", None)
        control = uvicorn.Server(uvicorn.Config(app, host=host, port=port, timeout_keep_alive=KEEP_ALIVE_SECONDS,
                                                **options))
        fleet = uvicorn.Server(uvicorn.Config(FleetOnly(app), host=fleet_host, port=fleet_port, lifespan="off",
                                              timeout_keep_alive=KEEP_ALIVE_SECONDS, **options))
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
    ours, flower_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    import uvicorn

    from promptfcl.common.flower_internals import internal

    flower_superlink = internal("superlink_main")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s promptfcl-superlink: %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    uvicorn.run = serve_two_listeners(ours.fleet_host, ours.fleet_port)  # flower_superlink calls uvicorn.run
    sys.argv = ["flower-superlink", *flower_args]
    return flower_superlink()


if __name__ == "__main__":
    sys.exit(main())
