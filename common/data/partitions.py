"""Client partitions: each client's share of a task, a pure function of (seed, client id, task, round).

The server never stores per-client data state, and a ClientApp started fresh in any process
recomputes exactly the same indices.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from ..config import sections as sections
from ..config.experiment import ConfigError
from .splits import ANY_ROUND, check_matches, read_splits
from .tasks import TaskLayout, class_order


@dataclass(frozen=True)
class Partition:
    """How the clients share each task's training data: the data layer's explicit inputs.

    Parameters
    ----------
    scheme : str
        ``partition``: iid, dirichlet, quantity-skew, quantity (static per task) or stateless
        (HePCo's population, drawn afresh every round).
    num_clients : int
        The population the shares are cut for (client ids ``0..num_clients-1``).
    seed : int
        Seeds every draw.
    whole : bool
        One client holds every sample of its task's classes: the centralised upper bound, or a
        deployed node whose data is all its own (``own_data``).
    own_data : bool
        The data is the client's own (a deployed node): every sample of a stream task's classes
        is its share, whatever its client id.
    splits : str
        A splits.npz whose recorded shares replace the draws ("": draw).
    scope, class_order, beta, classes_per_client, min_size, balance
        The static partitions' settings (``partition-scope``, ``partition-class-order``,
        ``dirichlet-beta``, ``classes-per-client``, ``min-partition-size``, ``dirichlet-balance``).
    category_ratio, split_ratio, imbalance_ratio, rounds_per_task
        The stateless population's draws, per round of a task.
    num_rounds, switch_every, switch_fraction
        Random tasks: which client owns a task (common/data/schedule.py ``RandomTaskSchedule``).
    """

    scheme: str
    num_clients: int
    seed: int
    whole: bool
    own_data: bool
    splits: str
    scope: str
    class_order: str
    beta: float
    classes_per_client: int
    min_size: int
    balance: bool
    category_ratio: float
    split_ratio: float
    imbalance_ratio: float
    rounds_per_task: int
    num_rounds: int
    switch_every: int
    switch_fraction: float

    @classmethod
    def of(cls, run: sections.RunSection, data: sections.DataSection, federation: sections.FederationSection
           ) -> Partition:
        """The partition a run of these sections draws over the run's dataset."""
        f = federation
        return cls(f.partition, f.num_clients, run.seed, f.centralised, False, data.splits, f.partition_scope,
                   f.partition_class_order, f.dirichlet_beta, f.classes_per_client, f.min_partition_size,
                   f.dirichlet_balance, f.category_ratio, f.split_ratio, f.imbalance_ratio, f.rounds_per_task,
                   data.num_rounds, f.switch_every, f.switch_fraction)

    def own(self) -> Partition:
        """This partition as a deployed node with data of its own holds it: every sample of its
        task's classes is its share (random tasks: the schedule's client it plays, drawn as the
        run's), and no splits file is opened."""
        return dataclasses.replace(self, whole=True, own_data=True, splits="")

    def owner(self, layout: TaskLayout, task: int) -> int:
        """The client that holds random task ``task`` (the run's random task schedule)."""
        from .schedule import RandomTaskSchedule  # schedule imports tasks; built only for random tasks

        return RandomTaskSchedule(layout.num_tasks, self.num_clients, self.num_rounds, self.switch_every,
                                  self.switch_fraction, self.seed).owner(task)

    def describe(self, layout: TaskLayout) -> str:
        """One line naming the scheme (the whole summary: :func:`partition_summary`)."""
        if layout.random or self.whole or self.scheme == "stateless":
            return f"partition: {self.scheme if not self.whole else 'centralised'} (drawn per task or round)"
        return f"partition: {self.scheme} (scope {self.scope})"


def client_indices(
    labels: np.ndarray, layout: TaskLayout, partition: Partition, client_id: int, task: int, round_: int
) -> np.ndarray:
    """Training indices of ``client_id`` for ``task`` (and, for stateless populations, ``round_``):
    those recorded in the partition's ``splits`` file if it names one, else drawn (:func:`drawn_indices`).

    A pure function of its arguments: the same inputs give the same indices in any process.
    """
    # a node's own data: any client id holds all of its stream task (random tasks: the run's clients)
    if (layout.random or not partition.own_data) and not 0 <= client_id < max(partition.num_clients, 1):
        raise ValueError(f"client id {client_id} outside the population of {partition.num_clients}")
    if partition.splits:
        splits = read_splits(partition.splits)
        check_matches(splits, labels)
        share = splits.share(client_id, task, round_)
        stray = np.setdiff1d(labels[share], layout.training_classes(task))
        if len(stray):
            raise ConfigError(f"splits file {partition.splits}: client {client_id}'s share of task {task} holds "
                              f"classes {stray[:5].tolist()} outside the task; it was written for another task "
                              "stream (num-tasks, task-generator or seed)")
        return share
    return drawn_indices(labels, layout, partition, client_id, task, round_)


