"""A run's whole memory, estimated before anything is built: one estimate per side.

common/node/footprint.py estimates the backbone (its parameters and a training step's activations);
this module adds what the method and the federation decide, so a run is refused up front with
its figure and the limit instead of failing at its first allocation (a CODA-P pool of 4095
components of 1024 tokens is 1.6 GB per prompted block at width 96, which a backbone-only
estimate never saw):

* **a node's message process** (:func:`node_memory`): the backbone and its activations, the
  trainable state (prompt pool or adapters, per prompted block, and the head) four times over
  (parameters, gradients, Adam's two moments), the message it received and the reply it sends,
  and the statistics the method uploads;
* **the ServerApp** (:func:`server_memory`): each round's replies (``clients-per-round``, with
  their statistics), the global arrays of this round and the last, the aggregate and its
  temporaries (one decoded copy: evaluation, a task's new slice), and what the method keeps
  between rounds (HGP's per-class covariances by ``hgp.cov-type``, HePCo's previous model,
  teachers and generators, prototype pools); with central evaluation also the backbone, an
  evaluation pass and the evaluated model. strategies/platform and server/run.py keep the
  ServerApp's own peak for a round within (clients per round + 4) x the trainable state above
  its idle memory (tests/test_server_memory.py measures it).

The trainable state is counted from the method's own prompt module built on torch's meta device
(shapes, no memory), so a method's pool is counted as it is built. What each method uploads and
keeps is :data:`METHOD_MEMORY` (a method outside it is counted from its declared ``statistics``,
generously). Upper estimates: label skew, a smaller backbone precision or a memory budget's
micro-batches only lower the real figure.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...common.config.experiment import ConfigError, ExperimentConfig
from ...common.data.tasks import TaskLayout
from ...common.model.weights import BackboneSpec
from ...common.node.footprint import (
    MAX_MEMORY_ENV,
    Footprint,
    MemoryEstimate,
    check_server_footprint,
    footprint,
    memory_problem,
    server_ceilings,
)
from ..registry import method_options, prompt_class, statistics_of
from .statistics import DIAGONAL, FACTOR, PACKED_TRIU

F32, F64 = 4, 8
#: class counts of the built-in datasets, for a run that leaves ``num-classes`` to its data
KNOWN_CLASSES = {"digits": 10, "fashion-mnist": 10}
#: floats per token of one block a no-grad pass holds at a time (common/node/memory_plan.py's NO_GRAD_FLOATS)
NO_GRAD_FLOATS = 12
#: the parts that live on an accelerator where the side trains or evaluates on one (and that a
#: node's memory budget plans: micro-batches, checkpointing); the others are always host memory
BACKBONE, ACTIVATIONS = "backbone", "activations"


@dataclass(frozen=True)
class RunSizes:
    """What a run's copies grow with.

    ``dim``: the token width D; ``classes``: the head's classes N; ``per_task``: classes of one task
    K (what one reply's statistics cover); ``clients``: the clients that may report to the server;
    ``per_round``: clients per round C; ``trainable``: bytes of the trainable state (prompt pool or
    adapters and the head); ``layers``: prompted (adapted) blocks; ``components``: a task's components
    per block.
    """

    dim: int
    classes: int
    per_task: int
    clients: int
    per_round: int
    trainable: int
    layers: int
    components: int


def run_classes(cfg: ExperimentConfig, sent: int | None = None) -> int:
    """The head's classes: the run's ``num-classes``, the server's message's (``sent``), or the
    built-in dataset's; else one per task (a dataset read later may have more)."""
    return max(cfg.data.num_classes, sent or 0) or KNOWN_CLASSES.get(cfg.data.dataset, cfg.data.num_tasks)


def trainable_bytes(cfg: ExperimentConfig, dim: int, num_classes: int) -> int:
    """Bytes of the trainable state a message carries: the method's prompt module (built on the
    meta device: shapes without memory) and the linear head."""
    import torch  # the method's module needs it; the checks that import this module need no more

    from ...common.model.trainable import ModuleShape

    with torch.device("meta"):
        prompt = prompt_class(cfg.run.strategy).of(ModuleShape(dim, tuple(cfg.model.layers), cfg.data.num_tasks,
                                                               cfg.model.pool_size, cfg.model.prompt_length))
        prompt.configure(cfg.method)
    state = prompt.state_dict()
    head = TaskLayout.of(cfg.run, cfg.data, cfg.federation, cfg.model, num_classes).head_size * (dim + 1)
    return sum(t.numel() * t.element_size() for t in state.values()) + head * F32


def _backbone_footprint(cfg: ExperimentConfig) -> Footprint:
    """The footprint of ``cfg``'s backbone at its batch size and prompt length."""
    backbone = BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching)
    return footprint(backbone, cfg.training.batch_size, cfg.model.prompt_length)


