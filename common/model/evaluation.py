"""Accuracy of the global model on the classes seen so far, as per-task counts.

Counts (not ratios) are returned so that federated evaluation can sum them over
clients before dividing; the server's centralised evaluation uses the same code.

On the class-incremental stream every seen class competes for every test image. With
random tasks (Powder's benchmark) classes recur across tasks, so a task is scored on the
test images of its classes with its own classes competing: their rows of the head, one per
class shared by the tasks holding it, or the task's own block (``head = "per-task"``, as the
authors' code gives every client task its own block).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .prompted import masked_logits
from .runtime import Runtime


@torch.no_grad()
def correct_counts(rt: Runtime, task: int, split: str = "test", batch_size: int = 256,
                   only: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per task i <= ``task``: (correct, total) predictions, all seen classes competing
    (random tasks: the task's own classes competing; ``only``: score that task alone, on
    its classes' images only, the others' counts left 0)."""
    layout, model = rt.layout, rt.model
    if only is not None and not layout.random:
        raise ValueError("only = <task> scores one task among its own classes: random tasks only")
    data = getattr(rt.data, split)
    random_tasks = layout.random
    seen = layout.seen(task) if only is None else layout.classes(only)
    allowed = torch.zeros(rt.data.num_classes, dtype=torch.bool)
    allowed[seen] = True
    index = np.flatnonzero(np.isin(data.labels, seen))
    queries = rt.queries(split, index)
    model.eval()
    model.prompt.set_task(task)
    preds = np.empty(len(index), dtype=np.int64)
    all_logits = torch.empty(len(index) if random_tasks else 0, layout.head_size)
    for start in range(0, len(index), batch_size):
        sel = index[start : start + batch_size]
        x = model.preprocess(torch.from_numpy(data.images[sel]).to(rt.device), evaluation=split == "test")
        with rt.autocast():
            q = queries[start : start + batch_size] if queries is not None else model.query(x)
            logits = model(x, q)
        if random_tasks:  # each task's argmax over its own head rows, below
            all_logits[start : start + len(sel)] = logits.float().cpu()
        else:
            preds[start : start + len(sel)] = masked_logits(logits.float(), allowed).argmax(1).cpu().numpy()
    labels = data.labels[index]
    if random_tasks:
        correct, total = np.zeros(task + 1, np.int64), np.zeros(task + 1, np.int64)
        for i in range(task + 1) if only is None else [only]:
            classes = layout.classes(i)
            rows = np.flatnonzero(np.isin(labels, classes))
            cols = torch.as_tensor(layout.head_rows(i))
            pred = classes[all_logits[rows][:, cols].argmax(1).numpy()]
            correct[i], total[i] = int((pred == labels[rows]).sum()), len(rows)
        return correct, total
    task_of = labels // layout.classes_per_task  # the stream's tasks hold contiguous classes
    correct = np.bincount(task_of, weights=(preds == labels), minlength=task + 1)[: task + 1]
    total = np.bincount(task_of, minlength=task + 1)[: task + 1]
    return correct.astype(np.int64), total.astype(np.int64)


def pooled_counts(rt: Runtime, task: int, pools: dict[int, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per task i <= ``task``: (correct, total) with each scored task seen through its own prompt
    slices (``pools``: task -> the slices its prompt module uses, ``local_tasks``), as methods
    whose clients keep per-task local pools are evaluated; tasks without a pool count 0 of 0."""
    correct, total = np.zeros(task + 1, np.int64), np.zeros(task + 1, np.int64)
    prompt: Any = rt.model.prompt  # a prompt module with local pools (Powder's)
    try:
        for scored, pool in pools.items():
            prompt.local_tasks = pool
            c, t = correct_counts(rt, task, only=scored)
            correct[scored], total[scored] = c[scored], t[scored]
    finally:
        prompt.local_tasks = None
    return correct, total


def accuracies(correct: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Per-task accuracy in percent (NaN where a task has no test samples)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, 100.0 * correct / np.maximum(total, 1), np.nan)
