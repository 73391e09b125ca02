"""LoRM's options (run-config keys ``lorm.<key>``).

Defaults are the paper's CIFAR-100 setting where it is known (through the authors' README
commands, which reproduce its figures) and the authors' code (aimagelab/fed-mammoth,
``_models/lorm.py``, ``_models/regmean.py``) otherwise; each field says whose it is. Every
switch of the code's that the paper's ablations could turn is an option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...common.config.experiment import ConfigError
from ...common.config.options import ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY, RANDOM_TASKS, MethodOptions

TRAIN_MATRICES = ("alt", "A", "B")
MERGES = ("closed-form", "fedavg")
TASK_MERGES = ("regmean", "running-mean", "sum")
GRAM_MODELS = ("code", "trained")
GRAM_VIEWS = ("augmented", "stored")
TASK_GRAMS = ("last-round", "task-end-pass")


@dataclass(frozen=True)
class LoRMOptions(MethodOptions):
    """``lorm.*`` options (kebab-case keys)."""

    prefix: ClassVar[str] = "lorm"
    # Synchronous tasks only: the round's closed form solves for one shared factor of the current
    # task's set, which every client must have started from, and the task merge runs when every
    # client has left the task. No differential privacy: see WHY_NOT.
    COMPATIBILITY = frozenset()
    WHY_NOT = {
        DIFFERENTIAL_PRIVACY: "LoRM uploads Gram matrices (sums over every token of the squared inputs of each "
                              "adapted projection, and of the head's features), which no per-row clip bounds "
                              "without changing what the closed-form merge divides by, and a noised Gram is not "
                              "positive semi-definite, so the solve is undefined",
        RANDOM_TASKS: "its merges assume every client on the current task of the shared stream",
        ASYNCHRONOUS_TASKS: "its merges assume every client on the current task of the shared stream",
    }

    # r of every adapter. Paper / README command for CIFAR-100 at beta = 0.5: 1 (16 at beta 0.1, 0.05)
    rank: int = 1
    # which factor a round trains: "alt" (B on even rounds of a task, A on odd: the paper's alternation,
    # the code's default), or one throughout ("A", "B": the code's --train_matrix)
    train_matrix: str = "alt"
    # round merge of the factors: "closed-form" (RegMean, the paper; code regmean_all = True) or
    # "fedavg" (sample-weighted mean: the code's regmean_all = False); the head is RegMean-merged in both
    merge: str = "closed-form"
    # G' = a G + (1 - a) diag G of the head's Gram (code: alpha_regmean_head = 0.5)
    alpha_head: float = 0.5
    # the same for the adapted projections; 0: diagonal Grams only (the paper shares only diagonals;
    # code README: alpha_regmean_backbone = 0). Other values need full Grams and are refused.
    alpha_backbone: float = 0.0
    # the merge across tasks at each task's end: "regmean" (the paper: RegMean of the tasks' deltas with
    # their Grams), "running-mean" (the code's in-task filler kept), "sum" (the code's run_sum)
    task_merge: str = "regmean"
    # the model the Gram pass runs through: "code" (the authors' code: the evaluation forward, the
    # running mean of the earlier tasks' deltas and this client's trained one), "trained" (W0 + B_t A_t,
    # the model this client trained; the paper's text does not say)
    gram_model: str = "code"
    # the Gram pass's inputs: "augmented" (code: the training augmentation) or "stored" (the images)
    gram_views: str = "augmented"
    # passes over the client's data for the Grams (code regmean_rounds: 1 for CIFAR-100, 2 for ImageNet-R)
    gram_passes: int = 1
    # the Grams of the task merge: "last-round" (the project's: the task's last round's, summed over its
    # clients) or "task-end-pass" (the authors' code, utils/training.py after the round loop,
    # LoRM.end_task_client: one more exchange at the task's end, no training, each client that trained
    # the task passing its data through the server's final factors and head, as gram-model,
    # gram-views and gram-passes say). The paper's text could not be read here.
    task_grams: str = "last-round"
    # learning rates of A and B (code lr_A, lr_B); -1: the run's lr (code default)
    lr_a: float = -1.0
    lr_b: float = -1.0

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError("lorm." + msg)

        need(self.rank >= 1, f"rank must be >= 1, got {self.rank}")
        need(self.train_matrix in TRAIN_MATRICES,
             f"train-matrix must be one of {TRAIN_MATRICES}, got {self.train_matrix!r}")
        need(self.merge in MERGES, f"merge must be one of {MERGES}, got {self.merge!r}")
        need(0.0 <= self.alpha_head <= 1.0, f"alpha-head must be in [0, 1], got {self.alpha_head}")
        need(self.alpha_backbone == 0.0,
             f"alpha-backbone = {self.alpha_backbone}: only 0 (diagonal Grams, the paper's and the code's "
             "setting) is implemented; a full Gram per projection (134.5 M floats per client at ViT-B/16) is not sent")
        need(self.task_merge in TASK_MERGES, f"task-merge must be one of {TASK_MERGES}, got {self.task_merge!r}")
        need(self.gram_model in GRAM_MODELS, f"gram-model must be one of {GRAM_MODELS}, got {self.gram_model!r}")
        need(self.gram_views in GRAM_VIEWS, f"gram-views must be one of {GRAM_VIEWS}, got {self.gram_views!r}")
        need(self.task_grams in TASK_GRAMS, f"task-grams must be one of {TASK_GRAMS}, got {self.task_grams!r}")
        need(self.gram_passes >= 1, f"gram-passes must be >= 1, got {self.gram_passes}")
        for key, value in (("lr-a", self.lr_a), ("lr-b", self.lr_b)):
            need(value == -1.0 or value > 0, f"{key} must be > 0 or -1 (the run's lr), got {value}")


def trained_factor(train_matrix: str, round_: int) -> str:
    """The factor (``"a"`` or ``"b"``) round ``round_`` (0-based, within its task) trains: B on even
    rounds, A on odd ones with ``"alt"`` (the code's ``set_train_matrix``: rounds count from 0 at each
    task); the one named otherwise."""
    if train_matrix == "alt":
        return "b" if round_ % 2 == 0 else "a"
    return train_matrix.lower()
