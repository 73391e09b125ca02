"""The deployment test's ClientApp: the project's own, behind a mod that makes a node hostile.

A SuperNode started with ``PROMPTFCL_TEST_HOSTILE=1`` in its environment claims 10^12
training samples in every train reply and, in every evaluation reply (and in the evaluation
counts a train reply carries), 10^9 samples per task, all of them correct: the two attacks on a deployed server that only bounds a node by what it
declared. Written for the tests and independent of ``client/faults.py``, so the server's
checks are not tested with the project's own fault switch.
"""

from __future__ import annotations

import os

from flwr.app import Context, Message, MessageType, MetricRecord

from promptfcl.common.records import EVALUATION
from tests.helpers import client_app


def hostile(msg: Message, context: Context, call_next) -> Message:
    reply = call_next(msg, context)
    if os.environ.get("PROMPTFCL_TEST_HOSTILE") != "1" or reply.has_error():
        return reply
    content = reply.content
    metrics = dict(content["metrics"])
    if msg.metadata.message_type == MessageType.TRAIN:
        metrics["num-examples"] = 10**12
        if EVALUATION in content.metric_records:  # evaluation counts carried by the train reply
            content[EVALUATION] = inflated(content[EVALUATION])
    else:
        metrics = dict(inflated(content["metrics"]))
    content["metrics"] = MetricRecord(metrics)
    return Message(content=content, reply_to=msg)


def inflated(counts: MetricRecord) -> MetricRecord:
    """Evaluation counts claiming 10^9 samples per task, all of them correct."""
    tasks = len(counts["correct"])
    return MetricRecord({**dict(counts), "correct": [10**9] * tasks, "total": [10**9] * tasks,
                         "num-examples": 10**9 * tasks})


app = client_app([hostile], operated=False)  # deployed nodes: their own node configs decide
