"""A recording TLS reverse proxy for Flower's Fleet API, and a decoder for what it saw.

SuperNodes connect to the tap (TLS, a certificate from the federation's CA); the tap
forwards every request to the SuperLink over TLS (verifying the CA) and keeps the exact
request and response bodies. Fleet API calls are protobuf over HTTPS POST
(``/v1/fleet/<call>``): messages travel as metadata plus an object tree, their contents as
separately pushed and pulled *objects* (``push-object`` / ``pull-object``), so every byte
of every message a node sends or receives passes through :class:`WireTap` and can be
decoded with Flower's own inflation code (:func:`wire_messages`).

Used by tests/test_deploy.py to check that only prompt parameters, heads and method
statistics cross the wire, and to count the bytes per round.
"""

from __future__ import annotations

import http.client
import io
import ssl
import threading
import time
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
               "proxy-connection", "te", "trailer"}


@dataclass
class Exchange:
    """One Fleet API call as it crossed the wire (bodies after TLS)."""

    path: str
    request: bytes
    response: bytes
    status: int
    at: float


@dataclass
class WireTap:
    """TLS-terminating recording proxy between SuperNodes and a SuperLink (runs in threads)."""

    upstream: tuple[str, int]
    certfile: str
    keyfile: str
    cafile: str
    exchanges: list[Exchange] = field(default_factory=list)

    def start(self) -> int:
        """Listen on a free loopback port; return it."""
        tap = self
        up_ctx = ssl.create_default_context(cafile=self.cafile)
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                conn = http.client.HTTPSConnection(*tap.upstream, context=up_ctx, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data, status, resp_headers = resp.read(), resp.status, resp.getheaders()
                except OSError as exc:
                    data, status, resp_headers = str(exc).encode(), 502, []
                finally:
                    conn.close()
                with lock:
                    tap.exchanges.append(Exchange(self.path, body, data, status, time.time()))
                self.send_response(status)
                for k, v in resp_headers:
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST  # noqa: N815

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.certfile, self.keyfile)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return int(self._server.server_address[1])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ---------------------------------------------------------------------------- decoding
def _parse(cls: Any, raw: bytes) -> Any:
    msg = cls()
    msg.ParseFromString(raw)
    return msg


def wire_objects(exchanges: list[Exchange]) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Object contents by id: (sent to nodes, sent by nodes)."""
    from promptfcl.common.flower_internals import internal

    PullObjectResponse, PushObjectRequest = internal("pull_object_response"), internal("push_object_request")
    get_object_id = internal("object_id")

    down: dict[str, bytes] = {}
    up: dict[str, bytes] = {}
    for ex in exchanges:
        if ex.status != 200:
            continue
        if ex.path.endswith("/pull-object"):
            res = _parse(PullObjectResponse, ex.response)
            if res.object_found and res.object_available:
                down[get_object_id(res.object_content)] = res.object_content
        elif ex.path.endswith("/push-object"):
            req = _parse(PushObjectRequest, ex.request)
            up[get_object_id(req.object_content)] = req.object_content
    return down, up


def wire_messages(exchanges: list[Exchange]) -> list[tuple[str, str, Any]]:
    """Every message that crossed the wire: (direction "s2c"/"c2s", message type, RecordDict content)."""
    from flwr.app import Message

    from promptfcl.common.flower_internals import internal

    PullMessagesResponse, PushMessagesRequest = internal("pull_messages_response"), internal("push_messages_request")
    inflate_object_from_contents = internal("inflate_object")

    down, up = wire_objects(exchanges)
    out = []
    for ex in exchanges:
        if ex.status != 200:
            continue
        if ex.path.endswith("/pull-messages"):
            direction, contents, protos = "s2c", down, _parse(PullMessagesResponse, ex.response).messages_list
        elif ex.path.endswith("/push-messages"):
            direction, contents, protos = "c2s", up, _parse(PushMessagesRequest, ex.request).messages_list
        else:
            continue
        for proto in protos:
            msg_id = proto.metadata.message_id
            if msg_id not in contents:
                raise AssertionError(f"{direction} message {msg_id} has no content on the wire")
            msg = inflate_object_from_contents(msg_id, contents, keep_object_contents=True)
            assert isinstance(msg, Message)
            out.append((direction, proto.metadata.message_type, msg.content if msg.has_content() else None))
    return out


def fab_files(exchanges: list[Exchange]) -> dict[str, int]:
    """Files (name -> size) of the app bundles nodes fetched (``get-fab``)."""
    from promptfcl.common.flower_internals import internal

    GetFabResponse = internal("get_fab_response")

    files: dict[str, int] = {}
    for ex in exchanges:
        if ex.path.endswith("/get-fab") and ex.status == 200:
            fab = _parse(GetFabResponse, ex.response).fab
            with zipfile.ZipFile(io.BytesIO(fab.content)) as zf:
                files.update({i.filename: i.file_size for i in zf.infolist()})
    return files


def bytes_by_call(exchanges: list[Exchange]) -> dict[str, dict[str, int]]:
    """Request/response body bytes per Fleet call (TLS and HTTP framing excluded)."""
    out: dict[str, dict[str, int]] = {}
    for ex in exchanges:
        name = ex.path.rsplit("/", 1)[-1]
        d = out.setdefault(name, {"calls": 0, "up": 0, "down": 0})
        d["calls"] += 1
        d["up"] += len(ex.request)
        d["down"] += len(ex.response)
    return out
