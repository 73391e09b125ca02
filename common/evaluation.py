"""Accuracy of the global model on the classes seen so far, as per-task counts.

Counts (not ratios) are returned so that federated evaluation can sum them over
clients before dividing; the server's centralised evaluation uses the same code.
"""

from __future__ import annotations

import numpy as np
import torch

from common.data import seen_classes
from common.model import masked_logits
from common.runtime import Runtime


@torch.no_grad()
def correct_counts(rt: Runtime, task: int, split: str = "test", batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Per task i <= ``task``: (correct, total) predictions, all seen classes competing."""
    cfg, model = rt.cfg, rt.model
    data = getattr(rt.data, split)
    k = rt.data.num_classes // cfg.num_tasks
    seen = seen_classes(task, rt.data.num_classes, cfg.num_tasks)
    allowed = torch.zeros(rt.data.num_classes, dtype=torch.bool)
    allowed[seen] = True
    index = np.flatnonzero(np.isin(data.labels, seen))
    queries = rt.queries(split, index)
    model.eval()
    model.prompt.set_task(task)
    preds = np.empty(len(index), dtype=np.int64)
    for start in range(0, len(index), batch_size):
        sel = index[start : start + batch_size]
        x = model.preprocess(torch.from_numpy(data.images[sel]).to(rt.device))
        with rt.autocast():
            q = queries[start : start + batch_size] if queries is not None else model.query(x)
            logits = model(x, q)
        preds[start : start + len(sel)] = masked_logits(logits.float(), allowed).argmax(1).cpu().numpy()
    labels = data.labels[index]
    task_of = labels // k
    correct = np.bincount(task_of, weights=(preds == labels), minlength=task + 1)[: task + 1]
    total = np.bincount(task_of, minlength=task + 1)[: task + 1]
    return correct.astype(np.int64), total.astype(np.int64)


def accuracies(correct: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Per-task accuracy in percent (NaN where a task has no test samples)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, 100.0 * correct / np.maximum(total, 1), np.nan)
