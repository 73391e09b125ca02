"""What a registered node may tell the SuperLink, decided from Flower's own state (deploy/fleet_gate.py).

Two rules, each a plain function of the SuperLink's LinkState so the gate can run it in a thread:

* **A node speaks for itself, and only answers.** Flower 1.41-1.42 authenticates the node of a
  ``push-messages`` call (``request.node``), not the messages it carries: a registered node could
  push a message whose sender is the SuperLink (node 1) to another node, which Flower stores as
  an instruction and the other node runs, or one addressed to the SuperLink, which the ServerApp
  pulls as if it were a reply. :func:`message_refusal` reads every pushed message's metadata and
  refuses one whose sender is not the caller, one that answers nothing (no
  ``reply_to_message_id``), and one answering a message that was not sent to the caller (looked
  up in the SuperLink's ``state.db``; Flower's ``store_message_res`` repeats that last check, but
  drops such a reply silently).
* **A crashed node rejoins at once.** Flower refuses to activate an identity marked online, and
  marks it offline only when its heartbeats have stopped for its patience (2 intervals: 60 s at
  Flower's 30 s default). A live SuperNode heartbeats at least every :func:`live_gap` seconds;
  an identity whose last heartbeat is older than that has no live session, so
  :func:`rejoin_decision` marks it offline (Flower's ``deactivate_node``) and lets the restarted
  node, which has just proved it holds the key, activate. deploy/supernode.py declares a 10 s
  interval (Flower's shortest), so a crashed node is back within about 11 s of its last heartbeat.
  A second machine holding a copy of the key cannot use this to displace a live node: a live
  node's heartbeats never leave that gap.
"""

from __future__ import annotations

from typing import Any

from promptfcl.common.flower_internals import internal
from promptfcl.common.node.identity import STILL_ONLINE, node_label
from promptfcl.common.text import printable

#: added to the longest heartbeat gap of a live SuperNode before its session is taken as ended
#: (a heartbeat queued behind other requests at the SuperLink)
REJOIN_MARGIN_SECONDS = 1.0
_UINT64 = (1 << 64) - 1


def message_refusal(body: bytes, node_id: int, linkstate: Any) -> tuple[int, str] | None:
    """Why the ``push-messages`` body ``body`` from node ``node_id`` is refused, with the HTTP
    status to answer (None: every message in it is a reply of that node to a message it was sent)."""
    from google.protobuf.message import DecodeError

    request = internal("push_messages_request")()
    try:
        request.ParseFromString(body)
    except DecodeError:
        return 400, "a body that is not a push-messages request"
    if request.node.node_id != node_id:
        return 403, f"a push naming node {request.node.node_id}, not its own"
    if not request.messages_list:
        return 400, "a push without a message"
    for message in request.messages_list:
        meta = message.metadata
        to = _named(meta.dst_node_id)
        if meta.src_node_id != node_id:
            return 403, f"a message whose sender is {_named(meta.src_node_id)}, not itself (to {to})"
        if not meta.reply_to_message_id:
            return 403, f"a message that answers none (no reply_to_message_id; to {to}): a node only replies"
        answered = message_destination(linkstate, meta.reply_to_message_id)
        if answered is not None and answered != node_id:
            return 403, f"a reply to message {printable(meta.reply_to_message_id, 80)}, which was sent to " \
                        f"node {answered}"
        if answered is None and isinstance(linkstate, internal("sql_linkstate")):
            return 403, f"a reply to message {printable(meta.reply_to_message_id, 80)}, which the SuperLink " \
                        "does not hold (never sent, expired, or already answered and collected)"
    return None


def _named(node_id: int) -> str:
    return "the SuperLink" if node_id == internal("superlink_node_id") else f"node {node_id}"


def message_destination(linkstate: Any, message_id: str) -> int | None:
    """The node the message ``message_id`` was sent to, where the SuperLink's state says (None:
    it holds no such live message, or its LinkState cannot be asked: Flower's in-memory one,
    which start-server.sh never runs; Flower's own check then stands alone)."""
    if not isinstance(linkstate, internal("sql_linkstate")):
        return None
    row = linkstate.get_valid_message_ins(message_id)
    return None if row is None else int(row["dst_node_id"]) & _UINT64  # stored as a signed 64-bit integer


def live_gap(heartbeat_interval: float) -> float:
    """The longest a live SuperNode leaves between two heartbeats the SuperLink records, at the
    interval it declared: Flower's sender waits (interval - call timeout) x (0.8 + up to 0.1),
    then the call takes up to its timeout; plus :data:`REJOIN_MARGIN_SECONDS`."""
    timeout = float(internal("heartbeat_call_timeout"))
    spread = float(internal("heartbeat_base_multiplier")) + float(max(internal("heartbeat_random_range")))
    return max(0.0, heartbeat_interval - timeout) * spread + timeout + REJOIN_MARGIN_SECONDS


def rejoin_decision(linkstate: Any, node_id: int, now: float) -> tuple[str | None, str | None]:
    """(why activating ``node_id`` is refused now, what was done to let it rejoin), either None.

    Refused while the identity is online and its last heartbeat is recent enough to come from a
    live session; an identity online whose last heartbeat is older than :func:`live_gap` is marked
    offline here (its session has ended: a crash), and the second element says so."""
    infos = linkstate.get_node_info(node_ids=[node_id])
    if not infos or infos[0].status != internal("node_status").ONLINE:
        return None, None
    info = infos[0]
    label = node_label(node_id, info.name, info.public_key)
    interval = float(info.heartbeat_interval)
    age = now - (float(info.online_until) - float(internal("heartbeat_patience")) * interval)
    gap = live_gap(interval)
    if age > gap:
        if not linkstate.deactivate_node(node_id):
            return None, None  # marked offline meanwhile: Flower's activation decides
        return None, (f"{label}: last heartbeat {age:.0f} s ago, longer than a live SuperNode leaves between "
                      f"heartbeats at its {interval:.0f} s interval ({gap:.1f} s): its session has ended, "
                      "marked offline so that its restart rejoins now")
    return (f"{label} {STILL_ONLINE}: its last heartbeat was {age:.0f} s ago and a live SuperNode sends one "
            f"at least every {gap:.1f} s at its {interval:.0f} s interval, so a node restarted after a crash "
            f"can rejoin in about {gap - age:.0f} s (deploy/start-client.sh waits and retries); if this node "
            "was not restarted, another machine is running with a copy of its key"), None


def label_of(linkstate: Any, node_id: int) -> str:
    """``node <id> (<registered name>)`` as the SuperLink's state knows it."""
    infos = linkstate.get_node_info(node_ids=[node_id])
    return node_label(node_id, infos[0].name, infos[0].public_key) if infos else node_label(node_id)


__all__ = ["label_of", "live_gap", "message_destination", "message_refusal", "rejoin_decision"]
