"""Flower's SuperLink, started with an HTTP keep-alive longer than its clients' (start-server.sh).

Flower 1.41 serves every SuperLink API (Fleet, Control, ServerAppIo) over HTTP from uvicorn,
whose idle keep-alive timeout (5 s) equals the keep-alive expiry of the httpx clients that
SuperNodes and the ServerApp use (5 s). A client that reuses a connection in the instant the
server closes it reads an EOF, and Flower's retry policy treats any error that mentions SSL
as a failed handshake and gives up: the ServerApp dies with "[SSL: UNEXPECTED_EOF_WHILE_READING]"
(seen once in CI under load). When the server keeps idle connections open longer than any
client does, the client always closes first and the race cannot happen.
"""

from __future__ import annotations

import functools
import sys

import uvicorn

# Longer than httpx's default keep-alive expiry (5 s), the only client Flower uses.
KEEP_ALIVE_SECONDS = 75


def main() -> int | None:
    from common.flower_internals import internal

    flower_superlink = internal("superlink_main")

    # flower_superlink calls uvicorn.run(...) without timeout_keep_alive; supply ours.
    uvicorn.run = functools.partial(uvicorn.run, timeout_keep_alive=KEEP_ALIVE_SECONDS)
    sys.argv[0] = "flower-superlink"
    return flower_superlink()


if __name__ == "__main__":
    sys.exit(main())
