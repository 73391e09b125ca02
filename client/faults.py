"""Seeded fault injection: a share of clients misbehave, for robustness experiments and tests.

With ``fault = "<kind>"`` and ``fault-rate = p``, each (client, task, round) misbehaves
with probability p, decided by the seed, so a run's faults are reproducible.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from common.config import ExperimentConfig
from common.records import ARRAYS, METRICS, from_array_record, to_array_record


class InjectedFault(RuntimeError):
    """Raised by a client chosen to fail."""


def is_faulty(cfg: ExperimentConfig, client_id: int, task: int, round_: int) -> bool:
    if not cfg.fault or cfg.fault_rate <= 0:
        return False
    return bool(np.random.default_rng([cfg.seed, client_id, task, round_, 0xFA17]).random() < cfg.fault_rate)


def before_training(cfg: ExperimentConfig, client_id: int, task: int, round_: int) -> None:
    """Faults that strike before any work: a crash or a hang."""
    if not is_faulty(cfg, client_id, task, round_):
        return
    if cfg.fault == "raise":
        raise InjectedFault(f"injected failure of client {client_id} (task {task}, round {round_})")
    if cfg.fault == "hang":
        time.sleep(cfg.fault_hang_seconds)


def corrupt_reply(cfg: ExperimentConfig, reply: RecordDict, client_id: int, task: int, round_: int) -> RecordDict:
    """Faults that corrupt what the client sends back."""
    if not is_faulty(cfg, client_id, task, round_) or cfg.fault in ("raise", "hang"):
        return reply
    arrays = from_array_record(reply[ARRAYS])
    if cfg.fault == "nan":
        name = next(iter(arrays))
        arrays[name] = np.full_like(arrays[name], np.nan)
        reply[ARRAYS] = to_array_record(arrays)
    elif cfg.fault == "shape":
        name = next(iter(arrays))
        arrays[name] = arrays[name].reshape(-1)[:-1].copy()
        reply[ARRAYS] = to_array_record(arrays)
    elif cfg.fault == "extra-record":
        reply["unexpected"] = ConfigRecord({"note": "not part of the protocol"})
    elif cfg.fault == "missing-record":
        out = RecordDict({ARRAYS: reply[ARRAYS]})
        return out
    elif cfg.fault == "huge-count":
        metrics = dict(reply[METRICS])
        metrics["num-examples"] = 10**12
        reply[METRICS] = MetricRecord(metrics)
    return reply


__all__ = ["InjectedFault", "before_training", "corrupt_reply", "is_faulty", "ArrayRecord"]
