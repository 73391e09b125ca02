"""The sections of a run configuration: one frozen dataclass per concern, each key declared once.

Every field is a run-config key (kebab-case at the edges: ``num-tasks`` is ``DataSection.num_tasks``)
declared with :func:`key` (its default and the identities it enters). A section checks its own
values when it is made (common/config/checks.py); checks that join sections are the whole
configuration's (``ExperimentConfig``, common/config/experiment.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import checks as config_checks

#: the sections of a run configuration (every key belongs to one), as ``ExperimentConfig`` names them
SECTIONS = ("run", "data", "federation", "training", "model", "evaluation", "robustness", "placement", "output",
            "caching")
#: what a key can enter besides being a key of its section: "results" (what a run computes: the
#: digest server and nodes compare, and a checkpoint's compatibility), "dataset" (a decoded source),
#: "node-folder" (a node's decoded image folder), "backbone" (the built backbone: its weights and
#: the queries it gives), "architecture" (the backbone's shape), "data-location" (where a client's
#: data comes from: a deployed node replaces these with its own)
IDENTITIES = ("results", "dataset", "node-folder", "backbone", "architecture", "data-location")


def key(default: Any, identities: tuple[str, ...]) -> Any:
    """A run-config key: its default and the identities it enters (``IDENTITIES``)."""
    assert set(identities) <= set(IDENTITIES), identities
    return field(default=default, metadata={"identities": frozenset(identities)})


@dataclass(frozen=True)
class RunSection:
    """What the run is: its method, seed and arithmetic."""

    strategy: str = key("fedavg", ("results",))
    seed: int = key(0, ("results", "dataset", "node-folder"))
    # Forward passes under bfloat16 autocast ("bf16"), or not ("fp32"); "auto": bf16 on CUDA
    # devices that support it, fp32 elsewhere (CPUs gain nothing). Parameters stay float32.
    precision: str = key("auto", ("results",))

    def __post_init__(self) -> None:
        config_checks.check_run(self)


@dataclass(frozen=True)
class DataSection:
    """The dataset and the task stream drawn over it."""

    dataset: str = key("digits", ("results", "dataset", "data-location"))
    # source-specific; fashion-mnist defaults to the Debian package path
    data_dir: str = key("", ("results", "dataset", "data-location"))
    # hf: sources: the hub revision (a commit hash, tag or branch) to load; "" = the default
    # branch, unpinned (recorded as such in results.json, so a later run may differ)
    hf_revision: str = key("", ("results", "dataset", "data-location"))
    num_tasks: int = key(5, ("results", "dataset"))
    # "stream": one class-incremental stream, task t owns classes [t k, (t+1) k), every client
    # walks it. "random": Powder's benchmark (Powder, section 5.1): every task belongs to one
    # client and holds `classes-per-task` random classes (at least `min-overlap` of them seen in
    # earlier tasks) with a disjoint `task-data-fraction` of each class's training images;
    # clients start on their own tasks and every `switch-every` rounds a random
    # `switch-fraction` of them moves to a new task, for `num-rounds` rounds.
    task_generator: str = key("stream", ("results",))
    # task-generator = random: rounds of the run (stream: num-tasks x rounds-per-task)
    num_rounds: int = key(0, ("results",))
    classes_per_task: int = key(0, ("results",))  # task-generator = random: n
    # task-generator = random: tau, least share of a task's classes seen before
    min_overlap: float = key(0.0, ("results",))
    # task-generator = random: each task's share of a class's images
    task_data_fraction: float = key(0.2, ("results",))
    # "disjoint": tasks holding a class get disjoint shares of its images; "independent": each
    # task draws its share on its own (needed when a class recurs in more than 1/fraction tasks)
    task_data_sharing: str = key("disjoint", ("results",))
    # held-out share for sources that ship no test split
    test_fraction: float = key(0.25, ("results", "dataset", "node-folder"))
    # 0 = all; caps big sources for quick runs
    max_train_per_class: int = key(0, ("results", "dataset", "node-folder"))
    max_test_per_class: int = key(0, ("results", "dataset", "node-folder"))
    # a splits.npz another run wrote beside its results.json: this run takes that run's class
    # order and every client's share per task from it instead of drawing them (simulation and
    # central evaluation only: deployed nodes do not open files the server names)
    splits: str = key("", ("results", "dataset"))
    # classes of the stream; 0 = from the server's data (needed with federated evaluation)
    num_classes: int = key(0, ("results",))
    # comma-separated class names in original label order; nodes must match them
    class_names: str = key("", ("results", "node-folder"))

    def __post_init__(self) -> None:
        config_checks.check_data(self)

    @property
    def class_name_list(self) -> list[str]:
        """``class-names`` split at commas (empty list when unset)."""
        return [v.strip() for v in self.class_names.split(",") if v.strip()]

    @property
    def random(self) -> bool:
        """Powder's random tasks (``task-generator = random``), else the stream."""
        return self.task_generator == "random"