def drawn_indices(
    labels: np.ndarray, layout: TaskLayout, partition: Partition, client_id: int, task: int, round_: int
) -> np.ndarray:
    """The share the partition draws (seed, scheme, task stream)."""
    p = partition
    if layout.random:  # the task's client holds all of its data
        owner = p.owner(layout, task)
        if client_id != owner:
            raise ValueError(f"random task {task} belongs to client {owner}, not {client_id}")
        return layout.random_task_indices(labels, task)
    classes = layout.classes(task)
    if p.whole:  # the one client holds the task (joint upper bound: every seen task)
        return np.flatnonzero(np.isin(labels, layout.training_classes(task)))
    pool = np.flatnonzero(np.isin(labels, classes))
    if p.scheme == "stateless":
        return _stateless_indices(labels, pool, classes, p, client_id, task, round_)
    cut_order = _cut_order(p.class_order, layout.num_classes, p.seed)
    if p.scope == "dataset":  # one partition of the whole training set; each task takes its classes
        parts = _static_partition(labels.tobytes(), p.scheme, p.num_clients, p.seed, -1, p.beta,
                                  p.classes_per_client, p.min_size, p.balance, cut_order)
        mine = parts[client_id]
        return mine[np.isin(labels[mine], classes)]
    parts = _static_partition(labels[pool].tobytes(), p.scheme, p.num_clients, p.seed, task,
                              p.beta, p.classes_per_client, p.min_size, p.balance, cut_order)
    return pool[parts[client_id]]


def _cut_order(order: str, num_classes: int, seed: int) -> bytes:
    """The rank at which each (remapped) class is cut by a balanced Dirichlet partition, as bytes
    (hashable for the partition cache): ``partition-class-order = "original"`` cuts the classes in
    the dataset's own label order, as NIID-Bench and FPPL's code do (they partition before the
    class order is shuffled into tasks), so the balancing cap falls on classes spread over every
    task; ``"task"`` cuts them in task order, which leaves the clients that filled up on the early
    tasks with nothing of the last ones."""
    if order == "task":
        return np.arange(num_classes, dtype=np.int64).tobytes()
    return class_order(num_classes, seed).astype(np.int64).tobytes()  # remapped r is original order[r]


def drawn_shares(labels: np.ndarray, layout: TaskLayout,
                 partition: Partition) -> dict[tuple[int, int, int], np.ndarray]:
    """Every share the partition draws, keyed (client, task, round within the task or -1 =
    every round): what splits.npz records (common/data/splits.py)."""
    p = partition
    shares: dict[tuple[int, int, int], np.ndarray] = {}
    for task in range(layout.num_tasks):
        if layout.random:
            owner = p.owner(layout, task)
            shares[(owner, task, ANY_ROUND)] = drawn_indices(labels, layout, p, owner, task, 0)
        elif p.whole:
            shares[(0, task, ANY_ROUND)] = drawn_indices(labels, layout, p, 0, task, 0)
        elif p.scheme == "stateless":  # HePCo's population draws afresh every round
            for client in range(p.num_clients):
                for round_ in range(p.rounds_per_task):
                    shares[(client, task, round_)] = drawn_indices(labels, layout, p, client, task, round_)
        else:
            for client in range(p.num_clients):
                shares[(client, task, ANY_ROUND)] = drawn_indices(labels, layout, p, client, task, 0)
    return shares


def partition_summary(labels: np.ndarray, layout: TaskLayout, partition: Partition) -> str:
    """Compute every task's partition once (raising ConfigError where one cannot be made, before
    any client trains) and describe it: client share sizes and the classes no client holds."""
    p = partition
    if layout.random or p.whole or p.scheme == "stateless":
        return p.describe(layout)
    sizes, unheld = [], 0
    for task in range(layout.num_tasks):
        parts = [client_indices(labels, layout, p, c, task, 0) for c in range(p.num_clients)]
        sizes += [len(s) for s in parts]
        held = np.unique(labels[np.concatenate(parts)]) if parts else np.zeros(0, np.int64)
        unheld += len(np.setdiff1d(layout.classes(task), held))
    return (f"{p.describe(layout)}, client shares of a task: "
            f"min {min(sizes)}, median {int(np.median(sizes))}, max {max(sizes)}, {sizes.count(0)} empty; "
            f"{unheld} task classes held by no client")


