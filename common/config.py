"""Experiment configuration: one typed, validated object built from Flower's run config.

Flower hands every ServerApp and ClientApp the same flat ``context.run_config``
(``[tool.flwr.app.config]`` in pyproject.toml plus ``--run-config`` overrides).
Keys are kebab-case (``num-tasks``); method-specific keys are namespaced by the
strategy name (``hepco.lambda-kl``) and are validated by the strategy itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from promptfcl.common.errors import ConfigError  # re-exported: the error of configurations
from promptfcl.common.options import coerce_value
from promptfcl.common.files import class_name_problem

PARTITIONS = ("iid", "dirichlet", "quantity", "quantity-skew", "stateless")
AUGMENTATIONS = ("none", "crop-flip")
CENTRALISED_MODES = ("incremental", "joint")
FAULTS = ("", "raise", "hang", "nan", "shape", "extra-record", "missing-record", "huge-count", "huge-values",
          "poison", "nan-metrics")
# Keys that do not change what a run computes (excluded from the digest clients check).
RESULT_NEUTRAL_KEYS = frozenset({"resume", "round-timeout", "threads", "device", "out-dir", "query-cache-disk",
                                 "backbone-cache-disk", "ray-address", "client-cpus", "client-gpus", "max-rounds",
                                 "evaluate-every", "keep-checkpoint", "evaluate-with-train"})
PROMPT_MODES = ("prefix", "prompt")
TASK_GENERATORS = ("stream", "random")
DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "fp32", "bf16")
POPULATIONS = ("virtual", "nodes")  # deployment: see deploy/README.md
EVALUATIONS = ("central", "federated")
AGGREGATIONS = ("mean", "median", "trimmed-mean")
HEADS = ("auto", "per-class", "per-task")
DP_NAMESPACE = "dp"  # differential privacy's run-config keys, dp.* (common/privacy.py)



@dataclass
class ExperimentConfig:
    """Everything that defines one run. Defaults are the offline default experiment.

    The paper-scale settings live in ``configs/*.toml``; see README.
    """

    # --- run ---
    strategy: str = "fedavg"
    seed: int = 0
    out_dir: str = "runs/latest"
    device: str = "auto"
    threads: int = 0  # torch threads per process; 0 = all cores shared by the parallel clients
    # Forward passes under bfloat16 autocast ("bf16"), or not ("fp32"); "auto": bf16 on CUDA
    # devices that support it, fp32 elsewhere (CPUs gain nothing). Parameters stay float32.
    precision: str = "auto"

    # --- data and task stream ---
    dataset: str = "digits"
    data_dir: str = ""  # source-specific; fashion-mnist defaults to the Debian package path
    num_tasks: int = 5
    # "stream": one class-incremental stream, task t owns classes [t k, (t+1) k), every client
    # walks it. "random": Powder's benchmark (Powder, section 5.1): every task belongs to one
    # client and holds `classes-per-task` random classes (at least `min-overlap` of them seen in
    # earlier tasks) with a disjoint `task-data-fraction` of each class's training images;
    # clients start on their own tasks and every `switch-every` rounds a random
    # `switch-fraction` of them moves to a new task, for `num-rounds` rounds.
    task_generator: str = "stream"
    num_rounds: int = 0  # task-generator = random: rounds of the run (stream: num-tasks x rounds-per-task)
    classes_per_task: int = 0  # task-generator = random: n
    min_overlap: float = 0.0  # task-generator = random: tau, least share of a task's classes seen before
    task_data_fraction: float = 0.2  # task-generator = random: each task's share of a class's images
    # "disjoint": tasks holding a class get disjoint shares of its images; "independent": each
    # task draws its share on its own (needed when a class recurs in more than 1/fraction tasks)
    task_data_sharing: str = "disjoint"
    # The linear head: "per-class", one row per class, shared by the tasks that hold it; or
    # "per-task" (task-generator = random only), a block of classes-per-task rows per task, the
    # task-specific head psi_c^t of Powder's text (Algorithm 1, eq. 8) and of its authors' code.
    # "auto": per-task with random tasks, per-class on the stream (where a class has one task).
    head: str = "auto"
    test_fraction: float = 0.25  # held-out share for sources that ship no test split
    max_train_per_class: int = 0  # 0 = all; caps big sources for quick runs
    max_test_per_class: int = 0

    # --- federation ---
    num_clients: int = 10  # size of the (virtual) client population
    clients_per_round: int = 5  # 0 with client_fraction > 0 means "fraction of the population"
    client_fraction: float = 0.0
    rounds_per_task: int = 3
    # Task arrival (common/schedule.py): every `switch-every` rounds (0: rounds-per-task) a
    # `switch-fraction` of the clients moves on to its next task; 1.0 is the synchronous stream.
    switch_every: int = 0
    switch_fraction: float = 1.0
    # "iid"; "dirichlet": label skew, each class's samples split by Dir(dirichlet-beta);
    # "quantity": label skew, k = classes-per-client classes per client; "quantity-skew": client
    # dataset SIZES drawn from Dir(dirichlet-beta), labels IID (NIID-Bench's quantity skew);
    # "stateless": HePCo's population (below). See common/data.py.
    partition: str = "dirichlet"
    dirichlet_beta: float = 0.5  # beta of partition = dirichlet and of partition = quantity-skew
    classes_per_client: int = 1  # for partition = quantity
    # dirichlet and quantity-skew: smallest share of a task a client may get; the Dirichlet draw
    # is repeated until every client has at least this many (0: empty shares allowed)
    min_partition_size: int = 0
    # HePCo's stateless population: category ratio, split ratio, long-tail imbalance ratio
    category_ratio: float = 0.6
    split_ratio: float = 0.1
    imbalance_ratio: float = 1.0
    centralised: bool = False  # one client with all data: the upper-bound reference
    # centralised = true: "incremental" trains the tasks in turn exactly like a client (CE over the
    # current task's classes; centralised incremental CODA-P); "joint" trains, at task t, on the
    # union of tasks 0..t's training data with every seen class in the CE (the usual ceiling;
    # the accuracy matrix still has one column per task). See README, Benchmarks.
    centralised_mode: str = "incremental"
    round_timeout: float = 3600.0  # seconds the server waits for replies; late ones are dropped
    min_replies: int = 1  # fewer usable replies than this and the round is retried
    round_retries: int = 2  # retries (with freshly sampled clients) before the run stops with an error
    max_reply_bytes: int = 256_000_000  # replies above this size are rejected
    # Defences against broken or hostile clients (strategies/replies.py): a reply whose update
    # norm is above update-norm-factor x the other replies' median (0: off) or above
    # max-update-norm (0: off) is excluded; with population = nodes no reply carries more than
    # max-client-weight of a round's weight (3+ replies); aggregation "median" or
    # "trimmed-mean" (trim-fraction cut at each end) replace the weighted mean.
    update_norm_factor: float = 10.0
    max_update_norm: float = 0.0
    max_client_weight: float = 0.5
    aggregation: str = "mean"
    trim_fraction: float = 0.2
    resume: bool = False  # continue the run checkpointed in out-dir
    # Stop after this many server rounds (0: run to the end), keeping the checkpoint so that
    # `promptfcl resume DIR --set max-rounds=0` continues: smoke tests of paper-scale
    # configurations and benchmarks of one round.
    max_rounds: int = 0
    # Keep the checkpoint of a finished run (it is deleted by default): `promptfcl audit` reads
    # what the server received from it.
    keep_checkpoint: bool = False
    # Fault injection for robustness experiments: a seeded share of client replies misbehave.
    fault: str = ""  # one of FAULTS (client/faults.py)
    fault_rate: float = 0.0
    # "3,7": these clients misbehave in every round they are sampled (a fixed hostile share of
    # the population); "" with fault-rate: a seeded share of all replies
    fault_clients: str = ""
    fault_hang_seconds: float = 30.0

    # --- simulation resources (server/simulation.py; they do not change what a run computes) ---
    # Ray to run the client actors on: "" starts a local Ray for this run only; "auto" or
    # "host:port" joins a running cluster (`ray start --head`, then `ray start --address` on
    # the other machines), whose scheduler spreads the actors over its nodes.
    ray_address: str = ""
    # CPUs per client actor: a number, or "auto" (the cores divided among the clients that
    # train at once).
    client_cpus: str = "auto"
    # Share of one GPU per client actor (Ray's num_gpus): a number such as 0.25, or "auto" (the
    # GPUs Ray sees divided among the clients that train at once, at most 1 each; 0 without
    # GPUs). An actor given no GPU sees CUDA_VISIBLE_DEVICES="" and trains on the CPU.
    client_gpus: str = "auto"

    # --- deployment (deploy/README.md) ---
    # "virtual": the server samples client ids and any node plays any client (simulation).
    # "nodes": every Flower node is one client with its own data (node-config `data-dir`,
    # `dataset`, or `partition-id`/`num-partitions`); num-clients is the number of nodes the
    # server waits for before the first round, then it samples among all connected nodes.
    population: str = "virtual"
    # "central": the server evaluates on its own copy of the test data. "federated": every
    # connected node evaluates the global model on its held-out data and the server sums the
    # per-task counts; the server then needs neither data nor backbone weights.
    evaluation: str = "central"
    # evaluate every k rounds and always at a task's end (the accuracy matrix is unchanged;
    # round records between evaluations carry no accuracy): fewer evaluation messages per node
    evaluate_every: int = 1
    # federated evaluation: a node sampled for the next round evaluates the model it receives
    # before training and sends the counts with its update, so the round needs no evaluation
    # message of its own to that node. Exact: the server asks only where the arrays it sends
    # are those it would evaluate, and sends an evaluation message to every other node; a
    # task's end and the run's last round are evaluated by messages as before.
    evaluate_with_train: bool = True
    num_classes: int = 0  # classes of the stream; 0 = from the server's data (needed with federated evaluation)
    class_names: str = ""  # comma-separated class names in original label order; nodes must match them

    # --- local training ---
    local_epochs: int = 5
    batch_size: int = 32
    # Adam. CODA-P uses 1e-3 with ViT-B/16 and long local training (configs/ set that); the
    # offline default's clients hold ~30 samples per task, so a larger step is needed.
    lr: float = 1e-2
    lr_schedule: str = "cosine"  # "cosine" or "constant", over one round's local steps
    # Training-time augmentation of every method's local training (client/learner.py):
    # "none", or "crop-flip" (random crop with zero padding of 1/8 of the side, then a random
    # horizontal flip; seeded per client, task and round). The query cache does not serve
    # augmented batches: q(x) is recomputed on the augmented image.
    augment: str = "none"
    query_cache: bool = True
    # Persist q(x) in the node's cache dir so a fresh ClientApp process reuses it: "auto" (on
    # with population=nodes, where every message may start a new process), "on" or "off".
    query_cache_disk: str = "auto"

    # --- backbone ---
    backbone: str = "vit_tiny_patch16_224"
    # "timm" (pretrained, from the hub), "pretrained:<source>" (built offline by
    # `promptfcl pretrain`), "random", or a checkpoint path
    weights: str = "pretrained:fashion-mnist"
    image_size: int = 32
    patch_size: int = 4  # 0 = the model's own
    embed_dim: int = 96  # 0 = the model's own
    depth: int = 4  # 0 = the model's own
    num_heads: int = 3  # 0 = the model's own
    # Keep the built, frozen backbone in the node's cache dir as a plain state dict for
    # common/vit.py's ViT, so a fresh ClientApp process builds it without importing timm:
    # "auto" (on with population=nodes, where every message may start a new process), "on" or "off".
    backbone_cache_disk: str = "auto"

    # --- prompts (CODA-P) ---
    prompt_mode: str = "prefix"
    prompt_layers: str = "0,1,2"  # comma-separated block indices
    pool_size: int = 20  # M, split evenly over the tasks
    prompt_length: int = 8  # L (prefix: half keys, half values)
    ortho_init: bool = True

    # --- method-specific options, "<strategy>.<key>" -> value ---
    method: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ derived
    @property
    def layers(self) -> list[int]:
        return [int(v) for v in self.prompt_layers.split(",") if v.strip() != ""]

    @property
    def per_task_head(self) -> bool:
        """Whether the head has a block of rows per task (``head``; "auto": with random tasks)."""
        return self.head == "per-task" or (self.head == "auto" and self.task_generator == "random")

    @property
    def class_name_list(self) -> list[str]:
        """``class-names`` split at commas (empty list when unset)."""
        return [v.strip() for v in self.class_names.split(",") if v.strip()]

    @property
    def fault_client_ids(self) -> frozenset[int]:
        """``fault-clients`` as a set of client ids."""
        return frozenset(int(v) for v in self.fault_clients.split(",") if v.strip())

    @property
    def client_cpus_value(self) -> float | None:
        """``client-cpus`` as a number (None: auto)."""
        return None if self.client_cpus == "auto" else float(self.client_cpus)

    @property
    def client_gpus_value(self) -> float | None:
        """``client-gpus`` as a number (None: auto)."""
        return None if self.client_gpus == "auto" else float(self.client_gpus)

    def method_options(self, name: str) -> dict[str, Any]:
        """Options namespaced ``name.*`` with the prefix removed (keys kebab-case)."""
        prefix = name + "."
        return {k[len(prefix):]: v for k, v in self.method.items() if k.startswith(prefix)}

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        """Flat kebab-case dict, the same shape as Flower's run config."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "method":
                continue
            out[f.name.replace("_", "-")] = getattr(self, f.name)
        out.update(self.method)
        return out

    def fingerprint(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def digest(self) -> str:
        """Short hash of the full configuration; server and clients must agree on it."""
        import hashlib

        relevant = {k: v for k, v in self.to_dict().items() if k not in RESULT_NEUTRAL_KEYS}
        return hashlib.sha1(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:12]

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "ExperimentConfig":
        """From Flower's ``context.run_config``; an empty one is an error, not the defaults.

        Flower fuses the overrides into every key pyproject.toml declares, so the run config
        holds every method's options (``[tool.flwr.app.config.<method>]``); only the run's
        method's and ``dp.*`` are kept (Flower has already refused keys it does not declare).
        """
        if not run_config:
            raise ConfigError(
                "the run config is empty: Flower did not pass the app's configuration "
                "(run with `flwr run .` or `promptfcl simulate`)"
            )
        strategy = str(run_config.get("strategy", cls.strategy))
        kept = (f"{strategy}.", f"{DP_NAMESPACE}.")
        return cls.from_dict({k: v for k, v in run_config.items() if "." not in k or k.startswith(kept)})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ExperimentConfig":
        """Build from a flat kebab-case mapping; unknown keys are an error, not ignored."""
        known = {f.name.replace("_", "-"): f for f in fields(cls) if f.name != "method"}
        values: dict[str, Any] = {}
        method: dict[str, Any] = {}
        for key, value in raw.items():
            if "." in key:
                method[key] = value
                continue
            f = known.get(key) or known.get(key.replace("_", "-"))
            if f is None:
                raise ConfigError(
                    f"unknown configuration key {key!r}; known keys: {', '.join(sorted(known))}"
                )
            values[f.name] = coerce_value(key, value, f.type)
        cfg = cls(**values, method=method)
        cfg.validate()
        return cfg

    def replace(self, **changes: Any) -> "ExperimentConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ConfigError for values that cannot work; checked before any training."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.num_tasks >= 1, f"num-tasks must be >= 1, got {self.num_tasks}")
        need(self.task_generator in TASK_GENERATORS,
             f"task-generator must be one of {TASK_GENERATORS}, got {self.task_generator!r}")
        if self.task_generator == "random":
            need(self.num_rounds >= 1, "task-generator = random: set num-rounds (the run's rounds) >= 1")
            need(self.classes_per_task >= 1, "task-generator = random: set classes-per-task >= 1")
            need(0.0 <= self.min_overlap <= 1.0, f"min-overlap must be in [0, 1], got {self.min_overlap}")
            need(0.0 < self.task_data_fraction <= 1.0,
                 f"task-data-fraction must be in (0, 1], got {self.task_data_fraction}")
            need(self.task_data_sharing in ("disjoint", "independent"),
                 f"task-data-sharing must be 'disjoint' or 'independent', got {self.task_data_sharing!r}")
            need(not self.centralised, "task-generator = random needs centralised = false")
            need(self.num_classes == 0 or self.classes_per_task <= self.num_classes,
                 f"classes-per-task ({self.classes_per_task}) exceeds num-classes ({self.num_classes})")
            need(self.head in HEADS, f"head must be one of {HEADS}, got {self.head!r}")
            need(self.partition == "dirichlet" and self.dirichlet_beta == 0.5 and self.classes_per_client == 1,
                 "task-generator = random: each task's data is held by its one client, so partition, "
                 "dirichlet-beta and classes-per-client do not apply; leave them unset")
        else:
            need(self.num_rounds == 0, "num-rounds applies to task-generator = random only (the stream runs "
                                       "num-tasks x rounds-per-task rounds)")
            need(self.classes_per_task == 0 and self.min_overlap == 0.0,
                 "classes-per-task and min-overlap apply to task-generator = random only")
            need(self.head in ("auto", "per-class"), "head = per-task applies to task-generator = random only "
                                                     "(on the stream every class belongs to one task)")
        need(self.rounds_per_task >= 1, f"rounds-per-task must be >= 1, got {self.rounds_per_task}")
        need(self.num_clients >= 1, f"num-clients must be >= 1, got {self.num_clients}")
        need(self.clients_per_round >= 0, "clients-per-round must be >= 0")
        need(0.0 <= self.client_fraction <= 1.0, f"client-fraction must be in [0, 1], got {self.client_fraction}")
        need(self.clients_per_round > 0 or self.client_fraction > 0,
             "set clients-per-round > 0 or client-fraction > 0")
        need(self.clients_per_round <= self.num_clients,
             f"clients-per-round ({self.clients_per_round}) exceeds num-clients ({self.num_clients})")
        from promptfcl.common.schedule import task_schedule

        task_schedule(self)  # switch-every / switch-fraction / num-tasks: raises ConfigError
        need(self.partition in PARTITIONS, f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        need(self.dirichlet_beta > 0, f"dirichlet-beta must be > 0, got {self.dirichlet_beta}")
        need(self.classes_per_client >= 1, "classes-per-client must be >= 1")
        need(self.min_partition_size >= 0, "min-partition-size must be >= 0")
        need(self.centralised_mode in CENTRALISED_MODES,
             f"centralised-mode must be one of {CENTRALISED_MODES}, got {self.centralised_mode!r}")
        need(self.centralised_mode == "incremental" or (self.centralised and self.population == "virtual"),
             "centralised-mode = joint is the centralised upper bound: it needs centralised = true "
             "(and population = virtual)")
        for name in ("category_ratio", "split_ratio"):
            v = getattr(self, name)
            need(0.0 < v <= 1.0, f"{name.replace('_', '-')} must be in (0, 1], got {v}")
        need(0.0 < self.imbalance_ratio <= 1.0, f"imbalance-ratio must be in (0, 1], got {self.imbalance_ratio}")
        need(0.0 < self.test_fraction < 1.0, f"test-fraction must be in (0, 1), got {self.test_fraction}")
        need(self.local_epochs >= 1, "local-epochs must be >= 1")
        need(self.batch_size >= 1, "batch-size must be >= 1")
        need(self.lr > 0, "lr must be > 0")
        need(self.lr_schedule in ("cosine", "constant"), "lr-schedule must be 'cosine' or 'constant'")
        need(self.augment in AUGMENTATIONS, f"augment must be one of {AUGMENTATIONS}, got {self.augment!r}")
        need(self.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        need(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        need(self.prompt_mode in PROMPT_MODES, f"prompt-mode must be one of {PROMPT_MODES}")
        need(self.prompt_length >= 1, "prompt-length must be >= 1")
        need(self.prompt_mode != "prefix" or self.prompt_length % 2 == 0,
             "prefix-tuning splits a prompt into key and value halves: prompt-length must be even")
        need(self.pool_size >= self.num_tasks and self.pool_size % self.num_tasks == 0,
             f"pool-size ({self.pool_size}) must be a positive multiple of num-tasks ({self.num_tasks})")
        try:
            layers = self.layers
        except ValueError as exc:
            raise ConfigError(f"prompt-layers must be comma-separated integers, got {self.prompt_layers!r}") from exc
        need(len(layers) == len(set(layers)), "prompt-layers has duplicates")
        need(all(v >= 0 for v in layers), "prompt-layers must be >= 0")
        need(self.image_size >= 8, "image-size must be >= 8")
        need(self.round_timeout > 0, "round-timeout must be > 0")
        need(self.threads >= 0, "threads must be >= 0")
        need(self.min_replies >= 1, "min-replies must be >= 1")
        need(self.min_replies <= max(1, self.clients_per_round or self.num_clients),
             f"min-replies ({self.min_replies}) exceeds the clients sampled per round")
        need(self.round_retries >= 0, "round-retries must be >= 0")
        need(math.isfinite(self.update_norm_factor) and (self.update_norm_factor == 0 or self.update_norm_factor > 1),
             f"update-norm-factor must be 0 (off) or > 1, got {self.update_norm_factor}")
        need(math.isfinite(self.max_update_norm) and self.max_update_norm >= 0,
             f"max-update-norm must be >= 0 (0: off), got {self.max_update_norm}")
        need(0 < self.max_client_weight <= 1, f"max-client-weight must be in (0, 1], got {self.max_client_weight}")
        need(self.aggregation in AGGREGATIONS, f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        need(0 <= self.trim_fraction < 0.5, f"trim-fraction must be in [0, 0.5), got {self.trim_fraction}")
        need(self.max_rounds >= 0, f"max-rounds must be >= 0 (0: run to the end), got {self.max_rounds}")
        need(self.max_reply_bytes > 0, "max-reply-bytes must be > 0")
        need(self.fault in FAULTS, f"fault must be one of {FAULTS}, got {self.fault!r}")
        need(0.0 <= self.fault_rate <= 1.0, f"fault-rate must be in [0, 1], got {self.fault_rate}")
        try:
            hostile = self.fault_client_ids
        except ValueError:
            hostile = frozenset({-1})
        need(all(0 <= c < self.num_clients for c in hostile),
             f"fault-clients must be comma-separated client ids below num-clients ({self.num_clients}), "
             f"got {self.fault_clients!r}")
        need(self.fault_hang_seconds >= 0, "fault-hang-seconds must be >= 0")
        need(self.query_cache_disk in ("auto", "on", "off"),
             f"query-cache-disk must be 'auto', 'on' or 'off', got {self.query_cache_disk!r}")
        need(self.backbone_cache_disk in ("auto", "on", "off"),
             f"backbone-cache-disk must be 'auto', 'on' or 'off', got {self.backbone_cache_disk!r}")
        for key, least in (("client-cpus", 0.0), ("client-gpus", 0.0)):
            raw = getattr(self, key.replace("-", "_"))
            try:
                amount = None if raw == "auto" else float(raw)
            except ValueError:
                amount = float("nan")
            need(amount is None or (math.isfinite(amount) and amount > least if key == "client-cpus"
                                    else math.isfinite(amount) and amount >= least),
                 f"{key} must be 'auto' or a number {'> 0' if key == 'client-cpus' else '>= 0'}, got {raw!r}")
        need(self.client_gpus_value is None or self.client_gpus_value <= 1 or self.client_gpus_value.is_integer(),
             f"client-gpus above 1 must be a whole number of GPUs, got {self.client_gpus!r}")
        need(valid_ray_address(self.ray_address),
             f"ray-address must be '' (a local Ray for this run), 'auto' or HOST:PORT (or ray://HOST:PORT), "
             f"got {self.ray_address!r}")
        need(self.population in POPULATIONS, f"population must be one of {POPULATIONS}, got {self.population!r}")
        need(self.evaluation in EVALUATIONS, f"evaluation must be one of {EVALUATIONS}, got {self.evaluation!r}")
        need(self.evaluate_every >= 1, f"evaluate-every must be >= 1, got {self.evaluate_every}")
        need(self.evaluate_every == 1 or self.task_generator == "stream",
             "evaluate-every > 1 needs task-generator = stream (random tasks are scored every round: "
             "Powder's metrics read each round's accuracies)")
        need(self.num_classes >= 0, f"num-classes must be >= 0, got {self.num_classes}")
        need(self.num_classes == 0 or self.task_generator == "random" or self.num_classes % self.num_tasks == 0,
             f"num-classes ({self.num_classes}) is not divisible into num-tasks = {self.num_tasks} equal tasks")
        names = self.class_name_list
        need(len(names) == len(set(names)), "class-names has duplicates")
        for name in names:  # class names become folder names on the nodes
            problem = class_name_problem(name)
            need(problem is None, f"class-names: {name!r} cannot be a class folder's name ({problem})")
        need(not names or self.num_classes in (0, len(names)),
             f"class-names lists {len(names)} classes but num-classes = {self.num_classes}")
        need(self.evaluation == "central" or self.population == "nodes",
             "evaluation=federated needs population=nodes (virtual clients share the server's dataset; "
             "evaluate centrally)")
        need(self.evaluation == "central" or self.num_classes > 0,
             "evaluation=federated: the server holds no data, so set num-classes (and optionally class-names)")


def toml_value(value: object) -> str:
    """``value`` (bool, int, float or str) as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def valid_ray_address(address: str) -> bool:
    """'' , 'auto', 'HOST:PORT' or 'ray://HOST:PORT' (Ray client)."""
    if address in ("", "auto"):
        return True
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and not any(c.isspace() for c in host)


def read_config(config_file: str | None, overrides: list[str], strategy: str | None = None,
                out: str | None = None) -> ExperimentConfig:
    """Defaults <- TOML file (flat keys, or a [tool.flwr.app.config] table) <- ``--set`` pairs <- flags.

    Only the configuration's own checks run here; ``client.methods.load_config`` adds the method's.
    """
    import tomllib
    from pathlib import Path

    raw: dict[str, Any] = {}
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            doc = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        doc = doc.get("tool", {}).get("flwr", {}).get("app", {}).get("config", doc)
        raw.update(_flatten(doc))
    raw.update(parse_overrides(overrides))
    if strategy:
        raw["strategy"] = strategy
    if out:
        raw["out-dir"] = out
    return ExperimentConfig.from_dict(raw)


def _flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["num-tasks=5", "lr=1e-3"]`` -> dict; values parsed as TOML scalars where possible."""
    import tomllib

    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} is not of the form key=value")
        key, raw = pair.split("=", 1)
        key, raw = key.strip(), raw.strip()
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw  # bare strings such as dataset=digits
    return out
