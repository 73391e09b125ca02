"""FPPL's options (run-config keys ``fppl.<key>``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...common.config.experiment import ConfigError
from ...common.config.options import ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY, MethodOptions

FUSION_SCALES = ("fixed", "learnable")
PROTOTYPE_VIEWS = ("augmented", "stored")


@dataclass(frozen=True)
class FPPLOptions(MethodOptions):
    """FPPL's ``fppl.*`` run-config options (kebab-case keys, e.g. ``fppl.server-epochs``).

    Defaults follow the paper; where it is silent, the authors' code
    (the authors' code).

    Attributes
    ----------
    temperature : float
        tau of the unified-representation InfoNCE (paper: 0.2).
    ur_weight : float
        Weight of L_ur in the client loss (paper: 1, eq. 8; the code's ``lamda``).
    unified_loss : bool
        Ablation "w/o unified representation loss" when False: no L_ur, and no global
        prototypes are sent.
    fusion : bool
        Ablation "w/o fusion" when False: each sample uses only the task prompt with the
        largest ``g_psi(q)`` (argmax, as in the authors' ``wo_fusion``) instead of the
        softmax-weighted sum.
    debias : bool
        Ablation "w/o debias" when False: the server does not retrain the head.
    pool : bool
        FPPL-WOP when False: no prototype pool; debiasing uses only the current
        local prototypes.
    server_epochs : int
        E_server, epochs of classifier debiasing per round (paper: 5).
    server_lr : float
        Adam learning rate of debiasing (paper silent; authors' code: 1e-3).
    server_batch_size : int
        Batch size of debiasing (paper silent; authors' code: 128, the training batch).
    fusion_scale : str
        "fixed": ``g_psi`` is the plain cosine of eq. 2; "learnable": times a learnable
        scale initialised at 1 (the authors' CosineLinear).
    latest_per_client : bool
        True (default; the authors' code's bookkeeping): global prototypes, debiasing and
        the pool use the latest prototypes of every client that has trained on the current
        task. False: only this round's clients' (Algorithm 1 read literally). The paper has
        every client in every round, where the two are the same; with partial participation
        False builds the pool from the task's last round alone, which can leave a class out
        of it for good (on the offline benchmark, 5 of 10 clients per round, Dirichlet 0.05:
        A_N 53.9 with True against 49.4; at 0.5 they tie, 58.9 and 59.8).
    prototype_views : str
        The images the local prototypes (eq. 3) average over when ``augment`` is on:
        "augmented" (default; the paper is silent, the authors' code averages over one pass of
        its augmenting training loader) takes one seeded augmented view of each image;
        "stored" the stored images (the evaluation's inputs; the default before issue 40).
        Without augmentation the two are the same.
    """

    prefix = "fppl"
    # not random tasks: prototypes are pooled per (client, task) of the stream
    COMPATIBILITY = frozenset({ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY})

    temperature: float = 0.2
    ur_weight: float = 1.0
    unified_loss: bool = True
    fusion: bool = True
    debias: bool = True
    pool: bool = True
    server_epochs: int = 5
    server_lr: float = 1e-3
    server_batch_size: int = 128
    fusion_scale: str = "fixed"
    latest_per_client: bool = True
    prototype_views: str = "augmented"

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.temperature > 0, f"fppl.temperature must be > 0, got {self.temperature}")
        need(self.ur_weight >= 0, f"fppl.ur-weight must be >= 0, got {self.ur_weight}")
        need(self.server_epochs >= 1, f"fppl.server-epochs must be >= 1, got {self.server_epochs}")
        need(self.server_lr > 0, f"fppl.server-lr must be > 0, got {self.server_lr}")
        need(self.server_batch_size >= 1, f"fppl.server-batch-size must be >= 1, got {self.server_batch_size}")
        need(self.fusion_scale in FUSION_SCALES,
             f"fppl.fusion-scale must be one of {FUSION_SCALES}, got {self.fusion_scale!r}")
        need(self.prototype_views in PROTOTYPE_VIEWS,
             f"fppl.prototype-views must be one of {PROTOTYPE_VIEWS}, got {self.prototype_views!r}")
