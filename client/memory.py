"""A node's memory budget applied to a message: the plan, set on the model, passed to the learner's fit, and reported.

The node's operator sets ``memory-budget-mb`` (and ``backbone-precision``) in its node config
(client/node_policy.py); before a message trains or evaluates, the node measures what its process
holds and plans the rest (common/node/memory_plan.py), the round's gradients, optimiser moments, reply
and statistics counted from the model's own sizes. The reply's metrics say what it chose and what
it used: the budget, the micro-batch, checkpointing, the backbone's bits, the process's peak
resident memory, by how much that peak passed the budget (``over-budget-mb``, also a warning in the
node's log) and how much of the frozen backbone it reads from the shared mapping of the node's cache.
"""

from __future__ import annotations

import logging

from ..common.model.backbone import backbone_cache_path
from ..common.model.prompted import PromptedViT
from ..common.model.runtime import Runtime
from ..common.node.memory_plan import (
    MIN_MICRO_BATCH,
    BudgetError,
    StepSizes,
    TrainingPlan,
    mapped_mb,
    mapped_tensor_mb,
    peak_resident_mb,
    plan_training,
    release_library_pages,
    resident_mb,
    return_freed_memory,
    round_after_mb,
)
from ..strategies.platform.run_memory import method_memory, run_sizes
from .message_context import MessageContext
from .node_policy import NodeRefusal

log = logging.getLogger("promptfcl")


def step_sizes(model: PromptedViT, batch_size: int) -> StepSizes:
    """What a training step of ``batch_size`` images costs grows with, read from the built model."""
    backbone = model.backbone
    layers = model.prompt.layers
    carried = 0
    if model.mode == "prompt":  # prompt tokens in the sequence: one prompt's, or every prompted block's
        carried = model.prompt.tokens_per_block * (len(layers) if model.tokens == "accumulate" else 1)
    size = backbone.patch_embed.img_size
    return StepSizes(batch=batch_size, tokens=int(backbone.patch_embed.num_patches) + 1 + carried,
                     width=model.embed_dim, graded_blocks=len(backbone.blocks) - min(layers, default=0),
                     blocks=len(backbone.blocks),
                     input_floats=int(backbone.patch_embed.proj.in_channels) * int(size[0]) * int(size[1]))


def apply_plan(node: MessageContext, runtime: Runtime) -> TrainingPlan:
    """Plan a message of context ``node`` (its run, its node's policy) within the node's budget and set
    the plan's chunks on the model; the plan, which a fit takes (``FitConditions``).

    What the process holds is measured now, with the frozen weights still to be read from the
    node's mapped cache counted as if read. Without a budget the plan is the default (whole
    batches, nothing recomputed), set all the same: a process that serves several nodes (a
    simulation's actor) must not keep another node's plan.

    Raises
    ------
    NodeRefusal
        The budget is too small for one image at a time (the text names ``memory-budget-mb``).
    """
    model, cfg, policy = runtime.model, node.cfg, node.policy
    if policy.memory_budget_mb:
        return_freed_memory()  # before anything large is allocated: freed activations leave the process
        release_library_pages()  # library pages a CPU never runs again (torch's CUDA libraries) leave it too
    held = resident_mb()
    cached = backbone_cache_path(runtime.backbone)
    if policy.memory_budget_mb and cached is not None:
        weights = [*model.backbone.parameters(), *model.backbone.buffers()]
        held += mapped_tensor_mb(weights, cached) - mapped_mb(cached)
    device = "cpu" if runtime.device.type == "cpu" else "other"
    try:
        plan = plan_training(policy.memory_budget_mb, step_sizes(model, cfg.training.batch_size), held,
                             runtime.precision, MIN_MICRO_BATCH[device],
                             after_mb=after_plan_mb(node, runtime) if policy.memory_budget_mb else 0.0)
    except BudgetError as exc:
        raise NodeRefusal(str(exc)) from None
    first = min(model.prompt.layers, default=0)
    model.checkpointed = frozenset(range(first, first + plan.checkpointed))
    model.max_batch = plan.no_grad_batch
    return plan


def after_plan_mb(node: MessageContext, runtime: Runtime) -> float:
    """MB the round adds after the plan besides its activations (common/node/memory_plan.py's
    ``round_after_mb``), from the built model: its trainable parameters' gradients and Adam's
    moments, the reply's arrays, the method's statistics (strategies/platform/run_memory.py)."""
    model = runtime.model
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    sent = sum(t.numel() * t.element_size() for t in model.trainable_state().values())
    statistics, _ = method_memory(node.cfg, run_sizes(node.cfg, runtime.data.num_classes), node.options)
    return round_after_mb(trained, sent, statistics, node.privacy.enabled)


def plan_metrics(plan: TrainingPlan, runtime: Runtime) -> dict[str, int | float]:
    """The reply's account of the plan: what the node chose, its peak memory (the process's
    high-water mark, read at the round's end), by how much that passed the budget (said in the
    node's log too), the shared backbone."""
    metrics = plan.metrics()
    metrics["peak-rss-mb"] = peak = peak_resident_mb()
    if plan.budget_mb and peak > plan.budget_mb:
        metrics["over-budget-mb"] = peak - plan.budget_mb
        log.warning("this round's process peaked at %.0f MB, above memory-budget-mb = %g by %.0f MB (micro-batch %d, "
                    "%d blocks recomputed): the plan's margin did not cover it", peak, plan.budget_mb,
                    peak - plan.budget_mb, plan.micro_batch, plan.checkpointed)
    cached = backbone_cache_path(runtime.backbone)
    metrics["backbone-mapped-mb"] = mapped_mb(cached) if cached is not None else 0.0
    return metrics


__all__ = ["after_plan_mb", "apply_plan", "plan_metrics", "step_sizes"]