#: Dirichlet redraws allowed before a min-partition-size is declared out of reach
MAX_SIZE_DRAWS = 10_000


@functools.lru_cache(maxsize=16)
def _static_partition(
    labels_bytes: bytes, scheme: str, num_clients: int, seed: int, task: int,
    beta: float, classes_per_client: int, min_size: int, balance: bool, cut_order: bytes = b"",
) -> list[np.ndarray]:
    """Split a task's samples (``task`` = -1: the whole training set) across the population, once
    per (seed, task); positions into the samples given. O(samples + clients) once per process,
    never per round. The skewed partitions are NIID-Bench's ("Federated Learning on Non-IID
    Data Silos: An Experimental Study", Li et al. 2022, section 4), which FPPL's and
    Fed-CPrompt's settings follow. ``cut_order`` (int64 bytes, indexed by remapped label; empty:
    ascending labels): the order in which a balanced Dirichlet partition cuts the classes.
    """
    labels = np.frombuffer(labels_bytes, dtype=np.int64)
    what = "the training set" if task < 0 else f"task {task}"
    rng = np.random.default_rng([seed, 0xDA7A5E7] if task < 0 else [seed, task, 0x9A27])
    if scheme == "iid":
        return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]
    if scheme == "dirichlet":
        rank = np.frombuffer(cut_order, dtype=np.int64) if cut_order else None
        return _label_dirichlet(labels, num_clients, beta, min_size, balance, rng, what, rank)
    if scheme == "quantity-skew":
        return _quantity_skew(len(labels), num_clients, beta, min_size, rng, what)
    if scheme == "quantity":
        return _k_classes(labels, num_clients, classes_per_client, rng, what)
    raise ConfigError(f"unknown partition {scheme!r}")  # pragma: no cover - validated in config


def _label_dirichlet(labels: np.ndarray, num_clients: int, beta: float, min_size: int, balance: bool,
                     rng: np.random.Generator, what: str, rank: np.ndarray | None = None) -> list[np.ndarray]:
    """Label skew (NIID-Bench's "noniid-labeldir"): each class's samples are cut at proportions
    drawn from Dir(beta) over the clients.

    ``balance`` (NIID-Bench's and FPPL's code, not in either paper's text): a client that
    already holds the average share N / clients gets nothing of the classes that follow, in the
    order ``rank`` gives (``rank[c]``: when class c is cut; None: ascending labels). The
    proportions are drawn in ascending label order whatever ``rank`` says, so without
    balancing the partition does not depend on it.
    The whole draw is repeated until every client holds at least ``min_size`` samples
    (NIID-Bench and FPPL's code use 10).
    """
    n = len(labels)
    if min_size * num_clients > n:
        raise ConfigError(f"cannot partition {what} with dirichlet: {num_clients} clients x "
                          f"min-partition-size {min_size} exceeds its {n} samples")
    present = np.unique(labels)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in present]
    cut = np.argsort(rank[present], kind="stable") if rank is not None else np.arange(len(present))
    for _ in range(MAX_SIZE_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, np.int64)
        drawn = [rng.dirichlet(np.full(num_clients, beta)) for _ in by_class]
        for j in cut:
            idx, proportions = by_class[j], drawn[j]
            if balance:  # some client is always below the average until the last class is cut
                proportions = proportions * (sizes < n / num_clients)
                proportions = proportions / proportions.sum()
            cuts = (np.cumsum(proportions) * len(idx)).astype(np.int64)[:-1]
            for client, piece in enumerate(np.split(idx, cuts)):
                parts[client].append(piece)
                sizes[client] += len(piece)
        if sizes.min() >= min_size:
            return [np.sort(np.concatenate(p)) for p in parts]
    raise ConfigError(f"cannot partition {what} with dirichlet: no Dir({beta}) draw in {MAX_SIZE_DRAWS} gave "
                      f"every one of {num_clients} clients >= {min_size} of its {n} samples; lower "
                      "min-partition-size or raise dirichlet-beta")