@dataclass(frozen=True)
class FederationSection:
    """The client population, its sampling and how the data is partitioned among it."""

    num_clients: int = key(10, ("results", "data-location"))  # size of the (virtual) client population
    # 0 with client_fraction > 0 means "fraction of the population"
    clients_per_round: int = key(5, ("results",))
    client_fraction: float = key(0.0, ("results",))
    rounds_per_task: int = key(3, ("results",))
    # Task arrival (common/data/schedule.py): every `switch-every` rounds (0: rounds-per-task) a
    # `switch-fraction` of the clients moves on to its next task; 1.0 is the synchronous stream.
    switch_every: int = key(0, ("results",))
    switch_fraction: float = key(1.0, ("results",))
    # "iid"; "dirichlet": label skew, each class's samples split by Dir(dirichlet-beta);
    # "quantity": label skew, k = classes-per-client classes per client; "quantity-skew": client
    # dataset SIZES drawn from Dir(dirichlet-beta), labels IID (NIID-Bench's quantity skew);
    # "stateless": HePCo's population (below). See common/data/sources.py.
    partition: str = key("dirichlet", ("results",))
    # beta of partition = dirichlet and of partition = quantity-skew
    dirichlet_beta: float = key(0.5, ("results",))
    classes_per_client: int = key(1, ("results",))  # for partition = quantity
    # dirichlet and quantity-skew: smallest share a client may get (of a task, or of the training
    # set with partition-scope = dataset); the Dirichlet draw is repeated until every client has at
    # least this many (0: empty shares allowed; NIID-Bench and FPPL's code: 10)
    min_partition_size: int = key(0, ("results",))
    # dirichlet: NIID-Bench's balancing (also FPPL's code): a client holding the average share
    # gets nothing of the classes cut after that
    dirichlet_balance: bool = key(False, ("results",))
    # "task": each task's samples are partitioned on their own (a fresh draw per task);
    # "dataset": the whole training set once, each task taking its classes' part of every
    # client's share (NIID-Bench's partition of a dataset, FPPL's code)
    partition_scope: str = key("task", ("results",))
    # dirichlet with dirichlet-balance: the order the classes are cut in. "original": the dataset's
    # own label order (NIID-Bench's and FPPL's code: they partition before shuffling classes into
    # tasks, so the balancing cap lands on classes of every task); "task": the task order (the
    # cap lands on the last tasks). Without balancing the two give the same partition.
    partition_class_order: str = key("original", ("results",))
    # HePCo's stateless population: category ratio, split ratio, long-tail imbalance ratio
    category_ratio: float = key(0.6, ("results",))
    split_ratio: float = key(0.1, ("results",))
    imbalance_ratio: float = key(1.0, ("results",))
    # one client with all data: the upper-bound reference
    centralised: bool = key(False, ("results", "data-location"))
    # centralised = true: "incremental" trains the tasks in turn exactly like a client (CE over the
    # current task's classes; centralised incremental CODA-P); "joint" trains, at task t, on the
    # union of tasks 0..t's training data with every seen class in the CE (the usual ceiling;
    # the accuracy matrix still has one column per task). See README, Benchmarks.
    centralised_mode: str = key("incremental", ("results", "data-location"))
    # "virtual": the server samples client ids and any node plays any client (simulation).
    # "nodes": every Flower node is one client with its own data (node-config `data-dir`,
    # `dataset`, or `partition-id`/`num-partitions`); num-clients is the number of nodes the
    # server waits for before the first round, then it samples among all connected nodes.
    population: str = key("virtual", ("results",))

    def __post_init__(self) -> None:
        config_checks.check_federation(self)

    @property
    def sampled_per_round(self) -> int:
        """Clients that train in one round (the one place it is computed): ``clients-per-round``,
        else ``client-fraction`` of the population, at least one; centralised: the one client."""
        if self.centralised:
            return 1
        return self.clients_per_round or max(1, int(round(self.client_fraction * self.num_clients)))

    @property
    def joint(self) -> bool:
        """The joint upper bound (``centralised``, ``centralised-mode = joint``)."""
        return self.centralised and self.centralised_mode == "joint"


