"""One round's bookkeeping: what the server sent each client, and each reply it accepted.

The platform makes a :class:`Sent` for every message of a round (the client, its task and
round, its config, and what its reply must hold) and an :class:`Accepted` for every reply that
passes the checks, with its weight. Methods read these instead of matching replies to messages
themselves: the task a reply counts for is always the one the server sent, never what the
client claims.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from ...common.flower_internals import internal
from ...common.records import ARRAYS, CONFIG, as_int, metrics_of
from ...common.text import escape_log_args, printable

log = escape_log_args()


@dataclass
class Sent:
    """One client's part of a round, as the server sent it."""

    client: int  # the client id it plays (deployed: the node's 62-bit id)
    task: int  # the task it trains (asynchronous arrival: its own)
    round: int  # round within that task
    slot: int  # its turn in the task schedule
    config: ConfigRecord  # the message's config
    message: Message | None = None  # set once the method's payload is made
    #: what the reply's arrays must hold (names, shapes, dtypes); None: the arrays sent
    expected: ArrayRecord | None = None
    #: what the reply's update is measured from (update norms); None: the values of ``expected``
    start: Mapping[str, np.ndarray] | None = None
    data: Any = None  # anything else the method keeps for this client (its payload's choices)

    @property
    def node(self) -> int:
        """The Flower node the message went to."""
        assert self.message is not None
        return int(self.message.metadata.dst_node_id)

    @property
    def final_config(self) -> ConfigRecord:
        """The config the message finally carried (the server loop may ask a message to evaluate too)."""
        if self.message is not None and CONFIG in self.message.content.config_records:
            return self.message.content.config_records[CONFIG]
        return self.config

    @property
    def arrays(self) -> ArrayRecord | None:
        """The arrays the message carried (None: none)."""
        assert self.message is not None
        content = self.message.content
        return content.array_records[ARRAYS] if ARRAYS in content.array_records else None


@dataclass
class Accepted:
    """A reply that passed every check, with the message it answers and its weight."""

    sent: Sent
    reply: Message
    update_norm: float = 0.0
    cosine: float | None = None  # its update's cosine with its task's median update (None: fewer than 3)
    weight: float = 0.0  # what aggregation multiplies (sample count, or its capped share)

    @property
    def content(self) -> RecordDict:
        return self.reply.content

    @property
    def examples(self) -> int:
        return as_int(metrics_of(self.reply.content)["num-examples"])

    @property
    def client(self) -> int:
        return self.sent.client

    @property
    def task(self) -> int:
        return self.sent.task


@dataclass
class SentRound:
    """The messages of one exchange (a round's training, or the exchange before it), matched to replies."""

    sent: list[Sent] = field(default_factory=list)
    skipped: int = 0  # sampled clients the method sent nothing (its payload was None)
    sample_rate: float = 0.0  # sampled / population at this sampling (Sampling._clients)
    _by_id: dict[str, Sent] = field(default_factory=dict)
    _taken: set[int] = field(default_factory=set)

    @property
    def messages(self) -> list[Message]:
        return [s.message for s in self.sent if s.message is not None]

    def match(self, reply: Message, consume: bool = True) -> Sent | None:
        """The message ``reply`` answers: by message id (Flower's grids set ids when sending); where
        the messages carry none, the next unmatched one sent to the reply's node (``consume``: the
        match is taken, as a round's replies are)."""
        if not self._by_id:
            self._by_id = {s.message.metadata.message_id: s for s in self.sent
                           if s.message is not None and s.message.metadata.message_id}
        if self._by_id:
            return self._by_id.get(reply.metadata.reply_to_message_id)
        for i, s in enumerate(self.sent):
            if i not in self._taken and s.node == reply.metadata.src_node_id:
                if consume:
                    self._taken.add(i)
                return s
        return None

    def sender(self, reply: Message) -> int:
        """The node a reply stands for: the one its message went to (a dead node's error reply is made
        by the SuperLink, under the SuperLink's id)."""
        by_id = self._by_id or {s.message.metadata.message_id: s for s in self.sent
                                if s.message is not None and s.message.metadata.message_id}
        sent = by_id.get(reply.metadata.reply_to_message_id)
        return sent.node if sent is not None else int(reply.metadata.src_node_id)


def forged(reply: Message, sent_ids: set[str]) -> str | None:
    """Why ``reply`` stands for no client at all (None: it may stand for one).

    The SuperLink (Flower's node 1) makes a reply itself only to report an error on a message
    it sent: its node died, or the message expired. Such a report answers that message (one of
    ``sent_ids``, the ids of the messages this exchange sent) and stands for the node it went
    to. A message under the SuperLink's id that answers none of them, or that is not an error,
    was made by someone else: a node pushing a message "from the SuperLink", which the
    SuperLink's node-facing gate also refuses (deploy/fleet_gate.py)."""
    if int(reply.metadata.src_node_id) != int(internal("superlink_node_id")):
        return None
    if reply.metadata.reply_to_message_id not in sent_ids:
        return "it claims the SuperLink's node id yet answers no message sent"
    if not reply.has_error():
        return "it claims the SuperLink's node id yet is not an error report"
    return None


def without_forged(replies: Iterable[Message], messages: Iterable[Message], what: str) -> list[Message]:
    """``replies`` to ``messages`` without the forged ones (:func:`forged`), each logged as such:
    never recorded as a client's reply, nor as a client's rejected one. ``what``: the exchange
    (for the log)."""
    sent_ids = {m.metadata.message_id for m in messages if m.metadata.message_id}
    kept = []
    for reply in replies:
        why = forged(reply, sent_ids)
        if why is None:
            kept.append(reply)
            continue
        said = f"error {printable(str(reply.error.reason), 200)!r}" if reply.has_error() else "content"
        log.warning("%s: a message from node %d (%s, answering %r) dropped as forged: %s", what,
                    int(reply.metadata.src_node_id), said, printable(reply.metadata.reply_to_message_id, 80), why)
    return kept
