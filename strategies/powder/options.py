"""Powder's options (run-config keys ``powder.<key>``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...common.config.experiment import ConfigError
from ...common.config.options import ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY, RANDOM_TASKS, MethodOptions

SELECTIONS = ("top-k", "random")
DISTILLATIONS = ("dual", "classic")
MEASURINGS = ("exchange", "in-training")


@dataclass(frozen=True)
class PowderOptions(MethodOptions):
    """Powder's options (run-config keys ``powder.<key>``, kebab-case).

    Defaults are the paper's (Appendix B: lambda 1, p 30; section 5.4: k 3). The ablation
    switches are Table 5's: ``first-step = false`` (w/o FUS), ``selection = "random"`` (w/o
    SEL), ``dual = false`` (w/o DUAL), ``distillation = "classic"`` (DIS: plain KD).
    ``temperature``: eq. 5 gives none, so the authors' code's 3 (their ``_ntd_loss(tau=3)``,
    scaled by tau^2 as FedNTD) is the default since issue 40; 1 was the default before.
    ``row-top``: the authors' code keeps a few top entries per correlation row, renormalised;
    eq. 3 and eq. 7 print the rows unnormalised, so ``row-top = 0`` (eq. 3 as printed) stays
    the default. ``measuring`` is Algorithm 1's separate measuring exchange by default.
    """

    prefix = "powder"
    COMPATIBILITY = frozenset({ASYNCHRONOUS_TASKS, RANDOM_TASKS})
    # refused whatever the options: the measuring exchange is a release outside the train reply
    WHY_NOT = {DIFFERENTIAL_PRIVACY: (
        "its measuring exchange answers, before training, with selection weights computed from the client's "
        "data (a second release per round, outside the train reply), and those weights choose which prompts "
        "it uploads; neither release is bounded nor accounted here")}

    k: int = 3  # tasks in a client's local pool (eq. 4), its own included
    p: float = 30.0  # sharpening exponent of the correlation (eq. 7)
    lambda_: float = 1.0  # run-config key "lambda": weight of the distillation term (eq. 8)
    first_step: bool = True  # false: no first-step aggregation, P_hat = P_g
    selection: str = "top-k"  # "random": own task + k-1 random known tasks
    dual: bool = True  # false: CE only
    distillation: str = "dual"  # "classic": KD over all current-task classes, no beta
    temperature: float = 3.0  # softening of the distillation (eq. 5 gives none; the authors' code: 3)
    row_top: int = 0  # > 0: keep that many top entries per G_task row, rows renormalised (authors' code)
    # Random tasks: score each task with its local pool (the k selected slices of P_hat, as its
    # client trains and the paper evaluates), or with the raw global pool P_g ("global").
    evaluation: str = "local"
    # "exchange": Algorithm 1 lines 8-10, a measuring message before training (the whole P_hat
    # out, alphas back), G updated, then the round trains with top-k. "in-training": one message
    # fewer; the alphas are measured at the start of the training round on the whole pool the
    # client then trains with, and G changes only after that round.
    measuring: str = "exchange"
    # The single-task reference of FT and CT (section 5.1: "single task training"): a task trained
    # alone with as many prompt components as a Powder client trains ("local-pool": k slices),
    # or with one task's slice ("task-slice", the reference FedAvg-Prompt is measured against)
    reference: str = "local-pool"

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError("powder." + msg)

        need(self.k >= 1, f"k must be >= 1, got {self.k}")
        need(np.isfinite(self.p) and self.p > 0, f"p must be > 0, got {self.p}")
        need(np.isfinite(self.lambda_) and self.lambda_ >= 0, f"lambda must be >= 0, got {self.lambda_}")
        need(self.selection in SELECTIONS, f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        need(self.distillation in DISTILLATIONS,
             f"distillation must be one of {DISTILLATIONS}, got {self.distillation!r}")
        need(np.isfinite(self.temperature) and self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        need(self.row_top >= 0, f"row-top must be >= 0 (0: dense rows), got {self.row_top}")
        need(self.evaluation in ("local", "global"), f"evaluation must be 'local' or 'global', got {self.evaluation!r}")
        need(self.reference in ("local-pool", "task-slice"),
             f"reference must be 'local-pool' or 'task-slice', got {self.reference!r}")
        need(self.measuring in MEASURINGS, f"measuring must be one of {MEASURINGS}, got {self.measuring!r}")
