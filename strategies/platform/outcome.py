"""What one round's aggregation made of its replies: the value the server loop receives.

``PromptStrategy.aggregate_round`` returns a :class:`RoundOutcome`; Flower's ``aggregate_train``
is built on it and returns its ``(arrays, metrics)``. The server loop reads the round's record
from the outcome (who was accepted, who was rejected and why, each reply's share, update norm and
cosine, where it trained, what the defences did) instead of reading the strategy's attributes, so
the strategy's state between rounds is its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from ...common.records import CONFIG, as_int
from .rounds import Accepted


@dataclass(frozen=True)
class RoundOutcome:
    """One round's aggregation, as a value.

    Attributes
    ----------
    arrays, metrics : ArrayRecord, MetricRecord or None
        What Flower's ``aggregate_train`` returns (None, None: too few usable replies).
    accepted : tuple of Accepted
        The replies that passed every check and defence, in reply order.
    rejected : tuple of (int, str)
        (node id, reason) of every reply left out, the exchange's before training included.
    shares : tuple of float
        Each accepted reply's share of the round's weight (empty where none was weighed).
    nodes : tuple of str
        Each accepted reply's node, named (aligned with ``accepted``).
    clients : tuple of int
        Each accepted reply's client id (aligned with ``accepted``).
    update_norms, update_cosines : tuple
        Each accepted reply's update norm (after a clip) and cosine with its task's median update
        (None: fewer than 3 on its task).
    placements : mapping
        Message id -> where its accepted reply trained (its ``placement`` record).
    defences : mapping of str to int
        Replies each defence excluded or clipped and statistics rows bounded; empty where the run
        applies no defence.
    stats_ratios : mapping of str to float
        Per uploaded statistics array, its largest row scale over the round's reference.
    sample_rate : float
        Sampled / population at this attempt's sampling (what differential privacy composes).
    """

    arrays: ArrayRecord | None
    metrics: MetricRecord | None
    accepted: tuple[Accepted, ...] = ()
    rejected: tuple[tuple[int, str], ...] = ()
    shares: tuple[float, ...] = ()
    nodes: tuple[str, ...] = ()
    clients: tuple[int, ...] = ()
    update_norms: tuple[float, ...] = ()
    update_cosines: tuple[float | None, ...] = ()
    placements: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    defences: Mapping[str, int] = field(default_factory=dict)
    stats_ratios: Mapping[str, float] = field(default_factory=dict)
    sample_rate: float = 0.0

    @property
    def aggregated(self) -> bool:
        """Whether the round produced arrays (enough usable replies, or nobody had to train)."""
        return self.arrays is not None

    def placement_of(self, message: Message) -> dict[str, Any]:
        """``message``'s client and where its accepted reply trained (None where unknown or rejected)."""
        config = message.content.config_records[CONFIG] if CONFIG in message.content.config_records else ConfigRecord()
        where = self.placements.get(message.metadata.message_id, {})
        return {"client": as_int(config["client-id"]) if "client-id" in config else None,
                "node": where.get("node"), "device": where.get("device"),
                "cuda_visible_devices": where.get("cuda-visible-devices"),
                "config_digest": where.get("config-digest")}
