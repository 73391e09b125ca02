"""Checks of what a client reply carries, before any of it is used.

Any client may be broken or hostile: ``PromptStrategy``'s reply checks run :func:`platform_problem`
on every reply (then the method's own ``check_records``), and a reply that fails is left out,
logged with the node it stands for. The schema of the metrics record and the update-norm and
weighting rules are in :mod:`promptfcl.strategies.platform.replies`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from ...common.records import (
    ARRAYS,
    EVALUATE_TASK,
    EVALUATION,
    METRICS,
    PLACEMENT,
    PLACEMENT_FIELDS,
    array_view,
    arrays_of,
    as_int,
    config_of,
    metrics_of,
    payload_bytes,
)
from .replies import MetricSpec, check_metrics
from .rounds import Sent

#: records any reply may carry besides the method's own; the platform checks placement, the server
#: loop the evaluation counts a train reply carries (evaluate-with-train)
PLATFORM_RECORDS = frozenset({PLACEMENT, EVALUATION})
NO_EXAMPLES = "no training examples"


def class_rows_problem(rec: ArrayRecord, rows: str, dim: int, task_classes: np.ndarray, client: int,
                       num_classes: int) -> str | None:
    """Why a per-class record of ``rows`` (its ``classes`` and ``means`` arrays: FPPL's prototypes,
    PILoRA's class means) cannot be used (None: it can): integer classes in range, one finite row of
    width ``dim`` per class, no class twice, every class among ``task_classes`` (those of the task the
    client was sent) and, where the record names its client, the one the server sent."""
    classes, means = rec["classes"].numpy(), rec["means"].numpy()
    if not np.issubdtype(classes.dtype, np.integer) or classes.ndim != 1:
        return f"{rows} classes must be a vector of integers"
    if means.ndim != 2 or means.shape != (classes.shape[0], dim):
        return f"{rows} of shape {means.shape} for {classes.shape[0]} classes of dim {dim}"
    if classes.size and (classes.min() < 0 or classes.max() >= num_classes):
        return f"{rows} classes out of range"
    if len(np.unique(classes)) != len(classes):
        return f"{rows} repeat a class"
    if not np.isfinite(means).all():
        return f"{rows} have non-finite values"
    if not np.isin(classes, task_classes).all():
        return f"{rows} of classes outside the task the client was sent"
    if "client" in rec.keys():
        claimed = rec["client"].numpy().reshape(-1)
        if claimed.shape != (1,) or int(claimed[0]) != client:
            return f"{rows} claim another client than the one the server sent"
    return None


def method_records(content: RecordDict) -> set[str]:
    """Names of the records a reply carries for the method (the platform's own left out)."""
    return set(content.keys()) - PLATFORM_RECORDS


def check_placement(content: RecordDict) -> str | None:
    """Why a reply's placement record is malformed (None: it is fine)."""
    if PLACEMENT not in content.config_records:
        return f"{PLACEMENT!r} is not a config record"
    record = content[PLACEMENT]
    unknown = set(record.keys()) - set(PLACEMENT_FIELDS)
    if unknown:
        return f"{PLACEMENT!r} has unknown fields {sorted(unknown)[:4]}"
    for key in record.keys():
        value = record[key]
        if not isinstance(value, str) or len(value) > 256:
            return f"{PLACEMENT}.{key} must be a string of at most 256 characters"
    return None


def placement_of(content: RecordDict) -> dict[str, str]:
    """A reply's placement record (its fields are strings: :func:`check_placement`)."""
    return {key: str(value) for key, value in config_of(content, PLACEMENT).items()}


@dataclass(frozen=True)
class HeldSamples:
    """What a server holding the data knows of a virtual population: ``total`` training samples in
    all, and how many client ``client`` holds for task ``task`` in round ``round_`` (``of``)."""

    total: int
    of: Callable[[int, int, int], int]


@dataclass
class SampleBounds:
    """What the server knows of how many samples a client can claim.

    Virtual population: exactly what the server knows the client holds for its task and round
    (``examples_of``, set by the server, which has the data). Nodes: at most what the node
    declared in its first reply (``declared``: node id -> (train-size, test-size)), fixed after.
    """

    max_examples: int | None = None
    examples_of: Callable[[int, int, int], int] | None = None
    nodes: bool = False  # population = nodes: counts are checked against declarations
    declared: dict[int, tuple[int, int]] = field(default_factory=dict)

    def check_train(self, reply: Message, sent: Sent, n: int) -> str | None:
        """Why a train reply's sample count ``n`` cannot be right (None: it can)."""
        if self.max_examples is not None and n > self.max_examples:
            return f"implausible num-examples {n} (a client holds at most {self.max_examples})"
        if self.examples_of is not None:
            expected = self.examples_of(sent.client, as_int(sent.config["task"]), as_int(sent.config["round"]))
            if n != expected:
                return f"num-examples {n}, but client {sent.client} holds {expected} for this task"
        if self.nodes:
            # the node the message went to: what a reply stands for, whatever its metadata claims
            return self.check_declared(sent.node, reply.content[METRICS], examples=n)
        return None

    def check_declared(self, node: int, metrics: Any, examples: int | None = None,
                       test_total: int | None = None) -> str | None:
        """A node's data sizes: declared once (its first reply), then fixed; counts within them."""
        if "train-size" not in metrics or "test-size" not in metrics:
            return "a node must declare its train-size and test-size"
        declared = (int(metrics["train-size"]), int(metrics["test-size"]))
        known = self.declared.setdefault(node, declared)
        if declared != known:
            return f"declared data sizes {declared} differ from the node's first declaration {known}"
        if examples is not None and examples > known[0]:
            return f"num-examples {examples} exceeds the node's declared train-size {known[0]}"
        if test_total is not None and test_total > known[1]:
            return f"evaluated on {test_total} samples, more than the node's declared test-size {known[1]}"
        return None


def count_and_size_problem(reply: Message, sent: Sent, n: int, bounds: SampleBounds, max_bytes: int) -> str | None:
    """Why ``reply``'s sample count ``n`` or its size cannot be right (None: they can): no more
    samples than its client holds (or its node declared), within ``max-reply-bytes``; a training
    reply's and a task-end answer's alike."""
    reason = bounds.check_train(reply, sent, n)
    if reason is not None:
        return reason
    size = payload_bytes(reply.content)
    return None if size <= max_bytes else f"reply of {size} bytes exceeds max-reply-bytes = {max_bytes}"


def platform_problem(reply: Message, sent: Sent | None, expected: ArrayRecord | None,
                     reply_records: frozenset[str] | None, reply_metrics: Mapping[str, MetricSpec],
                     bounds: SampleBounds, max_bytes: int) -> str | None:
    """Why the platform cannot aggregate ``reply`` (None: the method's own checks come next).

    In order: an error reply; no message of this round it answers; the ``arrays`` and ``metrics``
    records; the placement record; evaluation counts it was not asked for; the metrics schema;
    no examples (a client with nothing of the task, left out quietly); the method's records,
    exactly; the sample count; the size; the arrays' names, shapes and dtypes against
    ``expected``; finite values.
    """
    if reply.has_error():
        return f"client error: {reply.error.reason}"
    if sent is None:
        return "cannot tell which message this reply answers (no matching message sent this round)"
    content = reply.content
    if ARRAYS not in content.array_records or METRICS not in content.metric_records:
        return "missing 'arrays' or 'metrics' record"
    if PLACEMENT in content:
        reason = check_placement(content)
        if reason is not None:
            return reason
    if EVALUATION in content and (EVALUATION not in content.metric_records or EVALUATE_TASK not in sent.final_config):
        return f"an {EVALUATION!r} record this message did not ask for (or not a metric record)"
    reason = check_metrics(content[METRICS], reply_metrics)
    if reason is not None:
        return reason
    n = as_int(metrics_of(content)["num-examples"])
    if n == 0:
        return NO_EXAMPLES
    names = method_records(content)
    if reply_records is not None and names != set(reply_records):
        extra, missing = names - reply_records, reply_records - names
        return f"unexpected records {sorted(extra)}, missing records {sorted(missing)}"
    reason = count_and_size_problem(reply, sent, n, bounds, max_bytes)
    if reason is not None:
        return reason
    arrays = arrays_of(content)
    if expected is not None:
        if set(arrays.keys()) != set(expected.keys()):
            return f"array names differ from those sent: {sorted(set(arrays.keys()) ^ set(expected.keys()))[:4]}"
        for name in expected.keys():
            if tuple(arrays[name].shape) != tuple(expected[name].shape) or arrays[name].dtype != expected[name].dtype:
                return (f"array {name}: {arrays[name].dtype}{arrays[name].shape} != sent "
                        f"{expected[name].dtype}{expected[name].shape}")
    for name in arrays.keys():
        if not np.isfinite(array_view(arrays[name])).all():
            return f"array {name} has non-finite values"
    return None
