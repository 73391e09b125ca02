"""A node's memory budget: how a training round fits in it, planned before the first step.

A node may say how much memory a message may take (node-config ``memory-budget-mb``,
client/node_policy.py). The plan keeps the run's updates: the optimiser still steps once per
``batch-size`` images, each step's gradient accumulated over micro-batches whose losses are
weighted by their share of the batch (strategies/platform/learner.py), and where even a micro-batch of a few
images does not fit, the frozen blocks that prompts back-propagate through are recomputed in the
backward pass instead of kept (activation checkpointing, common/model/prompted.py). No-grad passes (the
query, evaluation, statistics) run in chunks that fit as well. What stays: the process as it
stands when the plan is made (interpreter, torch, the backbone, the node's data, the message),
measured, not estimated; what the round adds besides its activations (the gradients and Adam's
moments of the trainable parameters, the reply, the statistics: :func:`round_after_mb`) is
counted from the model's own sizes. The budget bounds the whole process: a round whose peak
(VmHWM) still passes it is reported (client/memory.py).

Where the memory of a step goes (D the width, S tokens per image, N blocks a gradient passes
through; measured at ViT-B/16, 224 px, on this project's CPU machine):

* kept for the backward pass: about 15 floats per token and block (LayerNorm inputs, q, k, v,
  the attention output, the 4D-wide MLP's input and hidden activations): 107 MB per image at
  ViT-B/16 (:data:`KEPT_FLOATS`, rounded up);
* with checkpointing: each block's input (one float per token and block) plus one block's
  activations and their gradients while it runs again (:data:`RECOMPUTE_FLOATS`);
* a no-grad pass: one block's activations at a time (:data:`NO_GRAD_FLOATS`);
* the batch's preprocessed inputs, kept for the whole step (3 H W floats per image).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the plan and the measures need no torch: the executor process reads them too
    import torch

#: floats per token and block a step keeps for the backward pass without checkpointing
KEPT_FLOATS = 20
#: floats per token the backward pass of a block holds at once (its activations, run again where
#: it is checkpointed, and their gradients)
RECOMPUTE_FLOATS = 48
#: floats per token a no-grad forward holds at a time (one block's activations)
NO_GRAD_FLOATS = 12
#: the plan leaves this much of the budget free: allocator slack, and the library pages a step brings
#: back after release_library_pages (about 100 MB at ViT-B/16). Measured at ViT-B/16 (bench edge) a
#: round's peak passed its plan by 124-377 MB; the optimiser's moments, the gradients and the reply
#: are counted apart (round_after_mb)
MARGIN_MB = 384.0
#: the smallest micro-batch worth keeping activations for rather than recomputing them: on a CPU
#: one image at a time costs about what a whole batch does per image, on a GPU small batches idle it
MIN_MICRO_BATCH = {"cpu": 1, "other": 8}
#: the largest chunk of a no-grad pass (what evaluation and the query cache used before a plan)
MAX_NO_GRAD_BATCH = 256
#: the node-config key this module plans for
BUDGET_KEY = "memory-budget-mb"
MB = 1e6


class BudgetError(ValueError):
    """A memory budget too small for even one image at a time; the text names the setting."""


@dataclass(frozen=True)
class StepSizes:
    """The sizes a training step's memory grows with.

    Parameters
    ----------
    batch : int
        Images per optimiser step (the run's ``batch-size``).
    tokens : int
        Tokens per image in the blocks (patches, CLS and any prompt tokens carried).
    width : int
        Token width D.
    graded_blocks : int
        Blocks a gradient passes through (from the first prompted block to the last block).
    blocks : int
        All blocks (a no-grad pass runs them all).
    input_floats : int
        Floats of one preprocessed input image (C x H x W).
    """

    batch: int
    tokens: int
    width: int
    graded_blocks: int
    blocks: int
    input_floats: int

    def per_image_mb(self, checkpointed: int = 0) -> float:
        """MB one image of a micro-batch adds to the step's peak with ``checkpointed`` of the graded
        blocks recomputed (each keeps only its input) and the others' activations kept."""
        kept = (self.graded_blocks - checkpointed) * KEPT_FLOATS + checkpointed
        return 4 * (kept + (RECOMPUTE_FLOATS if checkpointed else 0)) * self.tokens * self.width / MB

    def no_grad_per_image_mb(self) -> float:
        return 4 * NO_GRAD_FLOATS * self.tokens * self.width / MB

    def inputs_mb(self) -> float:
        """The whole batch's preprocessed inputs (kept through the step)."""
        return 4 * self.batch * self.input_floats / MB


@dataclass(frozen=True)
class TrainingPlan:
    """How this node trains a round: micro-batches, checkpointing, the frozen backbone's precision.

    The default (no budget) is the run's batch in one piece, nothing recomputed, float32.
    """

    budget_mb: float = 0.0  # 0: no budget
    micro_batch: int = 0  # 0: the whole batch at once
    checkpointed: int = 0  # graded blocks recomputed in the backward pass (from the first graded one)
    no_grad_batch: int = 0  # chunk of a no-grad pass (0: whole batches)
    precision: str = "fp32"  # the frozen backbone's: "fp32", "bf16" or "int8"
    held_mb: float = 0.0  # what the process held when the plan was made (its unread mapped weights counted)

    @property
    def backbone_bits(self) -> int:
        return {"fp32": 32, "bf16": 16, "int8": 8}[self.precision]

    def metrics(self) -> dict[str, int | float]:
        """What the node chose, for its reply's metrics (every field a number)."""
        return {"memory-budget-mb": float(self.budget_mb), "held-mb": float(self.held_mb),
                "micro-batch": int(self.micro_batch), "checkpointed-blocks": int(self.checkpointed),
                "backbone-bits": self.backbone_bits}


def plan_training(budget_mb: float, sizes: StepSizes, held_mb: float, precision: str = "fp32",
                  min_micro: int = 1, after_mb: float = 0.0) -> TrainingPlan:
    """The plan that trains a step of ``sizes`` within ``budget_mb``, the process holding ``held_mb``
    and the round adding ``after_mb`` besides the activations (the gradients and optimiser moments
    of the trainable parameters, the reply's copies, the uploaded statistics: :func:`round_after_mb`).

    The fewest checkpointed blocks (recomputing a block costs about one more forward pass of it)
    with which a micro-batch of ``min_micro`` images fits (:data:`MIN_MICRO_BATCH`), then the
    largest micro-batch that fits with them: the whole batch, nothing recomputed, where it fits.

    Raises
    ------
    BudgetError
        Not even one image at a time fits; the message names ``memory-budget-mb`` and what is needed.
    """
    if budget_mb <= 0:
        return TrainingPlan(precision=precision, held_mb=held_mb)
    free = budget_mb - held_mb - after_mb - MARGIN_MB - sizes.inputs_mb()
    no_grad = max(1, min(MAX_NO_GRAD_BATCH, int(free // sizes.no_grad_per_image_mb())))
    least = min(min_micro, sizes.batch)
    for wanted in (least, 1):
        for checkpointed in range(sizes.graded_blocks + 1):
            fits = int(free // sizes.per_image_mb(checkpointed)) if free > 0 else 0
            if fits >= wanted:
                return TrainingPlan(budget_mb, min(fits, sizes.batch), checkpointed, no_grad, precision, held_mb)
    needed = held_mb + after_mb + MARGIN_MB + sizes.inputs_mb() + sizes.per_image_mb(sizes.graded_blocks)
    raise BudgetError(f"node-config {BUDGET_KEY} = {budget_mb:g} is too small to train even one image at a time: "
                      f"this process holds {held_mb:.0f} MB (interpreter, torch, the backbone, the data, the message), "
                      f"the round adds {after_mb:.0f} MB besides its activations (gradients, optimiser moments, "
                      f"the reply) and a step of batch-size {sizes.batch} needs at least {needed:.0f} MB; raise "
                      f"{BUDGET_KEY}, or choose a smaller backbone precision (backbone-precision)")


def round_after_mb(trained_bytes: int, sent_bytes: int, statistics_bytes: float = 0.0, private: bool = False) -> float:
    """MB a training round adds after its plan is made besides the activations: the gradients and
    Adam's two moments of the ``trained_bytes`` of trainable parameters, the reply's arrays
    (``sent_bytes``) encoded, its statistics built and encoded, and under differential privacy the
    reference and the clipped, noised copy of the reply."""
    return (3 * trained_bytes + sent_bytes * (3 if private else 1) + 2 * statistics_bytes) / MB


# ---------------------------------------------------------------------------- measuring
def proc_status_kb(field: str, pid: int | str = "self") -> float:
    """A ``/proc/<pid>/status`` field in kB (0 where there is no /proc or no such process)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def resident_mb() -> float:
    """This process's resident memory now, MB (Linux; 0.0 elsewhere)."""
    return proc_status_kb("VmRSS") * 1024 / MB


def peak_resident_mb() -> float:
    """This process's peak resident memory (VmHWM), MB (Linux; 0.0 elsewhere)."""
    return proc_status_kb("VmHWM") * 1024 / MB


def process_memory_mb(pid: int | str = "self") -> tuple[float, float]:
    """(RSS, PSS) of process ``pid`` in MB, from ``/proc/<pid>/smaps_rollup`` ((0, 0) where it cannot be
    read). PSS divides each shared page among the processes that map it, so the PSS of a node's
    processes adds up to what they take together, where their RSS counts a shared page in each."""
    found = {"Rss:": 0.0, "Pss:": 0.0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                head = line.split()
                if head and head[0] in found:
                    found[head[0]] = float(head[1]) * 1024 / MB
    except OSError:
        pass
    return found["Rss:"], found["Pss:"]


def processes_line(processes: Iterable[tuple[str, int]]) -> str:
    """One line of what ``processes`` ((name, pid) pairs) hold: each one's RSS and PSS, and together."""
    parts, rss_sum, pss_sum = [], 0.0, 0.0
    for name, pid in processes:
        rss, pss = process_memory_mb(pid)
        parts.append(f"{name} (pid {pid}) RSS {rss:,.0f} MB, PSS {pss:,.0f} MB")
        rss_sum, pss_sum = rss_sum + rss, pss_sum + pss
    return f"{'; '.join(parts)}; together RSS {rss_sum:,.0f} MB, PSS {pss_sum:,.0f} MB"


#: glibc's mallopt parameter and the size above which a budgeted process maps its allocations
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_memory() -> bool:
    """Make this process's allocator hand large freed blocks back to the kernel (glibc; True if set).

    glibc raises its mmap threshold as large blocks are freed, after which activations of a
    few MB come from the heap, whose freed holes stay resident: a micro-batch after the first
    then grows the peak instead of reusing the memory (measured: 1,550 MB against 1,252 MB for one
    ViT-B/16 step in micro-batches of 4). A fixed threshold of 1 MB maps every activation on its
    own and unmaps it when freed, for some page faults.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc
        return False


#: madvise(2): drop a range's pages from this process (a file mapping's clean pages come back from the file)
_MADV_DONTNEED = 4


def release_library_pages() -> float:
    """Hand the kernel back the resident pages of this process's shared libraries that are the
    files' own (read-only mappings no relocation wrote); MB released (0.0 where not Linux).

    ``import torch`` maps its CUDA libraries even on a CPU-only node, and the loader and their
    initialisers leave some 240 MB of their pages resident (of 420 MB of library pages in all on
    this project's machine) that a CPU never runs again. Dropped, a page still needed comes back
    from the page cache at its next use (about 100 MB of them in a ViT-B/16 training step); a
    mapping some relocation wrote to (its ``Anonymous`` pages) is left alone, since dropping would
    lose what was written. A budgeted message's process calls this before it measures what it holds.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/smaps") as fh:
            lines = fh.read().splitlines()
    except (OSError, AttributeError):
        return 0.0
    mappings: list[dict[str, str]] = []
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's header line
            mappings.append({"range": head[0], "perms": head[1], "path": " ".join(head[5:])})
        elif head and mappings and head[0] in ("Rss:", "Anonymous:"):
            mappings[-1][head[0]] = head[1]
    released = 0
    for m in mappings:
        name = os.path.basename(m["path"])
        library = name.endswith(".so") or ".so." in name
        if not library or "w" in m["perms"] or m.get("Anonymous:") != "0" or int(m.get("Rss:", "0")) == 0:
            continue
        low, high = (int(v, 16) for v in m["range"].split("-"))
        if libc.madvise(low, high - low, _MADV_DONTNEED) == 0:
            released += int(m["Rss:"])
    return released * 1024 / MB


def file_mappings(path: Path | str) -> list[tuple[int, int]]:
    """Address ranges of this process's private mappings of ``path`` (Linux ``/proc/self/maps``; [] elsewhere)."""
    target = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split()
                # address perms offset dev inode path: a private ("p") mapping of the file
                if len(parts) >= 6 and parts[1].endswith("p") and " ".join(parts[5:]) == target:
                    low, high = (int(v, 16) for v in parts[0].split("-"))
                    out.append((low, high))
    except OSError:
        return []
    return out


def mapped_mb(path: Path | str) -> float:
    """MB of ``path``'s pages resident in this process through a file mapping (shared with every
    process that maps the same file; 0.0 when it is not mapped, or without /proc)."""
    target = os.path.realpath(path)
    total, inside = 0.0, False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split()
                if head and "-" in head[0] and ":" not in head[0]:  # a mapping's header (the kernel's resolved path)
                    inside = " ".join(head[5:]) == target
                elif inside and head and head[0] == "Rss:":
                    total += float(head[1]) * 1024 / MB
    except OSError:
        return 0.0
    return total


def mapped_tensor_mb(tensors: Iterable[torch.Tensor], path: Path | str) -> float:
    """MB of ``tensors`` whose data lie in a mapping of ``path``: what reading them all may add to
    the resident memory (pages not read yet are not resident)."""
    spans = file_mappings(path)
    total = 0
    for t in tensors:
        start = t.data_ptr()
        if any(low <= start < high for low, high in spans):
            total += t.numel() * t.element_size()
    return total / MB


__all__ = ["BUDGET_KEY", "BudgetError", "StepSizes", "TrainingPlan", "file_mappings", "mapped_mb",
           "mapped_tensor_mb", "peak_resident_mb", "plan_training", "process_memory_mb", "processes_line",
           "release_library_pages", "resident_mb", "return_freed_memory", "round_after_mb"]
