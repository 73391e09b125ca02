"""The one check of a run, before anything is loaded: every entry point calls :func:`check_run`.

The command line (:func:`load_config`: ``promptfcl simulate``, ``bench``, ``pretrain``, a
node's data ``check`` in client/node_data.py, deploy/submit-run.sh), its resume path and the
ServerApp check a run here, before any dataset or backbone is loaded; a ClientApp checks what
it needs before it uploads (:func:`check_client_run`). What a method supports of a run is data on its options
(``COMPATIBILITY``, ``WHY_NOT``: common/config/options.py) and its own checks of its options against
the run are its options' ``check_run``, so checking a run needs the method's options and
neither of its sides (the server's strategy, the client's learner).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...common.config.experiment import ConfigError, ExperimentConfig
from ...common.config.files import read_config
from ...common.config.options import ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY, RANDOM_TASKS, MethodOptions
from ...common.data.schedule import RandomTaskSchedule, TaskSchedule, task_schedule
from ...common.data.sources import check_source
from ...common.privacy import PrivacyOptions, check_privacy, privacy_options
from ..registry import check_method, check_namespaces, method_options
from .run_memory import check_server_memory


@dataclass(frozen=True)
class CheckedRun:
    """What checking a run found: the method's options parsed, the task schedule, ``dp.*``."""

    options: MethodOptions
    schedule: TaskSchedule | RandomTaskSchedule
    privacy: PrivacyOptions


def check_run(cfg: ExperimentConfig) -> CheckedRun:
    """Every check of the run ``cfg`` that needs nothing loaded (ConfigError at the first that fails):
    the method is known; every namespaced key names a method (or ``dp``) and one of its options;
    the configuration's own values (common/config/checks.py); the dataset's name; the task
    schedule and ``dp.*`` against what the method supports (its options' ``COMPATIBILITY``);
    the method's own checks of its options against the run (its options' ``check_run``); the
    run's memory against the server's ceilings (run_memory.py: the backbone, and a round's
    replies, copies and method state)."""
    check_method(cfg.run.strategy)
    check_namespaces(cfg.method)
    cfg.validate()  # run when the configuration was built; again for one built by dataclasses.replace
    check_source(cfg.data.dataset)
    options = method_options(cfg.run.strategy, cfg.method_options(cfg.run.strategy))
    schedule = _check_schedule(task_schedule(cfg.data, cfg.federation, cfg.run.seed),
                               cfg.data.task_generator == "random", cfg.run.strategy, options)
    privacy = check_privacy(privacy_options(cfg), cfg.federation.num_clients, cfg.run.strategy,
                            _privacy_refusal(options))
    check_options(options, cfg, privacy)
    check_server_memory(cfg)  # the run's whole estimate against the server's ceilings (run_memory.py)
    return CheckedRun(options, schedule, privacy)


def check_client_run(cfg: ExperimentConfig, options: MethodOptions | None = None,
                     privacy: PrivacyOptions | None = None) -> PrivacyOptions:
    """What a client checks of a run before it uploads: the method is known, ``dp.*`` against
    what the method supports, and the method's own checks (the schedule and the dataset are
    the server's); the method's strategy is not imported. ``options``, ``privacy``: the method's
    and the ``dp.*`` options, already parsed (None: parsed here)."""
    check_method(cfg.run.strategy)
    if options is None:
        options = method_options(cfg.run.strategy, cfg.method_options(cfg.run.strategy))
    privacy = check_privacy(privacy if privacy is not None else privacy_options(cfg), cfg.federation.num_clients,
                            cfg.run.strategy, _privacy_refusal(options))
    check_options(options, cfg, privacy)
    return privacy


def check_options(options: MethodOptions, cfg: ExperimentConfig, privacy: PrivacyOptions | None = None) -> None:
    """The method's own checks of its ``options`` against run ``cfg`` (its options' ``check_run``,
    given the sections it reads; ``privacy``: the run's ``dp.*``, read from ``cfg`` when None)."""
    options.check_run(data=cfg.data, federation=cfg.federation, model=cfg.model, evaluation=cfg.evaluation,
                      privacy=privacy_options(cfg) if privacy is None else privacy)


def load_config(config_file: str | None, overrides: list[str], strategy: str | None = None,
                out: str | None = None) -> ExperimentConfig:
    """A run's configuration from defaults, a TOML file, ``--set`` pairs and flags, checked
    (:func:`check_run`) before anything is loaded."""
    cfg = read_config(config_file, overrides, strategy, out)
    check_run(cfg)
    return cfg


def _check_schedule(schedule: TaskSchedule | RandomTaskSchedule, random_tasks: bool, strategy: str,
                    options: MethodOptions) -> TaskSchedule | RandomTaskSchedule:
    """The run's task ``schedule`` (``random_tasks``: Powder's random tasks), if method ``strategy``
    can follow it."""
    supports = options.COMPATIBILITY
    if random_tasks and not {RANDOM_TASKS, ASYNCHRONOUS_TASKS} <= supports:
        raise ConfigError(f"strategy {strategy!r} needs the shared task stream (task-generator = stream): "
                          + options.WHY_NOT.get(RANDOM_TASKS, "its server step assumes tasks of disjoint classes in "
                                                              "stream order"))
    if not schedule.synchronous and ASYNCHRONOUS_TASKS not in supports:
        raise ConfigError(f"strategy {strategy!r} needs synchronous task arrival (switch-fraction = 1 and "
                          f"switch-every = 0): {schedule.describe()}")
    return schedule


def _privacy_refusal(options: MethodOptions) -> str:
    """Why the method cannot bound its upload under ``dp.*`` ("" when it can: its ``COMPATIBILITY``)."""
    return "" if DIFFERENTIAL_PRIVACY in options.COMPATIBILITY else options.WHY_NOT.get(
        DIFFERENTIAL_PRIVACY, "its uploads cannot be bounded")
