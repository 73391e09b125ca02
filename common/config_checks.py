"""Checks of a run configuration's values, alone and together (``ExperimentConfig.validate``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .errors import ConfigError
from .files import class_name_problem
from .schedule import task_schedule

if TYPE_CHECKING:
    from .config import ExperimentConfig

# the values a key may take
PARTITIONS = ("iid", "dirichlet", "quantity", "quantity-skew", "stateless")
PARTITION_SCOPES = ("task", "dataset")
PARTITION_CLASS_ORDERS = ("original", "task")
AUGMENTATIONS = ("none", "crop-flip", "resized-crop-flip")
LR_SCHEDULES = ("cosine", "constant", "codap-cosine")
INPUT_NORMS = ("backbone", "unit")
PROMPT_TOKENS = ("auto", "truncate", "accumulate")
INTERPOLATIONS = ("bilinear", "bicubic")
CENTRALISED_MODES = ("incremental", "joint")
FAULTS = ("", "raise", "hang", "nan", "shape", "extra-record", "missing-record", "huge-count", "huge-values",
          "poison", "sign-flip", "poison-under-filter", "nan-metrics", "stats-scale", "stats-shift", "cov-inflate",
          "hist-forge")
PROMPT_MODES = ("prefix", "prompt")
TASK_GENERATORS = ("stream", "random")
DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "fp32", "bf16")
POPULATIONS = ("virtual", "nodes")  # deployment: see deploy/README.md
EVALUATIONS = ("central", "federated")
AGGREGATIONS = ("mean", "median", "trimmed-mean")
# where a run reports while it goes, besides rounds.jsonl (server/progress.py, server/trackers.py)
TRACKERS = ("none", "tensorboard", "mlflow", "wandb")
DEFENCES = ("auto", "on", "off")  # trust as a run setting: common/trust.py
HEADS = ("auto", "per-class", "per-task")


def valid_ray_address(address: str) -> bool:
    """'' , 'auto', 'HOST:PORT' or 'ray://HOST:PORT' (Ray client)."""
    if address in ("", "auto"):
        return True
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and not any(c.isspace() for c in host)


def validate_config(cfg: ExperimentConfig) -> None:
    """Raise ConfigError for values that cannot work; checked before any training."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(cfg.num_tasks >= 1, f"num-tasks must be >= 1, got {cfg.num_tasks}")
    need(cfg.task_generator in TASK_GENERATORS,
         f"task-generator must be one of {TASK_GENERATORS}, got {cfg.task_generator!r}")
    if cfg.task_generator == "random":
        need(cfg.num_rounds >= 1, "task-generator = random: set num-rounds (the run's rounds) >= 1")
        need(cfg.classes_per_task >= 1, "task-generator = random: set classes-per-task >= 1")
        need(0.0 <= cfg.min_overlap <= 1.0, f"min-overlap must be in [0, 1], got {cfg.min_overlap}")
        need(0.0 < cfg.task_data_fraction <= 1.0,
             f"task-data-fraction must be in (0, 1], got {cfg.task_data_fraction}")
        need(cfg.task_data_sharing in ("disjoint", "independent"),
             f"task-data-sharing must be 'disjoint' or 'independent', got {cfg.task_data_sharing!r}")
        need(not cfg.centralised, "task-generator = random needs centralised = false")
        need(cfg.num_classes == 0 or cfg.classes_per_task <= cfg.num_classes,
             f"classes-per-task ({cfg.classes_per_task}) exceeds num-classes ({cfg.num_classes})")
        need(cfg.head in HEADS, f"head must be one of {HEADS}, got {cfg.head!r}")
        need(cfg.partition == "dirichlet" and cfg.dirichlet_beta == 0.5 and cfg.classes_per_client == 1
             and cfg.partition_scope == "task" and not cfg.dirichlet_balance,
             "task-generator = random: each task's data is held by its one client, so partition, "
             "dirichlet-beta, dirichlet-balance, partition-scope and classes-per-client do not apply; "
             "leave them unset")
    else:
        need(cfg.num_rounds == 0, "num-rounds applies to task-generator = random only (the stream runs "
                                   "num-tasks x rounds-per-task rounds)")
        need(cfg.classes_per_task == 0 and cfg.min_overlap == 0.0,
             "classes-per-task and min-overlap apply to task-generator = random only")
        need(cfg.head in ("auto", "per-class"), "head = per-task applies to task-generator = random only "
                                                 "(on the stream every class belongs to one task)")
    need(cfg.rounds_per_task >= 1, f"rounds-per-task must be >= 1, got {cfg.rounds_per_task}")
    need(cfg.num_clients >= 1, f"num-clients must be >= 1, got {cfg.num_clients}")
    need(cfg.clients_per_round >= 0, "clients-per-round must be >= 0")
    need(0.0 <= cfg.client_fraction <= 1.0, f"client-fraction must be in [0, 1], got {cfg.client_fraction}")
    need(cfg.clients_per_round > 0 or cfg.client_fraction > 0,
         "set clients-per-round > 0 or client-fraction > 0")
    need(cfg.clients_per_round <= cfg.num_clients,
         f"clients-per-round ({cfg.clients_per_round}) exceeds num-clients ({cfg.num_clients})")

    task_schedule(cfg)  # switch-every / switch-fraction / num-tasks: raises ConfigError
    need(cfg.partition in PARTITIONS, f"partition must be one of {PARTITIONS}, got {cfg.partition!r}")
    need(cfg.dirichlet_beta > 0, f"dirichlet-beta must be > 0, got {cfg.dirichlet_beta}")
    need(cfg.classes_per_client >= 1, "classes-per-client must be >= 1")
    need(cfg.min_partition_size >= 0, "min-partition-size must be >= 0")
    need(cfg.tracker in TRACKERS, f"tracker must be one of {TRACKERS}, got {cfg.tracker!r}")
    need(cfg.partition_scope in PARTITION_SCOPES,
         f"partition-scope must be one of {PARTITION_SCOPES}, got {cfg.partition_scope!r}")
    need(cfg.partition_class_order in PARTITION_CLASS_ORDERS,
         f"partition-class-order must be one of {PARTITION_CLASS_ORDERS}, got {cfg.partition_class_order!r}")
    need(cfg.partition_scope == "task" or cfg.partition != "stateless",
         "partition-scope = dataset does not apply to the stateless population (it draws per round)")
    need(cfg.centralised_mode in CENTRALISED_MODES,
         f"centralised-mode must be one of {CENTRALISED_MODES}, got {cfg.centralised_mode!r}")
    need(cfg.centralised_mode == "incremental" or (cfg.centralised and cfg.population == "virtual"),
         "centralised-mode = joint is the centralised upper bound: it needs centralised = true "
         "(and population = virtual)")
    for name in ("category_ratio", "split_ratio"):
        v = getattr(cfg, name)
        need(0.0 < v <= 1.0, f"{name.replace('_', '-')} must be in (0, 1], got {v}")
    need(0.0 < cfg.imbalance_ratio <= 1.0, f"imbalance-ratio must be in (0, 1], got {cfg.imbalance_ratio}")
    need(0.0 < cfg.test_fraction < 1.0, f"test-fraction must be in (0, 1), got {cfg.test_fraction}")
    need(cfg.local_epochs >= 1, "local-epochs must be >= 1")
    need(cfg.batch_size >= 1, "batch-size must be >= 1")
    need(cfg.lr > 0, "lr must be > 0")
    need(cfg.lr_schedule in LR_SCHEDULES, f"lr-schedule must be one of {LR_SCHEDULES}, got {cfg.lr_schedule!r}")
    need(cfg.lr_schedule_epochs >= 0, f"lr-schedule-epochs must be >= 0, got {cfg.lr_schedule_epochs}")
    need(cfg.lr_schedule_epochs == 0 or cfg.lr_schedule == "codap-cosine",
         f"lr-schedule-epochs = {cfg.lr_schedule_epochs} applies to lr-schedule = codap-cosine only, "
         f"not {cfg.lr_schedule!r}")
    # past epoch K - 1 CODA-P's cosine turns negative (for K < 100): no run trains longer than its K
    need(cfg.lr_schedule != "codap-cosine" or cfg.lr_schedule_epochs == 0 or cfg.local_epochs <= cfg.lr_schedule_epochs,
         f"local-epochs = {cfg.local_epochs} exceeds lr-schedule-epochs = {cfg.lr_schedule_epochs}: CODA-P's "
         "cosine is defined over K epochs (0: K = local-epochs)")
    need(cfg.augment in AUGMENTATIONS, f"augment must be one of {AUGMENTATIONS}, got {cfg.augment!r}")
    need(0.0 < cfg.augment_crop_scale <= 1.0, f"augment-crop-scale must be in (0, 1], got {cfg.augment_crop_scale}")
    need(cfg.input_norm in INPUT_NORMS, f"input-norm must be one of {INPUT_NORMS}, got {cfg.input_norm!r}")
    need(cfg.prompt_tokens in PROMPT_TOKENS, f"prompt-tokens must be one of {PROMPT_TOKENS}, got {cfg.prompt_tokens!r}")
    need(cfg.prompt_tokens != "accumulate" or cfg.prompt_mode == "prompt",
         "prompt-tokens = accumulate applies to prompt-mode = prompt (prefix-tuning adds no tokens)")
    need(cfg.resize_interpolation in INTERPOLATIONS,
         f"resize-interpolation must be one of {INTERPOLATIONS}, got {cfg.resize_interpolation!r}")
    need(0.0 < cfg.eval_crop <= 1.0, f"eval-crop must be in (0, 1], got {cfg.eval_crop}")
    need(cfg.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {cfg.precision!r}")
    need(cfg.device in DEVICES, f"device must be one of {DEVICES}, got {cfg.device!r}")
    need(cfg.prompt_mode in PROMPT_MODES, f"prompt-mode must be one of {PROMPT_MODES}")
    need(cfg.prompt_length >= 1, "prompt-length must be >= 1")
    need(cfg.prompt_mode != "prefix" or cfg.prompt_length % 2 == 0,
         "prefix-tuning splits a prompt into key and value halves: prompt-length must be even")
    need(cfg.pool_size >= cfg.num_tasks and cfg.pool_size % cfg.num_tasks == 0,
         f"pool-size ({cfg.pool_size}) must be a positive multiple of num-tasks ({cfg.num_tasks})")
    try:
        layers = cfg.layers
    except ValueError as exc:
        raise ConfigError(f"prompt-layers must be comma-separated integers, got {cfg.prompt_layers!r}") from exc
    need(len(layers) == len(set(layers)), "prompt-layers has duplicates")
    need(all(v >= 0 for v in layers), "prompt-layers must be >= 0")
    need(cfg.image_size >= 8, "image-size must be >= 8")
    need(cfg.round_timeout > 0, "round-timeout must be > 0")
    need(cfg.threads >= 0, "threads must be >= 0")
    need(cfg.min_replies >= 1, "min-replies must be >= 1")
    need(cfg.min_replies <= max(1, cfg.clients_per_round or cfg.num_clients),
         f"min-replies ({cfg.min_replies}) exceeds the clients sampled per round")
    need(cfg.round_retries >= 0, "round-retries must be >= 0")
    need(cfg.defences in DEFENCES, f"defences must be one of {DEFENCES}, got {cfg.defences!r}")
    need(math.isfinite(cfg.update_norm_factor) and (cfg.update_norm_factor == 0 or cfg.update_norm_factor > 1),
         f"update-norm-factor must be 0 (off) or > 1, got {cfg.update_norm_factor}")
    need(math.isfinite(cfg.update_min_cosine) and -1 <= cfg.update_min_cosine < 1,
         f"update-min-cosine must be in [-1, 1) (-1: off), got {cfg.update_min_cosine}")
    need(math.isfinite(cfg.update_clip) and (cfg.update_clip == 0 or cfg.update_clip >= 1),
         f"update-clip must be 0 (off) or >= 1 (a multiple of the round's lower median norm), got {cfg.update_clip}")
    need(math.isfinite(cfg.update_reversed_norm) and cfg.update_reversed_norm >= 0,
         f"update-reversed-norm must be 0 (off) or > 0 (a multiple of the lower median norm), "
         f"got {cfg.update_reversed_norm}")
    need(math.isfinite(cfg.update_strike_norm) and (cfg.update_strike_norm == 0 or cfg.update_strike_norm >= 1),
         f"update-strike-norm must be 0 (off) or >= 1 (a multiple of the lower median norm), "
         f"got {cfg.update_strike_norm}")
    need(cfg.update_strikes >= 0, f"update-strikes must be >= 0 (0: off), got {cfg.update_strikes}")
    need(math.isfinite(cfg.update_mean_cosine) and -1 <= cfg.update_mean_cosine < 1,
         f"update-mean-cosine must be in [-1, 1) (-1: off), got {cfg.update_mean_cosine}")
    need(cfg.update_mean_cosine_after >= 1,
         f"update-mean-cosine-after must be >= 1 (replies judged before a client's mean counts), "
         f"got {cfg.update_mean_cosine_after}")
    need(cfg.update_norm_rounds >= 1,
         f"update-norm-rounds must be >= 1 (rounds a task's reference norm is read over, this one included), "
         f"got {cfg.update_norm_rounds}")
    need(math.isfinite(cfg.stats_bound) and (cfg.stats_bound == 0 or cfg.stats_bound >= 1),
         f"stats-bound must be 0 (off) or >= 1 (a multiple of the lower median), got {cfg.stats_bound}")
    need(math.isfinite(cfg.max_update_norm) and cfg.max_update_norm >= 0,
         f"max-update-norm must be >= 0 (0: off), got {cfg.max_update_norm}")
    need(0 < cfg.max_client_weight <= 1, f"max-client-weight must be in (0, 1], got {cfg.max_client_weight}")
    need(cfg.aggregation in AGGREGATIONS, f"aggregation must be one of {AGGREGATIONS}, got {cfg.aggregation!r}")
    need(0 <= cfg.trim_fraction < 0.5, f"trim-fraction must be in [0, 0.5), got {cfg.trim_fraction}")
    need(cfg.max_rounds >= 0, f"max-rounds must be >= 0 (0: run to the end), got {cfg.max_rounds}")
    need(cfg.max_reply_bytes > 0, "max-reply-bytes must be > 0")
    need(cfg.fault in FAULTS, f"fault must be one of {FAULTS}, got {cfg.fault!r}")
    need(0.0 <= cfg.fault_rate <= 1.0, f"fault-rate must be in [0, 1], got {cfg.fault_rate}")
    try:
        hostile = cfg.fault_client_ids
    except ValueError:
        hostile = frozenset({-1})
    need(all(0 <= c < cfg.num_clients for c in hostile),
         f"fault-clients must be comma-separated client ids below num-clients ({cfg.num_clients}), "
         f"got {cfg.fault_clients!r}")
    need(cfg.fault_hang_seconds >= 0, "fault-hang-seconds must be >= 0")
    need(cfg.query_cache_disk in ("auto", "on", "off"),
         f"query-cache-disk must be 'auto', 'on' or 'off', got {cfg.query_cache_disk!r}")
    need(cfg.backbone_cache_disk in ("auto", "on", "off"),
         f"backbone-cache-disk must be 'auto', 'on' or 'off', got {cfg.backbone_cache_disk!r}")
    for key, least in (("client-cpus", 0.0), ("client-gpus", 0.0)):
        raw = getattr(cfg, key.replace("-", "_"))
        try:
            amount = None if raw == "auto" else float(raw)
        except ValueError:
            amount = float("nan")
        need(amount is None or (math.isfinite(amount) and amount > least if key == "client-cpus"
                                else math.isfinite(amount) and amount >= least),
             f"{key} must be 'auto' or a number {'> 0' if key == 'client-cpus' else '>= 0'}, got {raw!r}")
    need(cfg.client_gpus_value is None or cfg.client_gpus_value <= 1 or cfg.client_gpus_value.is_integer(),
         f"client-gpus above 1 must be a whole number of GPUs, got {cfg.client_gpus!r}")
    need(valid_ray_address(cfg.ray_address),
         f"ray-address must be '' (a local Ray for this run), 'auto' or HOST:PORT (or ray://HOST:PORT), "
         f"got {cfg.ray_address!r}")
    need(cfg.population in POPULATIONS, f"population must be one of {POPULATIONS}, got {cfg.population!r}")
    need(cfg.evaluation in EVALUATIONS, f"evaluation must be one of {EVALUATIONS}, got {cfg.evaluation!r}")
    need(cfg.evaluate_every >= 1, f"evaluate-every must be >= 1, got {cfg.evaluate_every}")
    need(cfg.evaluate_every == 1 or cfg.task_generator == "stream",
         "evaluate-every > 1 needs task-generator = stream (random tasks are scored every round: "
         "Powder's metrics read each round's accuracies)")
    need(cfg.num_classes >= 0, f"num-classes must be >= 0, got {cfg.num_classes}")
    need(cfg.num_classes == 0 or cfg.task_generator == "random" or cfg.num_classes % cfg.num_tasks == 0,
         f"num-classes ({cfg.num_classes}) is not divisible into num-tasks = {cfg.num_tasks} equal tasks")
    names = cfg.class_name_list
    need(len(names) == len(set(names)), "class-names has duplicates")
    for name in names:  # class names become folder names on the nodes
        problem = class_name_problem(name)
        need(problem is None, f"class-names: {name!r} cannot be a class folder's name ({problem})")
    need(not names or cfg.num_classes in (0, len(names)),
         f"class-names lists {len(names)} classes but num-classes = {cfg.num_classes}")
    need(cfg.evaluation == "central" or cfg.population == "nodes",
         "evaluation=federated needs population=nodes (virtual clients share the server's dataset; "
         "evaluate centrally)")
    need(cfg.evaluation == "central" or cfg.num_classes > 0,
         "evaluation=federated: the server holds no data, so set num-classes (and optionally class-names)")
