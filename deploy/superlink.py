"""Flower's SuperLink on two listeners: nodes reach the Fleet API only (start-server.sh).

Flower 1.41-1.42 serves every SuperLink API from one HTTP app on one address: the Fleet API
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

Flower's HTTP app reads and parses a request's whole body before it authenticates the node
that sent it, so on the node-facing listener anyone could make the SuperLink hold any number
of bodies of any size (8 concurrent anonymous 50 MB uploads took it from 386 MB to 1.5 GB).
:class:`FleetOnly` therefore decides before the body is read:

* **who**: a Fleet call must carry a node's signed, fresh timestamp (the headers every Flower
  SuperNode sends, checked as Flower checks them) and, with node authentication on, a
  registered public key; otherwise 401. Flower repeats its own check after parsing (the node
  id in the body must be the key's);
* **how much**: each call's body is bounded by its path (:func:`body_limit`): an object push
  by ``--max-object-bytes`` (a reply's largest object; default the run config's
  ``max-reply-bytes`` default), every other call by :data:`SMALL_BODY_BYTES`; a declared
  ``Content-Length`` above it is refused with 413 unread, and the bytes actually streamed are
  counted, so a body without a length, or longer than it said, is cut off at the limit.

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
import binascii
import datetime
import json
import logging
import re
import sys
import time
from base64 import b64decode
from typing import Any

from promptfcl.common.node_identity import ACTIVATE, REJOIN_PROBE, STILL_ONLINE, node_label
from promptfcl.common.text import printable

#: longer than httpx's default keep-alive expiry (5 s), the only HTTP client Flower uses
KEEP_ALIVE_SECONDS = 75
#: what a SuperNode calls (flwr/supernode/fleet_http_client.py) and the health probe
FLEET_PATH = re.compile(r"/v1/fleet/[a-z][a-z-]*|/health")
#: the call that carries a message's objects (its arrays, cut by Flower into 5 MB chunks, and
#: each record): bounded by ``--max-object-bytes``
OBJECT_PUSH = "/v1/fleet/push-object"
#: the run config's max-reply-bytes default: no reply a run accepts has a larger object
DEFAULT_MAX_OBJECT_BYTES = 256_000_000
#: the fields around an object in a push (node, run id, object id)
OBJECT_FRAMING_BYTES = 64 * 1024
#: every other Fleet call sends ids, a node's public key, a heartbeat or a message's object tree
#: (about 100 bytes per array chunk): kilobytes in any run
SMALL_BODY_BYTES = 256 * 1024
UNREGISTERED = "a public key that is not registered"
#: the ASGI scope key where the gate keeps a request's registered node id
NODE_ID = "promptfcl.node_id"

log = logging.getLogger("promptfcl.superlink")


class BodyTooLarge(Exception):
    """A request's streamed body passed its path's limit (raised from the app's ``receive``)."""


def body_limit(path: str, max_object_bytes: int) -> int:
    """The most bytes a request body to ``path`` may have on the node-facing listener."""
    return max_object_bytes + OBJECT_FRAMING_BYTES if path == OBJECT_PUSH else SMALL_BODY_BYTES


class FleetOnly:
    """ASGI app: Flower's app for Fleet API paths, 403 for anything else, and no body read
    before the node is known and the body's size is within its path's limit.

    The path must match :data:`FLEET_PATH` exactly (no dot segments, no doubled slashes, no
    query-string tricks: the query is not part of ``scope["path"]``).

    Parameters
    ----------
    app : ASGI app
        Flower's SuperLink app; its ``state.enable_supernode_auth`` says whether keys must be
        registered, its ``state.linkstate_factory`` holds them.
    max_object_bytes : int
        The largest object a node may push (:func:`body_limit`).
    """

    def __init__(self, app: Any, max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES) -> None:
        self.app = app
        self.max_object_bytes = max_object_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and FLEET_PATH.fullmatch(path) and not scope.get("root_path"):
            if path == "/health":
                await self.app(scope, receive, send)
                return
            await self._fleet_call(scope, receive, send)
            return
        # the path is the caller's (%0a decodes to a newline): escaped, so it cannot forge log lines
        _log_refusal(scope, "only the Fleet API is served here")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            return
        await _respond(send, 403, "only the Fleet API (/v1/fleet/*) is served on this address")

    async def _fleet_call(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Authenticate, check the declared length, then pass the call on with its body counted."""
        unknown = await self._unauthenticated(scope)
        if unknown is not None:
            _log_refusal(scope, unknown)
            if scope["path"] == ACTIVATE and unknown == UNREGISTERED:  # a node starting: tell it what to do
                await _respond_activation_failed(send, "this node's public key is not registered with the "
                                                 "SuperLink: its operator registers it (deploy/register-node.sh)")
                return
            await _respond(send, 401, "node authentication required: a registered node's signed timestamp")
            return
        if scope["path"] == ACTIVATE and await self._activation_refused(scope, send):
            return
        limit = body_limit(scope["path"], self.max_object_bytes)
        declared = _header(scope, "content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            _log_refusal(scope, f"declared body of {printable(declared, 24)} bytes, above its limit {limit}")
            await _respond(send, 413, f"request body above this call's limit of {limit} bytes")
            return
        await self._counted(scope, receive, send, limit)

    async def _counted(self, scope: dict[str, Any], receive: Any, send: Any, limit: int) -> None:
        """Flower's app, with the body it reads cut off at ``limit`` bytes (then 413)."""
        seen, over, started = 0, False, False

        async def counting_receive() -> dict[str, Any]:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    raise BodyTooLarge(f"{seen} bytes read, limit {limit}")
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal started
            if over:  # whatever Flower answers to the aborted read (a 500) is replaced by the 413 below
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:  # Flower logs the cut-off read as an unexpected error: our warning says what it was
            if not over:
                raise
        if over:
            _log_refusal(scope, f"body streamed past its limit of {limit} bytes")
            if not started:
                await _respond(send, 413, f"request body above this call's limit of {limit} bytes")

    async def _unauthenticated(self, scope: dict[str, Any]) -> str | None:
        """Why the request is not from a node (None: it is), from its headers alone.

        Every Flower SuperNode signs the current time with its key on every Fleet call (with
        node authentication off too, with a key of its own making); with authentication on, the
        key must also be registered. A node's id is in the body: Flower checks it after parsing.
        """
        from starlette.concurrency import run_in_threadpool

        from promptfcl.common.flower_internals import internal

        names = [internal(n) for n in ("node_public_key_header", "node_signature_header", "node_timestamp_header")]
        values = [_header(scope, name.lower()) for name in names]
        if any(v is None for v in values):
            return "no node-authentication headers"
        key_text, signature_text, timestamp = values
        try:
            key = b64decode(key_text, validate=True)
            signature = b64decode(signature_text, validate=True)
            age = (datetime.datetime.now(datetime.UTC)
                   - datetime.datetime.fromisoformat(timestamp)).total_seconds()
            drift = internal("system_time_tolerance")
            if not -drift < age < internal("timestamp_tolerance") + drift:
                return "a signed timestamp outside the allowed window"
            if not internal("verify_signature")(internal("bytes_to_public_key")(key), timestamp.encode("ascii"),
                                                signature):
                return "a signature that does not verify"
        except (ValueError, TypeError, UnicodeError, binascii.Error):
            return "malformed node-authentication headers"
        state = getattr(self.app, "state", None)
        if not getattr(state, "enable_supernode_auth", False):
            return None
        linkstate = state.linkstate_factory.state()
        node_id = await run_in_threadpool(linkstate.get_node_id_by_public_key, key)
        if node_id is None:
            return UNREGISTERED
        scope[NODE_ID] = node_id  # the registered identity, for the activation check
        return None

    async def _activation_refused(self, scope: dict[str, Any], send: Any) -> bool:
        """Answer an activation Flower would refuse only as "Failed to activate SuperNode", saying
        why: the key's identity is still marked online (a node restarted at once after a crash,
        until its heartbeats time out; or a copy of its key running elsewhere). A probe
        (:data:`REJOIN_PROBE` header, ``deploy/supernode.py``) is answered here either way and
        never reaches Flower. Returns whether it answered."""
        from starlette.concurrency import run_in_threadpool

        node_id = scope.get(NODE_ID)
        online = None if node_id is None else await run_in_threadpool(self._still_online, node_id)
        if online is not None:
            _log_refusal(scope, online)
            await _respond_activation_failed(send, online)
            return True
        if _header(scope, REJOIN_PROBE) is not None:
            await _respond(send, 200, json.dumps({"ready": True}), b"application/json")
            return True
        return False

    def _still_online(self, node_id: int) -> str | None:
        """Why ``node_id`` cannot be activated now (None: it can): Flower activates a registered
        or offline node only, and marks a node offline once its heartbeats have stopped for its
        patience (2 x 30 s)."""
        from promptfcl.common.flower_internals import internal

        # Flower's app state, LinkState and NodeInfo: registered (and checked) in the door as
        # superlink_app, linkstate_factory, linkstate and node_info
        infos = self.app.state.linkstate_factory.state().get_node_info(node_ids=[node_id])
        if not infos or infos[0].status != internal("node_status").ONLINE:
            return None
        info = infos[0]
        until = datetime.datetime.fromtimestamp(info.online_until, datetime.UTC)
        left = max(0.0, info.online_until - time.time())
        return (f"{node_label(node_id, info.name, info.public_key)} {STILL_ONLINE} until {until:%H:%M:%S} UTC "
                f"({left:.0f} s from now, when its last heartbeat times out): a node restarted at once after a "
                "crash can rejoin then (deploy/start-client.sh waits and retries); if this node was not "
                "restarted, another machine is running with a copy of its key")


async def _respond_activation_failed(send: Any, why: str) -> None:
    """Flower's answer to a failed activation (412, its error code 2004, "Failed to activate
    SuperNode."), with ``why`` as the detail a SuperNode prints before it exits."""
    from promptfcl.common.flower_internals import internal

    code = int(internal("api_error_code").FLEET_NODE_ACTIVATION_FAILED)
    body = json.dumps({"code": code, "detail": "Failed to activate SuperNode.", "extra": why})
    await _respond(send, 412, body, b"application/json")


def _header(scope: dict[str, Any], name: str) -> str | None:
    """The value of the request header ``name`` (lower case), or None."""
    wanted = name.encode("latin-1")
    for key, value in scope.get("headers", []):
        if key.lower() == wanted:
            return value.decode("latin-1")
    return None


def _log_refusal(scope: dict[str, Any], why: str) -> None:
    """One log line per refused request, with the caller's address (everything it chose escaped)."""
    client = scope.get("client") or ("?", 0)
    log.warning("node-facing address: refused %s %s from %s:%s (%s)",
                printable(str(scope.get("method", scope["type"])), 20), printable(scope.get("path", ""), 200),
                printable(str(client[0]), 64), client[1], why)


async def _respond(send: Any, status: int, text: str, content_type: bytes = b"text/plain") -> None:
    """A response that closes the exchange (the body, if any, stays unread)."""
    body = (text + "\n").encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def serve_two_listeners(fleet_host: str, fleet_port: int,  # noqa: ANN201 (uvicorn.run's signature)
                        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES):
    """A stand-in for ``uvicorn.run`` that serves Flower's app on its own address (control) and,
    through :class:`FleetOnly`, on ``fleet_host:fleet_port``."""
    import uvicorn

    def run(app: Any, *, host: str, port: int, **options: Any) -> None:
        options.pop("workers", None)
        options.pop("reload", None)
        control = uvicorn.Server(uvicorn.Config(app, host=host, port=port, timeout_keep_alive=KEEP_ALIVE_SECONDS,
                                                **options))
        fleet = uvicorn.Server(uvicorn.Config(FleetOnly(app, max_object_bytes), host=fleet_host, port=fleet_port,
                                              lifespan="off", timeout_keep_alive=KEEP_ALIVE_SECONDS, **options))
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
    ours, flower_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    from promptfcl.common.flower_internals import internal

    flower_superlink = internal("superlink_main")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s promptfcl-superlink: %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    if ours.max_object_bytes < 1:
        parser.error("--max-object-bytes must be positive")
    # flower_superlink calls uvicorn.run (checked by the door: superlink_uvicorn)
    internal("superlink_uvicorn").run = serve_two_listeners(ours.fleet_host, ours.fleet_port, ours.max_object_bytes)
    sys.argv = ["flower-superlink", *flower_args]
    return flower_superlink()


if __name__ == "__main__":
    sys.exit(main())
