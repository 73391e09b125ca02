"""Methods, found by name from the run configuration (``strategy = "<name>"``).

Each method is one module here (its server strategy) plus, when local learning
changes, a learner class on the client side. The registry maps a name to both.
"""

from __future__ import annotations

import importlib
from typing import Any

from common.config import ConfigError

# name -> (strategy "module:Class", client learner "module:Class")
METHODS: dict[str, tuple[str, str]] = {
    "fedavg": ("strategies.fedavg:FedAvgPrompt", "client.learner:LocalLearner"),
    "fppl": ("strategies.fppl:FPPLStrategy", "client.fppl:FPPLLearner"),
    "hgp": ("strategies.hgp:HGPStrategy", "client.hgp:HGPLearner"),
    "hepco": ("strategies.hepco:HePCoStrategy", "client.learner:LocalLearner"),
    "fedcprompt": ("strategies.fedcprompt:FedCPromptStrategy", "client.fedcprompt:FedCPromptLearner"),
    "powder": ("strategies.powder:PowderStrategy", "client.powder:PowderLearner"),
}


def _load(path: str) -> Any:
    module, attr = path.split(":")
    return getattr(importlib.import_module(module), attr)


def check_method(name: str) -> None:
    if name not in METHODS:
        raise ConfigError(f"unknown strategy {name!r}; available: {', '.join(sorted(METHODS))}")


def strategy_class(name: str) -> Any:
    check_method(name)
    return _load(METHODS[name][0])


def learner_class(name: str) -> Any:
    check_method(name)
    return _load(METHODS[name][1])


def prompt_class(name: str) -> Any:
    """The prompt module a method's clients and server use (its strategy's ``prompt_class``)."""
    return strategy_class(name).prompt_class
