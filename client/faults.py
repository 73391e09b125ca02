"""Seeded fault injection, as a Flower ClientApp mod: a share of clients misbehave.

Only on a node whose operator enabled it (node-config ``fault-injection=true`` or
``PROMPTFCL_FAULT_INJECTION=1``; simulated nodes are their operator's: client/node_policy.py):
the run config chooses the fault, never whether a node obeys. There, with ``fault = "<kind>"``
and ``fault-rate = p`` in the run config, each (client, task, round) of a train message
misbehaves with probability p, decided by the seed, so a run's faults are reproducible; with
``fault-clients = "3,7"`` those clients misbehave whenever
they are sampled (a fixed hostile share of the population). The mod sits between Flower and the ClientApp
(``ClientApp(mods=[inject_faults])``), the mechanism Flower offers for wrapping a client:

* before training: ``raise`` (the client fails), ``hang`` (it sleeps ``fault-hang-seconds``);
* on the reply: ``nan`` (an array of NaN), ``shape`` (an array one element short),
  ``extra-record``, ``missing-record``, ``huge-count`` (10^12 samples), ``huge-values`` (every
  array times 1e30), ``poison`` (the update reversed and made ten times larger: sent - 10 x
  (trained - sent), a model-poisoning client), ``sign-flip`` (the update reversed: sent -
  (trained - sent)), ``poison-under-filter`` (the update reversed and scaled to 0.9 x
  ``update-norm-factor``, just under where the norm filter refuses an update of an honest
  client's length), ``nan-metrics`` (a NaN training loss), and on the statistics a reply
  carries (:data:`STATISTICS_ATTACKS`, :func:`forge_statistics`: what the method declares its
  records hold, ``strategies.registry.statistics_of``), in training replies and in
  the answers to an exchange before training (query messages: Powder's measured alphas);
* ``label-flip``: the client trains on its images with its task's classes reversed
  (:func:`flips_labels`); the colluding attacks (``alie``, ``ipm``, ``mimic``, ``min-max``,
  ``min-sum``) reply what they trained, and the server of the simulation replaces those replies
  by the attack computed from the colluders' updates (strategies/platform/attack_policy.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from ..common.config.experiment import ExperimentConfig
from ..common.records import ARRAYS, CONFIG, METRICS, arrays_of, as_int, from_array_record, metrics_of, to_array_record
from ..strategies.platform.collusion import COLLUDING_ATTACKS
from ..strategies.platform.statistics import Statistics
from ..strategies.registry import statistics_of
from .message_context import message_context
from .node_policy import NodePolicy

log = logging.getLogger("promptfcl")


class InjectedFault(RuntimeError):
    """Raised by a client chosen to fail."""


def is_faulty(chosen: frozenset[int], rate: float, seed: int, client_id: int, task: int, round_: int) -> bool:
    """``chosen`` (``fault-clients``) set: those clients always; else each (client, task, round) with
    probability ``rate`` (``fault-rate``), seeded by the run's ``seed``."""
    if chosen:
        return client_id in chosen
    if rate <= 0:
        return False
    return bool(np.random.default_rng([seed, client_id, task, round_, 0xFA17]).random() < rate)


