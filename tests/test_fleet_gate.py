"""What a node machine can send the SuperLink: the gate in front of Flower's app (deploy/fleet_gate.py).

The node-facing listener passes the Fleet API only, only from a node's signed headers, within
each call's and each node's bounds, and only a node's own replies to messages sent to it; the
control listener refuses the Fleet API; a crashed node's restart rejoins once its old session
has ended. Where the gate reads Flower's state, these tests give it a real one (Flower's
SqlLinkState on a state.db, with registered nodes, a run and messages sent to the nodes); the
end-to-end counterparts over real processes are in tests/test_deploy.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import pytest

from promptfcl.common.flower_internals import internal
from promptfcl.deploy.fleet_gate import MESSAGE_PUSH, OBJECT_FRAMING_BYTES, OBJECT_PUSH, SMALL_BODY_BYTES, FleetOnly

ACTIVATE = "/v1/fleet/activate-node"
# Flower's SqlLinkState migrates its state.db with alembic, which warns about its own configuration
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:alembic.*")


class FlowerStandIn:
    """Flower's app as the node-facing listener sees it: reads the whole body (as Flower's
    protobuf translation does, before it authenticates), then answers 200 (once ``hold`` is set)."""

    def __init__(self, registered: set[bytes] | None = None, factory: Any = None, auth: bool = True,
                 hold: asyncio.Event | None = None) -> None:
        """``registered``: node authentication on, these keys registered (as node 7, "node-a");
        ``factory``: a real LinkStateFactory instead (``auth``: node authentication on)."""
        import types

        self.called: list[str] = []
        self.chunks_read = 0
        self.body = b""
        self.hold = hold
        if registered is not None:
            info = types.SimpleNamespace(node_id=7, name="node-a", public_key=b"k", online_until=0.0,
                                         heartbeat_interval=30.0, status="offline")
            lookup = types.SimpleNamespace(get_node_id_by_public_key=lambda key: 7 if key in registered else None,
                                           get_node_info=lambda node_ids: [info] if 7 in node_ids else [])
            factory = types.SimpleNamespace(state=lambda: lookup)
        if factory is not None:
            self.state = types.SimpleNamespace(enable_supernode_auth=auth, linkstate_factory=factory)

    async def __call__(self, scope, receive, send):
        self.called.append(scope["path"])
        more = True
        while more:
            message = await receive()
            self.chunks_read += 1
            self.body += message.get("body", b"")
            more = message.get("more_body", False)
        if self.hold is not None:
            await self.hold.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"flower"})


def signed_headers(key=None, age: float = 0.0) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A SuperNode's node-authentication headers (its public key, a timestamp ``age`` seconds old
    and its signature, as flwr's NodeAuthHttpInterceptor makes them) and the public key's bytes."""
    import base64
    import datetime

    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = key or ec.generate_private_key(ec.SECP384R1())
    public = public_bytes(key)
    stamp = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=age)).isoformat()
    signature = key.sign(stamp.encode("ascii"), ec.ECDSA(hashes.SHA256()))
    return [(b"flwr-public-key", base64.b64encode(public)), (b"flwr-timestamp", stamp.encode()),
            (b"flwr-signature", base64.b64encode(signature))], public