@dataclass(frozen=True)
class TrainingSection:
    """Each client's local training."""

    local_epochs: int = key(5, ("results",))
    batch_size: int = key(32, ("results",))
    # Adam. CODA-P uses 1e-3 with ViT-B/16 and long local training (configs/ set that); the
    # offline default's clients hold ~30 samples per task, so a larger step is needed.
    lr: float = key(1e-2, ("results",))
    # The rate over one round's local training: "cosine" (annealed per step to 0 over the round's
    # local steps), "constant", or "codap-cosine": CODA-P's CosineSchedule (CODA-Prompt
    # utils/schedulers.py), stepped per local epoch: epoch e of K trains at
    # lr * cos(99 pi e / (200 (K - 1))), the last at about 1.6 % of lr; K = 1: constant.
    lr_schedule: str = key("cosine", ("results",))
    # K of codap-cosine: 0 = local-epochs (CODA-P's and Fed-CPrompt's code: the schedule's length
    # is the local epochs); Powder's code fixes K = 50 over its 10 local epochs
    lr_schedule_epochs: int = key(0, ("results",))
    # Training-time augmentation of every method's local training (strategies/platform/learner.py), seeded
    # per client, task and round: "none"; "crop-flip" (random crop with zero padding of 1/8 of
    # the side, then a random horizontal flip); "resized-crop-flip" (torchvision's
    # RandomResizedCrop to the backbone's size + horizontal flip, CODA-P's and FPPL's code; the
    # crop keeps augment-crop-scale to 1 of the area: torchvision 0.08, FPPL's code 0.05).
    # The query cache does not serve augmented batches: q(x) is recomputed on the augmented image.
    augment: str = key("none", ("results",))
    augment_crop_scale: float = key(0.08, ("results",))

    def __post_init__(self) -> None:
        config_checks.check_training(self)


@dataclass(frozen=True)
class ModelSection:
    """The backbone, the prompts and the head."""

    # The linear head: "per-class", one row per class, shared by the tasks that hold it; or
    # "per-task" (task-generator = random only), a block of classes-per-task rows per task, the
    # task-specific head psi_c^t of Powder's text (Algorithm 1, eq. 8) and of its authors' code.
    # "auto": per-task with random tasks, per-class on the stream (where a class has one task).
    head: str = key("auto", ("results",))
    # Inputs (common/model/preprocess.py): "backbone" normalises with the backbone's pretraining mean
    # and std, "unit" feeds [0, 1] pixels (CODA-P's and FPPL's code, HePCo's text)
    input_norm: str = key("backbone", ("results",))
    # every resize to the backbone's size: "bilinear" or "bicubic" (HGP's text)
    resize_interpolation: str = key("bilinear", ("results", "dataset", "node-folder"))
    backbone: str = key("vit_tiny_patch16_224", ("results", "backbone", "architecture"))
    # "timm" (pretrained, from the hub), "pretrained:<source>" (built offline by
    # `promptfcl pretrain`), "random", or a checkpoint path
    weights: str = key("pretrained:fashion-mnist", ("results", "backbone"))
    image_size: int = key(32, ("results", "dataset", "node-folder", "backbone", "architecture"))
    patch_size: int = key(4, ("results", "backbone", "architecture"))  # 0 = the model's own
    embed_dim: int = key(96, ("results", "backbone", "architecture"))  # 0 = the model's own
    depth: int = key(4, ("results", "backbone", "architecture"))  # 0 = the model's own
    num_heads: int = key(3, ("results", "backbone", "architecture"))  # 0 = the model's own
    prompt_mode: str = key("prefix", ("results",))
    # prompt-mode = "prompt": what happens to a block's prompt tokens after it. "truncate": they are
    # removed (the sequence keeps its length; FPPL's code); "accumulate": they stay in the sequence
    # through every later block, and the next prompted block adds its own (Powder's code); "auto":
    # the method's own choice (its prompt module's ``prompt_tokens``: Powder accumulates, the others
    # truncate).
    prompt_tokens: str = key("auto", ("results",))
    prompt_layers: str = key("0,1,2", ("results",))  # comma-separated block indices
    pool_size: int = key(20, ("results",))  # M, split evenly over the tasks
    prompt_length: int = key(8, ("results",))  # L (prefix: half keys, half values)
    ortho_init: bool = key(True, ("results",))

    def __post_init__(self) -> None:
        config_checks.check_model(self)

    def per_task_head(self, data: DataSection) -> bool:
        """Whether the head has a block of rows per task over ``data``'s tasks (``head``; "auto":
        with random tasks)."""
        return self.head == "per-task" or (self.head == "auto" and data.random)

    @property
    def layers(self) -> list[int]:
        """``prompt-layers`` as block indices."""
        return [int(v) for v in self.prompt_layers.split(",") if v.strip() != ""]


