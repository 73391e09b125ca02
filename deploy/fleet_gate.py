"""The SuperLink's node-facing listener: the Fleet API, and only what a node may send (deploy/superlink.py).

Flower's HTTP app reads and parses a request's whole body before it authenticates the node
that sent it, and then authenticates only the node the request names, not what it carries.
:class:`FleetOnly` stands in front of it and decides, in order:

* **where**: ``/v1/fleet/<call>`` and ``/health`` pass; every other path gets 403 (logged with
  the caller's address);
* **who**: a Fleet call must carry a node's signed, fresh timestamp (the headers every Flower
  SuperNode sends, checked as Flower checks them) and, with node authentication on, a
  registered public key; otherwise 401, before any of the body is read;
* **how much, per call**: each call's body is bounded by its path (:func:`body_limit`): an object
  push by ``--max-object-bytes``, every other call by :data:`SMALL_BODY_BYTES`; a declared
  ``Content-Length`` above it is refused with 413 unread, and the bytes actually streamed are
  counted, so a body without a length, or longer than it said, is cut off at the limit;
* **how much, per node** (:class:`NodeUploads`): a signed timestamp is valid for minutes and can
  be replayed on parallel connections, so one node (one key) has at most
  :data:`MAX_NODE_CALLS` calls in flight, of which as many object pushes as a SuperNode makes at
  once (Flower's 2), and at most ``--max-node-bytes`` of bodies in flight; beyond that 503 with
  ``Retry-After`` (Flower's SuperNode retries it), unread;
* **what**: a ``push-messages`` body (at most 256 KiB) is read and parsed here first: every
  message in it must be the caller's reply to a message sent to it
  (deploy/fleet_rules.py ``message_refusal``), else 403 and Flower never sees it;
* **rejoin**: an activation of an identity still marked online is answered here, saying why and
  when it may rejoin, or let through once its old session has ended (``rejoin_decision``).

Every refusal of a known node is logged with its registered name and counted per node.
"""

from __future__ import annotations

import asyncio
import binascii
import datetime
import gc
import json
import logging
import re
import time
from base64 import b64decode
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from promptfcl.common.flower_internals import internal
from promptfcl.common.node.identity import ACTIVATE, REJOIN_PROBE, key_fingerprint
from promptfcl.common.text import printable
from promptfcl.deploy.fleet_rules import label_of, message_refusal, rejoin_decision

#: what a SuperNode calls (flwr/supernode/fleet_http_client.py) and the health probe
FLEET_PATH = re.compile(r"/v1/fleet/[a-z][a-z-]*|/health")
#: the call that carries a message's objects (its arrays, cut by Flower into 5 MB chunks, and
#: each record): bounded by ``--max-object-bytes``
OBJECT_PUSH = "/v1/fleet/push-object"
#: the call that carries a node's reply messages (their metadata; the contents follow as objects)
MESSAGE_PUSH = "/v1/fleet/push-messages"
#: the run config's max-reply-bytes default: no reply a run accepts has a larger object
DEFAULT_MAX_OBJECT_BYTES = 256_000_000
#: the fields around an object in a push (node, run id, object id)
OBJECT_FRAMING_BYTES = 64 * 1024
#: every other Fleet call sends ids, a node's public key, a heartbeat or a message's object tree
#: (about 100 bytes per array chunk): kilobytes in any run
SMALL_BODY_BYTES = 256 * 1024
#: bodies from this size on, answered with an error, are swept up after (:class:`Sweeper`)
LARGE_BODY_BYTES = 1 << 20
#: a sweep waits this long after such an answer (the request's tasks end first), and sweeps are
#: at least :data:`SWEEP_INTERVAL_SECONDS` apart (each pauses the listener for a full collection)
SWEEP_DELAY_SECONDS = 0.5
SWEEP_INTERVAL_SECONDS = 2.0
#: Fleet calls one node may have in flight: a SuperNode makes one call at a time from its loop
#: (two object transfers at once), plus its heartbeat
MAX_NODE_CALLS = 8
UNREGISTERED = "a public key that is not registered"

log = logging.getLogger("promptfcl.superlink")


def body_limit(path: str, max_object_bytes: int) -> int:
    """The most bytes a request body to ``path`` may have on the node-facing listener."""
    return max_object_bytes + OBJECT_FRAMING_BYTES if path == OBJECT_PUSH else SMALL_BODY_BYTES


@dataclass
class Caller:
    """A request's node: the public key that signed it, and its node id where known."""

    key: bytes
    node_id: int | None = None


