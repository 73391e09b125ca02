"""A node's identity: the name its operator registered, and its rejoin after a crash.

A Flower node id is a number the SuperLink assigns; with node authentication (deploy/README.md)
it stands for a registered public key, which ``register-node.sh --name`` also names. Flower
1.41 exposes both in its ``NodeInfo`` (the SuperLink's state; ``Grid.get_nodes`` on the
ServerApp's side), so logs, refusals and round records say ``node 4211 (hospital-a)``, or the
key's fingerprint where the key has no name, instead of a bare number.

The identity is marked online from its activation until its heartbeats stop for Flower's
patience (2 x 30 s), and Flower refuses to activate an identity marked online. A node
restarted at once after a crash is refused so for up to a minute: deploy/superlink.py says
why (:data:`STILL_ONLINE`) and answers a signed probe (:data:`REJOIN_PROBE`) without
activating anything, which deploy/supernode.py asks until the node may rejoin.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from typing import Any

from ..text import printable

log = logging.getLogger("promptfcl")

#: the call a SuperNode starts with (Flower's Fleet API)
ACTIVATE = "/v1/fleet/activate-node"
#: what the SuperLink's refusal of an identity still online says (deploy/supernode.py waits on it)
STILL_ONLINE = "is still marked online"
#: header of deploy/supernode.py's activation probe: answered by deploy/superlink.py, never by Flower
REJOIN_PROBE = "promptfcl-rejoin-probe"


def node_label(node_id: int, name: str = "", public_key: bytes = b"") -> str:
    """``node <id>`` with its registered name, or else its key's fingerprint."""
    if name:
        return f"node {node_id} ({printable(name, 64)})"
    if public_key:
        return f"node {node_id} (key {key_fingerprint(public_key)})"
    return f"node {node_id}"


def key_fingerprint(public_key: bytes) -> str:
    """The first 12 hex digits of the key's SHA-256: short, and the same wherever the key is."""
    return hashlib.sha256(public_key).hexdigest()[:12]


def registered_names(infos: Iterable[Any]) -> dict[int, str]:
    """Node id -> its registered name, or ``key <fingerprint>`` for a key without one (NodeInfo-like
    objects: ``node_id``, ``name``, ``public_key``); nodes with neither are left out."""
    names: dict[int, str] = {}
    for info in infos:
        name, key = getattr(info, "name", ""), getattr(info, "public_key", b"")
        if name:
            names[int(info.node_id)] = printable(name, 64)
        elif key:
            names[int(info.node_id)] = f"key {key_fingerprint(key)}"
    return names


def grid_names(grid: Any) -> dict[int, str]:
    """:func:`registered_names` of the nodes a Flower grid knows ({} where it says nothing: a
    grid without ``get_nodes``, or one that fails: names are for reading, never for deciding)."""
    get_nodes = getattr(grid, "get_nodes", None)
    if get_nodes is None:
        return {}
    try:
        return registered_names(get_nodes())
    except Exception as exc:  # a transient Runtime API error must not cost the round
        log.debug("node names unavailable (%s: %s)", type(exc).__name__, exc)
        return {}


__all__ = ["ACTIVATE", "REJOIN_PROBE", "STILL_ONLINE", "grid_names", "key_fingerprint", "node_label",
           "registered_names"]
