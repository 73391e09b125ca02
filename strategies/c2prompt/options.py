"""C2Prompt's options (run-config keys ``c2prompt.<key>``).

No code of the authors could be read, and of the paper only the abstract, Eq. (1)-(2) (quoted by
a review, themoonlight.io) and the framework figure, which the authors' repository (nhtsymh/C2Prompt)
holds in two drafts that differ: ``framework.pdf`` (the earlier, probably the submission's) and
``framework.png`` (11 minutes later, the one its README shows). Each option's comment names its
source: "PDF" / "PNG" (one figure file), "figures" (both agree), "note" (a summary of the paper,
en.papernotes.org and themoonlight.io, whose claims could not be checked against the paper's
text), or "reading" (the project's, where every source is silent). docs/methods.md's C2Prompt
table lists the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...common.config.experiment import ConfigError, DataSection, FederationSection, ModelSection
from ...common.config.options import ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY, RANDOM_TASKS, MethodOptions
from ...common.privacy import PrivacyOptions, privacy_refused

GLOBAL_STATS = ("gaussian-diag", "mean-only")
COMP_LOSSES = ("nll", "mse", "kl")
COMP_ATTACH = ("concat", "add")
COMP_SCHEDULES = ("once", "every-round")
STATS_ROUNDS = ("exchange", "first-training")
HISTOGRAMS = ("top-k", "mass")
CPA_SCOPES = ("component", "all")
CPA_SIMILARITIES = ("cosine", "softmax")
CPA_WEIGHTINGS = ("samples", "uniform")
CPA_POOLS = ("merge", "keep-all")
CPA_COLLAPSES = ("usage", "samples")
DISTILLATIONS = ("none", "dual", "classic")


@dataclass(frozen=True)
class C2PromptOptions(MethodOptions):
    """C2Prompt's options (run-config keys ``c2prompt.<key>``, kebab-case).

    Ablations (the abstract's two components): ``lcdc = false`` (no compensation prompts, no
    statistics used), ``cpa = false`` (prompts by FedAvg: Fed-CODA-P). Each comment says whose
    the default is (the module docstring names the sources).
    """

    prefix = "c2prompt"
    # its uploads (q(x) statistics, selection histograms) are bounded rows (records.py); the
    # compensation prompts never leave the client; CPA groups replies by the task the server sent.
    # DP needs stats-round = "first-training" (check_run: the exchange's answers are not privatised)
    COMPATIBILITY = frozenset({ASYNCHRONOUS_TASKS, RANDOM_TASKS, DIFFERENTIAL_PRIVACY})

    lcdc: bool = True  # figures (c): local class distribution compensation; false: ablation
    cpa: bool = True  # figures (b): class-aware prompt aggregation; false: FedAvg of prompts
    # PNG (d): the class's compensation prompt attached with p = 0.5; the PDF's (d) reads p = 0.3
    # (comp-prob = 0.3). The PNG is the later file and the one the README shows
    comp_prob: float = 0.5
    # figures (a): "Stage t / Round 0" holds the distribution estimation, rounds 1..N_r the training
    # (PDF: "N_r + 1 Rounds"). "exchange": a statistics-only message to the round's clients on a
    # task they have not reported, before the task's first training round (the platform's
    # exchange), so every class has its global distribution from that round on; "first-training":
    # the reply of that round carries them (reading; one release, so the one that dp.* bounds)
    stats_round: str = "exchange"
    # figures (c)-(d): the class prompt is learnable in round 0 (c) and frozen in (d); note: trained
    # in round 0, then frozen. "once": a client's compensation prompts of a task are trained as in
    # (c) (the class tokens alone on the frozen backbone, no discriminative prompt), from a seed of
    # (client, task), on its round-0 share and the global distributions frozen for it by the server
    # at its first round with its own report: the same prompts in every round of the task, though
    # the stateless client recomputes them. "every-round": the project's earlier reading, trained
    # afresh each round with the current discriminative prompts attached
    comp_schedule: str = "once"
    # reading (Eq. (1)-(2), quoted by the note, pool a per-class mean and variance with count
    # weights: the figures' Gaussians): a diagonal Gaussian of q(x) per class (count-weighted mean,
    # law of total variance); "mean-only": means, unit variance
    global_stats: str = "gaussian-diag"
    # reading: L_d, the loss pulling a compensated feature toward its class's global distribution:
    # "nll" Gaussian negative log-likelihood under the global diagonal Gaussian; "mse" squared
    # distance to the global mean; "kl" KL(batch's class Gaussian || global), moment matching
    comp_loss: str = "nll"
    # reading: how a compensation prompt joins the discriminative one in (d): "concat" its tokens
    # after them (prefix-tuning: after each half; the figures draw the class tokens beside the
    # others), "add" summed onto them (needs comp-length = prompt-length, comp-schedule = every-round)
    comp_attach: str = "concat"
    # tokens of a compensation prompt; 0: the run's prompt-length (reading). The note: 3; the
    # figures draw 2 per class row, an illustration (comp-length = 3 needs prompt-mode = prompt)
    comp_length: int = 0
    comp_epochs: int = 1  # reading: local epochs of LCDC (once per task, or before each round's training)
    comp_lr: float = 0.0  # reading: Adam's rate for the compensation prompts (0: the run's lr)
    var_floor: float = 1e-4  # reading: the global variances are floored here in "nll" and "kl"
    # reading: a client's histogram H (prompt component x class) of CODA-P's soft weights: "top-k"
    # counts each image's k highest-weighted components of its task's slice (the figure's
    # "selected"), "mass" adds each image's positive weights normalised to sum 1
    histogram: str = "top-k"
    histogram_k: int = 1  # reading: components counted per image with histogram = "top-k"
    # figures (b): W_g^t is square over every client's every prompt of the task ("all"; PDF
    # "(KN x KN)", PNG "(KL_c x KL_c)"); "component": only the other clients' copies of the same
    # component (the project's earlier reading: identical histograms then give FedAvg exactly)
    cpa_scope: str = "all"
    # reading: a W row's similarities: "cosine" of the histogram rows (self 1), times the column's
    # weight, rows normalised; "softmax": note, W = softmax(H H^T / tau), H's rows scaled to unit
    # length first (reading: raw counts would let the softmax follow sample counts), times the
    # column's weight (cpa-weighting = "uniform": the note's formula exactly)
    cpa_similarity: str = "cosine"
    cpa_tau: float = 0.1  # reading: tau of "softmax" (the note gives none); on cosines in [0, 1]
    # reading: each copy's weight in a CPA row, times its similarity: the reply's sample weight
    # ("samples": with cosine and identical histograms, FedAvg exactly) or none ("uniform")
    cpa_weighting: str = "samples"
    # figures (b): P_g^{t*} = W_g^t * P_g^t keeps every client's prompts (PDF: K N rows, PNG: K L_c),
    # and the PDF's (d) feeds client k its own rows back. "keep-all": the task's slice holds
    # num-clients parts of pool-size / num-tasks / num-clients components; the client of schedule
    # slot k trains part k alone and CPA writes each part's row of W P; evaluation reads all K N.
    # "merge": the project's reading, one pool of N components (cpa-collapse below)
    cpa_pool: str = "merge"
    # reading, cpa-pool = "merge": component n of the one pool is the CPA copies averaged with
    # weights = each client's share of selections of n times its sample weight ("usage"), or the
    # sample weights alone ("samples")
    cpa_collapse: str = "usage"
    # note: Powder's distillation term kept (eq. 5 of "Federated Continual Learning via Prompt-based
    # Dual Knowledge Transfer", from the round-start model): "dual" eq. 5 over the non-true classes,
    # every sample weighted alike (Powder's beta needs its task correlation, which C2Prompt lacks);
    # "classic" plain KD over the task's classes; "none" (figures: only L_d and L_ce drawn)
    distill: str = "none"
    distill_lambda: float = 1.0  # Powder's lambda (its Appendix B: 1)
    distill_temperature: float = 3.0  # Powder's authors' code's temperature

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError("c2prompt." + msg)

        need(0.0 <= self.comp_prob <= 1.0, f"comp-prob must be in [0, 1], got {self.comp_prob}")
        for name, value, allowed in (("global-stats", self.global_stats, GLOBAL_STATS),
                                     ("stats-round", self.stats_round, STATS_ROUNDS),
                                     ("comp-schedule", self.comp_schedule, COMP_SCHEDULES),
                                     ("comp-loss", self.comp_loss, COMP_LOSSES),
                                     ("comp-attach", self.comp_attach, COMP_ATTACH),
                                     ("histogram", self.histogram, HISTOGRAMS),
                                     ("cpa-scope", self.cpa_scope, CPA_SCOPES),
                                     ("cpa-similarity", self.cpa_similarity, CPA_SIMILARITIES),
                                     ("cpa-weighting", self.cpa_weighting, CPA_WEIGHTINGS),
                                     ("cpa-pool", self.cpa_pool, CPA_POOLS),
                                     ("cpa-collapse", self.cpa_collapse, CPA_COLLAPSES),
                                     ("distill", self.distill, DISTILLATIONS)):
            need(value in allowed, f"{name} must be one of {allowed}, got {value!r}")
        need(self.comp_length >= 0, f"comp-length must be >= 0 (0: prompt-length), got {self.comp_length}")
        need(self.comp_epochs >= 0, f"comp-epochs must be >= 0, got {self.comp_epochs}")
        need(self.comp_lr >= 0, f"comp-lr must be >= 0 (0: the run's lr), got {self.comp_lr}")
        need(self.var_floor > 0, f"var-floor must be > 0, got {self.var_floor}")
        need(self.histogram_k >= 1, f"histogram-k must be >= 1, got {self.histogram_k}")
        need(self.cpa_tau > 0, f"cpa-tau must be > 0, got {self.cpa_tau}")
        need(self.distill_lambda >= 0, f"distill-lambda must be >= 0, got {self.distill_lambda}")
        need(self.distill_temperature > 0, f"distill-temperature must be > 0, got {self.distill_temperature}")
        need(not (self.comp_attach == "add" and self.comp_schedule == "once"),
             "comp-attach = add sums the compensation prompt onto the discriminative one, which comp-schedule = once "
             "does not attach while it trains (figure (c)): use comp-schedule = every-round")

    def compensation_length(self, prompt_length: int) -> int:
        """Tokens of a compensation prompt in a run whose prompts have ``prompt_length``."""
        return self.comp_length or prompt_length

    def components_per_client(self, model: ModelSection, data: DataSection, federation: FederationSection) -> int:
        """Components a client trains of its task's slice: all of it, or its part (``keep-all``)."""
        per_task = max(model.pool_size // data.num_tasks, 1)
        return per_task // federation.num_clients if self.cpa_pool == "keep-all" else per_task

    def check_run(self, *, data: DataSection, federation: FederationSection, model: ModelSection,
                  privacy: PrivacyOptions, **_: Any) -> None:
        """Added compensation prompts have the discriminative prompts' shape; a prefix is split in
        halves (keys, values), so a concatenated one has an even length; keep-all splits a task's
        slice evenly over the clients; the exchange's answers are not privatised."""
        length = self.compensation_length(model.prompt_length)
        if self.comp_attach == "add" and length != model.prompt_length:
            raise ConfigError(f"c2prompt.comp-attach = add sums the compensation prompt onto the prompt: comp-length "
                              f"must be 0 or prompt-length ({model.prompt_length}), got {length}")
        if model.prompt_mode == "prefix" and length % 2:
            raise ConfigError(f"c2prompt.comp-length must be even with prompt-mode = prefix (key and value halves), "
                              f"got {length}")
        per_task = model.pool_size // data.num_tasks
        if self.cpa_pool == "keep-all" and federation.population != "virtual":
            raise ConfigError("c2prompt.cpa-pool = keep-all gives each client of the virtual population its own part "
                              "of a task's slice; deployed nodes (population = nodes) have no fixed part")
        if self.cpa_pool == "keep-all" and (per_task % federation.num_clients or not per_task):
            raise ConfigError(f"c2prompt.cpa-pool = keep-all splits a task's {per_task} components into one part per "
                              f"client: pool-size / num-tasks must be a positive multiple of num-clients "
                              f"({federation.num_clients})")
        own = self.components_per_client(model, data, federation)
        if self.histogram == "top-k" and self.histogram_k > max(own, 1):
            raise ConfigError(f"c2prompt.histogram-k = {self.histogram_k} exceeds the {own} components a client "
                              "trains of its task's slice")
        if self.stats_round == "exchange" and privacy.enabled:
            raise privacy_refused(self.prefix, "c2prompt.stats-round = exchange answers a statistics-only message "
                                               "before training, which the client does not privatise (only train "
                                               "replies are); use c2prompt.stats-round = first-training")
