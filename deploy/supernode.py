"""Flower's SuperNode with its waits shortened (start-client.sh runs it).

Flower 1.41-1.42's SuperNode loop (``flwr/supernode/start_client_internal.py``) sleeps a fixed 3 s
whenever the SuperLink has no message for it, so a round's message waits 0-3 s before a node
even pulls it (a round waits for the slowest of its nodes), and it checks its own local state
for a finished reply every 0.5 s. This launcher runs Flower's own ``flower_supernode``,
unchanged, with the module's ``time`` seen through :class:`ShorterWaits`: the idle wait is
``--idle-poll`` seconds (default 1; Flower's 3 with ``--idle-poll 3``), local waits at most
``--local-poll`` (default 0.05: a read of the node's own state). Each idle node then asks the
SuperLink for work once per ``--idle-poll``: 100 nodes at 1 s are 100 small requests a second.

A node restarted at once after a crash finds its identity still marked online at the SuperLink
until its last heartbeat is older than a live SuperNode ever leaves (deploy/fleet_rules.py), and
Flower's SuperNode, refused, exits. Before starting it, this launcher asks the SuperLink
(deploy/fleet_gate.py answers a signed activation probe without activating anything) and,
while the identity is still online, says so and asks again every :data:`REJOIN_POLL_SECONDS`,
up to ``--rejoin-timeout`` (default 300 s; 0: do not wait). An identity still online after that
is held by a live process: another machine with a copy of this node's key.

How soon that is depends on the heartbeat interval the node declares: Flower's SuperNode
declares a fixed 30 s (its heartbeats then leave gaps of up to 28 s, and Flower marks it offline
after 60 s). This launcher declares ``--heartbeat`` seconds (default 10, the shortest the
SuperLink accepts) and sends at that pace, so a crashed node's session is known to have ended
about 11 s after its last heartbeat, and the restarted node rejoins then. A node sends one small
heartbeat every 3.5-4.5 s instead of every 17-23 s.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

#: Flower's idle wait in the SuperNode loop, the one ``--idle-poll`` replaces
FLOWER_IDLE_WAIT = 3.0
#: how often a node waiting to rejoin asks the SuperLink again
REJOIN_POLL_SECONDS = 1.0
#: the heartbeat interval a node declares (Flower's shortest accepted): see the module's docstring
DEFAULT_HEARTBEAT_SECONDS = 10.0


class ShorterWaits:
    """The ``time`` module, but ``sleep`` of Flower's idle wait lasts ``idle`` seconds and any
    other sleep at most ``local``."""

    def __init__(self, idle: float, local: float) -> None:
        self.idle, self.local = idle, local

    def sleep(self, seconds: float) -> None:
        time.sleep(self.idle if seconds >= FLOWER_IDLE_WAIT else min(seconds, self.local))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def rejoin_refusal(superlink: str, key_file: str, root_certificates: str | None, insecure: bool) -> str | None:
    """Why the SuperLink would refuse this node's activation now because its identity is still
    online (None: it would not, or the SuperLink cannot be asked: Flower's SuperNode then reports
    and retries as it does)."""
    import datetime
    import ssl
    from base64 import b64encode
    from pathlib import Path

    import httpx
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key

    from promptfcl.common.flower_internals import internal
    from promptfcl.common.node.identity import ACTIVATE, REJOIN_PROBE, STILL_ONLINE

    key = load_ssh_private_key(Path(key_file).expanduser().read_bytes(), password=None)
    stamp = datetime.datetime.now(datetime.UTC).isoformat()
    headers = {
        internal("node_public_key_header"): b64encode(internal("public_key_to_bytes")(key.public_key())).decode(),
        internal("node_timestamp_header"): stamp,
        internal("node_signature_header"): b64encode(internal("sign_message")(key, stamp.encode("ascii"))).decode(),
        REJOIN_PROBE: "1",
    }
    verify: bool | ssl.SSLContext = True
    if root_certificates:
        verify = ssl.create_default_context(cafile=str(Path(root_certificates).expanduser()))
    url = f"{'http' if insecure else 'https'}://{superlink}{ACTIVATE}"
    try:  # an empty body: a SuperLink other than ours refuses it without activating anything
        reply = httpx.post(url, headers=headers, content=b"", timeout=10, verify=verify)
        detail = reply.json().get("extra", "") if reply.status_code == 412 else ""
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return detail if isinstance(detail, str) and STILL_ONLINE in detail else None


def wait_to_rejoin(flower_args: list[str], timeout: float) -> None:
    """Until the SuperLink would activate this node (its identity not still online), at most
    ``timeout`` seconds, saying why it waits.

    Raises
    ------
    SystemExit
        The identity is still online after ``timeout``: a live process holds it.
    """
    peek = argparse.ArgumentParser(add_help=False)
    for name in ("--superlink", "--root-certificates", "--auth-supernode-private-key"):
        peek.add_argument(name)
    peek.add_argument("--insecure", action="store_true")
    node, _ = peek.parse_known_args(flower_args)
    if timeout <= 0 or not node.superlink or not node.auth_supernode_private_key:
        return  # without a registered key a node gets a new identity each start: nothing to wait for
    deadline = time.monotonic() + timeout
    told = -1.0  # when the node's operator was last told why it waits
    while True:
        why = rejoin_refusal(node.superlink, node.auth_supernode_private_key, node.root_certificates, node.insecure)
        if why is None:
            return
        if time.monotonic() + REJOIN_POLL_SECONDS > deadline:
            sys.exit(f"start-client: the SuperLink still refuses this node after {timeout:.0f} s: {why}. An "
                     "identity this long online is held by a live process: stop the other copy of this node's key, "
                     "or have the operator register a new key for this node")
        if told < 0 or time.monotonic() - told >= 10:
            told = time.monotonic()
            print(f"start-client: not rejoining yet: {why}. Asking again every {REJOIN_POLL_SECONDS:.0f} s "
                  f"(up to {deadline - time.monotonic():.0f} s more)", file=sys.stderr, flush=True)
        time.sleep(REJOIN_POLL_SECONDS)


def declare_heartbeat(seconds: float) -> None:
    """Make this process's SuperNode declare and keep a ``seconds`` heartbeat interval (Flower's
    SuperNode reads both from a module constant of 30 s).

    Raises
    ------
    SystemExit
        ``seconds`` is outside what the SuperLink accepts.
    """
    from promptfcl.common.flower_internals import internal, replace_internal

    low, high = float(internal("heartbeat_min_interval")), float(internal("heartbeat_max_interval"))
    if not low <= seconds <= high:
        sys.exit(f"--heartbeat must be within {low:.0f}-{high:.0f} s (what the SuperLink accepts), got {seconds:g}")
    replace_internal("supernode_heartbeat_interval", seconds)  # what it declares at activation and each heartbeat
    replace_internal("heartbeat_sender_interval", seconds)  # how often its heartbeat thread sends


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--idle-poll", type=float, default=1.0)
    parser.add_argument("--local-poll", type=float, default=0.05)
    parser.add_argument("--rejoin-timeout", type=float, default=300.0)
    parser.add_argument("--heartbeat", type=float, default=DEFAULT_HEARTBEAT_SECONDS)
    ours, flower_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not (0.05 <= ours.idle_poll <= 60 and 0.01 <= ours.local_poll <= 1):
        sys.exit("--idle-poll must be within 0.05-60 s and --local-poll within 0.01-1 s")
    declare_heartbeat(ours.heartbeat)
    wait_to_rejoin(flower_args, ours.rejoin_timeout)

    from promptfcl.common.flower_internals import internal, replace_internal

    replace_internal("supernode_loop_time", ShorterWaits(ours.idle_poll, ours.local_poll))
    sys.argv = ["flower-supernode", *flower_args]
    return internal("supernode_main")()  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
