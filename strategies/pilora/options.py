"""PILoRA's options (run-config keys ``pilora.<key>``).

The paper's body could not be read (its loss form, ``l_dce + lambda l_pl + gamma l_ort``, and the
incremental sum of LoRA sets are all that is known of it), so each default is the authors' code's
(Ghy0501/PILoRA, "A" below) unless a field says otherwise; fed-mammoth's ``pilora3`` ("M", the
PILoRA row of LoRM's paper) is the other reading where the two differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...common.config.experiment import ConfigError, DataSection, ModelSection
from ...common.config.options import ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY, RANDOM_TASKS, MethodOptions

SOFTMAX_SCOPES = ("all", "task")
REWEIGHTS = ("heterogeneity", "fedavg")
CLASS_MEANS = ("training-batches", "separate-pass")
ROUND_SCHEDULES = ("cosine", "none")


@dataclass(frozen=True)
class PILoRAOptions(MethodOptions):
    """PILoRA's ``pilora.*`` run-config options (kebab-case keys, e.g. ``pilora.reweight-temperature``).

    Attributes
    ----------
    rank : int
        r of every LoRA set (A: ``r=4`` in ``federated_main.py``; M's default 4).
    temperature : float
        T of the distance logits ``-d(f, c) / T`` (both codes: 1).
    pl : float
        lambda, weight of the prototype loss ``mean d(f, c_y)`` (both codes: 0.001).
    ortho : float
        gamma, weight of the orthogonality loss ``sum_{tau<t} sum |A_t A_tau^T|`` from task 1 on
        (both codes: 0.5); 0 switches it off (ablation).
    l1 : float
        mu, weight of ``||A_t^q||_1 + ||A_t^v||_1`` (both codes: 0.01; not in the paper's
        three-term loss as its summary prints it).
    weight_decay : float
        Adam's (coupled) weight decay of the trained set and the task's prototypes, added to the
        loss as ``wd / 2 * ||p||^2`` (A and M: 1e-5).
    prototype_lr, lora_lr : float
        Adam learning rates of the prototypes and of the LoRA sets (A's ``train_d.sh``:
        ``centers_lr = 2e-3``, ``encoders_lr = 1e-5``; M's are ``--lr`` and ``--lr_back``, which its
        released experiments set to 0.02 and 1e-4, as its maintainer confirmed in fed-mammoth
        issue #2).
        The run's ``lr`` then drives nothing (the head's bias is unused).
    round_schedule : str
        "cosine" (A): both rates times 1 in round 0 of a task of E rounds and
        ``(1 + cos(pi (r - 1) / E)) / 2`` in round r >= 1 (A updates the rates after each round
        for the next: 1, 1, 0.75 at E = 3); "none" (M). Set the run's ``lr-schedule = "constant"`` beside it for A's
        arithmetic (the platform's cosine runs over one round's local steps).
    softmax_over : str
        The DCE's softmax: "all" (both codes) over every class's prototype, those of other tasks
        frozen (unseen classes' random ones included); "task" over the current task's classes
        (the platform's masked cross-entropy, as every other method here).
    lora : bool
        False: no adapters (the prototypes learn on the frozen backbone; ablation).
    lora_sum : bool
        True (the paper's summary, "sums orthogonal LoRA components", and M): the forward adds
        the sets of tasks 0..t, earlier ones frozen; False (A's ``VLT.py``): only task t's set.
    reweight : str
        "heterogeneity" (both codes, the paper's re-weight module): each class's prototype is the
        softmax-weighted mean of the clients' prototypes by their distance to the clients' class
        means; "fedavg": the platform's sample-weighted mean (ablation).
    reweight_temperature : float
        The re-weighting softmax's temperature (A: 0.2; M: ``soft_temp = 5`` multiplies, the same).
    class_means : str
        What the uploaded class means average: "training-batches" (both codes) the detached
        features of every training batch over all local epochs; "separate-pass" one no-grad pass
        over the client's stored images after training.
    min_class_count : int
        A class mean is uploaded only from this many feature rows (A: 1, every class seen; M: 6,
        it drops classes counted at most 5 times over all epochs' batches).
    """

    prefix = "pilora"
    # not random tasks: one prototype per class, held in the head's rows of a per-class head
    COMPATIBILITY = frozenset({ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY})
    WHY_NOT = {RANDOM_TASKS: "its prototypes are one per class in the head's rows; random tasks score classes "
                             "through a per-task head block, which has no row per class"}

    rank: int = 4
    temperature: float = 1.0
    pl: float = 0.001
    ortho: float = 0.5
    l1: float = 0.01
    weight_decay: float = 1e-5
    prototype_lr: float = 2e-3
    lora_lr: float = 1e-5
    round_schedule: str = "cosine"
    softmax_over: str = "all"
    lora: bool = True
    lora_sum: bool = True
    reweight: str = "heterogeneity"
    reweight_temperature: float = 0.2
    class_means: str = "training-batches"
    min_class_count: int = 1

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.rank >= 1, f"pilora.rank must be >= 1, got {self.rank}")
        need(self.temperature > 0, f"pilora.temperature must be > 0, got {self.temperature}")
        for key, value in (("pl", self.pl), ("ortho", self.ortho), ("l1", self.l1),
                           ("weight-decay", self.weight_decay)):
            need(value >= 0, f"pilora.{key} must be >= 0, got {value}")
        need(self.prototype_lr >= 0 and self.lora_lr >= 0, "pilora.prototype-lr and pilora.lora-lr must be >= 0")
        need(self.reweight_temperature > 0,
             f"pilora.reweight-temperature must be > 0, got {self.reweight_temperature}")
        need(self.min_class_count >= 1, f"pilora.min-class-count must be >= 1, got {self.min_class_count}")
        for key, choice, allowed in (("softmax-over", self.softmax_over, SOFTMAX_SCOPES),
                                     ("reweight", self.reweight, REWEIGHTS),
                                     ("class-means", self.class_means, CLASS_MEANS),
                                     ("round-schedule", self.round_schedule, ROUND_SCHEDULES)):
            need(choice in allowed, f"pilora.{key} must be one of {allowed}, got {choice!r}")

    def check_run(self, *, data: DataSection, model: ModelSection, **_: Any) -> None:
        if model.per_task_head(data):
            raise ConfigError("pilora holds one prototype per class in the head's rows: it needs head = "
                              "\"per-class\"")
