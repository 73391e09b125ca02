"""Messages between the server and the nodes: sending a batch and pulling its replies, and their size."""

from __future__ import annotations

import time

from flwr.app import Message
from flwr.serverapp import Grid

from ..common.records import payload_bytes

#: seconds between two pulls for replies; Flower's deployment grid waits 3 s between pulls, so
#: a reply that arrives just after one sits idle for up to 3 s, twice per round (train and
#: evaluation). A pull is one small request to the SuperLink.
PULL_INTERVAL_SECONDS = 0.2


def send_and_receive(grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
    """``Grid.send_and_receive`` with a short wait between pulls (``PULL_INTERVAL_SECONDS``):
    push the messages, then pull until every one has its reply or ``timeout`` seconds pass.
    Replies come back in the order their messages were sent, whatever order they arrived in,
    so that aggregation (a floating-point sum) is the same in every run."""
    ids = list(grid.push_messages(messages))
    pending = set(ids)
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    while pending:
        got = list(grid.pull_messages(pending))
        replies += got
        pending -= {m.metadata.reply_to_message_id for m in got}
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(PULL_INTERVAL_SECONDS)
    order = {message_id: i for i, message_id in enumerate(ids)}
    return sorted(replies, key=lambda m: order.get(m.metadata.reply_to_message_id, len(order)))


def unanswered(messages: list[Message], replies: list[Message]) -> list[Message]:
    """The messages no reply answers (by message id, which Flower's grids set when sending)."""
    answered = {r.metadata.reply_to_message_id for r in replies}
    return [m for m in messages if m.metadata.message_id not in answered]


def message_bytes(messages: list[Message]) -> int:
    """Total payload of ``messages``; shared contents are measured once, counted per message."""
    sizes: dict[int, int] = {}
    total = 0
    for m in messages:
        key = id(m.content)
        if key not in sizes:
            sizes[key] = payload_bytes(m.content)
        total += sizes[key]
    return total