@dataclass(frozen=True)
class EvaluationSection:
    """How and when the global model is scored."""

    # "central": the server evaluates on its own copy of the test data. "federated": every
    # connected node evaluates the global model on its held-out data and the server sums the
    # per-task counts; the server then needs neither data nor backbone weights.
    evaluation: str = key("central", ("results",))
    # evaluate every k rounds and always at a task's end (the accuracy matrix is unchanged;
    # round records between evaluations carry no accuracy): fewer evaluation messages per node
    evaluate_every: int = key(1, ())
    # federated evaluation: a node sampled for the next round evaluates the model it receives
    # before training and sends the counts with its update, so the round needs no evaluation
    # message of its own to that node. Exact: the server asks only where the arrays it sends
    # are those it would evaluate, and sends an evaluation message to every other node; a
    # task's end and the run's last round are evaluated by messages as before.
    evaluate_with_train: bool = key(True, ())
    # evaluation keeps this central fraction of each side before resizing (CODA-P's and FPPL's
    # code on ImageNet-type data: Resize(256) + CenterCrop(224) = 0.875; on CIFAR they resize the
    # whole image, 1)
    eval_crop: float = key(1.0, ("results",))

    def __post_init__(self) -> None:
        config_checks.check_evaluation(self)


@dataclass(frozen=True)
class RobustnessSection:
    """The server's patience, the defences against broken or hostile clients, and fault injection."""

    round_timeout: float = key(3600.0, ())  # seconds the server waits for replies; late ones are dropped
    min_replies: int = key(1, ("results",))  # fewer usable replies than this and the round is retried
    # retries (with freshly sampled clients) before the run stops with an error
    round_retries: int = key(2, ("results",))
    max_reply_bytes: int = key(256_000_000, ("results",))  # replies above this size are rejected
    # Trust is a property of the run (common/config/trust.py): "auto" turns the hostile-client defences
    # below (update-norm-factor, max-update-norm, update-clip, update-min-cosine, stats-bound) off
    # in a simulation of this project's own clients with no fault injection, where every client is
    # honest and each method is computed as its paper defines it, and on for deployed nodes
    # (population = nodes) and whenever faults are injected; "on" / "off" force it. The record
    # checks are always on (they never change an honest reply); the max-client-weight cap is on
    # for nodes and in defended simulations ("defended" means "untrusted").
    defences: str = key("auto", ("results",))
    # Defences against broken or hostile clients (strategies/platform/checks.py): a reply whose update
    # norm is above update-norm-factor x the other replies' median (0: off) or above
    # max-update-norm (0: off) is excluded; with population = nodes or defended no reply carries
    # more than max-client-weight of a round's weight (from 1 / max-client-weight replies on);
    # aggregation "median", "trimmed-mean" (trim-fraction cut at each end), or Flower's "krum",
    # "multikrum", "bulyan" replace the weighted mean.
    update_norm_factor: float = key(10.0, ("results",))
    # Norm bounding: an accepted update longer than update-clip x the lower median update norm of
    # the replies on its task is scaled down to that length (0: off): what one reply can carry.
    # Default: in the tail of honest replies (docs/reliability.md), so a hostile reply on a median
    # sample count weighs at most 3 honest ones
    update_clip: float = key(3.0, ("results",))
    # The clip's bound grows with a reply's sample count (x sqrt(n / the task's lower median n),
    # never below 1): an honest update's norm grows with its local steps, so under label skew the
    # longest honest replies are those of the clients holding most of a class (false: one bound)
    update_clip_by_count: bool = key(True, ("results",))
    # An update longer than update-strike-norm x its task's lower median (times the clip's count
    # allowance) is excluded and a strike (0: off): above honest replies (docs/reliability.md);
    # kept clipped, two reversed ones of five replies would outweigh the round's honest ones
    update_strike_norm: float = key(5.0, ("results",))
    # Direction check (3+ replies on a task): an update whose cosine with its task's coordinate-wise
    # median update is below update-min-cosine (-1: off) is flagged (a strike), one below 0 while
    # it is longer than update-reversed-norm x the task's lower median norm (0: off) is excluded
    update_min_cosine: float = key(-0.6, ("results",))
    update_reversed_norm: float = key(3.5, ("results",))
    # Strikes (strategies/platform/screens/strikes.py): a client whose updates the norm filter, the
    # direction check (excluded, or a cosine below update-min-cosine) or update-strike-norm
    # flagged in this many rounds is excluded from then on, the reply that reached it included;
    # below it, a cosine flag alone does not exclude (0: off, it excludes at once). Honest
    # label-skewed clients disagree with the round rarely, hostile ones in most rounds
    update_strikes: int = key(2, ("results",))
    # Direction history: a client whose cosines with its task's median update average below
    # update-mean-cosine (-1: off) over its replies so far, judged from its
    # update-mean-cosine-after-th reply on, is excluded from then on: a reversed update of
    # ordinary length swings with the round, its mean does not (docs/reliability.md)
    update_mean_cosine: float = key(0.0, ("results",))
    update_mean_cosine_after: int = key(3, ("results",))
    # The reference norm and count of a task's round are the lower of the round's own and those
    # read over the task's kept replies of this many rounds, this one included (1: the round's
    # own): one round whose replies on a task are mostly hostile (2 of 3 at Dirichlet 0.1) does
    # not set its own reference
    update_norm_rounds: int = key(3, ("results",))
    # Bounded influence of uploaded statistics (HGP's Gaussians, FPPL's prototypes, Powder's
    # alphas; strategies/platform/statistics.py): a row (class mean, covariance scale) beyond
    # stats-bound x the lower median of the round's rows of that array is cut to it, a count to the
    # reply's own num-examples (0: off)
    stats_bound: float = key(4.0, ("results",))
    max_update_norm: float = key(0.0, ("results",))
    max_client_weight: float = key(0.5, ("results",))
    aggregation: str = key("mean", ("results",))
    trim_fraction: float = key(0.2, ("results",))
    # Fault injection for robustness experiments: a seeded share of client replies misbehave.
    fault: str = key("", ("results",))  # one of FAULTS (client/faults.py)
    fault_rate: float = key(0.0, ("results",))
    # "3,7": these clients misbehave in every round they are sampled (a fixed hostile share of
    # the population); "" with fault-rate: a seeded share of all replies
    fault_clients: str = key("", ("results",))
    fault_hang_seconds: float = key(30.0, ("results",))
    # The colluding attacks (alie, ipm, mimic, min-max, min-sum; strategies/platform/collusion.py):
    # ALIE's z (0: the paper's formula for the round's clients), IPM's epsilon (the paper's small
    # one), and what the colluders know: their own honest updates ("colluders") or every
    # reply of the round ("all")
    fault_z: float = key(0.0, ("results",))
    fault_epsilon: float = key(0.5, ("results",))
    fault_knowledge: str = key("colluders", ("results",))
    # aggregation = krum | multikrum | bulyan: the malicious replies they assume among a row's
    # (0: the run's hostile share, fault-clients of num-clients or fault-rate, of the row's
    # replies rounded up, at least 1); too few replies for it and a row is the median
    byzantine_clients: int = key(0, ("results",))

    def __post_init__(self) -> None:
        config_checks.check_robustness(self)

    @property
    def fault_client_ids(self) -> frozenset[int]:
        """``fault-clients`` as a set of client ids."""
        return frozenset(int(v) for v in self.fault_clients.split(",") if v.strip())


