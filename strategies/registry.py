"""Methods, found by name from the run configuration (``strategy = "<name>"``): the one
registry.

A method is one module in ``strategies/`` (its server strategy, its options, its prompt
module and the record keys both sides use) plus, when local learning changes, a learner
in ``client/<name>.py``. ``METHODS`` below lists both halves of every method; it lives in
the client layer because it names client classes, and the strategies never do.
Configurations are loaded here too: checking one needs the method's options.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from promptfcl.common.config import ConfigError, ExperimentConfig, read_config
from promptfcl.common.privacy import NAMESPACE as DP_NAMESPACE
from promptfcl.common.privacy import PrivacyOptions



@dataclass(frozen=True)
class Method:
    """Where a method's two halves live, as ``"module:Class"`` (imported on first use, so a
    client process loads only its own method). Its prompt module is the strategy's
    ``prompt_class`` (the server builds the model from it too)."""

    strategy: str  # a strategies.base.PromptStrategy subclass: the server's side
    learner: str  # a client.learner.LocalLearner subclass (or itself): local learning


#: every method, by the name ``strategy = "<name>"`` selects
METHODS: dict[str, Method] = {
    "fedavg": Method("promptfcl.strategies.fedavg.strategy:FedAvgPrompt", "promptfcl.common.learner:LocalLearner"),
    "fppl": Method("promptfcl.strategies.fppl.strategy:FPPLStrategy", "promptfcl.strategies.fppl.learner:FPPLLearner"),
    "hgp": Method("promptfcl.strategies.hgp.strategy:HGPStrategy", "promptfcl.strategies.hgp.learner:HGPLearner"),
    "hepco": Method("promptfcl.strategies.hepco.strategy:HePCoStrategy", "promptfcl.common.learner:LocalLearner"),
    "fedcprompt": Method("promptfcl.strategies.fedcprompt.strategy:FedCPromptStrategy", "promptfcl.strategies.fedcprompt.learner:FedCPromptLearner"),
    "powder": Method("promptfcl.strategies.powder.strategy:PowderStrategy", "promptfcl.strategies.powder.learner:PowderLearner"),
}


def load_by_path(path: str) -> Any:
    """The object a ``"module:attribute"`` string names (imported on first use)."""
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def check_method(name: str) -> None:
    if name not in METHODS:
        raise ConfigError(f"unknown strategy {name!r}; available: {', '.join(sorted(METHODS))}")


def strategy_class(name: str) -> Any:
    check_method(name)
    return load_by_path(METHODS[name].strategy)


def check_namespaces(method_keys: dict[str, Any]) -> None:
    """Every dotted run-config key (``<method>.<option>``) names a method and one of its options.

    Options of methods other than the run's are checked too (a comparison may switch methods,
    and a typo must not pass silently because the method is not the one running). One
    namespace is not a method: ``dp.*``, differential privacy (common/privacy.py).
    """
    namespaces: dict[str, dict[str, Any]] = {}
    for key, value in method_keys.items():
        namespace, _, option = key.partition(".")
        if not option:
            raise ConfigError(f"configuration key {key!r} has an empty option name")
        namespaces.setdefault(namespace, {})[option] = value
    for namespace, options in namespaces.items():
        if namespace == DP_NAMESPACE:
            PrivacyOptions.from_options(options)
            continue
        if namespace not in METHODS:
            example = next(iter(options))
            raise ConfigError(f"unknown configuration namespace {namespace!r} (in {namespace}.{example}); "
                              f"options are namespaced by method ({', '.join(sorted(METHODS))}) or "
                              f"{DP_NAMESPACE!r} (differential privacy)")
        strategy_class(namespace).check_options(options)


def namespaced_defaults() -> dict[str, dict[str, Any]]:
    """Every namespaced run-config key with its default, by namespace: ``dp`` and each method's
    options. pyproject.toml declares them as ``[tool.flwr.app.config.<namespace>]`` tables
    (:func:`app_config_tables`): Flower's run-config check refuses any key it does not declare."""
    out: dict[str, dict[str, Any]] = {DP_NAMESPACE: PrivacyOptions().to_dict()}
    for name in sorted(METHODS):
        options = strategy_class(name).options_class
        if options is not None:
            out[name] = options().to_dict()
    return out


def app_config_tables() -> str:
    """The ``[tool.flwr.app.config.<namespace>]`` tables of pyproject.toml, as TOML text."""
    from promptfcl.common.config import toml_value

    blocks = []
    for namespace, options in namespaced_defaults().items():
        lines = [f"[tool.flwr.app.config.{namespace}]"] + [f"{k} = {toml_value(v)}" for k, v in options.items()]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def load_config(config_file: str | None, overrides: list[str], strategy: str | None = None,
                out: str | None = None) -> ExperimentConfig:
    """A run's configuration from defaults, a TOML file, ``--set`` pairs and flags, checked as far
    as it can be before anything is loaded: every key and value, the method, every method
    option, the task schedule, differential privacy and the dataset's name."""
    from promptfcl.common.data import check_source

    cfg = read_config(config_file, overrides, strategy, out)
    check_method(cfg.strategy)
    check_namespaces(cfg.method)
    strategy_class(cfg.strategy).check_options(cfg.method_options(cfg.strategy))
    strategy_class(cfg.strategy).check_schedule(cfg)
    strategy_class(cfg.strategy).check_privacy(cfg)
    check_source(cfg)
    return cfg


def learner_class(name: str) -> Any:
    """The ``LocalLearner`` subclass that trains method ``name`` on a client."""
    check_method(name)
    return load_by_path(METHODS[name].learner)


def prompt_class(name: str) -> Any:
    """The prompt module a method's clients and server use (its strategy's ``prompt_class``)."""
    return strategy_class(name).prompt_class
