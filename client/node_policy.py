"""What a node accepts from a run: limits it sets itself, and switches only its operator turns on.

Everything in a run config comes from the server, and a node that joins a federation across
organisations must not let the server decide how much of its memory and time a message may
take, or switch on behaviour meant for experiments. Three rules, all read from the node's own
``--node-config`` (never from the run):

* **Limits.** Each run-config size that scales what a message allocates or computes on the
  node has a ceiling (:data:`LIMITS`, node-config ``max-<key>`` to change it), and so do the
  backbone's tokens per image and the message's estimated memory (:data:`FOOTPRINT_LIMITS`:
  ``max-tokens``, ``max-memory-gb``). The estimate (strategies/platform/run_memory.py; the
  server checks its own side of it) counts the backbone, its activations, the trainable state
  with its gradients and Adam's moments, the message's copies and the method's statistics; what
  a GPU or a memory budget's plan cannot take (the trainable state, the copies, the statistics)
  must also fit this machine's memory, unless the operator set ``max-memory-gb``. A message of a
  run beyond a ceiling is refused before anything is built: the ClientApp raises
  :class:`NodeRefusal`, Flower returns an error reply, and the server logs it with the node id.
* **Fault injection** (client/faults.py) runs only on a node started with
  ``fault-injection=true`` (or ``PROMPTFCL_FAULT_INJECTION=1`` in its environment).
* **Data location.** A node reads only the data its node config names; ``data-from-run=true``
  lets a partition node read the run's ``dataset`` / ``data-dir`` instead.
* **Memory and precision.** ``memory-budget-mb`` is how much memory a message's process may
  reach on this node: a round whose gradients, optimiser moments and reply cannot fit beside what
  the process holds is refused at once (:meth:`NodePolicy.check_budget`), the rest planned within
  it (micro-batches, checkpointing; client/memory.py);
  ``backbone-precision`` (``fp32``, ``bf16``, ``int8``) is the frozen backbone's, float32 unless
  the operator chooses otherwise. Neither comes from the run; a node's environment may set them
  (``PROMPTFCL_MEMORY_BUDGET_MB``, ``PROMPTFCL_BACKBONE_PRECISION``: a simulation's nodes).
* **Backbone.** A node takes its backbone only from its own node config (``weights=...``: a
  checkpoint on the node, ``"timm"``, ``"pretrained:<source>"`` or ``"random"``) or its cache:
  a run's ``weights = "pretrained:<source>"`` (the node's cache of that pretraining) and
  ``"random"`` are taken, a run naming a checkpoint path or a hub source (``weights = "timm"``,
  a ``backbone`` with a source prefix such as ``hf-hub:`` or ``local-dir:``) is refused before
  anything is opened (:meth:`NodePolicy.backbone`): otherwise the server could make every node
  open a file of its choosing and learn from the error whether it exists, or fetch from the
  network. ``weights-from-run=true`` lets a node take the run's choice.

Flower's Ray simulation (``promptfcl simulate``, ``flwr run`` with a local federation) runs
every node in a Ray actor for the one operator who started it and chose the run config, so
:func:`simulated_nodes_mod` sets the last two switches on those nodes. A deployed node's
ClientApp runs in a process of its SuperNode, never in a Ray actor.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import Context, Message

from ..common.config.experiment import ConfigError, ExperimentConfig, PlacementSection
from ..common.model.low_precision import PRECISIONS
from ..common.model.weights import BackboneSpec
from ..common.node.footprint import (
    DEFAULT_MAX_MEMORY_GB,
    DEFAULT_MAX_TOKENS,
    footprint,
    footprint_problem,
    memory_problem,
)
from ..common.node.memory_plan import BUDGET_KEY, MARGIN_MB, release_library_pages, resident_mb, round_after_mb
from ..common.privacy import PrivacyOptions, privacy_options
from ..common.text import printable
from ..strategies.platform.run_memory import method_memory, node_memory, run_sizes

log = logging.getLogger("promptfcl")

#: run-config key -> the node's default ceiling (node-config ``max-<key>`` overrides it). Generous
#: for paper-scale runs on a GPU node (ViT-B/16 at 224 px, batch 128, pools of 100 x 20 tokens).
LIMITS: dict[str, int] = {
    "image-size": 1024,  # activations and decoded images grow with its square
    "batch-size": 2048,
    "pool-size": 4096,  # prompt components per layer
    "prompt-length": 1024,
    "num-classes": 100_000,  # head rows, per-class statistics (HGP: a D x D covariance each)
    "num-tasks": 1000,
    "embed-dim": 8192,  # backbone width, built on the node
    "depth": 128,
    "num-heads": 256,
    "local-epochs": 1000,  # time, not memory: a message may not keep the node busy for ever
}
#: ceilings on what the run's sizes add up to (common/node/footprint.py): tokens per image,
#: (image-size / patch-size)^2, and a message's estimated memory in GB (node-config ``max-<key>``;
#: strategies/platform/run_memory.py)
FOOTPRINT_LIMITS: dict[str, int] = {"tokens": DEFAULT_MAX_TOKENS, "memory-gb": DEFAULT_MAX_MEMORY_GB}
FAULT_INJECTION = "fault-injection"
DATA_FROM_RUN = "data-from-run"
WEIGHTS_FROM_RUN = "weights-from-run"
#: node-config key: this node's own backbone weights (what the run's ``weights`` would say)
WEIGHTS = "weights"
#: node-config keys: the memory a message may take on this node, in MB (absent: no budget), and the
#: frozen backbone's precision (absent: fp32)
MEMORY_BUDGET = BUDGET_KEY
BACKBONE_PRECISION = "backbone-precision"
#: node-config keys of this module (client/node_data.py accepts them beside its own)
POLICY_KEYS = (FAULT_INJECTION, DATA_FROM_RUN, WEIGHTS_FROM_RUN, WEIGHTS, MEMORY_BUDGET, BACKBONE_PRECISION,
               *(f"max-{k}" for k in (*LIMITS, *FOOTPRINT_LIMITS)))
#: run ``weights`` a node takes from its cache: nothing the server names is opened or fetched
CACHED_WEIGHTS = re.compile(r"random|pretrained:.+")
#: a timm model name (with an optional pretrained tag): no source prefix, no path
PLAIN_BACKBONE = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)?")
FAULT_INJECTION_ENV = "PROMPTFCL_FAULT_INJECTION"
MEMORY_BUDGET_ENV = "PROMPTFCL_MEMORY_BUDGET_MB"
BACKBONE_PRECISION_ENV = "PROMPTFCL_BACKBONE_PRECISION"


class NodeRefusal(ValueError):
    """A node declines a message of a run outside the limits or rules its operator set."""


@dataclass(frozen=True)
class NodePolicy:
    """The node's own limits and switches, from its node config."""

    limits: Mapping[str, int]
    fault_injection: bool = False
    data_from_run: bool = False
    weights_from_run: bool = False
    weights: str | None = None  # the node's own backbone weights (node-config ``weights``)
    memory_budget_mb: float = 0.0  # node-config ``memory-budget-mb`` (0: none)
    precision: str = "fp32"  # node-config ``backbone-precision``
    # this machine's memory bounds a message too, unless the operator set max-memory-gb (swap, a GPU)
    machine_ceiling: bool = True

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodePolicy:
        limits = {**LIMITS, **FOOTPRINT_LIMITS}
        for key in limits:
            value = node_config.get(f"max-{key}")
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NodeRefusal(f"node-config max-{key} must be a positive integer, got {value!r}")
            limits[key] = value
        weights = node_config.get(WEIGHTS)
        if weights is not None and (not isinstance(weights, str) or not weights):
            raise NodeRefusal(f"node-config {WEIGHTS} must be a checkpoint path, \"timm\", \"pretrained:<source>\" "
                              f"or \"random\", got {printable(repr(weights), 80)}")
        # the node's operator may say both in the node's environment instead (a simulation's nodes,
        # whose node config Flower writes): the node config wins
        budget = node_config.get(MEMORY_BUDGET, _env_number(MEMORY_BUDGET_ENV))
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0 or budget == math.inf:
            raise NodeRefusal(f"node-config {MEMORY_BUDGET} must be a number of MB (0: no budget), got {budget!r}")
        precision = node_config.get(BACKBONE_PRECISION, os.environ.get(BACKBONE_PRECISION_ENV) or "fp32")
        if precision not in PRECISIONS:
            raise NodeRefusal(f"node-config {BACKBONE_PRECISION} must be one of {', '.join(PRECISIONS)}, "
                              f"got {printable(repr(precision), 40)}")
        return cls(limits, flag(node_config, FAULT_INJECTION) or os.environ.get(FAULT_INJECTION_ENV) == "1",
                   flag(node_config, DATA_FROM_RUN), flag(node_config, WEIGHTS_FROM_RUN), weights,
                   float(budget), str(precision), machine_ceiling="max-memory-gb" not in node_config)

    def backbone_weights(self, backbone: str, run_weights: str) -> str:
        """The weights this node uses for the run's ``backbone`` (``run_weights``: the run's
        ``weights``), checked before anything is opened.

        The node's own ``weights`` (node config) wins over the run's; without it, the run's
        ``weights`` must be one the node takes from its cache (:data:`CACHED_WEIGHTS`), unless
        the node trusts the run (``weights-from-run``). The refusal names the key and is logged
        here; it never quotes the value back (the server chose it).

        Raises
        ------
        NodeRefusal
            The run names a checkpoint path or a hub source for the backbone.
        """
        if self.weights_from_run:
            return run_weights
        if not PLAIN_BACKBONE.fullmatch(backbone):
            # timm reads a "hf-hub:" model's config from the network and a "local-dir:" one from disk
            raise self._refusal("backbone", backbone, "is not a plain timm model name (a source prefix such "
                                "as hf-hub: or local-dir:, or a path, would make the node fetch or open what the "
                                "run names)")
        if self.weights is not None:
            if self.weights != run_weights:
                log.info("backbone weights from this node's config (weights = %r), not the run's (%r)",
                         self.weights, run_weights)
            return self.weights
        if CACHED_WEIGHTS.fullmatch(run_weights):
            return run_weights
        what = "a hub source" if run_weights == "timm" else "a checkpoint file"
        raise self._refusal("weights", run_weights, f"names {what}; this node takes its backbone only from its own "
                            "node-config (weights=...) or its cache (weights = \"pretrained:<source>\" or \"random\")")

    @staticmethod
    def _refusal(key: str, value: str, why: str) -> NodeRefusal:
        """The refusal of the run's ``key``, logged here with its value (escaped: the server chose it)."""
        log.warning("node refuses the run: %s = %r %s", key, value, why)
        return NodeRefusal(f"node refuses the run: its {key} {why}")

    def check_run(self, cfg: ExperimentConfig, sent_num_classes: Any = None, options: Any = None,
                  privacy: PrivacyOptions | None = None) -> None:
        """Refuse (:class:`NodeRefusal`) a run whose sizes exceed this node's limits, each alone
        (:data:`LIMITS`) or together (tokens per image and estimated memory, :data:`FOOTPRINT_LIMITS`);
        ``sent_num_classes`` is the head size a message names (checked the same way); ``options``,
        ``privacy``: the method's and the ``dp.*`` options, already parsed (None: parsed here)."""
        run = cfg.to_dict()
        sizes = {key: run[key] for key in LIMITS}
        if sent_num_classes is not None:
            if isinstance(sent_num_classes, bool) or not isinstance(sent_num_classes, int):
                raise NodeRefusal(f"the message's num-classes {sent_num_classes!r} is not an integer")
            sizes["num-classes"] = max(int(sizes["num-classes"]), sent_num_classes)
        for key, value in sizes.items():
            if int(value) > self.limits[key]:
                raise NodeRefusal(f"node refuses the run: {key} = {value} exceeds this node's limit "
                                  f"max-{key} = {self.limits[key]} (its operator's node-config)")
        # each size may pass alone and their product still not fit (a million tokens per image), and a
        # message takes the trainable state four times over, its copies and the method's statistics
        try:
            backbone = BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching)
            size = footprint(backbone, cfg.training.batch_size, cfg.model.prompt_length)
            problem = footprint_problem(size, cfg.model.image_size, self.limits["tokens"], math.inf,
                                        "this node's limit")
            if problem is None:
                estimate = node_memory(cfg, sent_num_classes, options)
                # the backbone and its activations are a GPU's, or a memory budget's to plan (client/memory.py)
                planned = self.memory_budget_mb > 0 or trains_on_accelerator(cfg.placement)
                problem = memory_problem(estimate, self.limits["memory-gb"], "this node's limit",
                                         "its operator's node-config", on_accelerator=planned,
                                         machine_gb=None if self.machine_ceiling else 0.0)
        except ConfigError as exc:  # a size left to the model that its name does not say
            raise NodeRefusal(f"node refuses the run: {exc}") from None
        if problem is not None:
            raise NodeRefusal(f"node refuses the run: {problem}")
        if self.memory_budget_mb:
            self.check_budget(cfg, sent_num_classes, options, privacy)

    def check_budget(self, cfg: ExperimentConfig, sent_num_classes: Any = None, options: Any = None,
                     privacy: PrivacyOptions | None = None) -> None:
        """Refuse (:class:`NodeRefusal`) a run whose round cannot fit ``memory-budget-mb`` whatever the
        plan: what this process holds now (the message received) and what the round adds besides its
        activations (the trainable state's gradients and Adam's moments, the reply, the statistics;
        common/node/memory_plan.py), before the runtime is built. The plan (client/memory.py) checks the
        rest once the backbone, the data and the model are there."""
        sizes = run_sizes(cfg, sent_num_classes)
        statistics, _ = method_memory(cfg, sizes, options)
        release_library_pages()  # what a CPU never runs again is not held (as the plan measures it)
        dp = privacy if privacy is not None else privacy_options(cfg)
        held, after = resident_mb(), round_after_mb(sizes.trainable, sizes.trainable, statistics, dp.enabled)
        if held + after + MARGIN_MB > self.memory_budget_mb:
            raise NodeRefusal(
                f"node refuses the run: node-config {MEMORY_BUDGET} = {self.memory_budget_mb:g} is too small for its "
                f"round: this process holds {held:.0f} MB with the message, the round adds at least {after:.0f} MB "
                f"(the gradients and Adam's moments of a {sizes.trainable / 1e6:.0f} MB trainable state, the reply, "
                f"the statistics) and the plan keeps {MARGIN_MB:.0f} MB free; raise {MEMORY_BUDGET} or run smaller "
                "prompts (pool-size, prompt-length)")