@dataclass
class InFlight:
    calls: int = 0
    pushes: int = 0
    bytes: int = 0


class NodeUploads:
    """What each node (public key) has in flight: calls, object pushes and body bytes, bounded.

    The gate runs on one event loop and neither method awaits, so a check and its reservation
    are one step."""

    def __init__(self, max_calls: int, max_pushes: int, max_bytes: int) -> None:
        self.max_calls, self.max_pushes, self.max_bytes = max_calls, max_pushes, max_bytes
        self.by_key: dict[bytes, InFlight] = {}

    def admit(self, key: bytes, push: bool, size: int) -> str | None:
        """Reserve one call of up to ``size`` bytes (``push``: an object push); why not (None: reserved)."""
        now = self.by_key.setdefault(key, InFlight())
        if push and now.pushes >= self.max_pushes:
            why = f"{now.pushes} object pushes of this node in flight already, its limit"
        elif now.calls >= self.max_calls:
            why = f"{now.calls} calls of this node in flight already, its limit"
        elif now.bytes + size > self.max_bytes:
            why = f"{now.bytes} bytes of this node's bodies in flight, {size} more pass its limit {self.max_bytes}"
        else:
            now.calls, now.pushes, now.bytes = now.calls + 1, now.pushes + push, now.bytes + size
            return None
        if not now.calls:
            del self.by_key[key]
        return why

    def release(self, key: bytes, push: bool, size: int) -> None:
        now = self.by_key[key]
        now.calls, now.pushes, now.bytes = now.calls - 1, now.pushes - push, now.bytes - size
        if not now.calls:
            del self.by_key[key]


class Sweeper:
    """A full garbage collection soon after Flower answered a large body with an error, at most
    one every :data:`SWEEP_INTERVAL_SECONDS`.

    Flower's app answers a failed call (a run not running, an unknown push session) by raising,
    and the exception's traceback holds the frames that hold the request, its body and the parsed
    copy: a reference cycle, freed only at Python's next collection of the generation it reached,
    which a long-running SuperLink may not make for minutes (two refused 50 MB pushes kept it
    200 MB above idle in the deployment test). Only error answers: an accepted body leaves no
    cycle, so a node's ordinary uploads never pause the listener."""

    def __init__(self) -> None:
        self.timer: asyncio.TimerHandle | None = None
        self.last = float("-inf")

    def failed(self, size: int) -> None:
        """A body of ``size`` bytes was answered with an error (on the event loop)."""
        if size < LARGE_BODY_BYTES or self.timer is not None:
            return
        loop = asyncio.get_running_loop()
        delay = max(SWEEP_DELAY_SECONDS, self.last + SWEEP_INTERVAL_SECONDS - loop.time())
        self.timer = loop.call_later(delay, self.sweep, loop)

    def sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer, self.last = None, loop.time()
        started = time.perf_counter()
        freed = gc.collect()
        log.debug("swept %d objects after a failed large body in %.3f s", freed, time.perf_counter() - started)


