"""C2Prompt's options (run-config keys ``c2prompt.<key>``).

No code of the authors could be read (their repository holds a README and the framework figure),
and of the paper only the abstract and the framework figure: the two components (LCDC, CPA), the
compensation prompt attached with probability 0.5, and the class histograms are the paper's
figure; every other choice below is **the project's reading**, marked so, and an option.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...common.config import ConfigError, ExperimentConfig
from ...common.options import ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY, RANDOM_TASKS, MethodOptions

GLOBAL_STATS = ("gaussian-diag", "mean-only")
COMP_LOSSES = ("nll", "mse", "kl")
COMP_ATTACH = ("concat", "add")
HISTOGRAMS = ("top-k", "mass")
CPA_SCOPES = ("component", "all")
CPA_WEIGHTINGS = ("samples", "uniform")
CPA_COLLAPSES = ("usage", "samples")


@dataclass(frozen=True)
class C2PromptOptions(MethodOptions):
    """C2Prompt's options (run-config keys ``c2prompt.<key>``, kebab-case).

    Ablations (the abstract's two components): ``lcdc = false`` (no compensation prompts, no
    statistics used), ``cpa = false`` (prompts by FedAvg: Fed-CODA-P). Whose each default is:
    "figure" (the paper's framework figure), "reading" (the project's, UNVERIFIED).
    """

    prefix = "c2prompt"
    # its uploads (q(x) statistics, selection histograms) are bounded rows (records.py); the
    # compensation prompts never leave the client; CPA groups replies by the task the server sent
    COMPATIBILITY = frozenset({ASYNCHRONOUS_TASKS, RANDOM_TASKS, DIFFERENTIAL_PRIVACY})

    lcdc: bool = True  # figure (c): local class distribution compensation; false: ablation
    cpa: bool = True  # figure (b): class-aware prompt aggregation; false: FedAvg of prompts
    comp_prob: float = 0.5  # figure (d): the class's compensation prompt attached with p = 0.5
    # reading: the global class distribution of q(x) (figure (a), EQ. (1)-(2) unread) as a diagonal
    # Gaussian (count-weighted mean, law of total variance); "mean-only": means, unit variance
    global_stats: str = "gaussian-diag"
    # reading: L_d, the loss pulling a compensated feature toward its class's global distribution:
    # "nll" Gaussian negative log-likelihood under the global diagonal Gaussian; "mse" squared
    # distance to the global mean; "kl" KL(batch's class Gaussian || global), moment matching
    comp_loss: str = "nll"
    # reading: how a compensation prompt joins the discriminative one: "concat" its tokens after
    # them (prefix-tuning: after each half), "add" summed onto them (needs comp-length = prompt-length)
    comp_attach: str = "concat"
    comp_length: int = 0  # reading: tokens of a compensation prompt (0: the run's prompt-length)
    comp_epochs: int = 1  # reading: local epochs of LCDC before each round's discriminative training
    comp_lr: float = 0.0  # reading: Adam's rate for the compensation prompts (0: the run's lr)
    var_floor: float = 1e-4  # reading: the global variances are floored here in "nll" and "kl"
    # reading: a client's histogram H (prompt component x class) of CODA-P's soft weights: "top-k"
    # counts each image's k highest-weighted components of its task's slice (the figure's
    # "selected"), "mass" adds each image's positive weights normalised to sum 1
    histogram: str = "top-k"
    histogram_k: int = 1  # reading: components counted per image with histogram = "top-k"
    # reading: CPA combines a component with the other clients' copies of the same component
    # ("component"), or with every client's every component of the task ("all": the figure's
    # (K L_c) x (K L_c) matrix, which mixes components whose class profiles agree)
    cpa_scope: str = "component"
    # reading: each copy's weight in a CPA row, times its histogram similarity: the reply's sample
    # weight ("samples": identical histograms give FedAvg exactly) or none ("uniform")
    cpa_weighting: str = "samples"
    # reading: the global model keeps one pool; component n of it is the CPA copies averaged with
    # weights = each client's share of selections of n times its sample weight ("usage"), or the
    # sample weights alone ("samples")
    cpa_collapse: str = "usage"

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError("c2prompt." + msg)

        need(0.0 <= self.comp_prob <= 1.0, f"comp-prob must be in [0, 1], got {self.comp_prob}")
        for name, value, allowed in (("global-stats", self.global_stats, GLOBAL_STATS),
                                     ("comp-loss", self.comp_loss, COMP_LOSSES),
                                     ("comp-attach", self.comp_attach, COMP_ATTACH),
                                     ("histogram", self.histogram, HISTOGRAMS),
                                     ("cpa-scope", self.cpa_scope, CPA_SCOPES),
                                     ("cpa-weighting", self.cpa_weighting, CPA_WEIGHTINGS),
                                     ("cpa-collapse", self.cpa_collapse, CPA_COLLAPSES)):
            need(value in allowed, f"{name} must be one of {allowed}, got {value!r}")
        need(self.comp_length >= 0, f"comp-length must be >= 0 (0: prompt-length), got {self.comp_length}")
        need(self.comp_epochs >= 0, f"comp-epochs must be >= 0, got {self.comp_epochs}")
        need(self.comp_lr >= 0, f"comp-lr must be >= 0 (0: the run's lr), got {self.comp_lr}")
        need(self.var_floor > 0, f"var-floor must be > 0, got {self.var_floor}")
        need(self.histogram_k >= 1, f"histogram-k must be >= 1, got {self.histogram_k}")

    def compensation_length(self, prompt_length: int) -> int:
        """Tokens of a compensation prompt in a run whose prompts have ``prompt_length``."""
        return self.comp_length or prompt_length

    def check_run(self, cfg: ExperimentConfig) -> None:
        """Added compensation prompts have the discriminative prompts' shape; a prefix is split in
        halves (keys, values), so a concatenated one has an even length."""
        length = self.compensation_length(cfg.prompt_length)
        if self.comp_attach == "add" and length != cfg.prompt_length:
            raise ConfigError(f"c2prompt.comp-attach = add sums the compensation prompt onto the prompt: comp-length "
                              f"must be 0 or prompt-length ({cfg.prompt_length}), got {length}")
        if cfg.prompt_mode == "prefix" and length % 2:
            raise ConfigError(f"c2prompt.comp-length must be even with prompt-mode = prefix (key and value halves), "
                              f"got {length}")
        if self.histogram == "top-k" and self.histogram_k > max(cfg.pool_size // cfg.num_tasks, 1):
            raise ConfigError(f"c2prompt.histogram-k = {self.histogram_k} exceeds the {cfg.pool_size // cfg.num_tasks} "
                              "components of a task's slice")
