"""The class-incremental task stream: the seeded class order, each task's classes and head rows, and
Powder's random tasks (tasks of random, overlapping classes, section 5.1), as one frozen value,
:class:`TaskLayout`, built once per run and passed where the whole experiment is not needed."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..config import sections as sections
from ..config.experiment import ConfigError


def class_order(num_classes: int, seed: int) -> np.ndarray:
    """Seeded permutation of the original class ids; position = remapped label."""
    return np.random.default_rng([seed, 0xC1A55]).permutation(num_classes)


@dataclass(frozen=True)
class TaskLayout:
    """The run's tasks, classes, prompt pool and head: what most units need of the experiment.

    Parameters
    ----------
    num_tasks, num_classes : int
        The stream's tasks and the dataset's classes (remapped labels ``0..num_classes-1``).
    classes_per_task : int
        Classes of one task: ``num_classes // num_tasks`` for the stream (contiguous classes),
        ``classes-per-task`` for random tasks.
    pool_size : int
        Prompt components per prompted block, split evenly over the tasks.
    per_task_head : bool
        A block of ``classes_per_task`` head rows per task (random tasks), else a row per class.
    random : bool
        Powder's random tasks (``task-generator = random``), else the stream.
    joint : bool
        The joint upper bound (``centralised``, ``centralised-mode = joint``): task t trains on
        every class seen so far.
    seed, min_overlap, task_data_fraction, task_data_sharing
        What random tasks are drawn from (``seed`` also orders the classes).
    """

    num_tasks: int
    num_classes: int
    classes_per_task: int
    pool_size: int
    per_task_head: bool
    random: bool
    joint: bool
    seed: int
    min_overlap: float
    task_data_fraction: float
    task_data_sharing: str

    @classmethod
    def of(cls, run: sections.RunSection, data: sections.DataSection, federation: sections.FederationSection,
           model: sections.ModelSection, num_classes: int) -> TaskLayout:
        """The layout a run of these sections has over a dataset of ``num_classes`` classes."""
        return cls(data.num_tasks, num_classes, data.classes_per_task if data.random else num_classes // data.num_tasks,
                   model.pool_size, model.per_task_head(data), data.random, federation.joint, run.seed,
                   data.min_overlap, data.task_data_fraction, data.task_data_sharing)

    @property
    def components_per_task(self) -> int:
        """Prompt components of one task's slice of the pool."""
        return self.pool_size // self.num_tasks

    def slice_of(self, task: int) -> slice:
        """``task``'s slice of the prompt pool."""
        return slice(task * self.components_per_task, (task + 1) * self.components_per_task)

    def classes(self, task: int) -> np.ndarray:
        """The classes of ``task`` (remapped labels, ascending)."""
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"task {task} out of range [0, {self.num_tasks})")
        if self.random:
            return self.random_tasks()[task].copy()  # the cached tasks stay read-only
        k = self.classes_per_task
        return np.arange(task * k, (task + 1) * k)

    def seen(self, task: int) -> np.ndarray:
        """The union of the classes of tasks 0..``task``."""
        if self.random:
            return np.unique(np.concatenate(self.random_tasks()[: task + 1]))
        return np.arange((task + 1) * self.classes_per_task)

    def task_of(self, label: int) -> int:
        """The stream task holding class ``label`` (random tasks share classes: no single task)."""
        if self.random:
            raise ValueError("random tasks share classes: a class has no single task")
        return int(label) // self.classes_per_task

    @property
    def head_size(self) -> int:
        """Outputs of the linear head: one per class, or (a per-task head, random tasks) a block of
        ``classes-per-task`` per task."""
        return self.num_tasks * self.classes_per_task if self.per_task_head else self.num_classes

    def head_rows(self, task: int) -> np.ndarray:
        """The head rows scoring ``task``'s classes, in ``classes`` order: the classes' own rows
        (shared with every other task holding them), or ``task``'s own block (a per-task head)."""
        if self.per_task_head:
            return np.arange(task * self.classes_per_task, (task + 1) * self.classes_per_task)
        return self.classes(task)

    def head_targets(self, task: int, labels: np.ndarray) -> np.ndarray:
        """Labels of ``task``'s classes as the head rows that score them (their logit's index)."""
        if not self.per_task_head:
            return np.asarray(labels)
        classes = self.classes(task)
        pos = np.searchsorted(classes, labels)
        if not np.array_equal(classes[np.minimum(pos, len(classes) - 1)], labels):
            raise ValueError(f"labels outside task {task}'s classes {classes.tolist()}")
        return self.head_rows(task)[pos]

    def training_classes(self, task: int) -> np.ndarray:
        """The classes a client learns while on ``task``: its data's classes and the CE's.

        The task's own classes, except for the joint upper bound (``centralised = true``,
        ``centralised-mode = "joint"``), which at task t trains on every class seen so far.
        """
        return self.seen(task) if self.joint else self.classes(task)

    def task_rows(self, name: str, value: np.ndarray, task: int) -> slice | np.ndarray | None:
        """The rows of trainable array ``name`` that belong to ``task`` (None: not task-structured).

        A prompt array's first dimension is the pool, split evenly over the tasks (task t owns
        slice t); a head array's is the head's rows (``head_rows``: task t's classes, which with
        random tasks two tasks may share, or task t's own block). Methods that average, send or
        reply per task (Fed-CPrompt, Powder) locate a task's part with this.
        """
        if name.startswith("prompt.lora_") and value.ndim >= 1 and value.shape[0] == self.num_tasks:
            return slice(task, task + 1)  # a low-rank adapter's sets, one per task (common/model/adapters.py)
        if name.startswith("prompt.") and value.ndim >= 1 and value.shape[0] == self.pool_size:
            return self.slice_of(task)
        if name.startswith("head.") and value.ndim >= 1 and value.shape[0] == self.head_size:
            return self.head_rows(task)
        return None

    def random_tasks(self) -> tuple[np.ndarray, ...]:
        """Powder's tasks (Powder, section 5.1): ``num-tasks`` sets of ``classes-per-task`` classes.

        Task 0 draws its classes uniformly; every later task takes ``ceil(min-overlap * n)`` of
        its classes from those of earlier tasks (the paper's "least overlap tau"), the least
        reused ones first (ties broken at random) so that classes recur evenly, and draws the
        rest uniformly from the classes it has not taken yet. A pure function of the seed. With
        ``task-data-sharing = disjoint``, raises ConfigError when a class would be in more
        tasks than its images can give disjoint ``task-data-fraction`` shares to.
        """
        fraction = self.task_data_fraction if self.task_data_sharing == "disjoint" else 0.0
        return _random_tasks(self.num_tasks, self.num_classes, self.classes_per_task, self.min_overlap, fraction,
                             self.seed)

    def random_task_indices(self, labels: np.ndarray, task: int) -> np.ndarray:
        """Training indices of a random task: for each of its classes, the task's share.

        ``disjoint``: a class's images are shuffled once (seeded) and the tasks holding the
        class take consecutive shares of ``task-data-fraction`` of them in task order.
        ``independent``: every task draws its own share (two tasks' shares may overlap).
        """
        tasks = self.random_tasks()
        disjoint = self.task_data_sharing == "disjoint"
        out = []
        for y in tasks[task]:
            holders = [g for g in range(len(tasks)) if y in tasks[g]]
            j = holders.index(task)
            key = [self.seed, int(y), 0xDA7A] + ([] if disjoint else [task])
            idx = np.random.default_rng(key).permutation(np.flatnonzero(labels == y))
            share = int(self.task_data_fraction * len(idx))
            if share == 0:
                raise ConfigError(f"class {y} has {len(idx)} training images: a task-data-fraction of "
                                  f"{self.task_data_fraction} of them is empty")
            start = j * share if disjoint else 0
            out.append(idx[start : start + share])
        return np.sort(np.concatenate(out))


@functools.lru_cache(maxsize=8)
def _random_tasks(num_tasks: int, num_classes: int, n: int, min_overlap: float, fraction: float,
                  seed: int) -> tuple[np.ndarray, ...]:
    """See ``TaskLayout.random_tasks``; ``fraction`` 0 skips the disjoint-shares check."""
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