class FleetOnly:
    """ASGI app: Flower's app for Fleet API paths, 403 for anything else; no body read before the
    node is known, its body is within its path's and its node's bounds, and (a message push) what
    it carries is the node's own reply.

    The path must match :data:`FLEET_PATH` exactly (no dot segments, no doubled slashes, no
    query-string tricks: the query is not part of ``scope["path"]``).

    Parameters
    ----------
    app : ASGI app
        Flower's SuperLink app; its ``state.enable_supernode_auth`` says whether keys must be
        registered, its ``state.linkstate_factory`` holds them.
    max_object_bytes : int
        The largest object a node may push (:func:`body_limit`).
    max_node_bytes : int, optional
        The most body bytes one node may have in flight (default: one largest object push).
    clock : callable, optional
        The time now (``time.time``): how old a node's last heartbeat is.
    """

    def __init__(self, app: Any, max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
                 max_node_bytes: int | None = None, clock: Callable[[], float] = time.time) -> None:
        self.app = app
        self.clock = clock
        self.max_object_bytes = max_object_bytes
        cap = body_limit(OBJECT_PUSH, max_object_bytes) if max_node_bytes is None else max_node_bytes
        self.uploads = NodeUploads(MAX_NODE_CALLS, int(internal("max_concurrent_object_pushes")), cap)
        self.refusals: Counter[str] = Counter()  # per node (its label): refusals so far
        self.sweeper = Sweeper()
        self._labels: dict[int, str] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and FLEET_PATH.fullmatch(path) and not scope.get("root_path"):
            if path == "/health":
                await self.app(scope, receive, send)
                return
            await self._fleet_call(scope, receive, send)
            return
        # the path is the caller's (%0a decodes to a newline): escaped, so it cannot forge log lines
        log_refusal(scope, "only the Fleet API is served here")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            return
        await respond(send, 403, "only the Fleet API (/v1/fleet/*) is served on this address")

    def _linkstate(self) -> Any:
        return self.app.state.linkstate_factory.state()

    async def _fleet_call(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Authenticate, check the declared length and the node's bounds, read the body (within
        them), check a message push's messages, then hand Flower the call."""
        caller = await self._caller(scope)
        if isinstance(caller, str):
            log_refusal(scope, caller)
            if scope["path"] == ACTIVATE and caller == UNREGISTERED:  # a node starting: tell it what to do
                await respond_activation_failed(send, "this node's public key is not registered with the "
                                                "SuperLink: its operator registers it (deploy/register-node.sh)")
                return
            await respond(send, 401, "node authentication required: a registered node's signed timestamp")
            return
        path = scope["path"]
        if path == ACTIVATE and await self._activation_answered(scope, caller, send):
            return
        limit = body_limit(path, self.max_object_bytes)
        declared = header(scope, "content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            log_refusal(scope, f"declared body of {printable(declared, 24)} bytes, above its limit {limit}")
            await respond(send, 413, f"request body above this call's limit of {limit} bytes")
            return
        size = limit if declared is None else int(declared)
        busy = self.uploads.admit(caller.key, path == OBJECT_PUSH, size)
        if busy is not None:
            await self._refuse(scope, caller, busy)
            await respond(send, 503, "this node has too many uploads in flight: retry", extra=[(b"retry-after", b"1")])
            return
        try:
            parcel = await self._read_body(scope, receive, send, size)
            if parcel is not None and (path != MESSAGE_PUSH or await self._own_replies(scope, send, caller, parcel[0])):
                await self._pass_on(scope, parcel, receive, send, size)
        finally:
            self.uploads.release(caller.key, path == OBJECT_PUSH, size)

    async def _read_body(self, scope: dict[str, Any], receive: Any, send: Any, limit: int) -> list[bytearray] | None:
        """The request's whole body, read here before Flower sees any of it (in a list: whoever
        holds it can let go of it). One buffer, grown as bytes arrive (never committed before
        they do), so a large body is one mapping that goes back to the operating system when
        freed, not Flower's list of 64 KiB pieces on the heap. None, answered, when it passes
        ``limit`` (413) or the caller went away."""
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None  # the caller went away
            body += message.get("body", b"")
            if len(body) > limit:
                log_refusal(scope, f"body streamed past its limit of {limit} bytes")
                await respond(send, 413, f"request body above this call's limit of {limit} bytes")
                return None
            more = message.get("more_body", False)
        return [body]

    async def _own_replies(self, scope: dict[str, Any], send: Any, caller: Caller, body: bytearray) -> bool:
        """Whether every message of a message push is the caller's reply to a message sent to it
        (deploy/fleet_rules.py); if not, answered (403, or 400 for a body that is no push)."""
        from starlette.concurrency import run_in_threadpool

        linkstate = self._linkstate()
        if caller.node_id is None:  # node authentication off: the key's self-registered node
            caller.node_id = await run_in_threadpool(linkstate.get_node_id_by_public_key, caller.key)
        if caller.node_id is None:
            refusal: tuple[int, str] | None = (403, "a key that no node holds")
        else:
            refusal = await run_in_threadpool(message_refusal, bytes(body), caller.node_id, linkstate)
        if refusal is None:
            return True
        status, why = refusal
        await self._refuse(scope, caller, why)
        await respond(send, status, f"refused: {why}")
        return False

    async def _pass_on(self, scope: dict[str, Any], parcel: list[bytearray], receive: Any, send: Any,
                       size: int) -> None:
        """Flower's app, reading the body in ``parcel`` (``size`` bytes reserved) as the request's,
        in one piece (then the caller's later events: its disconnect); the gate lets go of it once
        Flower has it, and of what Flower kept of it once Flower has answered."""
        status = [500]  # an exception before Flower answers is a failure too

        async def watched_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        async def replay() -> dict[str, Any]:
            if parcel:
                return {"type": "http.request", "body": parcel.pop(), "more_body": False}
            return dict(await receive())

        try:
            await self.app(scope, replay, watched_send)
        finally:
            if status[0] >= 400:
                self.sweeper.failed(size)
            # Flower keeps the parsed request (a 50 MB object push: 50 MB) in the request's state,
            # which outlives the answer as long as the server keeps the request's scope
            state = scope.get("state")
            if isinstance(state, dict):
                state.clear()

    async def _caller(self, scope: dict[str, Any]) -> Caller | str:
        """The node that signed the request (its key, and with node authentication on its node id),
        or why the request is not from a node, from its headers alone.

        Every Flower SuperNode signs the current time with its key on every Fleet call (with
        node authentication off too, with a key of its own making); with authentication on, the
        key must also be registered. Flower repeats its own check after parsing (the node id in
        the body must be the key's).
        """
        from starlette.concurrency import run_in_threadpool

        names = [internal(n) for n in ("node_public_key_header", "node_signature_header", "node_timestamp_header")]
        values = [header(scope, name.lower()) for name in names]
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
            return Caller(key)
        node_id = await run_in_threadpool(self._linkstate().get_node_id_by_public_key, key)
        return UNREGISTERED if node_id is None else Caller(key, int(node_id))

    async def _activation_answered(self, scope: dict[str, Any], caller: Caller, send: Any) -> bool:
        """Answer an activation Flower would refuse only as "Failed to activate SuperNode", saying
        why: the key's identity is still marked online by a session that may be live (a node
        restarted at once after a crash, until its last heartbeat is older than a live one leaves;
        or a copy of its key running elsewhere). An identity whose session has ended is marked
        offline first (deploy/fleet_rules.py ``rejoin_decision``). A probe (:data:`REJOIN_PROBE`
        header, ``deploy/supernode.py``) is answered here either way and never reaches Flower.
        Returns whether it answered."""
        from starlette.concurrency import run_in_threadpool

        if caller.node_id is not None:
            refused, rejoined = await run_in_threadpool(rejoin_decision, self._linkstate(), caller.node_id,
                                                        self.clock())
            if rejoined is not None:
                log.warning("rejoin: %s", rejoined)
            if refused is not None:
                log_refusal(scope, refused)
                await respond_activation_failed(send, refused)
                return True
        if header(scope, REJOIN_PROBE) is not None:
            await respond(send, 200, json.dumps({"ready": True}), b"application/json")
            return True
        return False

    async def _refuse(self, scope: dict[str, Any], caller: Caller, why: str) -> None:
        """Log a refusal of a known caller under its node's registered name, counted per node."""
        from starlette.concurrency import run_in_threadpool

        if caller.node_id is None:
            who = f"key {key_fingerprint(caller.key)}"
        else:
            if caller.node_id not in self._labels:
                self._labels[caller.node_id] = await run_in_threadpool(label_of, self._linkstate(), caller.node_id)
            who = self._labels[caller.node_id]
        self.refusals[who] += 1
        log_refusal(scope, f"{why}; refusal {self.refusals[who]} of {who}")


async def respond_activation_failed(send: Any, why: str) -> None:
    """Flower's answer to a failed activation (412, its error code 2004, "Failed to activate
    SuperNode."), with ``why`` as the detail a SuperNode prints before it exits."""
    code = int(internal("api_error_code").FLEET_NODE_ACTIVATION_FAILED)
    body = json.dumps({"code": code, "detail": "Failed to activate SuperNode.", "extra": why})
    await respond(send, 412, body, b"application/json")


def header(scope: dict[str, Any], name: str) -> str | None:
    """The value of the request header ``name`` (lower case), or None."""
    wanted = name.encode("latin-1")
    for key, value in scope.get("headers", []):
        if key.lower() == wanted:
            return str(value.decode("latin-1"))
    return None


def log_refusal(scope: dict[str, Any], why: str, where: str = "node-facing address") -> None:
    """One log line per refused request, with the caller's address (everything it chose escaped)."""
    client = scope.get("client") or ("?", 0)
    log.warning("%s: refused %s %s from %s:%s (%s)", where,
                printable(str(scope.get("method", scope["type"])), 20), printable(scope.get("path", ""), 200),
                printable(str(client[0]), 64), client[1], why)


async def respond(send: Any, status: int, text: str, content_type: bytes = b"text/plain",
                  extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """A response that closes the exchange (the body, if any, stays unread)."""
    body = (text + "\n").encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(extra or [])]})
    await send({"type": "http.response.body", "body": body})
