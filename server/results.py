"""What a run reports: results.json's contents, the privacy guarantee so far, and log lines."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from ..common import metrics
from ..common.config.experiment import ExperimentConfig
from ..common.config.trust import resolve_trust
from ..common.data.splits import FILE_NAME as SPLITS_FILE
from ..common.data.tasks import class_order
from ..common.model.runtime import Runtime
from ..common.privacy import PrivacyOptions, privacy_report
from ..strategies.platform.strategy import PromptStrategy
from .rounds import RoundRecord

log = logging.getLogger("promptfcl")


def privacy_so_far(opts: PrivacyOptions, strategy: PromptStrategy, rounds: list[RoundRecord]) -> dict[str, Any]:
    """results.json's ``privacy`` after ``rounds`` under the run's privacy options ``opts``
    (common/privacy.py): every training attempt is one step of the sampled Gaussian mechanism (a
    retried round's clients uploaded too), at the rate it was sampled with."""
    if not opts.enabled:  # called after every round: nothing to count
        return privacy_report(opts, [], strategy.sample_rate)
    return privacy_report(opts, sample_rates(rounds, strategy.sample_rate), strategy.sample_rate,
                          most_uploads(rounds))


def sample_rates(rounds: list[RoundRecord], nominal: float) -> list[float]:
    """Every attempt's sampling rate; a round recorded without them (a checkpoint older than the
    record) counts its attempts at the nominal rate."""
    rates: list[float] = []
    for record in rounds:
        recorded = record.sample_rates if len(record.sample_rates) == record.attempts else []
        rates += recorded or [nominal] * record.attempts
    return rates


def most_uploads(rounds: list[RoundRecord]) -> int:
    """Uploads of the client sampled most often: what the server (which knows the sample) sees of
    one client. Rounds record the last attempt's clients; an earlier attempt counts for everyone."""
    counts: Counter[int] = Counter()
    retries = 0
    for record in rounds:
        counts.update({int(p["client"]) for p in record.placement if p.get("client") is not None})
        retries += record.attempts - 1
    return max(counts.values(), default=0) + retries


def build_results(cfg: ExperimentConfig, runtime: Runtime | None, acc: np.ndarray, rounds: list[dict[str, Any]],
                  arrays: ArrayRecord, seconds: float, evaluate: Any = None) -> dict[str, Any]:
    """results.json: the configuration, data, accuracy matrix and summary, rounds, bytes and times."""
    n_params = sum(int(np.prod(arrays[k].shape)) for k in arrays.keys())
    total_s2c = sum(r["bytes_s2c"] for r in rounds)
    total_c2s = sum(r["bytes_c2s"] for r in rounds)
    if runtime is not None:
        backbone = runtime.weights_source
        dataset = {
            "name": runtime.data.name,
            "num_classes": runtime.data.num_classes,
            "class_order_names": runtime.data.class_names,
            "train_size": len(runtime.data.train),
            "test_size": len(runtime.data.test),
            "fingerprint": runtime.data.fingerprint,
            "split": runtime.data.split,
            "splits_file": SPLITS_FILE,  # class order and every client's share per task (common/data/splits.py)
        }
    else:  # federated evaluation: what the server knows of the nodes' data

        names = cfg.data.class_name_list
        backbone = f"{cfg.model.backbone} with weights {cfg.model.weights!r}, held by the nodes (not by the server)"
        dataset = {
            "name": "the nodes' own data (federated evaluation)",
            "num_classes": cfg.data.num_classes,
            "class_order_names": [names[c] for c in class_order(cfg.data.num_classes, cfg.run.seed)] if names else None,
            "train_size": None,
            "test_size": getattr(evaluate, "last_total", None),  # held-out samples in the last evaluation
            "fingerprint": None,
            "split": "each node's own train/test (see the nodes' logs)",
            "splits_file": None,
        }
    random_tasks = cfg.data.task_generator == "random"  # no task ends for everyone: no accuracy matrix
    return {
        "config": cfg.to_dict(),
        "config_digest": cfg.digest(),  # what every node's reply echoes (placement): the same run config
        # whether the hostile-client defences applied, and why (common/config/trust.py)
        "defences": resolve_trust(cfg.robustness.defences, cfg.federation.population, cfg.robustness.fault).to_dict(),
        "backbone": backbone,
        "dataset": dataset,
        "accuracy_matrix": [[None if np.isnan(v) else float(v) for v in row] for row in acc],
        **(summary_so_far(acc) if not random_tasks else {}),
        "average_accuracy_per_task": None
        if random_tasks or np.isnan(acc[0, 0])
        else [float(v) for v in metrics.average_accuracies(acc, finished_tasks(acc) - 1)],
        "rounds": rounds,
        "communication": {
            "trainable_parameters": n_params,
            "bytes_s2c_total": total_s2c,
            "bytes_c2s_total": total_c2s,
            "bytes_s2c_per_round": total_s2c / max(len(rounds), 1),
            "bytes_c2s_per_round": total_c2s / max(len(rounds), 1),
            "bytes_per_client_exchange": (total_s2c + total_c2s)
            / max(sum(r["clients_sampled"] for r in rounds), 1)
            / 2,
        },
        "timing": {
            "total_seconds": seconds,
            "client_seconds_per_round": float(np.mean([r["client_seconds"] for r in rounds])),
            "server_seconds_per_round": float(np.mean([r["server_seconds"] for r in rounds])),
            "round_seconds_mean": float(np.mean([r["round_seconds"] for r in rounds])),
        },
    }


def log_placement(placement: list[dict[str, Any]]) -> None:
    """One line: on which devices and nodes this round's clients trained."""
    devices = Counter(str(p["device"]) for p in placement if p["device"] is not None)
    nodes = {p["node"] for p in placement if p["node"] is not None}
    visible = Counter(repr(p["cuda_visible_devices"]) for p in placement if p["device"] is not None)
    log.info(
        "clients trained on %s, on %d node(s); CUDA_VISIBLE_DEVICES %s",
        ", ".join(f"{d} x{n}" for d, n in devices.items()) or "unknown devices",
        len(nodes),
        ", ".join(f"{v} x{n}" for v, n in visible.items()) or "unknown",
    )


def finished_tasks(acc: np.ndarray) -> int:
    """How many tasks have their accuracy-matrix column (all of them unless the run stopped early)."""
    return int(sum(not np.isnan(acc[t, t]) for t in range(acc.shape[0])))


#: results.json's top-level summary keys (random tasks: Powder's AIA, FM, final accuracy and BT)
SUMMARY_KEYS = ("final_average_accuracy", "average_incremental_accuracy", "average_forgetting", "backward_transfer")


def summary_so_far(acc: np.ndarray) -> dict[str, float | None]:
    """A_N, AIA, forgetting and backward transfer over the finished tasks (None before the first
    task ends; backward transfer also None after one task, where it is undefined)."""
    done = finished_tasks(acc)
    if done == 0:
        return dict.fromkeys(SUMMARY_KEYS)
    return dict(metrics.summary(acc, upto=done - 1))


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KB, MB or GB."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