@dataclass(frozen=True)
class PlacementSection:
    """Where the run executes (never what it computes)."""

    device: str = key("auto", ())
    threads: int = key(0, ())  # torch threads per process; 0 = all cores shared by the parallel clients
    # Ray to run the client actors on: "" starts a local Ray for this run only; "auto" or
    # "host:port" joins a running cluster (`ray start --head`, then `ray start --address` on
    # the other machines), whose scheduler spreads the actors over its nodes.
    ray_address: str = key("", ())
    # CPUs per client actor: a number, or "auto" (the cores divided among the clients that
    # train at once).
    client_cpus: str = key("auto", ())
    # Share of one GPU per client actor (Ray's num_gpus): a number such as 0.25, or "auto" (the
    # GPUs Ray sees divided among the clients that train at once, at most 1 each; 0 without
    # GPUs). An actor given no GPU sees CUDA_VISIBLE_DEVICES="" and trains on the CPU.
    client_gpus: str = key("auto", ())

    def __post_init__(self) -> None:
        config_checks.check_placement(self)

    @property
    def client_cpus_value(self) -> float | None:
        """``client-cpus`` as a number (None: auto)."""
        return None if self.client_cpus == "auto" else float(self.client_cpus)

    @property
    def client_gpus_value(self) -> float | None:
        """``client-gpus`` as a number (None: auto)."""
        return None if self.client_gpus == "auto" else float(self.client_gpus)


