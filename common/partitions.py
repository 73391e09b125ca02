"""Client partitions: each client's share of a task, a pure function of (seed, client id, task, round).

The server never stores per-client data state, and a ClientApp started fresh in any process
recomputes exactly the same indices.
"""

from __future__ import annotations

import functools

import numpy as np

from promptfcl.common.config import ConfigError, ExperimentConfig
from promptfcl.common.tasks import random_task_indices, task_classes, training_classes


def client_indices(
    labels: np.ndarray, cfg: ExperimentConfig, num_classes: int, client_id: int, task: int, round_: int
) -> np.ndarray:
    """Training indices of ``client_id`` for ``task`` (and, for stateless populations, ``round_``).

    A pure function of its arguments: the same inputs give the same indices in any process.
    """
    if not 0 <= client_id < max(cfg.num_clients, 1):
        raise ValueError(f"client id {client_id} outside the population of {cfg.num_clients}")
    if cfg.task_generator == "random":  # the task's client holds all of its data
        from promptfcl.common.schedule import task_schedule

        owner = task_schedule(cfg).owner(task)
        if client_id != owner:
            raise ValueError(f"random task {task} belongs to client {owner}, not {client_id}")
        return random_task_indices(labels, cfg, num_classes, task)
    classes = task_classes(cfg, task, num_classes)
    if cfg.centralised:  # the one client holds the task (joint upper bound: every seen task)
        return np.flatnonzero(np.isin(labels, training_classes(cfg, task, num_classes)))
    pool = np.flatnonzero(np.isin(labels, classes))
    if cfg.partition == "stateless":
        return _stateless_indices(labels, pool, classes, cfg, client_id, task, round_)
    parts = _static_partition(
        labels[pool].tobytes(), cfg.partition, cfg.num_clients, cfg.seed, task,
        cfg.dirichlet_beta, cfg.classes_per_client, cfg.min_partition_size,
    )
    return pool[parts[client_id]]


@functools.lru_cache(maxsize=16)
def _static_partition(
    task_labels_bytes: bytes, scheme: str, num_clients: int, seed: int, task: int,
    beta: float, classes_per_client: int, min_size: int,
) -> list[np.ndarray]:
    """Split one task's samples across the whole population, once per (seed, task).

    Uses flwr-datasets partitioners (quantity skew: see ``_quantity_skew``); returns
    positions into the task's sample pool.
    Cost is O(samples + clients) once per process, never per round.
    """
    import datasets as hf
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, PathologicalPartitioner

    task_labels = np.frombuffer(task_labels_bytes, dtype=np.int64)
    pos = np.arange(len(task_labels))
    part_seed = int(np.random.default_rng([seed, task, 0x9A27]).integers(2**31 - 1))
    if scheme == "iid":
        # IidPartitioner shards a shuffled dataset; shuffle by seed first.
        shuffled = np.random.default_rng(part_seed).permutation(pos)
        ds = hf.Dataset.from_dict({"label": task_labels[shuffled], "pos": shuffled})
        partitioner = IidPartitioner(num_partitions=num_clients)
    elif scheme == "dirichlet":
        ds = hf.Dataset.from_dict({"label": task_labels, "pos": pos})
        partitioner = DirichletPartitioner(
            num_partitions=num_clients, partition_by="label", alpha=beta,
            min_partition_size=min_size, self_balancing=False, shuffle=True, seed=part_seed,
        )
    elif scheme == "quantity-skew":
        return _quantity_skew(len(task_labels), num_clients, beta, min_size, part_seed, task)
    elif scheme == "quantity":
        n_classes = len(np.unique(task_labels))
        if classes_per_client > n_classes:
            raise ConfigError(f"classes-per-client = {classes_per_client} exceeds the {n_classes} classes of a task")
        ds = hf.Dataset.from_dict({"label": task_labels, "pos": pos})
        partitioner = PathologicalPartitioner(
            num_partitions=num_clients, partition_by="label",
            num_classes_per_partition=classes_per_client, class_assignment_mode="random",
            shuffle=True, seed=part_seed,
        )
    else:  # pragma: no cover - validated in config
        raise ConfigError(f"unknown partition {scheme!r}")
    partitioner.dataset = ds
    try:
        return [np.asarray(partitioner.load_partition(i)["pos"], dtype=np.int64) for i in range(num_clients)]
    except ValueError as exc:
        raise ConfigError(f"cannot partition task {task} with {scheme} over {num_clients} clients: {exc}") from exc


#: Dirichlet redraws allowed before a min-partition-size is declared out of reach
MAX_SIZE_DRAWS = 10_000


def _quantity_skew(n: int, num_clients: int, beta: float, min_size: int, seed: int, task: int) -> list[np.ndarray]:
    """Quantity skew as in NIID-Bench ("Federated Learning on Non-IID Data Silos: An
    Experimental Study", Li et al. 2022), the setting Fed-CPrompt's Table 2 follows.

    Client dataset sizes follow proportions drawn from Dir(beta) over the clients; the
    samples are shuffled and cut at those proportions, so labels are IID: each client's
    label histogram is a random sample of the task's. As in NIID-Bench, the proportions are
    drawn again until every client gets at least ``min_size`` samples (NIID-Bench uses 10).

    flwr-datasets' SizePartitioner cuts consecutive sizes in the same way but refuses empty
    partitions, which Dir(beta) gives at small beta; the cut is done here instead.

    Returns positions into the task's sample pool, one array per client (a pure function
    of its arguments).
    """
    if min_size * num_clients > n:
        raise ConfigError(f"cannot partition task {task} with quantity-skew: {num_clients} clients x "
                          f"min-partition-size {min_size} exceeds its {n} samples")
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    for _ in range(MAX_SIZE_DRAWS):
        proportions = rng.dirichlet(np.full(num_clients, beta))
        cuts = (np.cumsum(proportions) * n).astype(np.int64)[:-1]  # NIID-Bench's rounding
        sizes = np.diff(np.concatenate([[0], cuts, [n]]))
        if sizes.min() >= min_size:
            return [np.sort(part) for part in np.split(order, cuts)]
    raise ConfigError(f"cannot partition task {task} with quantity-skew: no Dir({beta}) draw in {MAX_SIZE_DRAWS} "
                      f"gave every one of {num_clients} clients >= {min_size} of its {n} samples; lower "
                      "min-partition-size or raise dirichlet-beta")



def _stateless_indices(
    labels: np.ndarray, pool: np.ndarray, classes: np.ndarray, cfg: ExperimentConfig,
    client_id: int, task: int, round_: int,
) -> np.ndarray:
    """HePCo's stateless population: each (client, round) draws afresh.

    A category ratio kappa of the task's classes, a split ratio gamma of each chosen
    class's images, then a long-tail profile with imbalance ratio beta (the
    rarest chosen class keeps a fraction beta of the most frequent one).
    """
    rng = np.random.default_rng([cfg.seed, client_id, task, round_, 0x57A7E])
    n_cls = max(1, int(round(cfg.category_ratio * len(classes))))
    chosen = rng.permutation(classes)[:n_cls]
    out = []
    for rank, c in enumerate(chosen):
        idx = pool[labels[pool] == c]
        n = max(1, int(round(cfg.split_ratio * len(idx))))
        # exponential long-tail profile over ranks: 1 -> beta
        frac = cfg.imbalance_ratio ** (rank / max(n_cls - 1, 1))
        n = max(1, int(round(n * frac)))
        out.append(rng.choice(idx, size=min(n, len(idx)), replace=False))
    return np.sort(np.concatenate(out))