def public_bytes(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


async def call(gate, path: str, method: str = "POST", headers=(), chunks=(b"",)) -> tuple[int, bytes, dict]:
    """(status, body, response headers) of one HTTP request to the ASGI app ``gate``."""
    sent, pending = [], list(chunks)

    async def receive():
        body = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "client": ("10.0.0.7", 5555),
             "headers": list(headers), "query_string": b""}
    await gate(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body, dict(start["headers"])


def asgi_call(app, path: str, method: str = "POST", headers=(), chunks=(b"",), inner=None,
              ) -> tuple[int, bytes, bool]:
    """(status, body, whether the wrapped app was called) for one HTTP request to ``app(inner)``,
    its body sent as ``chunks``."""
    inner = inner or FlowerStandIn()
    status, body, _ = asyncio.run(call(app(inner), path, method, headers, chunks))
    return status, body, bool(inner.called)


# ----------------------------------------------------------------------------- a real SuperLink state
@dataclass
class Federation:
    """Flower's own SuperLink state with two registered, online nodes, a run, and one train
    message sent to each node (``sent``: node name -> its message id)."""

    factory: Any
    state: Any
    run_id: int
    keys: dict[str, Any]
    ids: dict[str, int]
    sent: dict[str, str]


@pytest.fixture
def federation(tmp_path) -> Federation:
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    _, factory = internal("linkstate_factories")(str(tmp_path / "state.db"), internal("federation_manager")())
    state = factory.state()
    keys = {name: ec.generate_private_key(ec.SECP384R1()) for name in ("node-a", "node-b")}
    ids = {name: int(state.create_node("operator", "operator", public_bytes(key), 10, name=name))
           for name, key in keys.items()}
    for node in ids.values():
        assert state.activate_node(node, 10)  # as a SuperNode declaring a 10 s heartbeat interval
    run_id = state.create_run(None, None, "fab", {}, internal("noop_federation_id"), None, "operator", "serverapp")
    identity = internal("task_identity")
    saved = (identity._task_id, identity._run_id, identity._node_id)
    identity.task_id, identity.run_id, identity.node_id = 1, run_id, internal("superlink_node_id")  # the ServerApp's
    try:
        sent = {}
        for name, node in ids.items():
            message = Message(RecordDict({"config": ConfigRecord({"task": 0})}), dst_node_id=node,
                              message_type=MessageType.TRAIN)
            message.metadata.__dict__["_message_id"] = message.object_id  # as Flower's grid sets it
            sent[name] = state.store_message_ins(message)
            assert sent[name]
    finally:
        identity._task_id, identity._run_id, identity._node_id = saved
    return Federation(factory, state, run_id, keys, ids, sent)


def push_body(node: int, src: int, dst: int, run_id: int, reply_to: str = "", error: str = "") -> bytes:
    """A push-messages request from ``node`` carrying one message's metadata, as a SuperNode sends it."""
    request = internal("push_messages_request")()
    request.node.node_id = node
    message = request.messages_list.add()
    meta = message.metadata
    meta.run_id, meta.src_node_id, meta.dst_node_id, meta.reply_to_message_id = run_id, src, dst, reply_to
    meta.message_id, meta.message_type, meta.created_at, meta.ttl = "ab" * 32, "train", time.time(), 600.0
    if error:
        message.error.reason = error
    request.message_object_trees.add().object_id = meta.message_id
    return bytes(request.SerializeToString())


# ----------------------------------------------------------------------------- where, who, how much per call
def test_node_facing_listener_passes_fleet_calls_and_refuses_everything_else():
    headers, _ = signed_headers()
    for path in ("/v1/fleet/pull-messages", OBJECT_PUSH, ACTIVATE, "/health"):
        assert asgi_call(FleetOnly, path, headers=headers) == (200, b"flower", True), path
    for path in ("/v1/control/list-runs", "/v1/control/start-run", "/v1/control/stop-run", "/v1/runtime/get-nodes",
                 "/v1/fleet/../control/list-runs", "/v1/fleet//pull-messages", "/v1/fleet/", "/docs",
                 "/openapi.json", "/", "/v1/fleet/pull-messages/x", "/healthz"):
        status, body, called = asgi_call(FleetOnly, path, headers=headers)
        assert status == 403 and not called and b"only the Fleet API" in body, path


def test_node_facing_listener_knows_the_node_and_bounds_the_body_before_reading_it(caplog):
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    headers, public = signed_headers(key)
    stale, _ = signed_headers(key, age=3600)
    forged = [(k, v if k != b"flwr-signature" else signed_headers()[0][2][1]) for k, v in headers]
    other_key, _ = signed_headers()
    # no headers, a stale or forged signature: 401, Flower's app never called (nothing read)
    for bad in ([], stale, forged, [(b"flwr-public-key", b"%%%")] + headers[1:]):
        status, body, called = asgi_call(FleetOnly, OBJECT_PUSH, headers=bad, chunks=[b"x" * 1000])
        assert (status, called) == (401, False) and b"node authentication required" in body
    # with node authentication on, a well-signed but unregistered key is refused too
    registered = functools.partial(FlowerStandIn, {public})
    assert asgi_call(FleetOnly, "/v1/fleet/pull-messages", headers=headers, inner=registered())[0] == 200
    assert asgi_call(FleetOnly, "/v1/fleet/pull-messages", headers=other_key, inner=registered())[:2] == (
        401, b"node authentication required: a registered node's signed timestamp\n")
    # a node starting with an unregistered key is told so, in the error format a SuperNode prints
    status, body, called = asgi_call(FleetOnly, ACTIVATE, headers=other_key, inner=registered())
    assert (status, called) == (412, False)
    assert json.loads(body) == {"code": 2004, "detail": "Failed to activate SuperNode.", "extra":
                                "this node's public key is not registered with the SuperLink: its operator "
                                "registers it (deploy/register-node.sh)"}
    # a declared length beyond the path's limit: 413 unread; an object push may carry more
    small = SMALL_BODY_BYTES + 1
    length = [(b"content-length", str(small).encode())]
    assert asgi_call(FleetOnly, "/v1/fleet/pull-messages", headers=headers + length)[::2] == (413, False)
    assert asgi_call(FleetOnly, OBJECT_PUSH, headers=headers + length, chunks=[b"x" * small]) == (200, b"flower", True)
    tight = functools.partial(FleetOnly, max_object_bytes=10)
    too_long = [(b"content-length", str(11 + OBJECT_FRAMING_BYTES).encode())]
    assert asgi_call(tight, OBJECT_PUSH, headers=headers + too_long)[::2] == (413, False)
    # no declared length: the streamed bytes are counted and the read cut at the limit, before
    # Flower's app has any of them (the gate reads a body whole, then hands it on in one piece)
    inner = FlowerStandIn()
    with caplog.at_level("WARNING", logger="promptfcl.superlink"):
        status, body, called = asgi_call(FleetOnly, "/v1/fleet/send-node-heartbeat", headers=headers,
                                         chunks=[b"x" * 65536] * 100, inner=inner)
    assert (status, called) == (413, False) and b"limit of 262144 bytes" in body
    assert any("body streamed past its limit" in m and "10.0.0.7" in m for m in caplog.messages)
    inner = FlowerStandIn()
    chunks = [b"x" * 65536] * (SMALL_BODY_BYTES // 65536)  # at the limit: Flower reads all of it, in one piece
    assert asgi_call(FleetOnly, "/v1/fleet/send-node-heartbeat", headers=headers, chunks=chunks, inner=inner) == \
        (200, b"flower", True)
    assert inner.chunks_read == 1 and inner.body == b"".join(chunks)


# ----------------------------------------------------------------------------- how much per node
def test_one_node_has_few_uploads_in_flight_however_often_it_replays_its_headers(caplog):
    """One signed header set replayed on parallel calls: at most 2 object pushes (a SuperNode's
    own concurrency) and ``max_node_bytes`` of bodies in flight per node, the rest refused with
    503 and Retry-After, unread; another node is not held up, and finished calls free their share."""
    headers, _ = signed_headers()
    others, _ = signed_headers()

    def length(n: int) -> list[tuple[bytes, bytes]]:
        return [(b"content-length", str(n).encode())]

    async def scenario() -> dict[str, Any]:
        release = asyncio.Event()
        inner = FlowerStandIn(hold=release)  # Flower answers once released: the calls stay in flight
        gate = FleetOnly(inner, max_object_bytes=1000, max_node_bytes=1500)
        held = [asyncio.create_task(call(gate, OBJECT_PUSH, headers=headers + length(500), chunks=[b"x" * 500]))
                for _ in range(2)]
        while len(inner.called) < 2:
            await asyncio.sleep(0.001)
        out = {
            "third push": await call(gate, OBJECT_PUSH, headers=headers + length(10), chunks=[b"x" * 10]),
            "past the byte cap": await call(gate, "/v1/fleet/send-node-heartbeat", headers=headers + length(600),
                                            chunks=[b"x" * 600]),
        }
        other = asyncio.create_task(call(gate, OBJECT_PUSH, headers=others + length(500), chunks=[b"x" * 500]))
        while len(inner.called) < 3:
            await asyncio.sleep(0.001)
        release.set()
        out["held"] = [await task for task in held] + [await other]
        out["after"] = await call(gate, OBJECT_PUSH, headers=headers + length(1000), chunks=[b"x" * 1000])
        out["reached flower"] = len(inner.called)
        out["in flight"] = dict(gate.uploads.by_key)
        return out

    with caplog.at_level("WARNING", logger="promptfcl.superlink"):
        out = asyncio.run(scenario())
    for refused in ("third push", "past the byte cap"):
        status, _, response_headers = out[refused]
        assert status == 503 and response_headers[b"retry-after"] == b"1", refused
    assert [status for status, _, _ in out["held"]] == [200, 200, 200] and out["after"][0] == 200
    assert out["reached flower"] == 4 and out["in flight"] == {}  # the refused two never did; nothing left reserved
    assert any("2 object pushes of this node in flight already, its limit" in m and "refusal 1 of key" in m
               for m in caplog.messages)
    assert any("1000 bytes of this node's bodies in flight, 600 more pass its limit 1500" in m and
               "refusal 2 of key" in m for m in caplog.messages)


def test_what_flower_keeps_of_a_large_body_it_refused_is_swept_up():
    """Flower answers a failed call by raising; the traceback's frames hold the body in a reference
    cycle that a long-running SuperLink may not collect for minutes. After a large body answered
    with an error (and only then), the gate collects it: here with Python's own collector off."""
    import gc
    import weakref

    from promptfcl.deploy.fleet_gate import LARGE_BODY_BYTES, SWEEP_DELAY_SECONDS

    class Failing(FlowerStandIn):
        """Reads the body, keeps it in a reference cycle (as a raised exception's frames do), answers 500."""

        async def __call__(self, scope, receive, send):
            message = await receive()

            class Kept:
                pass

            kept = Kept()
            kept.body, kept.cycle = message["body"], kept
            self.kept.append(weakref.ref(kept))
            await send({"type": "http.response.start", "status": self.status, "headers": []})
            await send({"type": "http.response.body", "body": b"no"})

    headers, _ = signed_headers()
    big = [b"x" * (LARGE_BODY_BYTES + 1)]

    async def scenario(status: int) -> list:
        inner = Failing()
        inner.kept, inner.status = [], status
        await call(FleetOnly(inner), OBJECT_PUSH, headers=headers, chunks=big)
        await asyncio.sleep(SWEEP_DELAY_SECONDS + 0.3)
        return [ref() is None for ref in inner.kept]

    gc.collect()
    gc.disable()
    try:
        assert asyncio.run(scenario(500)) == [True]  # swept
        assert asyncio.run(scenario(200)) == [False]  # an accepted body: no pause for the listener
    finally:
        gc.enable()
        gc.collect()


def test_the_control_listener_refuses_the_fleet_api(caplog):
    from deploy.superlink import ControlOnly

    headers, _ = signed_headers()
    with caplog.at_level("WARNING", logger="promptfcl.superlink"):
        for path in (OBJECT_PUSH, MESSAGE_PUSH, "/v1/fleet/pull-messages"):
            status, body, called = asgi_call(ControlOnly, path, headers=headers, chunks=[b"x" * 1000])
            assert (status, called) == (403, False) and b"node-facing address only" in body, path
    assert "control address: refused POST /v1/fleet/push-object from 10.0.0.7" in caplog.text
    for path in ("/v1/control/list-runs", "/v1/runtime/pull-messages", "/health"):  # the operator's, the ServerApp's
        assert asgi_call(ControlOnly, path) == (200, b"flower", True), path
    seen = []

    async def flower(scope, receive, send):  # Flower's lifespan (its state, its SuperExec) starts behind it
        seen.append(scope["type"])

    asyncio.run(ControlOnly(flower)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


# ----------------------------------------------------------------------------- what: a node's own replies only
def test_a_node_pushes_only_its_own_replies_to_messages_sent_to_it(federation, caplog):
    """Finding 1's two attacks (a message "from the server" to another node; a forged error to the
    ServerApp) and their variants, pushed with node-a's own key: refused (403, logged under its
    registered name, counted) before Flower reads a byte; its real reply reaches Flower unchanged."""
    f = federation
    a, b, run = f.ids["node-a"], f.ids["node-b"], f.run_id
    superlink = internal("superlink_node_id")
    headers, _ = signed_headers(f.keys["node-a"])
    refused = {
        "a train message from the server to node b": (push_body(a, superlink, b, run), 403,
                                                      "sender is the SuperLink, not itself"),
        "a forged error to the ServerApp": (push_body(a, superlink, superlink, run, error="forged by node-a"), 403,
                                            "sender is the SuperLink, not itself"),
        "another node's reply": (push_body(a, b, superlink, run, f.sent["node-b"]), 403,
                                 f"sender is node {b}, not itself"),
        "its own message answering none": (push_body(a, a, superlink, run), 403, "answers none"),
        "a reply to node b's message": (push_body(a, a, superlink, run, f.sent["node-b"]), 403,
                                        f"which was sent to node {b}"),
        "a reply to no message": (push_body(a, a, superlink, run, "cd" * 32), 403, "does not hold"),
        "a push naming node b": (push_body(b, b, superlink, run, f.sent["node-b"]), 403, f"naming node {b}"),
        "not a push": (b"\xff\xff\xff not protobuf", 400, "not a push-messages request"),
    }
    inner = FlowerStandIn(factory=f.factory)
    gate = FleetOnly(inner)
    with caplog.at_level("WARNING", logger="promptfcl.superlink"):
        for label, (body, status, why) in refused.items():
            half = len(body) // 2
            got, answer, _ = asyncio.run(call(gate, MESSAGE_PUSH, headers=headers, chunks=[body[:half], body[half:]]))
            assert (got, inner.called) == (status, []) and why in answer.decode(), (label, got, answer)
    lines = [m for m in caplog.messages if "refused POST /v1/fleet/push-messages" in m]
    assert len(lines) == len(refused) and all(f"of node {a} (node-a)" in m for m in lines)
    assert f"refusal {len(refused)} of node {a} (node-a)" in lines[-1]  # counted per node
    # its own reply to the message sent to it goes on to Flower, byte for byte
    reply = push_body(a, a, superlink, run, f.sent["node-a"])
    assert asyncio.run(call(gate, MESSAGE_PUSH, headers=headers, chunks=[reply[:9], reply[9:]]))[:2] == (200, b"flower")
    assert inner.called == [MESSAGE_PUSH] and inner.body == reply
    # node authentication off: the key's self-registered node is the sender all the same
    off = functools.partial(FlowerStandIn, factory=f.factory, auth=False)
    assert asgi_call(FleetOnly, MESSAGE_PUSH, headers=headers, chunks=[refused["a forged error to the ServerApp"][0]],
                     inner=off())[::2] == (403, False)
    assert asgi_call(FleetOnly, MESSAGE_PUSH, headers=headers, chunks=[reply], inner=off()) == (200, b"flower", True)
    stranger, _ = signed_headers()
    status, answer, called = asgi_call(FleetOnly, MESSAGE_PUSH, headers=stranger, chunks=[reply], inner=off())
    assert (status, called) == (403, False) and b"a key that no node holds" in answer


# ----------------------------------------------------------------------------- rejoin after a crash
def test_a_restarted_node_rejoins_once_its_last_heartbeat_is_older_than_a_live_node_leaves(federation, caplog):
    from promptfcl.common.node.identity import REJOIN_PROBE
    from promptfcl.deploy.fleet_rules import live_gap

    f = federation
    a = f.ids["node-a"]
    headers, _ = signed_headers(f.keys["node-a"])
    probe = headers + [(REJOIN_PROBE.encode(), b"1")]
    # a live SuperNode's heartbeats leave at most 10.5 s at a 10 s interval (28.5 s at Flower's 30 s)
    assert (live_gap(10), live_gap(30)) == (10.5, 28.5)
    # node-a just activated: a live session may hold its identity; Flower would only say "Failed to
    # activate SuperNode.", the node hears why and when it may rejoin, and Flower is not called
    with caplog.at_level("WARNING", logger="promptfcl.superlink"):
        status, body, called = asgi_call(FleetOnly, ACTIVATE, headers=headers, inner=FlowerStandIn(factory=f.factory))
    assert (status, called) == (412, False)
    answer = json.loads(body)
    assert answer["code"] == 2004 and answer["detail"] == "Failed to activate SuperNode."
    assert re.match(rf"node {a} \(node-a\) is still marked online: its last heartbeat was [01] s ago", answer["extra"])
    assert re.search(r"can rejoin in about (9|10) s", answer["extra"]) and "a copy of its key" in answer["extra"]
    assert asgi_call(FleetOnly, ACTIVATE, headers=probe, inner=FlowerStandIn(factory=f.factory))[::2] == (412, False)
    # 12 s on, no heartbeat since: its session has ended (a crash); the probe marks it offline and
    # says "ready" (the gate's answer, not Flower's), and Flower's own activation then succeeds
    later = functools.partial(FleetOnly, clock=lambda: time.time() + 12)
    with caplog.at_level("WARNING", logger="promptfcl.superlink"):
        status, body, called = asgi_call(later, ACTIVATE, headers=probe, inner=FlowerStandIn(factory=f.factory))
    assert (status, json.loads(body), called) == (200, {"ready": True}, False)
    assert re.search(rf"rejoin: node {a} \(node-a\): last heartbeat 1[23] s ago, longer than a live SuperNode leaves",
                     caplog.text)
    assert f.state.get_node_info(node_ids=[a])[0].status == "offline"
    assert asgi_call(FleetOnly, ACTIVATE, headers=headers, inner=FlowerStandIn(factory=f.factory)) == \
        (200, b"flower", True)
    assert f.state.activate_node(a, 10)
    # a node whose heartbeats keep coming (node-b, 5 s on) cannot be displaced by a copy of its key
    f.state.acknowledge_node_heartbeat(f.ids["node-b"], 10)
    soon = functools.partial(FleetOnly, clock=lambda: time.time() + 5)
    headers_b, _ = signed_headers(f.keys["node-b"])
    assert asgi_call(soon, ACTIVATE, headers=headers_b, inner=FlowerStandIn(factory=f.factory))[::2] == (412, False)
    assert f.state.get_node_info(node_ids=[f.ids["node-b"]])[0].status == "online"


def test_the_launcher_waits_while_the_superlink_says_the_identity_is_online(monkeypatch, capsys):
    import deploy.supernode as launcher

    answers = iter(["node 7 (node-a) is still marked online: its last heartbeat was 3 s ago ..."] * 2 + [None])
    monkeypatch.setattr(launcher, "rejoin_refusal", lambda *args: next(answers))
    monkeypatch.setattr(launcher, "REJOIN_POLL_SECONDS", 0.01)
    args = ["--superlink", "127.0.0.1:9", "--auth-supernode-private-key", "k", "--root-certificates", "ca.crt"]
    launcher.wait_to_rejoin(args, timeout=5)
    err = capsys.readouterr().err
    # asked three times, said once why it waits (again every 10 s at most)
    assert err.count("start-client: not rejoining yet: node 7 (node-a) is still marked online") == 1
    # still online at the deadline: a live process holds the identity
    monkeypatch.setattr(launcher, "rejoin_refusal", lambda *args: "node 7 (node-a) is still marked online: ...")
    with pytest.raises(SystemExit, match="still refuses this node after 0 s: .*stop the other copy of this node's key"):
        launcher.wait_to_rejoin(args, timeout=0.001)
    launcher.wait_to_rejoin(["--superlink", "127.0.0.1:9"], timeout=5)  # no registered key: nothing to wait for


def test_the_launcher_declares_and_keeps_its_heartbeat_interval():
    """What deploy/supernode.py sets is what Flower's SuperNode declares and how often it sends."""
    import deploy.supernode as launcher

    declared, sender = internal("supernode_heartbeat_interval"), internal("heartbeat_sender_interval")
    try:
        launcher.declare_heartbeat(10)
        assert internal("supernode_heartbeat_interval") == internal("heartbeat_sender_interval") == 10
        with pytest.raises(SystemExit, match="--heartbeat must be within 10-1800 s"):
            launcher.declare_heartbeat(5)
    finally:
        from promptfcl.common.flower_internals import replace_internal

        replace_internal("supernode_heartbeat_interval", declared)
        replace_internal("heartbeat_sender_interval", sender)