def inject_faults(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """The mod: pass every message through, and make the chosen train messages misbehave (on a node
    that enabled fault injection)."""
    kind = msg.metadata.message_type
    if kind not in (MessageType.TRAIN, MessageType.QUERY) or not context.run_config.get("fault") \
            or context.run_config.get("fault") in HONEST_REPLIES:
        return call_next(msg, context)
    # an exchange before training (Powder's measured alphas) carries statistics, not a model
    if kind == MessageType.QUERY and context.run_config.get("fault") not in STATISTICS_ATTACKS:
        return call_next(msg, context)
    node = message_context(context)
    if not node.policy.fault_injection:
        log.warning(
            "the run asks for fault injection (fault = %r); this node did not enable it and trains normally",
            context.run_config.get("fault"),
        )
        return call_next(msg, context)
    cfg = node.cfg
    config = msg.content.config_records[CONFIG] if CONFIG in msg.content.config_records else ConfigRecord()
    try:
        client, task, round_ = as_int(config["client-id"]), as_int(config["task"]), as_int(config["round"])
    except (KeyError, TypeError, ValueError):
        return call_next(msg, context)  # not a message the ClientApp can train on: it reports that itself
    if not cfg.robustness.fault or not is_faulty(cfg.robustness.fault_client_ids, cfg.robustness.fault_rate,
                                                 cfg.run.seed, client, task, round_):
        return call_next(msg, context)
    if cfg.robustness.fault == "raise":
        raise InjectedFault(f"injected failure of client {client} (task {task}, round {round_})")
    if cfg.robustness.fault == "hang":
        time.sleep(cfg.robustness.fault_hang_seconds)
        return call_next(msg, context)
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    sent = from_array_record(arrays_of(msg.content)) if ARRAYS in msg.content.array_records else {}
    specs = statistics_of(cfg.run.strategy) if cfg.robustness.fault in STATISTICS_ATTACKS else {}
    return Message(content=corrupt(cfg.robustness.fault, reply.content, sent, cfg.robustness.update_norm_factor, specs),
                   reply_to=msg)


#: fault kinds whose hostile clients reply what they trained: the colluding attacks (the server of a
#: simulation replaces their replies: strategies/platform/attack_policy.py) and label flipping
#: (the client's data: :func:`flips_labels`)
HONEST_REPLIES = (*COLLUDING_ATTACKS, "label-flip")


def flips_labels(cfg: ExperimentConfig, policy: NodePolicy, client: int, task: int, round_: int) -> bool:
    """Whether this fit of ``client`` trains on flipped labels: ``fault = "label-flip"``, on a node
    whose ``policy`` enables fault injection, for a client the fault chose (:func:`is_faulty`)."""
    rob = cfg.robustness
    return rob.fault == "label-flip" and policy.fault_injection and \
        is_faulty(rob.fault_client_ids, rob.fault_rate, cfg.run.seed, client, task, round_)


#: the factor each reversing attack multiplies the client's own update by (None: the norm filter's)
REVERSALS = {"poison": 10.0, "sign-flip": 1.0, "poison-under-filter": None}


def reverse_update(trained: np.ndarray, sent: np.ndarray | None, scale: float) -> np.ndarray:
    """``sent - scale x (trained - sent)``, the client's own update reversed and scaled. A reply
    array that is a block of rows of what was sent (FPPL returns only its task's prompt row) is
    reversed against the block of the sent array nearest to it (the rows it was trained from);
    an array with nothing to compare to is negated."""
    if sent is not None and sent.shape != trained.shape and sent.ndim == trained.ndim \
            and sent.shape[1:] == trained.shape[1:] and trained.shape[0] <= sent.shape[0]:
        rows, whole = trained.shape[0], sent
        start = min(range(whole.shape[0] - rows + 1), key=lambda i: float(np.sum((whole[i:i + rows] - trained) ** 2)))
        sent = whole[start:start + rows]
    if sent is None or sent.shape != trained.shape:
        return (-scale * trained).astype(trained.dtype)
    return (sent - scale * (trained - sent)).astype(trained.dtype)


def corrupt(kind: str, reply: RecordDict, sent: dict[str, np.ndarray], norm_factor: float = 10.0,
            specs: Mapping[str, Statistics] | None = None) -> RecordDict:
    """``reply`` as a client with fault ``kind`` would send it (``norm_factor``: the run's
    ``update-norm-factor``, which ``poison-under-filter`` stays under; ``specs``: what the
    method declares each record of statistics holds, which the statistics attacks forge)."""
    out = RecordDict({name: reply[name] for name in reply.keys()})
    arrays = from_array_record(arrays_of(reply)) if ARRAYS in reply.array_records else {}
    name = next(iter(arrays), "")
    if kind == "nan":
        arrays[name] = np.full_like(arrays[name], np.nan)
    elif kind == "shape":
        arrays[name] = arrays[name].reshape(-1)[:-1].copy()
    elif kind == "huge-values":
        arrays = {k: v * np.asarray(1e30, dtype=v.dtype) for k, v in arrays.items()}
    elif kind in REVERSALS:  # the update reversed and scaled
        scale = REVERSALS[kind] or 0.9 * (norm_factor if norm_factor > 0 else 10.0)
        arrays = {k: reverse_update(v, sent.get(k), scale) for k, v in arrays.items()}
    elif kind == "extra-record":
        out["unexpected"] = ConfigRecord({"note": "not part of the protocol"})
    elif kind == "missing-record":
        return RecordDict({ARRAYS: reply[ARRAYS]})
    elif kind in ("huge-count", "nan-metrics"):
        metrics = dict(metrics_of(reply))
        if kind == "huge-count":
            metrics["num-examples"] = 10**12
        else:
            metrics["train-loss"] = float("nan")
        out[METRICS] = MetricRecord(metrics)
    if kind in ("nan", "shape", "huge-values", *REVERSALS):
        out[ARRAYS] = to_array_record(arrays)
    if kind in STATISTICS_ATTACKS:
        for record, spec in (specs or {}).items():
            if record in reply.array_records:
                out[record] = to_array_record(forge_statistics(kind, from_array_record(arrays_of(reply, record)), spec))
    return out


#: attacks on the statistics a reply carries besides the model, on whatever the method declares
#: its records hold (its ``statistics``: HGP's class statistics, FPPL's prototypes, Powder's alphas,
#: LoRM's Grams, ...), each well-formed so that record checks pass
STATISTICS_ATTACKS = ("stats-scale", "stats-shift", "cov-inflate", "hist-forge")


def forge_statistics(kind: str, arrays: dict[str, np.ndarray], spec: Statistics) -> dict[str, np.ndarray]:
    """One statistics record, whose arrays ``spec`` declares, as a hostile client forges it:
    ``stats-scale`` (its vectors: class means, prototypes, alphas x 20), ``stats-shift`` (the same
    + 5 in every coordinate), ``cov-inflate`` (its second moments: covariances, Grams x 100),
    ``hist-forge`` (every count moved to the record's first row: the total, which the server
    checks against the reply's samples, unchanged)."""
    out = dict(arrays)
    for name, value in arrays.items():
        if kind == "stats-scale" and name in spec.vectors:
            out[name] = (value * 20).astype(value.dtype)
        elif kind == "stats-shift" and name in spec.vectors:
            out[name] = (value + 5).astype(value.dtype)
        elif kind == "cov-inflate" and name in spec.second_moments:
            out[name] = (value * 100).astype(value.dtype)
        elif kind == "hist-forge" and name in spec.counts and value.size > 1:
            forged = np.zeros_like(value)
            forged.reshape(-1)[0] = value.sum()
            out[name] = forged
    return out


__all__ = ["HONEST_REPLIES", "STATISTICS_ATTACKS", "InjectedFault", "corrupt", "flips_labels",
           "forge_statistics", "inject_faults", "is_faulty"]