def trains_on_accelerator(placement: PlacementSection) -> bool:
    """Whether this node trains on a GPU with ``placement`` (its backbone and activations then live there)."""
    if placement.device == "cpu":
        return False
    import torch  # the ClientApp has it loaded; the check itself needs none of it

    return placement.device != "auto" or torch.cuda.is_available()


def _env_number(name: str) -> Any:
    """A number from the node's environment (0: unset; the text itself when it is not a number)."""
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else 0
    except ValueError:
        return raw


def flag(node_config: Mapping[str, Any], key: str) -> bool:
    """A boolean node-config switch (absent: off); anything but a boolean is an error."""
    value = node_config.get(key, False)
    if not isinstance(value, bool):
        raise NodeRefusal(f"node-config {key} must be true or false, got {value!r}")
    return value


def simulated_nodes_mod(msg: Message, context: Context,
                        call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower mod: a node simulated in a Ray actor belongs to the operator who chose the run config,
    so it takes its data location from the run and obeys the run's fault switch."""
    if in_ray_actor():
        trust_run(context)
    return call_next(msg, context)


def trust_run(context: Context) -> None:
    """Switch on what an operator who chose the run config may (simulated or test nodes)."""
    context.node_config.setdefault(FAULT_INJECTION, True)
    context.node_config.setdefault(DATA_FROM_RUN, True)
    context.node_config.setdefault(WEIGHTS_FROM_RUN, True)


def in_ray_actor() -> bool:
    """Whether this process is a Ray worker (a simulated client); Ray is never imported for this."""

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
