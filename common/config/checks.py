"""Checks of a run configuration's values: each section's own (``check_<section>``, run when the section is
made) and those that join sections (:func:`validate_config`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..data.schedule import task_schedule
from ..errors import ConfigError
from ..files import class_name_problem

if TYPE_CHECKING:
    from . import sections as sections
    from .experiment import ExperimentConfig

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
          "hist-forge", "alie", "ipm", "mimic", "min-max", "min-sum", "label-flip")
#: the fault kinds whose hostile clients collude (strategies/platform/collusion.py): simulation only
COLLUDING_FAULTS = ("alie", "ipm", "mimic", "min-max", "min-sum")
FAULT_KNOWLEDGE = ("colluders", "all")
PROMPT_MODES = ("prefix", "prompt")
TASK_GENERATORS = ("stream", "random")
DEVICES = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "fp32", "bf16")
POPULATIONS = ("virtual", "nodes")  # deployment: see deploy/README.md
EVALUATIONS = ("central", "federated")
AGGREGATIONS = ("mean", "median", "trimmed-mean", "krum", "multikrum", "bulyan")
# where a run reports while it goes, besides rounds.jsonl (server/progress.py, server/trackers.py)
TRACKERS = ("none", "tensorboard", "mlflow", "wandb")
DEFENCES = ("auto", "on", "off")  # trust as a run setting: common/config/trust.py
HEADS = ("auto", "per-class", "per-task")


def valid_ray_address(address: str) -> bool:
    """'' , 'auto', 'HOST:PORT' or 'ray://HOST:PORT' (Ray client)."""
    if address in ("", "auto"):
        return True
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and not any(c.isspace() for c in host)


def need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def check_run(r: sections.RunSection) -> None:
    need(r.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {r.precision!r}")


def check_data(d: sections.DataSection) -> None:
    need(d.num_tasks >= 1, f"num-tasks must be >= 1, got {d.num_tasks}")
    need(d.task_generator in TASK_GENERATORS,
         f"task-generator must be one of {TASK_GENERATORS}, got {d.task_generator!r}")
    if d.task_generator == "random":
        need(d.num_rounds >= 1, "task-generator = random: set num-rounds (the run's rounds) >= 1")
        need(d.classes_per_task >= 1, "task-generator = random: set classes-per-task >= 1")
        need(0.0 <= d.min_overlap <= 1.0, f"min-overlap must be in [0, 1], got {d.min_overlap}")
        need(0.0 < d.task_data_fraction <= 1.0,
             f"task-data-fraction must be in (0, 1], got {d.task_data_fraction}")
        need(d.task_data_sharing in ("disjoint", "independent"),
             f"task-data-sharing must be 'disjoint' or 'independent', got {d.task_data_sharing!r}")
        need(d.num_classes == 0 or d.classes_per_task <= d.num_classes,
             f"classes-per-task ({d.classes_per_task}) exceeds num-classes ({d.num_classes})")
    else:
        need(d.num_rounds == 0, "num-rounds applies to task-generator = random only (the stream runs "
                                 "num-tasks x rounds-per-task rounds)")
        need(d.classes_per_task == 0 and d.min_overlap == 0.0,
             "classes-per-task and min-overlap apply to task-generator = random only")
    need(0.0 < d.test_fraction < 1.0, f"test-fraction must be in (0, 1), got {d.test_fraction}")
    need(d.num_classes >= 0, f"num-classes must be >= 0, got {d.num_classes}")
    need(d.num_classes == 0 or d.task_generator == "random" or d.num_classes % d.num_tasks == 0,
         f"num-classes ({d.num_classes}) is not divisible into num-tasks = {d.num_tasks} equal tasks")
    names = d.class_name_list
    need(len(names) == len(set(names)), "class-names has duplicates")
    for name in names:  # class names become folder names on the nodes
        problem = class_name_problem(name)
        need(problem is None, f"class-names: {name!r} cannot be a class folder's name ({problem})")
    need(not names or d.num_classes in (0, len(names)),
         f"class-names lists {len(names)} classes but num-classes = {d.num_classes}")


def check_federation(f: sections.FederationSection) -> None:
    need(f.rounds_per_task >= 1, f"rounds-per-task must be >= 1, got {f.rounds_per_task}")
    need(f.num_clients >= 1, f"num-clients must be >= 1, got {f.num_clients}")
    need(f.clients_per_round >= 0, "clients-per-round must be >= 0")
    need(0.0 <= f.client_fraction <= 1.0, f"client-fraction must be in [0, 1], got {f.client_fraction}")
    need(f.clients_per_round > 0 or f.client_fraction > 0,
         "set clients-per-round > 0 or client-fraction > 0")
    need(f.clients_per_round <= f.num_clients,
         f"clients-per-round ({f.clients_per_round}) exceeds num-clients ({f.num_clients})")
    need(f.partition in PARTITIONS, f"partition must be one of {PARTITIONS}, got {f.partition!r}")
    need(f.dirichlet_beta > 0, f"dirichlet-beta must be > 0, got {f.dirichlet_beta}")
    need(f.classes_per_client >= 1, "classes-per-client must be >= 1")
    need(f.min_partition_size >= 0, "min-partition-size must be >= 0")
    need(f.partition_scope in PARTITION_SCOPES,
         f"partition-scope must be one of {PARTITION_SCOPES}, got {f.partition_scope!r}")
    need(f.partition_class_order in PARTITION_CLASS_ORDERS,
         f"partition-class-order must be one of {PARTITION_CLASS_ORDERS}, got {f.partition_class_order!r}")
    need(f.partition_scope == "task" or f.partition != "stateless",
         "partition-scope = dataset does not apply to the stateless population (it draws per round)")
    need(f.centralised_mode in CENTRALISED_MODES,
         f"centralised-mode must be one of {CENTRALISED_MODES}, got {f.centralised_mode!r}")
    need(f.centralised_mode == "incremental" or (f.centralised and f.population == "virtual"),
         "centralised-mode = joint is the centralised upper bound: it needs centralised = true "
         "(and population = virtual)")
    for name, v in (("category-ratio", f.category_ratio), ("split-ratio", f.split_ratio)):
        need(0.0 < v <= 1.0, f"{name} must be in (0, 1], got {v}")
    need(0.0 < f.imbalance_ratio <= 1.0, f"imbalance-ratio must be in (0, 1], got {f.imbalance_ratio}")
    need(f.population in POPULATIONS, f"population must be one of {POPULATIONS}, got {f.population!r}")


def check_training(t: sections.TrainingSection) -> None:
    need(t.local_epochs >= 1, "local-epochs must be >= 1")
    need(t.batch_size >= 1, "batch-size must be >= 1")
    need(t.lr > 0, "lr must be > 0")
    need(t.lr_schedule in LR_SCHEDULES, f"lr-schedule must be one of {LR_SCHEDULES}, got {t.lr_schedule!r}")
    need(t.lr_schedule_epochs >= 0, f"lr-schedule-epochs must be >= 0, got {t.lr_schedule_epochs}")
    need(t.lr_schedule_epochs == 0 or t.lr_schedule == "codap-cosine",
         f"lr-schedule-epochs = {t.lr_schedule_epochs} applies to lr-schedule = codap-cosine only, "
         f"not {t.lr_schedule!r}")
    # past epoch K - 1 CODA-P's cosine turns negative (for K < 100): no run trains longer than its K
    need(t.lr_schedule != "codap-cosine" or t.lr_schedule_epochs == 0 or t.local_epochs <= t.lr_schedule_epochs,
         f"local-epochs = {t.local_epochs} exceeds lr-schedule-epochs = {t.lr_schedule_epochs}: CODA-P's "
         "cosine is defined over K epochs (0: K = local-epochs)")
    need(t.augment in AUGMENTATIONS, f"augment must be one of {AUGMENTATIONS}, got {t.augment!r}")
    need(0.0 < t.augment_crop_scale <= 1.0, f"augment-crop-scale must be in (0, 1], got {t.augment_crop_scale}")


def check_model(m: sections.ModelSection) -> None:
    need(m.head in HEADS, f"head must be one of {HEADS}, got {m.head!r}")
    need(m.input_norm in INPUT_NORMS, f"input-norm must be one of {INPUT_NORMS}, got {m.input_norm!r}")
    need(m.prompt_tokens in PROMPT_TOKENS, f"prompt-tokens must be one of {PROMPT_TOKENS}, got {m.prompt_tokens!r}")
    need(m.prompt_tokens != "accumulate" or m.prompt_mode == "prompt",
         "prompt-tokens = accumulate applies to prompt-mode = prompt (prefix-tuning adds no tokens)")
    need(m.resize_interpolation in INTERPOLATIONS,
         f"resize-interpolation must be one of {INTERPOLATIONS}, got {m.resize_interpolation!r}")
    need(m.prompt_mode in PROMPT_MODES, f"prompt-mode must be one of {PROMPT_MODES}")
    need(m.prompt_length >= 1, "prompt-length must be >= 1")
    need(m.prompt_mode != "prefix" or m.prompt_length % 2 == 0,
         "prefix-tuning splits a prompt into key and value halves: prompt-length must be even")
    need(m.pool_size >= 1, f"pool-size must be >= 1, got {m.pool_size}")
    try:
        layers = m.layers
    except ValueError as exc:
        raise ConfigError(f"prompt-layers must be comma-separated integers, got {m.prompt_layers!r}") from exc
    need(len(layers) == len(set(layers)), "prompt-layers has duplicates")
    need(all(v >= 0 for v in layers), "prompt-layers must be >= 0")
    need(m.image_size >= 8, "image-size must be >= 8")


def check_evaluation(e: sections.EvaluationSection) -> None:
    need(0.0 < e.eval_crop <= 1.0, f"eval-crop must be in (0, 1], got {e.eval_crop}")
    need(e.evaluation in EVALUATIONS, f"evaluation must be one of {EVALUATIONS}, got {e.evaluation!r}")
    need(e.evaluate_every >= 1, f"evaluate-every must be >= 1, got {e.evaluate_every}")


def check_robustness(r: sections.RobustnessSection) -> None:
    need(r.round_timeout > 0, "round-timeout must be > 0")
    need(r.min_replies >= 1, "min-replies must be >= 1")
    need(r.round_retries >= 0, "round-retries must be >= 0")
    need(r.defences in DEFENCES, f"defences must be one of {DEFENCES}, got {r.defences!r}")
    need(math.isfinite(r.update_norm_factor) and (r.update_norm_factor == 0 or r.update_norm_factor > 1),
         f"update-norm-factor must be 0 (off) or > 1, got {r.update_norm_factor}")
    need(math.isfinite(r.update_min_cosine) and -1 <= r.update_min_cosine < 1,
         f"update-min-cosine must be in [-1, 1) (-1: off), got {r.update_min_cosine}")
    need(math.isfinite(r.update_clip) and (r.update_clip == 0 or r.update_clip >= 1),
         f"update-clip must be 0 (off) or >= 1 (a multiple of the round's lower median norm), got {r.update_clip}")
    need(math.isfinite(r.update_reversed_norm) and r.update_reversed_norm >= 0,
         f"update-reversed-norm must be 0 (off) or > 0 (a multiple of the lower median norm), "
         f"got {r.update_reversed_norm}")
    need(math.isfinite(r.update_strike_norm) and (r.update_strike_norm == 0 or r.update_strike_norm >= 1),
         f"update-strike-norm must be 0 (off) or >= 1 (a multiple of the lower median norm), "
         f"got {r.update_strike_norm}")
    need(r.update_strikes >= 0, f"update-strikes must be >= 0 (0: off), got {r.update_strikes}")
    need(math.isfinite(r.update_mean_cosine) and -1 <= r.update_mean_cosine < 1,
         f"update-mean-cosine must be in [-1, 1) (-1: off), got {r.update_mean_cosine}")
    need(r.update_mean_cosine_after >= 1,
         f"update-mean-cosine-after must be >= 1 (replies judged before a client's mean counts), "
         f"got {r.update_mean_cosine_after}")
    need(r.update_norm_rounds >= 1,
         f"update-norm-rounds must be >= 1 (rounds a task's reference norm is read over, this one included), "
         f"got {r.update_norm_rounds}")
    need(math.isfinite(r.stats_bound) and (r.stats_bound == 0 or r.stats_bound >= 1),
         f"stats-bound must be 0 (off) or >= 1 (a multiple of the lower median), got {r.stats_bound}")
    need(math.isfinite(r.max_update_norm) and r.max_update_norm >= 0,
         f"max-update-norm must be >= 0 (0: off), got {r.max_update_norm}")
    need(0 < r.max_client_weight <= 1, f"max-client-weight must be in (0, 1], got {r.max_client_weight}")
    need(r.aggregation in AGGREGATIONS, f"aggregation must be one of {AGGREGATIONS}, got {r.aggregation!r}")
    need(0 <= r.trim_fraction < 0.5, f"trim-fraction must be in [0, 0.5), got {r.trim_fraction}")
    need(r.max_reply_bytes > 0, "max-reply-bytes must be > 0")
    need(r.fault in FAULTS, f"fault must be one of {FAULTS}, got {r.fault!r}")
    need(0.0 <= r.fault_rate <= 1.0, f"fault-rate must be in [0, 1], got {r.fault_rate}")
    need(r.fault_hang_seconds >= 0, "fault-hang-seconds must be >= 0")
    need(math.isfinite(r.fault_z) and r.fault_z >= 0, f"fault-z must be >= 0 (0: ALIE's formula), got {r.fault_z}")
    need(math.isfinite(r.fault_epsilon) and r.fault_epsilon > 0, f"fault-epsilon must be > 0, got {r.fault_epsilon}")
    need(r.fault not in COLLUDING_FAULTS or bool(r.fault_clients.strip()),
         f"fault = {r.fault!r} is a colluding attack: name its colluders with fault-clients (a fault-rate "
         "chooses no fixed clients to collude)")
    need(r.fault_knowledge in FAULT_KNOWLEDGE,
         f"fault-knowledge must be one of {FAULT_KNOWLEDGE}, got {r.fault_knowledge!r}")
    need(r.byzantine_clients >= 0, f"byzantine-clients must be >= 0 (0: from the run's hostile share), "
                                   f"got {r.byzantine_clients}")


def check_placement(p: sections.PlacementSection) -> None:
    need(p.device in DEVICES, f"device must be one of {DEVICES}, got {p.device!r}")
    need(p.threads >= 0, "threads must be >= 0")
    for key, raw in (("client-cpus", p.client_cpus), ("client-gpus", p.client_gpus)):
        try:
            amount = None if raw == "auto" else float(raw)
        except ValueError:
            amount = float("nan")
        need(amount is None or (math.isfinite(amount) and amount > 0.0 if key == "client-cpus"
                                else math.isfinite(amount) and amount >= 0.0),
             f"{key} must be 'auto' or a number {'> 0' if key == 'client-cpus' else '>= 0'}, got {raw!r}")
    need(p.client_gpus_value is None or p.client_gpus_value <= 1 or p.client_gpus_value.is_integer(),
         f"client-gpus above 1 must be a whole number of GPUs, got {p.client_gpus!r}")
    need(valid_ray_address(p.ray_address),
         f"ray-address must be '' (a local Ray for this run), 'auto' or HOST:PORT (or ray://HOST:PORT), "
         f"got {p.ray_address!r}")


def check_output(o: sections.OutputSection) -> None:
    need(o.tracker in TRACKERS, f"tracker must be one of {TRACKERS}, got {o.tracker!r}")
    need(o.max_rounds >= 0, f"max-rounds must be >= 0 (0: run to the end), got {o.max_rounds}")


def check_caching(c: sections.CachingSection) -> None:
    need(c.query_cache_disk in ("auto", "on", "off"),
         f"query-cache-disk must be 'auto', 'on' or 'off', got {c.query_cache_disk!r}")
    need(c.backbone_cache_disk in ("auto", "on", "off"),
         f"backbone-cache-disk must be 'auto', 'on' or 'off', got {c.backbone_cache_disk!r}")


def validate_config(cfg: ExperimentConfig) -> None:
    """Raise ConfigError for values of different sections that cannot work together (each section
    has checked its own); checked before any training."""
    data, fed, model = cfg.data, cfg.federation, cfg.model
    if data.random:
        need(not fed.centralised, "task-generator = random needs centralised = false")
        need(fed.partition == "dirichlet" and fed.dirichlet_beta == 0.5 and fed.classes_per_client == 1
             and fed.partition_scope == "task" and not fed.dirichlet_balance,
             "task-generator = random: each task's data is held by its one client, so partition, "
             "dirichlet-beta, dirichlet-balance, partition-scope and classes-per-client do not apply; "
             "leave them unset")
    else:
        need(model.head in ("auto", "per-class"), "head = per-task applies to task-generator = random only "
                                                   "(on the stream every class belongs to one task)")
    task_schedule(data, fed, cfg.run.seed)  # switch-every / switch-fraction / num-tasks: raises ConfigError
    need(model.pool_size >= data.num_tasks and model.pool_size % data.num_tasks == 0,
         f"pool-size ({model.pool_size}) must be a positive multiple of num-tasks ({data.num_tasks})")
    rob = cfg.robustness
    need(rob.min_replies <= max(1, fed.clients_per_round or fed.num_clients),
         f"min-replies ({rob.min_replies}) exceeds the clients sampled per round")
    try:
        hostile = rob.fault_client_ids
    except ValueError:
        hostile = frozenset({-1})
    need(all(0 <= c < fed.num_clients for c in hostile),
         f"fault-clients must be comma-separated client ids below num-clients ({fed.num_clients}), "
         f"got {rob.fault_clients!r}")
    need(rob.fault not in COLLUDING_FAULTS or fed.population == "virtual",
         f"fault = {rob.fault!r} is a colluding attack, computed by the server of a simulation from the "
         "hostile clients' honest updates (strategies/platform/attack_policy.py); deployed nodes "
         "(population = nodes) cannot collude this way: use it in a simulation")
    ev = cfg.evaluation
    need(ev.evaluate_every == 1 or data.task_generator == "stream",
         "evaluate-every > 1 needs task-generator = stream (random tasks are scored every round: "
         "Powder's metrics read each round's accuracies)")
    need(ev.evaluation == "central" or fed.population == "nodes",
         "evaluation=federated needs population=nodes (virtual clients share the server's dataset; "
         "evaluate centrally)")
    need(ev.evaluation == "central" or data.num_classes > 0,
         "evaluation=federated: the server holds no data, so set num-classes (and optionally class-names)")