def _k_classes(labels: np.ndarray, num_clients: int, k: int, rng: np.random.Generator,
               what: str) -> list[np.ndarray]:
    """Quantity-based label skew (NIID-Bench's "noniid-#label k"): k classes per client, each
    class's samples split evenly over the clients that hold it.

    NIID-Bench gives client i the class i mod K first and draws the rest at random, which
    covers every class only when clients >= K. Here client i's first classes are i, i + clients,
    i + 2 clients, ... (up to k of them, below K), the same as NIID-Bench when clients >= K, and
    every class is held whenever clients x k >= K; fewer refuses (a class no client holds is
    never trained but always tested).
    """
    classes = np.unique(labels)
    n_classes = len(classes)
    if k > n_classes:
        raise ConfigError(f"classes-per-client = {k} exceeds the {n_classes} classes of {what}")
    if num_clients * k < n_classes:
        raise ConfigError(f"cannot partition {what} with quantity: {num_clients} clients x classes-per-client "
                          f"{k} = {num_clients * k} < its {n_classes} classes, so {n_classes - num_clients * k} "
                          "would be held by no client; raise classes-per-client or num-clients")
    held: list[list[int]] = []
    for i in range(num_clients):
        current = [s for s in range(i, min(k * num_clients, n_classes), num_clients)] or [i % n_classes]
        while len(current) < k:
            c = int(rng.integers(n_classes))
            if c not in current:
                current.append(c)
        held.append(current)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for position, c in enumerate(classes):
        holders = [i for i in range(num_clients) if position in held[i]]
        pieces = np.array_split(rng.permutation(np.flatnonzero(labels == c)), len(holders))
        for client, piece in zip(holders, pieces):
            parts[client].append(piece)
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def _quantity_skew(n: int, num_clients: int, beta: float, min_size: int, rng: np.random.Generator,
                   what: str) -> list[np.ndarray]:
    """Quantity skew as in NIID-Bench, the setting Fed-CPrompt's Table 2 follows.

    Client dataset sizes follow proportions drawn from Dir(beta) over the clients; the
    samples are shuffled and cut at those proportions, so labels are IID: each client's
    label histogram is a random sample of the task's. As in NIID-Bench, the proportions are
    drawn again until every client gets at least ``min_size`` samples (NIID-Bench uses 10).
    """
    if min_size * num_clients > n:
        raise ConfigError(f"cannot partition {what} with quantity-skew: {num_clients} clients x "
                          f"min-partition-size {min_size} exceeds its {n} samples")
    order = rng.permutation(n)
    for _ in range(MAX_SIZE_DRAWS):
        proportions = rng.dirichlet(np.full(num_clients, beta))
        cuts = (np.cumsum(proportions) * n).astype(np.int64)[:-1]  # NIID-Bench's rounding
        sizes = np.diff(np.concatenate([[0], cuts, [n]]))
        if sizes.min() >= min_size:
            return [np.sort(part) for part in np.split(order, cuts)]
    raise ConfigError(f"cannot partition {what} with quantity-skew: no Dir({beta}) draw in {MAX_SIZE_DRAWS} "
                      f"gave every one of {num_clients} clients >= {min_size} of its {n} samples; lower "
                      "min-partition-size or raise dirichlet-beta")


def _stateless_indices(
    labels: np.ndarray, pool: np.ndarray, classes: np.ndarray, partition: Partition,
    client_id: int, task: int, round_: int,
) -> np.ndarray:
    """HePCo's stateless population: each (client, round) draws afresh.

    A category ratio kappa of the task's classes, a split ratio gamma of each chosen
    class's images, then a long-tail profile with imbalance ratio beta (the
    rarest chosen class keeps a fraction beta of the most frequent one).
    """
    rng = np.random.default_rng([partition.seed, client_id, task, round_, 0x57A7E])
    n_cls = max(1, int(round(partition.category_ratio * len(classes))))
    chosen = rng.permutation(classes)[:n_cls]
    out = []
    for rank, c in enumerate(chosen):
        idx = pool[labels[pool] == c]
        n = max(1, int(round(partition.split_ratio * len(idx))))
        # exponential long-tail profile over ranks: 1 -> beta
        frac = partition.imbalance_ratio ** (rank / max(n_cls - 1, 1))
        n = max(1, int(round(n * frac)))
        out.append(rng.choice(idx, size=min(n, len(idx)), replace=False))
    return np.sort(np.concatenate(out))
