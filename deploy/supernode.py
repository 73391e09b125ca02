"""Flower's SuperNode with its waits shortened (start-client.sh runs it).

Flower 1.41's SuperNode loop (``flwr/supernode/start_client_internal.py``) sleeps a fixed 3 s
whenever the SuperLink has no message for it, so a round's message waits 0-3 s before a node
even pulls it (a round waits for the slowest of its nodes), and it checks its own local state
for a finished reply every 0.5 s. This launcher runs Flower's own ``flower_supernode``,
unchanged, with the module's ``time`` seen through :class:`ShorterWaits`: the idle wait is
``--idle-poll`` seconds (default 1; Flower's 3 with ``--idle-poll 3``), local waits at most
``--local-poll`` (default 0.05: a read of the node's own state). Each idle node then asks the
SuperLink for work once per ``--idle-poll``: 100 nodes at 1 s are 100 small requests a second.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

#: Flower's idle wait in the SuperNode loop, the one ``--idle-poll`` replaces
FLOWER_IDLE_WAIT = 3.0


class ShorterWaits:
    """The ``time`` module, but ``sleep`` of Flower's idle wait lasts ``idle`` seconds and any
    other sleep at most ``local``."""

    def __init__(self, idle: float, local: float) -> None:
        self.idle, self.local = idle, local

    def sleep(self, seconds: float) -> None:
        time.sleep(self.idle if seconds >= FLOWER_IDLE_WAIT else min(seconds, self.local))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--idle-poll", type=float, default=1.0)
    parser.add_argument("--local-poll", type=float, default=0.05)
    ours, flower_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not (0.05 <= ours.idle_poll <= 60 and 0.01 <= ours.local_poll <= 1):
        sys.exit("--idle-poll must be within 0.05-60 s and --local-poll within 0.01-1 s")

    from promptfcl.common.flower_internals import internal, replace_internal

    replace_internal("supernode_loop_time", ShorterWaits(ours.idle_poll, ours.local_poll))
    sys.argv = ["flower-supernode", *flower_args]
    return internal("supernode_main")()  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
