"""One message's context on a node: the run config, the method's options and the node's policy, parsed once.

A train, query or evaluate message reads the run config (``ExperimentConfig``), the method's
``<method>.*`` options and the ``dp.*`` options, and the node's own policy (client/node_policy.py).
Each is parsed here, once per message, into a frozen :class:`MessageContext` that the ClientApp's
functions pass down to what needs them (the runtime, the memory plan, the fault decisions).

The mods sit between Flower and those functions and receive only Flower's ``Context``:
:func:`message_context_mod` builds the message's context before them (after the mod that
may switch on a simulated node's options, which it must see), and the mods and the function
take that one (:func:`message_context`) instead of parsing again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from flwr.app import Context, Message

from ..common.config.experiment import ExperimentConfig
from ..common.config.options import MethodOptions
from ..common.node import startup
from ..common.privacy import PrivacyOptions, privacy_options
from ..strategies.registry import method_options
from .node_policy import NodePolicy


@dataclass(frozen=True)
class MessageContext:
    """What one message runs under on this node, each part parsed once.

    ``cfg``: the run config (the server's); ``digest``: its digest (every message names the one it
    was sent under); ``options``: the method's ``<strategy>.*`` options; ``privacy``: the run's
    ``dp.*`` options; ``policy``: the node's own limits and switches; ``node_config``: the node
    config they were parsed from (read-only)."""

    cfg: ExperimentConfig
    digest: str
    options: MethodOptions
    privacy: PrivacyOptions
    policy: NodePolicy
    node_config: Mapping[str, Any]

    @classmethod
    def of(cls, cfg: ExperimentConfig, node_config: Mapping[str, Any]) -> MessageContext:
        """The context of run ``cfg`` on a node of ``node_config`` (ConfigError, NodeRefusal on bad values)."""
        return cls(cfg, cfg.digest(), method_options(cfg.run.strategy, cfg.method_options(cfg.run.strategy)),
                   privacy_options(cfg), NodePolicy.from_node_config(node_config),
                   MappingProxyType(dict(node_config)))

    @classmethod
    def from_flower(cls, context: Context) -> MessageContext:
        """The context of Flower's ``context`` (its run config and node config)."""
        return cls.of(ExperimentConfig.from_run_config(context.run_config), context.node_config)


# the context of the message being handled in this thread (set by the mod, for the mods and the function)
_current: ContextVar[tuple[Context, MessageContext] | None] = ContextVar("promptfcl_message_context", default=None)


@contextmanager
def handling(context: Context, built: MessageContext) -> Iterator[MessageContext]:
    """``built`` is the context of the message handled within (for :func:`message_context`)."""
    token = _current.set((context, built))
    try:
        yield built
    finally:
        _current.reset(token)


def message_context_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower mod: parse the message's context once, for the mods after it and the ClientApp's function."""
    startup.since_imports()  # a fresh process: how long Flower took to hand it the message
    with startup.phase("context"):
        built = MessageContext.from_flower(context)
    with handling(context, built):
        return call_next(msg, context)


def message_context(context: Context) -> MessageContext:
    """The context of the message handled now with Flower's ``context``: the mod's, or (a function
    called without the mod) parsed here."""
    current = _current.get()
    if current is not None and current[0] is context:
        return current[1]
    return MessageContext.from_flower(context)


__all__ = ["MessageContext", "handling", "message_context", "message_context_mod"]
