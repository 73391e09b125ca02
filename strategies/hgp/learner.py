"""HGP's client: the shared local loop, then a generative prototype per local class.

Local learning is the shared loop (CE over the current task's classes) with HGP's
prompt module (keys only, normalised cosine weights; see prompt.py). After
training, the client runs its local data through the prompted model once more and
uploads, for every class it holds, the sample count, mean and covariance of the
prompted pre-logit features as the ``class-stats`` record (paper section 3.2.2). With
``augment = "crop-flip"`` the statistics are still taken over the stored images (the
features the head is evaluated on); option ``stats-augment`` takes them over one augmented
view of each image instead (wider covariances, shifted means). With differential privacy
(``dp.clip`` C) every feature is clipped to norm C before the statistics are taken, which
bounds them (the client's train path then adds the noise, common/privacy.py).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord

from ...common.privacy import clip_rows
from ..platform.learner import LocalLearner
from .gaussians import class_statistics
from .options import HGPOptions
from .records import STATS


class HGPLearner(LocalLearner):
    """FedAvg-Prompt local learning plus per-class feature statistics (generative prototypes).

    Parameters
    ----------
    runtime : Runtime
        Data, model, device and query cache of this process.
    options : HGPOptions
        ``hgp.*`` options; the covariance encoding is read here.
    """

    opts: HGPOptions

    @torch.no_grad()
    def prompted_features(self, index: np.ndarray, task: int,
                          batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompted features (N, D) and labels (N,) of the training samples ``index``, eval mode.

        With ``augment`` on and ``hgp.stats-augment``, each image is seen through one augmented
        view (seeded, a stream of its own), as the client's training pipeline shows it; q(x) is
        then computed on the view. Otherwise the stored images (query cache allowed).
        """
        rt, model = self.rt, self.rt.model
        model.eval()
        augment = self.augmentation(0x57A75) if self.opts.stats_augment else None
        queries = rt.queries("train", index) if augment is None else None
        feats = []
        for start in range(0, len(index), batch_size):
            sel = index[start : start + batch_size]
            x = self.inputs(rt.data.train.images[sel], augment)
            q = queries[start : start + batch_size] if queries is not None else model.query(x)
            feats.append(model.features(x, q).float().cpu())
        return torch.cat(feats), torch.as_tensor(self.labels_of(index, task))

    def round_end(self, index: np.ndarray, task: int) -> dict[str, ArrayRecord]:
        """Upload the generative prototypes of this client's classes."""
        features, labels = self.prompted_features(index, task)
        dp = self.privacy
        if dp.enabled:  # bounded features bound the statistics (HGPStrategy.private_records says how)
            features = torch.from_numpy(clip_rows(features.numpy(), dp.clip))
        return {STATS: class_statistics(features, labels, self.opts)}
