"""C2Prompt's client: LCDC, then the discriminative prompts trained with the compensation prompt
attached at random, then the uploads (q(x) class statistics when asked, the selection histogram).

Per fit (the figure's client side, in the project's reading where the figure is silent):

1. ``round_start``: with ``c2prompt.lcdc`` and global class distributions from the server, a
   compensation prompt per class of the task (and per prompted block) is trained for
   ``comp-epochs`` local epochs with the discriminative prompts and the head frozen, so that the
   compensated feature f_{x,p} of an image of class y fits class y's global distribution (L_d,
   ``comp-loss``). Clients keep no state between rounds (the platform's clients are stateless):
   the compensation prompts are drawn afresh (seeded) and trained each round; they never travel.
2. the shared loop trains the discriminative prompts and the head with cross-entropy; each image
   of a class with a compensation prompt has it attached with probability ``comp-prob`` (a seeded
   draw per image). The platform's loop computes the plain forward of every image; ``extra_loss``
   runs the compensated forward of the attached images and swaps their cross-entropy (it adds
   CE_compensated - CE_plain of each attached image), so each image's loss is exactly the
   forward it drew, at the cost of one more forward of the attached images.
3. ``round_end``: the per-class count, mean and variance of the frozen backbone's q(x) of the
   client's images when the server asks (the first round it sees the task), and the histogram H
   of its images' selections among the task's slice, per prompted block.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, RecordDict

from ...common.partitions import client_indices
from ...common.privacy import clip_rows, privacy_options
from ...common.records import arrays_of, config_of, from_array_record, to_array_record
from ..platform.learner import Batch, LocalLearner
from .cpa import selection_histogram
from .distributions import class_statistics, compensation_loss, empty_statistics
from .options import C2PromptOptions
from .prompt import C2PromptPrompt
from .records import CLASS_STATS, GLOBAL_STATS, HISTOGRAM, UPLOAD_STATS


class C2PromptLearner(LocalLearner):
    """Local learning with class distribution compensation; statistics and histograms uploaded."""

    options_class = C2PromptOptions
    opts: C2PromptOptions

    # ------------------------------------------------------------------ hooks
    def round_start(self, content: RecordDict, task: int) -> None:
        """Read what the server asks and sends; train the compensation prompts (LCDC)."""
        layout = self.rt.layout
        self.task = task
        self.upload_stats = bool(config_of(content).get(UPLOAD_STATS, False))
        self.classes = layout.classes(task)
        # head row of a batch label -> its class's position among the task's classes (-1: none)
        self.position = torch.full((layout.head_size,), -1, dtype=torch.long)
        self.position[torch.as_tensor(layout.head_targets(task, self.classes))] = torch.arange(len(self.classes))
        self.compensation: dict[int, torch.Tensor] | None = None
        self.has_global = torch.zeros(len(self.classes), dtype=torch.bool)
        self.draws = np.random.default_rng(list(self.seed) + [0xC2B])  # the per-image attachment draws
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
        """Each attached image's cross-entropy swapped for that of its compensated forward."""
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
        with self.prompt.compensated(self.attached(chosen, batch.images.device), self.cfg.prompt_mode == "prefix"):
            logits = model.logits(model.features(batch.images[rows], batch.query[rows]))
        allowed = torch.isfinite(batch.logits[0])
        logits = logits.masked_fill(~allowed[None, :], float("-inf"))
        swapped = F.cross_entropy(logits, batch.labels[rows], reduction="sum") - \
            F.cross_entropy(batch.logits[rows], batch.labels[rows], reduction="sum")
        return swapped / len(batch.labels)

    def round_end(self, index: np.ndarray, task: int) -> dict[str, ArrayRecord]:
        """The q(x) class statistics (empty unless asked) and the selection histogram."""
        queries = self.queries_of(index)
        labels = self.rt.data.train.labels[index]
        dim = queries.shape[1]
        if self.upload_stats:
            q = queries.double().cpu().numpy()
            dp = privacy_options(self.cfg)
            if dp.enabled:  # bounded queries bound the statistics (records.py says how)
                q = clip_rows(q, dp.clip)
            stats = class_statistics(q, labels)
        else:
            stats = empty_statistics(dim)
        return {CLASS_STATS: stats, HISTOGRAM: self.histogram(queries, labels, task)}

    def round_cleanup(self) -> None:
        self.compensation = None

    # ------------------------------------------------------------------ parts
    @property
    def prompt(self) -> C2PromptPrompt:
        prompt = self.rt.model.prompt
        assert isinstance(prompt, C2PromptPrompt)
        return prompt

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
        return torch.cat(out)

    @torch.no_grad()
    def histogram(self, queries: torch.Tensor, labels: np.ndarray, task: int) -> ArrayRecord:
        """H (blocks, slice components, task classes): the images' selections among the task's slice."""
        prompt = self.prompt
        was_training = prompt.training
        prompt.eval()
        rows = prompt.slice_of(task)
        where = {int(c): i for i, c in enumerate(self.classes.tolist())}
        positions = np.array([where[int(c)] for c in labels], dtype=np.int64)
        try:
            hist = [selection_histogram(prompt.weights(queries, layer)[:, rows].float(), positions, len(self.classes),
                                        self.opts.histogram, self.opts.histogram_k) for layer in prompt.layers]
        finally:
            prompt.train(was_training)
        return to_array_record({"hist": np.stack(hist).astype(np.float32)})

    def train_compensation(self, task: int) -> dict[int, torch.Tensor]:
        """LCDC (figure (c)): the task's compensation prompts trained on the client's images of the
        classes with a global distribution, the discriminative prompts and the head frozen."""
        rt, cfg, model, prompt = self.rt, self.cfg, self.rt.model, self.prompt
        length = self.opts.compensation_length(cfg.prompt_length)
        gen = torch.Generator().manual_seed(int(np.random.default_rng(list(self.seed) + [0xC2C]).integers(2**31)))
        scale = 0.0 if self.opts.comp_attach == "add" else 0.02  # "add" starts from the plain prompt
        comps = {layer: torch.nn.Parameter((scale * torch.randn(len(self.classes), length, model.embed_dim,
                                                                generator=gen)).to(rt.device))
                 for layer in prompt.layers}
        index = client_indices(rt.data.train.labels, rt.layout, rt.partition, self.seed[1], task, self.seed[3])
        where = {int(c): i for i, c in enumerate(self.classes.tolist())}
        positions = np.array([where.get(int(c), -1) for c in rt.data.train.labels[index]], dtype=np.int64)
        keep = (positions >= 0) & self.has_global.numpy()[positions.clip(0)]
        index, positions = index[keep], positions[keep]
        if len(index) == 0 or self.opts.comp_epochs == 0:
            return {layer: c.detach() for layer, c in comps.items()}
        frozen = [p for p in model.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        optimizer = torch.optim.Adam(list(comps.values()), lr=self.opts.comp_lr or cfg.lr)
        rng = np.random.default_rng(list(self.seed) + [0xC2D])
        augment = self.augmentation(0xC2E)
        queries = rt.queries("train", index) if augment is None else None
        var = None if self.opts.global_stats == "mean-only" else self.global_var
        model.eval()  # the discriminative prompts fixed: no training-mode detaching needed
        try:
            for _ in range(self.opts.comp_epochs):
                order = rng.permutation(len(index))
                for start in range(0, len(order), cfg.batch_size):
                    pos = order[start : start + cfg.batch_size]
                    x = self.inputs(rt.data.train.images[index[pos]], augment)
                    which = torch.from_numpy(positions[pos])
                    optimizer.zero_grad(set_to_none=True)
                    with rt.autocast():
                        q = queries[pos] if queries is not None else model.query(x)
                        with prompt.compensated({layer: c[which.to(c.device)] for layer, c in comps.items()},
                                                cfg.prompt_mode == "prefix"):
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
