"""What HePCo's pseudo-latents are: teacher accuracies on them, and (``hepco.diagnostics``) the
round's consolidation measured on real images of the server's central data."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from ...common.model.runtime import Runtime
from ...common.records import to_array_record, to_torch
from .distill import set_sampling_mode
from .latents import LatentGenerator, Teachers

if TYPE_CHECKING:  # the runtime (data, backbone) is built by the strategy, for diagnostics only
    from ...common.model.runtime import Runtime


@torch.no_grad()
def sample_latents(gen: LatentGenerator, classes: torch.Tensor, per_class: int, mode: str,
                   rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` pseudo-latents of every class in ``classes``, sampled as distillation samples them."""
    set_sampling_mode([gen], mode)
    labels = classes.repeat_interleave(per_class)
    return gen.sample(labels, rng), labels


@torch.no_grad()
def teacher_accuracy(teachers: Teachers, z: torch.Tensor, labels: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Per teacher (C,): accuracy (%) of its head over ``classes`` on latents ``z`` of ``labels``.

    Whether a generator's latents are recognisable as their classes by the heads it was fitted
    against: the minimum a latent must do before distillation can transfer anything.
    """
    pred = teachers.logits(z, classes).argmax(-1) + classes[0]
    return (pred == labels[None]).float().mean(-1) * 100


class RealDataProbe:
    """The round's consolidation measured on real images (``hepco.diagnostics``; never trained on).

    The server distils prompts and head on pseudo-latents of the *query* space, while at
    test time the head sees the *prompted* features of real images. The probe takes up to
    ``per_class`` training images of each seen class (seeded) from the server's central
    data and reports:

    * ``real-query-feature-cos``: mean cosine between q(x) and the prompted feature f(x)
      (distilled prompts), and ``real-prompt-shift``: mean ||f(x) - q(x)|| over the mean
      distance of q(x) to its mean: how far the head's test-time input is from the query space;
    * ``latent-{query,feature}-cos-{old,new}``: mean over classes of the cosine between
      the class's mean pseudo-latent and its mean real q(x) / f(x);
      ``latent-{query,feature}-ncm-{old,new}``: accuracy (%) of assigning each
      pseudo-latent to the class with the nearest (cosine) real mean; and
      ``latent-feature-norm-ratio``: mean ||z|| over mean ||f(x)||;
    * ``real-{old,new}-acc-{provisional,distilled-head,distilled-prompts,distilled}``:
      accuracy (%) on real prompted features, all seen classes competing (as evaluation
      does), of the provisional model, with only its head distilled, with only its prompts
      distilled, and fully distilled: what each distillation does to old and new classes;
    * ``real-query-{old,new}-acc-distilled``: the distilled head on real q(x) (the space
      it was distilled in).
    """

    def __init__(self, runtime: Runtime, seed: int, per_class: int) -> None:
        self.rt = runtime  # the server's central evaluation runtime (``get_runtime``, cached)
        self.seed, self.per_class = seed, per_class

    def images(self, classes: np.ndarray) -> np.ndarray:
        """Up to ``per_class`` training-image indices of each class (seeded, same every round)."""
        labels = self.rt.data.train.labels
        rng = np.random.default_rng([self.seed, 0xD1A6])
        picks = []
        for c in classes:
            idx = np.flatnonzero(labels == c)
            picks.append(np.sort(rng.permutation(idx)[: self.per_class]) if len(idx) else idx)
        return np.concatenate(picks) if picks else np.zeros(0, np.int64)

    @torch.no_grad()
    def features(self, state: dict[str, np.ndarray], index: np.ndarray, task: int,
                 batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """(q(x), f(x)) of training images ``index`` under the prompts of ``state`` (float32, CPU)."""

        rt, model = self.rt, self.rt.model
        model.load_trainable_state(to_torch(to_array_record(state)))
        model.prompt.set_task(task)
        model.eval()
        queries = rt.queries("train", index)
        qs, fs = [], []
        for start in range(0, len(index), batch):
            x = model.preprocess(torch.from_numpy(rt.data.train.images[index[start : start + batch]]).to(rt.device))
            with rt.autocast():
                q = queries[start : start + batch] if queries is not None else model.query(x)
                f = model.features(x, q)
            qs.append(q.float().cpu())
            fs.append(f.float().cpu())
        return torch.cat(qs), torch.cat(fs)

    def measure(
        self,
        provisional: dict[str, np.ndarray],
        distilled: dict[str, np.ndarray],
        task: int,
        seen: np.ndarray,
        old: np.ndarray,
        latents: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> dict[str, float]:
        """The metrics above; ``latents`` maps ``"old"`` / ``"new"`` to (pseudo-latents, labels)."""
        index = self.images(seen)
        y = torch.as_tensor(self.rt.data.train.labels[index])
        is_old = torch.as_tensor(np.isin(y.numpy(), old))
        q, f_prov = self.features(provisional, index, task)
        _, f_dist = self.features(distilled, index, task)
        seen_t = torch.as_tensor(seen)
        out: dict[str, float] = {}

        def acc(feats: torch.Tensor, head: dict[str, np.ndarray], part: torch.Tensor) -> float:
            w, b = torch.from_numpy(head["head.weight"][seen]), torch.from_numpy(head["head.bias"][seen])
            pred = seen_t[(feats[part] @ w.T + b).argmax(1)]
            return float((pred == y[part]).float().mean() * 100) if part.any() else float("nan")

        for name, part in (("old", is_old), ("new", ~is_old)):
            if not part.any():
                continue
            out[f"real-{name}-acc-provisional"] = acc(f_prov, provisional, part)
            out[f"real-{name}-acc-distilled-head"] = acc(f_prov, distilled, part)
            out[f"real-{name}-acc-distilled-prompts"] = acc(f_dist, provisional, part)
            out[f"real-{name}-acc-distilled"] = acc(f_dist, distilled, part)
            out[f"real-query-{name}-acc-distilled"] = acc(q, distilled, part)
        out["real-query-feature-cos"] = float(F.cosine_similarity(q, f_dist, dim=-1).mean())
        # Cosines of ViT features share a large common component; the prompts' shift against
        # the spread of the queries says how far apart the two spaces really are.
        out["real-prompt-shift"] = float((f_dist - q).norm(dim=-1).mean() / (q - q.mean(0)).norm(dim=-1).mean())

        # Pseudo-latents against the real class means of both spaces.
        means = {
            "query": torch.stack([q[y == c].mean(0) for c in seen]),
            "feature": torch.stack([f_dist[y == c].mean(0) for c in seen]),
        }
        for name, (z, labels) in latents.items():
            z, labels = z.float().cpu(), labels.cpu()
            pos = torch.searchsorted(seen_t, labels)  # seen is ascending
            for space, mu in means.items():
                cos = F.normalize(z, dim=-1) @ F.normalize(mu, dim=-1).T  # (B, |seen|)
                out[f"latent-{space}-ncm-{name}"] = float((cos.argmax(1) == pos).float().mean() * 100)
                classes = labels.unique()
                z_mean = torch.stack([z[labels == c].mean(0) for c in classes])
                out[f"latent-{space}-cos-{name}"] = float(
                    F.cosine_similarity(z_mean, mu[torch.searchsorted(seen_t, classes)], dim=-1).mean()
                )
            out[f"latent-feature-norm-ratio-{name}"] = float(z.norm(dim=-1).mean() / f_dist.norm(dim=-1).mean())
        return out