@dataclass(frozen=True)
class OutputSection:
    """Where the run writes and when it stops."""

    out_dir: str = key("runs/latest", ())
    resume: bool = key(False, ())  # continue the run checkpointed in out-dir
    # Stop after this many server rounds (0: run to the end), keeping the checkpoint so that
    # `promptfcl resume DIR --set max-rounds=0` continues: smoke tests of paper-scale
    # configurations and benchmarks of one round.
    max_rounds: int = key(0, ())
    # Keep the checkpoint of a finished run (it is deleted by default): `promptfcl audit` reads
    # what the server received from it.
    keep_checkpoint: bool = key(False, ())
    # while the run goes, besides rounds.jsonl and accuracy_matrix.csv: "none", "tensorboard"
    # (scalars under <out-dir>/tensorboard), "mlflow" (SQLite under <out-dir>/mlflow, or
    # $MLFLOW_TRACKING_URI) or "wandb" (offline under <out-dir>/wandb unless WANDB_MODE or
    # WANDB_API_KEY says otherwise); each needs its package (the extras of the same names)
    tracker: str = key("none", ())

    def __post_init__(self) -> None:
        config_checks.check_output(self)


@dataclass(frozen=True)
class CachingSection:
    """What is kept between processes and rounds."""

    query_cache: bool = key(True, ("results",))
    # decode a source once per machine into memory-mapped arrays every process maps read-only
    # (common/data/cache.py); false: each process decodes into its own memory
    data_cache: bool = key(True, ())
    # Persist q(x) in the node's cache dir so a fresh ClientApp process reuses it: "auto" (on
    # with population=nodes, where every message may start a new process), "on" or "off".
    query_cache_disk: str = key("auto", ())
    # Keep the built, frozen backbone in the node's cache dir as a plain state dict for
    # common/model/vit.py's ViT, so a fresh ClientApp process builds it without importing timm:
    # "auto" (on with population=nodes, where every message may start a new process), "on" or "off".
    backbone_cache_disk: str = key("auto", ())

    def __post_init__(self) -> None:
        config_checks.check_caching(self)


#: each section's class, by its name in ``SECTIONS``
SECTION_CLASSES: dict[str, type] = {
    "run": RunSection, "data": DataSection, "federation": FederationSection, "training": TrainingSection,
    "model": ModelSection, "evaluation": EvaluationSection, "robustness": RobustnessSection,
    "placement": PlacementSection, "output": OutputSection, "caching": CachingSection,
}
