"""The class-incremental task stream: the seeded class order, each task's classes and head rows, and
Powder's random tasks (tasks of random, overlapping classes, section 5.1)."""

from __future__ import annotations

import functools

import numpy as np

from .config import ConfigError, ExperimentConfig


def class_order(num_classes: int, seed: int) -> np.ndarray:
    """Seeded permutation of the original class ids; position = remapped label."""
    return np.random.default_rng([seed, 0xC1A55]).permutation(num_classes)


def task_classes(cfg: ExperimentConfig, task: int, num_classes: int) -> np.ndarray:
    """The classes of ``task`` (remapped labels, ascending)."""
    if not 0 <= task < cfg.num_tasks:
        raise ValueError(f"task {task} out of range [0, {cfg.num_tasks})")
    if cfg.task_generator == "random":
        return random_tasks(cfg, num_classes)[task].copy()  # the cached tasks stay read-only
    k = num_classes // cfg.num_tasks
    return np.arange(task * k, (task + 1) * k)


def seen_classes(cfg: ExperimentConfig, task: int, num_classes: int) -> np.ndarray:
    """The union of the classes of tasks 0..``task``."""
    if cfg.task_generator == "random":
        return np.unique(np.concatenate(random_tasks(cfg, num_classes)[: task + 1]))
    return np.arange((task + 1) * (num_classes // cfg.num_tasks))


def head_size(cfg: ExperimentConfig, num_classes: int) -> int:
    """Outputs of the linear head: one per class, or (a per-task head, random tasks) a block of
    ``classes-per-task`` per task."""
    return cfg.num_tasks * cfg.classes_per_task if cfg.per_task_head else num_classes


def head_rows(cfg: ExperimentConfig, task: int, num_classes: int) -> np.ndarray:
    """The head rows scoring ``task``'s classes, in ``task_classes`` order: the classes' own rows
    (shared with every other task holding them), or ``task``'s own block (a per-task head)."""
    if cfg.per_task_head:
        return np.arange(task * cfg.classes_per_task, (task + 1) * cfg.classes_per_task)
    return task_classes(cfg, task, num_classes)


def head_targets(cfg: ExperimentConfig, task: int, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Labels of ``task``'s classes as the head rows that score them (their logit's index)."""
    if not cfg.per_task_head:
        return np.asarray(labels)
    classes = task_classes(cfg, task, num_classes)
    pos = np.searchsorted(classes, labels)
    if not np.array_equal(classes[np.minimum(pos, len(classes) - 1)], labels):
        raise ValueError(f"labels outside task {task}'s classes {classes.tolist()}")
    return head_rows(cfg, task, num_classes)[pos]


def training_classes(cfg: ExperimentConfig, task: int, num_classes: int) -> np.ndarray:
    """The classes a client learns while on ``task``: its data's classes and the CE's.

    The task's own classes, except for the joint upper bound (``centralised = true``,
    ``centralised-mode = "joint"``), which at task t trains on every class seen so far.
    """
    if cfg.centralised and cfg.centralised_mode == "joint":
        return seen_classes(cfg, task, num_classes)
    return task_classes(cfg, task, num_classes)


def task_rows(cfg: ExperimentConfig, name: str, value: np.ndarray, task: int,
              num_classes: int) -> slice | np.ndarray | None:
    """The rows of trainable array ``name`` that belong to ``task`` (None: not task-structured).

    A prompt array's first dimension is the pool, split evenly over the tasks (task t owns
    slice t); a head array's is the head's rows (``head_rows``: task t's classes, which with
    random tasks two tasks may share, or task t's own block). Methods that average, send or
    reply per task (Fed-CPrompt, Powder) locate a task's part with this.
    """
    if name.startswith("prompt.") and value.ndim >= 1 and value.shape[0] == cfg.pool_size:
        per_task = cfg.pool_size // cfg.num_tasks
        return slice(task * per_task, (task + 1) * per_task)
    if name.startswith("head.") and value.ndim >= 1 and value.shape[0] == head_size(cfg, num_classes):
        return head_rows(cfg, task, num_classes)
    return None


def random_tasks(cfg: ExperimentConfig, num_classes: int) -> tuple[np.ndarray, ...]:
    """Powder's tasks (Powder, section 5.1): ``num-tasks`` sets of ``classes-per-task`` classes.

    Task 0 draws its classes uniformly; every later task takes ``ceil(min-overlap * n)`` of
    its classes from those of earlier tasks (the paper's "least overlap tau"), the least
    reused ones first (ties broken at random) so that classes recur evenly, and draws the
    rest uniformly from the classes it has not taken yet. A pure function of the seed. With
    ``task-data-sharing = disjoint``, raises ConfigError when a class would be in more
    tasks than its images can give disjoint ``task-data-fraction`` shares to.
    """
    fraction = cfg.task_data_fraction if cfg.task_data_sharing == "disjoint" else 0.0
    return _random_tasks(cfg.num_tasks, num_classes, cfg.classes_per_task, cfg.min_overlap, fraction, cfg.seed)


@functools.lru_cache(maxsize=8)
def _random_tasks(num_tasks: int, num_classes: int, n: int, min_overlap: float, fraction: float,
                  seed: int) -> tuple[np.ndarray, ...]:
    """See ``random_tasks``; ``fraction`` 0 skips the disjoint-shares check."""
    if n > num_classes:
        raise ConfigError(f"classes-per-task ({n}) exceeds the dataset's {num_classes} classes")
    rng = np.random.default_rng([seed, 0x7A5C5])
    tasks: list[np.ndarray] = []
    holders = np.zeros(num_classes, dtype=np.int64)  # tasks holding each class so far
    for _ in range(num_tasks):
        old = np.flatnonzero(holders)
        take = min(int(np.ceil(min_overlap * n - 1e-9)), len(old)) if len(tasks) else 0
        chosen = old[np.lexsort((rng.random(len(old)), holders[old]))[:take]]  # least reused first
        rest = np.setdiff1d(np.arange(num_classes), chosen)
        chosen = np.concatenate([chosen, rng.choice(rest, n - take, replace=False)]).astype(np.int64)
        tasks.append(np.sort(chosen))
        tasks[-1].flags.writeable = False  # cached and handed out: nobody may change them
        holders[chosen] += 1
    if holders.max() * fraction > 1.0 + 1e-9:
        raise ConfigError(
            f"with this seed a class is in {holders.max()} of the {num_tasks} random tasks, but "
            f"{holders.max()} disjoint shares of task-data-fraction = {fraction} exceed its images; "
            f"lower task-data-fraction to <= {1.0 / holders.max():.3f} or min-overlap, or set "
            f"task-data-sharing = independent")
    return tuple(tasks)


def random_task_indices(labels: np.ndarray, cfg: ExperimentConfig, num_classes: int, task: int) -> np.ndarray:
    """Training indices of a random task: for each of its classes, the task's share.

    ``disjoint``: a class's images are shuffled once (seeded) and the tasks holding the
    class take consecutive shares of ``task-data-fraction`` of them in task order.
    ``independent``: every task draws its own share (two tasks' shares may overlap).
    """
    tasks = random_tasks(cfg, num_classes)
    out = []
    for y in tasks[task]:
        holders = [g for g in range(len(tasks)) if y in tasks[g]]
        j = holders.index(task)
        key = [cfg.seed, int(y), 0xDA7A] + ([] if cfg.task_data_sharing == "disjoint" else [task])
        idx = np.random.default_rng(key).permutation(np.flatnonzero(labels == y))
        share = int(cfg.task_data_fraction * len(idx))
        if share == 0:
            raise ConfigError(f"class {y} has {len(idx)} training images: a task-data-fraction of "
                              f"{cfg.task_data_fraction} of them is empty")
        start = j * share if cfg.task_data_sharing == "disjoint" else 0
        out.append(idx[start : start + share])
    return np.sort(np.concatenate(out))


