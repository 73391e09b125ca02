"""C2Prompt's client: LCDC, then the discriminative prompts trained with the compensation prompt
attached at random, then the uploads; and the statistics-only exchange before training.

Per fit (the figures' client side, in the project's reading where they are silent):

1. ``round_start``: with ``c2prompt.lcdc`` and global class distributions from the server, a
   compensation prompt per class of the task (and per prompted block) is trained for
   ``comp-epochs`` local epochs with the discriminative prompts and the head frozen, so that the
   compensated feature f_{x,p} of an image of class y fits class y's global distribution (L_d,
   ``comp-loss``). Clients keep no state between rounds (the platform's clients are stateless),
   so the compensation prompts never travel and are computed at every fit: with
   ``comp-schedule = "once"`` (figures (c)-(d): learnt in round 0, frozen after) as in figure
   (c), the class tokens alone on the frozen backbone, from a seed of (client, task), on the
   client's round-0 share of the task and the distributions the server froze for it, so every
   fit of the task computes the same prompts; with ``"every-round"`` afresh each round, with the
   round's discriminative prompts attached. With ``cpa-pool = "keep-all"`` the prompt module is
   restricted to the client's part of its task's slice (config ``c2prompt-part``).
2. the shared loop trains the discriminative prompts and the head with cross-entropy; each image
   of a class with a compensation prompt has it attached with probability ``comp-prob`` (a seeded
   draw per image). The platform's loop computes the plain forward of every image; ``extra_loss``
   runs the compensated forward of the attached images and swaps their cross-entropy (it adds
   CE_compensated - CE_plain of each attached image), so each image's loss is exactly the
   forward it drew, at the cost of one more forward of the attached images. With ``distill``
   Powder's distillation term from the round-start model is added (lambda ``distill-lambda``).
3. ``round_end``: the per-class count, mean and variance of the frozen backbone's q(x) of the
   client's images when the server asks in the train message (``stats-round =
   "first-training"``), and the histogram H of its images' selections among the components it
   trained, per prompted block.

``answer``: the statistics-only exchange (``stats-round = "exchange"``, figures (a)'s round 0):
the same statistics of the client's share of its task, and nothing else.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from ...common.data.partitions import client_indices
from ...common.privacy import clip_rows
from ...common.records import METRICS, arrays_of, as_int, config_of, from_array_record, to_array_record
from ..platform.distillation import classic_distillation, dual_distillation
from ..platform.learner import Batch, LocalLearner
from .cpa import selection_histogram
from .distributions import class_statistics, compensation_loss, empty_statistics
from .options import C2PromptOptions
from .prompt import C2PromptPrompt
from .records import CLASS_STATS, GLOBAL_STATS, HISTOGRAM, PART, UPLOAD_STATS


class C2PromptLearner(LocalLearner):
    """Local learning with class distribution compensation; statistics and histograms uploaded."""

    opts: C2PromptOptions
    teacher: tuple[torch.nn.Module, torch.nn.Module] | None = None  # the round-start prompt and head (distill)

    # ------------------------------------------------------------------ hooks
    def round_start(self, content: RecordDict, task: int) -> None:
        """Read what the server asks and sends; restrict the pool to the client's part
        (keep-all); keep the round-start model (distill); train the compensation prompts (LCDC)."""
        layout = self.rt.layout
        config = config_of(content)
        self.task = task
        self.upload_stats = bool(config.get(UPLOAD_STATS, False))
        self.classes = layout.classes(task)
        # head row of a batch label -> its class's position among the task's classes (-1: none)
        self.position = torch.full((layout.head_size,), -1, dtype=torch.long)
        self.position[torch.as_tensor(layout.head_targets(task, self.classes))] = torch.arange(len(self.classes))
        self.compensation: dict[int, torch.Tensor] | None = None
        self.has_global = torch.zeros(len(self.classes), dtype=torch.bool)
        self.draws = np.random.default_rng(list(self.seed) + [0xC2B])  # the per-image attachment draws
        if self.opts.cpa_pool == "keep-all":
            self.prompt.restrict(self.part_rows(as_int(config[PART]), task))
        if self.opts.distill != "none" and self.opts.distill_lambda > 0:
            model = self.rt.model
            self.teacher = (copy.deepcopy(model.prompt).eval(), copy.deepcopy(model.head).eval())
        if not self.opts.lcdc or GLOBAL_STATS not in content.array_records:
            return
        record = from_array_record(arrays_of(content, GLOBAL_STATS))
        where = {int(c): i for i, c in enumerate(self.classes.tolist())}
        dim = self.rt.model.embed_dim
        self.global_means = torch.zeros(len(self.classes), dim)
        self.global_var = torch.ones(len(self.classes), dim)
        for row, c in enumerate(np.asarray(record["classes"]).tolist()):
            if int(c) in where:
                i = where[int(c)]
                self.global_means[i] = torch.from_numpy(np.asarray(record["means"][row], dtype=np.float32))
                if self.opts.global_stats == "gaussian-diag" and "var" in record:
                    self.global_var[i] = torch.from_numpy(np.asarray(record["var"][row], dtype=np.float32))
                self.has_global[i] = True
        if self.has_global.any():
            self.compensation = self.train_compensation(task)

    def extra_loss(self, batch: Batch, task: int) -> torch.Tensor | None:
        """Powder's distillation term (``distill``), and each attached image's cross-entropy
        swapped for that of its compensated forward."""
        terms = [t for t in (self.distillation(batch), self.compensated_swap(batch)) if t is not None]
        return sum(terms[1:], terms[0]) if terms else None

    def round_end(self, index: np.ndarray, task: int) -> dict[str, ArrayRecord]:
        """The q(x) class statistics (empty unless asked) and the selection histogram."""
        queries = self.queries_of(index)
        labels = self.labels_of(index, task)
        stats = self.statistics(queries, labels) if self.upload_stats else empty_statistics(queries.shape[1])
        return {CLASS_STATS: stats, HISTOGRAM: self.histogram(queries, labels, task)}

    def round_cleanup(self) -> None:
        self.compensation = None
        self.teacher = None
        self.prompt.restrict(None)

    def answer(self, content: RecordDict, task: int, round_: int, client_id: int) -> RecordDict:
        """The statistics-only exchange (figures (a), round 0): the class statistics of q(x) over
        the client's share of ``task`` and their sample count; no arrays, no training."""
        if not config_of(content).get(UPLOAD_STATS, False):
            raise ValueError(f"a message before training must ask for class statistics ({UPLOAD_STATS} = true)")
        index = client_indices(self.rt.data.train.labels, self.rt.layout, self.rt.partition, client_id, task, round_)
        stats = self.statistics(self.queries_of(index), self.rt.data.train.labels[index])
        return RecordDict({CLASS_STATS: stats, METRICS: MetricRecord({"num-examples": int(len(index))})})

    # ------------------------------------------------------------------ parts
    @property
    def prompt(self) -> C2PromptPrompt:
        prompt = self.rt.model.prompt
        assert isinstance(prompt, C2PromptPrompt)
        return prompt

    def part_rows(self, part: int, task: int) -> slice:
        """Rows of part ``part`` of ``task``'s slice (keep-all)."""
        n = self.opts.components_per_client(self.model, self.data, self.federation)
        if not 0 <= part < self.federation.num_clients:
            raise ValueError(f"{PART} {part} names no part of the {self.federation.num_clients} of a task's slice")
        start = self.prompt.slice_of(task).start
        return slice(start + part * n, start + (part + 1) * n)

    def statistics(self, queries: torch.Tensor, labels: np.ndarray) -> ArrayRecord:
        """Count, mean and diagonal variance of q(x) per class (q(x) clipped first under ``dp.*``)."""
        q = queries.double().cpu().numpy()
        dp = self.privacy
        if dp.enabled:  # bounded queries bound the statistics (records.py says how)
            q = clip_rows(q, dp.clip)
        return class_statistics(q, labels)

    def compensated_swap(self, batch: Batch) -> torch.Tensor | None:
        """CE of the attached images' compensated forwards minus that of their plain ones, / batch."""
        if self.compensation is None or self.opts.comp_prob <= 0:
            return None
        positions = self.position[batch.labels.cpu()]
        drawn = torch.from_numpy(self.draws.random(len(positions)) < self.opts.comp_prob)
        attach = drawn & (positions >= 0) & self.has_global[positions.clamp_min(0)]
        if not bool(attach.any()):
            return None
        rows = attach.nonzero().flatten().to(batch.images.device)
        chosen = positions[attach]
        model = self.rt.model
        with self.prompt.compensated(self.attached(chosen, batch.images.device), self.model.prompt_mode == "prefix"):
            logits = model.logits(model.features(batch.images[rows], batch.query[rows]))
        allowed = torch.isfinite(batch.logits[0])
        logits = logits.masked_fill(~allowed[None, :], float("-inf"))
        swapped = F.cross_entropy(logits, batch.labels[rows], reduction="sum") - \
            F.cross_entropy(batch.logits[rows], batch.labels[rows], reduction="sum")
        return swapped / len(batch.labels)

    def distillation(self, batch: Batch) -> torch.Tensor | None:
        """lambda x Powder's term from the round-start model on the plain forward (None: off)."""
        if self.teacher is None:
            return None
        model = self.rt.model
        prompt, head = model.prompt, model.head
        model.prompt, model.head = self.teacher  # type: ignore[assignment]
        try:
            with torch.no_grad():
                teacher = model.logits(model.features(batch.images, batch.query))
        finally:
            model.prompt, model.head = prompt, head
        teacher = teacher.masked_fill(~torch.isfinite(batch.logits), float("-inf"))
        t = self.opts.distill_temperature
        loss = classic_distillation(batch.logits, teacher, t) if self.opts.distill == "classic" else \
            dual_distillation(batch.logits, teacher, batch.labels, None, t)
        return self.opts.distill_lambda * loss

    def attached(self, positions: torch.Tensor, device: torch.device) -> dict[int, torch.Tensor]:
        """Each prompted block's compensation prompts of the classes at ``positions`` (B, Lc, D)."""
        assert self.compensation is not None
        return {layer: comp[positions.to(comp.device)].to(device) for layer, comp in self.compensation.items()}

    @torch.no_grad()
    def queries_of(self, index: np.ndarray, batch_size: int = 256) -> torch.Tensor:
        """q(x) of the stored training images ``index`` (the query cache where it is on)."""
        rt, model = self.rt, self.rt.model
        cached = rt.queries("train", index)
        if cached is not None:
            return cached.float()
        out = []
        for start in range(0, len(index), batch_size):
            images = rt.data.train.images[index[start : start + batch_size]]
            x = model.preprocess(torch.from_numpy(images).to(rt.device))
            with rt.autocast():
                out.append(model.query(x).float())
        return torch.cat(out) if out else torch.zeros(0, model.embed_dim)

    @torch.no_grad()
    def histogram(self, queries: torch.Tensor, labels: np.ndarray, task: int) -> ArrayRecord:
        """H (blocks, components trained, task classes): the images' selections among the
        components the client trained of its task's slice (its part, with keep-all)."""
        prompt = self.prompt
        was_training = prompt.training
        prompt.eval()
        columns = prompt.task_columns()
        where = {int(c): i for i, c in enumerate(self.classes.tolist())}
        positions = np.array([where[int(c)] for c in labels], dtype=np.int64)
        try:
            hist = [selection_histogram(prompt.weights(queries, layer)[:, columns].float(), positions,
                                        len(self.classes), self.opts.histogram, self.opts.histogram_k)
                    for layer in prompt.layers]
        finally:
            prompt.train(was_training)
        return to_array_record({"hist": np.stack(hist).astype(np.float32)})

    def train_compensation(self, task: int) -> dict[int, torch.Tensor]:
        """LCDC (figure (c)): the task's compensation prompts trained on the client's images of the
        classes with a global distribution, the discriminative prompts and the head frozen.

        ``comp-schedule = "once"``: the class tokens alone (figure (c)'s token row), seeded by
        (run seed, client, task), on the client's round-0 share: a function of the task, the
        client and the distributions sent, not of the round. ``"every-round"``: seeded by the fit,
        on its share, with the round's discriminative prompts attached."""
        rt, model, prompt = self.rt, self.rt.model, self.prompt
        once = self.opts.comp_schedule == "once"
        seed = [self.run.seed, self.seed[1], task, 0] if once else list(self.seed)
        length = self.opts.compensation_length(self.model.prompt_length)
        gen = torch.Generator().manual_seed(int(np.random.default_rng(seed + [0xC2C]).integers(2**31)))
        scale = 0.0 if self.opts.comp_attach == "add" else 0.02  # "add" starts from the plain prompt
        comps = {layer: torch.nn.Parameter((scale * torch.randn(len(self.classes), length, model.embed_dim,
                                                                generator=gen)).to(rt.device))
                 for layer in prompt.layers}
        index = client_indices(rt.data.train.labels, rt.layout, rt.partition, seed[1], task, seed[3])
        where = {int(c): i for i, c in enumerate(self.classes.tolist())}
        positions = np.array([where.get(int(c), -1) for c in rt.data.train.labels[index]], dtype=np.int64)
        keep = (positions >= 0) & self.has_global.numpy()[positions.clip(0)]
        index, positions = index[keep], positions[keep]
        if len(index) == 0 or self.opts.comp_epochs == 0:
            return {layer: c.detach() for layer, c in comps.items()}
        frozen = [p for p in model.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        optimizer = torch.optim.Adam(list(comps.values()), lr=self.opts.comp_lr or self.training.lr)
        rng = np.random.default_rng(seed + [0xC2D])
        # the platform's augmentation() is seeded by the fit; "once" needs the task's round-0 views
        augment = None if self.training.augment == "none" else np.random.default_rng(seed + [0xC2E])
        queries = rt.queries("train", index) if augment is None and not once else None
        var = None if self.opts.global_stats == "mean-only" else self.global_var
        model.eval()  # the discriminative prompts fixed: no training-mode detaching needed
        try:
            for _ in range(self.opts.comp_epochs):
                order = rng.permutation(len(index))
                for start in range(0, len(order), self.training.batch_size):
                    pos = order[start : start + self.training.batch_size]
                    x = self.inputs(rt.data.train.images[index[pos]], augment)
                    which = torch.from_numpy(positions[pos])
                    optimizer.zero_grad(set_to_none=True)
                    with rt.autocast():
                        # alone, the prompt reads no q(x): zeros stand in for it
                        q = torch.zeros(len(pos), model.embed_dim, device=x.device) if once else \
                            queries[pos] if queries is not None else model.query(x)
                        with prompt.compensated({layer: c[which.to(c.device)] for layer, c in comps.items()},
                                                self.model.prompt_mode == "prefix", alone=once):
                            feats = model.features(x, q)
                    loss = compensation_loss(feats, self.global_means[which].to(rt.device),
                                             None if var is None else var[which].to(rt.device), self.opts.comp_loss,
                                             self.opts.var_floor, which.to(rt.device))
                    loss.backward()
                    optimizer.step()
        finally:
            for p in frozen:
                p.requires_grad_(True)
        return {layer: c.detach() for layer, c in comps.items()}