def run_sizes(cfg: ExperimentConfig, sent_classes: int | None = None) -> RunSizes:
    """The sizes of ``cfg`` (``sent_classes``: the head size a message names)."""
    classes = run_classes(cfg, sent_classes)
    dim = _backbone_footprint(cfg).width
    layout = TaskLayout.of(cfg.run, cfg.data, cfg.federation, cfg.model, classes)
    per_task = max(1, layout.classes_per_task if layout.random else -(-classes // cfg.data.num_tasks))
    fed = cfg.federation
    return RunSizes(dim=dim, classes=classes, per_task=per_task, clients=max(fed.num_clients, fed.clients_per_round),
                    per_round=fed.clients_per_round or max(1, round(fed.client_fraction * fed.num_clients)),
                    trainable=trainable_bytes(cfg, dim, classes), layers=len(cfg.model.layers),
                    components=max(1, cfg.model.pool_size // cfg.data.num_tasks))


# ------------------------------------------------------------------ what each method adds
#: (bytes of one reply's statistics, bytes the server keeps of the method's state), from the run's
#: sizes and the method's options
MethodMemory = Callable[[RunSizes, Any], tuple[float, float]]


def _hgp(s: RunSizes, opts: Any) -> tuple[float, float]:
    """Per class of the task: a mean and a covariance (full: its packed upper triangle on the wire,
    D x D float64 once the server unpacks it into a mixture; diag: D; lowrank: D x (rank + 1)); the
    server keeps every class's statistics from every client, and each class's mixture."""
    d, wire = s.dim, 2 if getattr(opts, "cov_dtype", "float32") == "float16" else F32
    cov_wire, cov_server = {"full": (d * (d + 1) // 2, d * d), "diag": (d, d),
                            "lowrank": (d * (opts.cov_rank + 1), d * (opts.cov_rank + 1))}[opts.cov_type]
    per_class = d * F32 + 2 * F64 + cov_wire * wire  # mean, class and count (int64), covariance
    return s.per_task * per_class, s.classes * s.clients * (per_class + (d + cov_server) * F64)


def _prototypes(s: RunSizes, opts: Any) -> tuple[float, float]:
    """FPPL's prototypes, PILoRA's class means: a mean per class of the task; the server's pool of
    every class's from every client."""
    per_class = s.dim * F32 + 3 * F64  # the mean; class, count and client (int64)
    return s.per_task * per_class, s.classes * s.clients * per_class


def _c2prompt(s: RunSizes, opts: Any) -> tuple[float, float]:
    """q(x) means and variances per class of the task, and the prompt-selection histogram (block x
    component x class); the server keeps every (class, client, task) report in float64."""
    per_class = 2 * s.dim * F32 + 2 * F64  # mean and variance; class and count (int64)
    histogram = s.layers * s.components * s.per_task * F32
    return s.per_task * per_class + histogram, s.classes * s.clients * (2 * s.dim + 4) * F64


def _lorm(s: RunSizes, opts: Any) -> tuple[float, float]:
    """Per adapted block the Gram diagonals of qkv, proj, fc1 (D each) and fc2 (4D), and the head's
    packed Gram; the server keeps the round's and the tasks' Grams (float64) and a merge's deltas."""
    grams = (s.layers * 7 * s.dim + s.dim * (s.dim + 1) // 2 + 3) * F32
    return grams, 2 * 2 * grams + 2 * s.trainable


def _hepco(s: RunSizes, opts: Any) -> tuple[float, float]:
    """HePCo's server distils: a teacher per reply and the student, the previous task's model, and two
    latent generators (noise and label embedding, the hidden layers, D outputs) with Adam's moments."""
    widths = [opts.noise_dim + opts.label_embed_dim, *opts.hidden, s.dim]
    generator = sum(a * b + b for a, b in zip(widths, widths[1:])) + s.classes * opts.label_embed_dim
    return 0.0, (s.per_round + 2) * s.trainable + 2 * 3 * generator * F32


def _previous_slices(s: RunSizes, opts: Any) -> tuple[float, float]:
    """Fed-CPrompt keeps each task's best slices (at most the whole pool and head)."""
    return 0.0, float(s.trainable)


def _powder(s: RunSizes, opts: Any) -> tuple[float, float]:
    """Powder's alphas: a task and a class correlation vector per reply; the server's matrices."""
    vectors = (s.classes + s.per_task) * F64
    return vectors, 4 * s.classes * s.classes * F64


METHOD_MEMORY: dict[str, MethodMemory] = {
    "fedavg": lambda s, o: (0.0, 0.0), "hgp": _hgp, "fppl": _prototypes, "pilora": _prototypes,
    "c2prompt": _c2prompt, "lorm": _lorm, "hepco": _hepco, "fedcprompt": _previous_slices, "powder": _powder,
}


def _declared(s: RunSizes, strategy: str) -> tuple[float, float]:
    """A method outside :data:`METHOD_MEMORY`, from its declared statistics (strategies/platform/statistics.py):
    per class of the task a row of each vector (D), second moment (packed: D (D + 1) / 2, diagonal: D,
    factor: D x 16) and count; the server keeps every class's from every client."""
    per_class = 0
    for spec in statistics_of(strategy).values():
        per_class += len(spec.vectors) * s.dim + len(spec.counts) + 1
        for kind in spec.second_moments.values():
            per_class += {PACKED_TRIU: s.dim * (s.dim + 1) // 2, DIAGONAL: s.dim, FACTOR: 16 * s.dim}.get(kind, s.dim)
    return s.per_task * per_class * F32, s.classes * s.clients * per_class * F32


def method_memory(cfg: ExperimentConfig, sizes: RunSizes, options: Any = None) -> tuple[float, float]:
    """(bytes of one reply's statistics, bytes of the server's method state) of ``cfg``'s method
    (``options``: its options, already parsed; None: parsed here)."""
    estimate = METHOD_MEMORY.get(cfg.run.strategy)
    if estimate is None:
        return _declared(sizes, cfg.run.strategy)
    if options is None:
        options = method_options(cfg.run.strategy, cfg.method_options(cfg.run.strategy))
    return estimate(sizes, options)


# ------------------------------------------------------------------ the two sides
def node_memory(cfg: ExperimentConfig, sent_classes: int | None = None, options: Any = None) -> MemoryEstimate:
    """What a node's message process needs for one training message of ``cfg`` (``options``: the
    method's, already parsed; None: parsed here)."""
    sizes = run_sizes(cfg, sent_classes)
    backbone = _backbone_footprint(cfg)
    upload, _ = method_memory(cfg, sizes, options)
    t = sizes.trainable
    return MemoryEstimate((
        (BACKBONE, backbone.parameters * F32),
        (ACTIVATIONS, backbone.activations * F32),
        ("trainable state x4 (parameters, gradients, Adam's moments)", 4 * t),
        ("messages x2 (received, reply)", 2 * t),
        ("uploaded statistics x2", 2 * upload),
    ), accelerated=frozenset({BACKBONE, ACTIVATIONS}))


def server_memory(cfg: ExperimentConfig) -> MemoryEstimate:
    """What the ServerApp needs for a round of ``cfg`` (its backbone's activations aside: the
    backbone ceiling is :func:`~promptfcl.common.node.footprint.check_server_footprint`'s)."""
    sizes = run_sizes(cfg)
    upload, state = method_memory(cfg, sizes)
    t = sizes.trainable
    parts: list[tuple[str, float]] = [
        (f"replies ({sizes.per_round} per round, with their statistics)", sizes.per_round * (t + upload)),
        ("global arrays x2 (this round's, the last)", 2 * t),
        ("aggregate and its temporaries x2", 2 * t),
        ("method state", state),
    ]
    if cfg.evaluation.evaluation != "federated":  # the server evaluates: the backbone, a pass, the evaluated model
        backbone = _backbone_footprint(cfg)
        sequence = backbone.tokens + 1 + cfg.model.prompt_length
        parts += [(BACKBONE, backbone.parameters * F32),
                  (ACTIVATIONS, cfg.training.batch_size * sequence * NO_GRAD_FLOATS * backbone.width * F32),
                  ("evaluated model's trainable state", t)]
    return MemoryEstimate(tuple(parts), accelerated=frozenset({BACKBONE, ACTIVATIONS}))


def check_server_memory(cfg: ExperimentConfig) -> None:
    """Refuse, before the server builds anything, a run beyond the server's ceilings: the backbone's
    (:func:`~promptfcl.common.node.footprint.check_server_footprint`), then the round's whole estimate
    (:func:`server_memory`) against ``PROMPTFCL_MAX_MEMORY_GB`` and this machine's memory.

    Raises
    ------
    ConfigError
        Naming the estimate, its largest parts and the limit it exceeds.
    """
    backbone = BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching)
    check_server_footprint(backbone, cfg.training.batch_size, cfg.model.prompt_length, cfg.model.image_size)
    _, max_memory_gb = server_ceilings()
    # the backbone and its activations (central evaluation) are the backbone ceiling's: this machine's
    # memory bounds the server's own copies
    problem = memory_problem(server_memory(cfg), max_memory_gb, "the server's limit",
                             f"{MAX_MEMORY_ENV} in the server's environment raises it", on_accelerator=True,
                             machine_gb=0.0 if os.environ.get(MAX_MEMORY_ENV) else None)
    if problem is not None:
        raise ConfigError(f"the ServerApp would not fit: {problem}")


__all__ = ["METHOD_MEMORY", "RunSizes", "check_server_memory", "method_memory", "node_memory", "run_sizes",
           "server_memory", "trainable_bytes"]
