"""HePCo's options (run-config keys ``hepco.<key>``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...common.config.experiment import ConfigError, EvaluationSection, FederationSection
from ...common.config.options import ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY, MethodOptions

#: Table 3 rows, as names for ``hepco.ablate`` (comma-separated, composable).
ABLATIONS = ("previous-model", "kl", "mse", "prompt-distillation", "classifier-distillation")


@dataclass
class HePCoOptions(MethodOptions):
    """``hepco.*`` run-config options (kebab-case keys), paper defaults (Appendix B).

    Attributes
    ----------
    noise_dim, label_embed_dim : int
        Generator input: noise (64) concatenated with a label embedding (64).
    generator_hidden : str
        Hidden widths, comma-separated: layer inputs [128, 256, 1024] -> D.
    generator_batchnorm : bool
        BatchNorm between generator layers (authors' code; the paper does not say).
    generator_epochs, generator_batch_size, generator_lr : int, int, float
        100 steps of 64 latents, Adam 1e-4.
    past_generator_epochs_per_task : int
        Extra steps per past task for the old-class generator (code: 50; paper: 0).
    distill_epochs, distill_batch_size, distill_lr : int, int, float
        200 steps, 64 current-task latents per step (+ replay), Adam 1e-4.
    lambda_kl, lambda_mse : float
        Weights of the maximised disagreement terms (1 and 0.1).
    replay_ratio : float
        Old-class latents per current-task latent in the composite batch (0.5).
    ablate : str
        Comma-separated Table 3 ablations, any of :data:`ABLATIONS`.
    averaging : str
        Provisional model: ``"uniform"`` (1/C sum, sec. 5.2 and the code) or
        ``"samples"`` (the platform's sample-weighted FedAvg).
    old_prompt_mean : str
        What the previous-task server's prompt MSE (eq. 6, the ``zeta`` term) is averaged
        over. ``"composite"`` (default, the paper): eq. 6 is a per-sample loss over the
        composite batch and ``zeta`` switches the teacher on for old-class samples, so the
        term is the old-latent mean scaled by the old share of the batch (1/3 at replay
        ratio 0.5). ``"old"``: the mean over the old latents alone, which weighs the
        previous-task teacher 1/share (3) times more than the paper.
    distill_generator_mode : str
        BatchNorm mode of the generators while they produce distillation latents.
        ``"eval"`` (default): running statistics, as the authors' code (the paper does not
        say, and the generator's BatchNorm is itself the code's). ``"train"``: each
        batch's own statistics.
    old_latent_teachers : str
        Who teaches the prompts on old-class latents in eq. 6. ``"clients-and-previous"``
        (default, the paper): every client on every latent of the composite batch, and the
        previous task's server (the ``zeta`` term) on the old-class latents too.
        ``"previous"`` (the authors' code): the clients on the current-task latents only, the
        previous server alone on the old-class latents, weighted as their code weighs it: per
        latent, the previous server as much as the clients together times the current task's
        classes (10 on CIFAR-100; ``distill.old_teacher_weight``); ``old-prompt-mean`` does not
        apply. Before issue 40 it kept the composite weight, 75 times lighter than their code
        at CIFAR-100's setting.
    pool_training : str
        ``"whole"`` (default since issue 40: the paper's one shared pool, sec. 5.1, "the sum of
        the P_i weighted by their cosine scores" over the pool of M = 100, and the authors' code,
        which trains all of it): the whole pool is trained on every task, on clients and in
        distillation, initialised once. ``"task-slices"`` (CODA-P's slices, which the paper
        adapts L2P after; the default before): each task trains its own slice of the pool,
        earlier slices frozen.
    client_weights : str
        The sums over clients of the generator's L_cls, L_KL and L_MSE (eqs. 2-4) and of the
        clients' prompt MSE in distillation (eq. 6); each latent's weights sum to C, so the
        terms keep their scale. ``"class-counts"`` (sec. 5.2, "a weighted sum of classification
        losses for each individual client, similar to Zhang et al. (2022b)": that work weighs
        client k on a sample of class y by n_k^y / n^y; the authors' code weighs client j by
        its count of y): client c on a latent of class y weighs C n_c^y / n^y, so a client that
        holds none of y does not judge its latents, and only classes some client of the round
        holds are drawn. Clients upload their label counts (records.py). ``"samples"``:
        C n_c / sum n by its sample count on every latent. ``"uniform"`` (eq. 2 as printed):
        every client 1. With clients on several tasks a task's share of the latents is its
        clients' samples (its replies with ``"uniform"``). Latent labels are uniform over the
        drawn classes (Algorithm 1, "sample class labels y randomly"; the authors' code draws
        them in proportion to the round's counts).
    generator_classes : str
        The classes the teachers' and the student's logits span in the generators' losses
        (eqs. 2-3). ``"seen"`` (default: the paper's phi is the whole classifier, and the
        authors' trainer slices the logits up to the last seen class): every class seen so
        far, so a latent of class y must win against the old classes too. ``"task"`` (the
        reading before issue 58): the current task's classes only, where the clients' heads
        are trained; a latent then only has to beat the task's other classes.
    head_loss : str
        Cross-entropy of the head distillation over the composite batch. ``"ce"`` (default,
        sec. 5.3): plain mean over the batch, so each class weighs as often as it is drawn;
        at replay ratio 0.5 an old class gets 1/(2t) of a current class's latents at task
        t (0-indexed, equal-size tasks).
        ``"balanced"`` (not in the paper): each seen class drawn in the batch weighs the same,
        so the head is not pulled towards the current task by how often it is sampled.
    diagnostics : bool
        Also measure, every round, the consolidation against real data (a measurement,
        never fed back into training; needs the server's central data, so simulation
        with ``evaluation = "central"``): real queries and prompted features of up to
        ``diagnostics_per_class`` training images per seen class, their distance to the
        pseudo-latents, and the accuracy on the real prompted features of the provisional
        and distilled prompts x heads (see :class:`RealDataProbe`).
    diagnostics_per_class : int
        Real images and pseudo-latents per class for the diagnostics.
    """

    prefix = "hepco"
    # not random tasks: tasks of the stream, contiguous classes and slices
    COMPATIBILITY = frozenset({ASYNCHRONOUS_TASKS, DIFFERENTIAL_PRIVACY})

    noise_dim: int = 64
    label_embed_dim: int = 64
    generator_hidden: str = "256,1024"
    generator_batchnorm: bool = True
    generator_epochs: int = 100
    generator_batch_size: int = 64
    generator_lr: float = 1e-4
    past_generator_epochs_per_task: int = 0
    distill_epochs: int = 200
    distill_batch_size: int = 64
    distill_lr: float = 1e-4
    lambda_kl: float = 1.0
    lambda_mse: float = 0.1
    replay_ratio: float = 0.5
    ablate: str = ""
    averaging: str = "uniform"
    old_prompt_mean: str = "composite"
    distill_generator_mode: str = "eval"
    old_latent_teachers: str = "clients-and-previous"
    pool_training: str = "whole"
    head_loss: str = "ce"
    generator_classes: str = "seen"
    client_weights: str = "samples"
    diagnostics: bool = False
    diagnostics_per_class: int = 50

    # ---------------------------------------------------------------- derived switches
    @property
    def ablated(self) -> set[str]:
        return {a.strip() for a in self.ablate.split(",") if a.strip()}

    @property
    def use_previous(self) -> bool:
        return "previous-model" not in self.ablated

    @property
    def use_kl(self) -> bool:
        return "kl" not in self.ablated

    @property
    def use_mse(self) -> bool:
        return "mse" not in self.ablated

    @property
    def distill_prompts(self) -> bool:
        return "prompt-distillation" not in self.ablated

    @property
    def distill_head(self) -> bool:
        return "classifier-distillation" not in self.ablated

    @property
    def hidden(self) -> list[int]:
        return [int(v) for v in self.generator_hidden.split(",") if v.strip()]

    # ---------------------------------------------------------------- parsing
    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"hepco: {msg}")

        for name in ("noise_dim", "label_embed_dim", "generator_batch_size", "distill_batch_size"):
            need(getattr(self, name) >= 1, f"{name.replace('_', '-')} must be >= 1")
        for name in ("generator_epochs", "distill_epochs", "past_generator_epochs_per_task"):
            need(getattr(self, name) >= 0, f"{name.replace('_', '-')} must be >= 0")
        need(self.generator_lr > 0 and self.distill_lr > 0, "learning rates must be > 0")
        need(self.lambda_kl >= 0 and self.lambda_mse >= 0, "lambda-kl and lambda-mse must be >= 0")
        need(self.replay_ratio >= 0, f"replay-ratio must be >= 0, got {self.replay_ratio}")
        try:
            hidden = self.hidden
        except ValueError:
            raise ConfigError("hepco: generator-hidden must be comma-separated integers, "
                              f"got {self.generator_hidden!r}") from None
        need(len(hidden) >= 1 and all(h >= 1 for h in hidden), "generator-hidden needs at least one positive width")
        bad = self.ablated - set(ABLATIONS)
        need(not bad, f"unknown ablation(s) {sorted(bad)}; choose from {', '.join(ABLATIONS)}")
        need(
            self.averaging in ("uniform", "samples"),
            f"averaging must be 'uniform' or 'samples', got {self.averaging!r}",
        )
        need(
            self.old_prompt_mean in ("composite", "old"),
            f"old-prompt-mean must be 'composite' or 'old', got {self.old_prompt_mean!r}",
        )
        need(
            self.distill_generator_mode in ("eval", "train"),
            f"distill-generator-mode must be 'eval' or 'train', got {self.distill_generator_mode!r}",
        )
        need(self.old_latent_teachers in ("clients-and-previous", "previous"),
             f"old-latent-teachers must be 'clients-and-previous' or 'previous', got {self.old_latent_teachers!r}")
        need(self.old_latent_teachers == "clients-and-previous" or self.old_prompt_mean == "composite",
             "old-prompt-mean applies to old-latent-teachers = 'clients-and-previous' (with 'previous' the "
             "previous-task teacher's weight is the authors' code's)")
        need(self.pool_training in ("task-slices", "whole"),
             f"pool-training must be 'task-slices' or 'whole', got {self.pool_training!r}")
        need(self.generator_classes in ("seen", "task"),
             f"generator-classes must be 'seen' or 'task', got {self.generator_classes!r}")
        need(self.head_loss in ("ce", "balanced"), f"head-loss must be 'ce' or 'balanced', got {self.head_loss!r}")
        need(self.client_weights in ("class-counts", "samples", "uniform"),
             f"client-weights must be 'class-counts', 'samples' or 'uniform', got {self.client_weights!r}")
        need(self.diagnostics_per_class >= 1, "diagnostics-per-class must be >= 1")

    def check_run(self, *, federation: FederationSection, evaluation: EvaluationSection, **_: Any) -> None:
        if self.diagnostics and (evaluation.evaluation != "central" or federation.population != "virtual"):
            raise ConfigError("hepco.diagnostics measures against the server's central data: it needs "
                              "evaluation = central and population = virtual (simulation)")
