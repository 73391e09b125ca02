"""Differential privacy: options, the client-side Gaussian mechanism and the accountant.

Run-config keys (namespace ``dp``; absent or ``dp.clip = 0``: off, the default):

* ``dp.clip`` C, the L2 bound of every uploaded quantity;
* ``dp.noise-multiplier`` z (0 with a clip: clipping only, no guarantee, epsilon null);
* ``dp.delta`` the delta of the reported (epsilon, delta) guarantee (1e-5).

Adjacency: client-level. Two federations are adjacent when they differ in one client's whole
local data: the client is present (its upload carries its contribution) or absent (it
contributes nothing: no update, no statistics), as in DP-FedAvg ("Learning Differentially
Private Recurrent Language Models", McMahan et al., section 2). A client's contribution is k
quantities (the update of the prompt/head arrays relative to the arrays it received, plus
each per-class statistic its method uploads), quantity j clipped to an L2 bound S_j. Scaled by
1/S_j each has norm <= 1, so the whole upload has L2 sensitivity sqrt(k) in those units; the
client adds N(0, (z sqrt(k) S_j)^2) to every coordinate of quantity j, which makes its whole
upload a Gaussian mechanism with noise multiplier z ("The Algorithmic Foundations of
Differential Privacy", Dwork and Roth, Appendix A; scaling each quantity to a unit bound is
what lets quantities of different units, such as means and covariances, share one mechanism).
Everything the server computes from the uploads (averages, HGP's mixtures and rebalancing,
FPPL's debiasing, HePCo's distillation) is post-processing.

What the guarantee does not cover, by design:

* the label histogram: which classes a client holds, their per-class counts and
  ``num-examples`` travel in the clear (the server's reply checks need them exact, and the
  averages weigh by them); the guarantee is for the data given those counts;
* federated evaluation's correct/total counts on a node's held-out data;
* ``train-loss`` is data-dependent and is therefore not released: it is sent as 0.

Under replace-one adjacency (the client's data swapped for other data, the client present in
both) the sensitivity doubles: the reported epsilon then holds for noise multiplier z / 2.

Accounting (:func:`epsilon`): opacus's RDP accountant (Renyi DP of the sampled Gaussian
mechanism, "Renyi Differential Privacy of the Sampled Gaussian Mechanism", Mironov et al.),
composed over every training attempt of the run (all tasks; a retried round releases twice),
each at the sampling rate it actually had: q = sampled / population at sampling time. With a
virtual population that is clients-per-round / num-clients in every round; with ``population =
"nodes"`` the population is the nodes connected when the round samples, so after a node drops
out the rate rises (2 of 3 nodes, q = 2/3; 2 of the 2 left, q = 1), and each round records the
rate it had (``sample_rates``, one per attempt). The server samples clients without
replacement; that is accounted as Poisson sampling at rate q, the usual approximation. With
q = 1 there is no amplification. Amplification by sampling assumes the observer does not
know which clients were sampled: the server does, and the sample is a function of the run's
seed (so that runs reproduce), so anyone holding the configuration does too. results.json
therefore also carries the epsilon without amplification (q = 1), the guarantee against the
server and against anyone who knows the configuration; ``epsilon`` (with q) holds only against
an observer of the released model who knows neither.

Noise is drawn on the client from NumPy's generator seeded with the operating system's entropy
(a seed the server knows would let it subtract the noise), so runs with
``dp.noise-multiplier > 0`` are not bit-reproducible. It is a research mechanism: the
generator is not cryptographic and floating-point Gaussian sampling is not hardened against
precision attacks.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from .config.experiment import DP_NAMESPACE, ConfigError, ExperimentConfig
from .config.options import MethodOptions
from .records import ARRAYS, METRICS, arrays_of, from_array_record, to_array_record

NAMESPACE = DP_NAMESPACE
MECHANISM = "gaussian, client-side, client-level"
ACCOUNTANT = "opacus RDPAccountant (RDP of the Poisson-sampled Gaussian mechanism)"


@dataclass
class PrivacyOptions(MethodOptions):
    """``dp.*`` run-config keys (see the module docstring)."""

    prefix: ClassVar[str] = NAMESPACE
    clip: float = 0.0  # C; 0: differential privacy off
    noise_multiplier: float = 0.0  # z
    delta: float = 1e-5

    @property
    def enabled(self) -> bool:
        return self.clip > 0

    def validate(self) -> None:
        for key, value in (("dp.clip", self.clip), ("dp.noise-multiplier", self.noise_multiplier)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{key} must be a finite number >= 0, got {value}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"dp.delta must be in (0, 1), got {self.delta}")
        if self.noise_multiplier > 0 and not self.enabled:
            raise ConfigError("dp.noise-multiplier is set but dp.clip is 0: noise is calibrated to the clip bound, "
                              "so set dp.clip > 0 (or drop dp.noise-multiplier)")


def privacy_options(cfg: ExperimentConfig) -> PrivacyOptions:
    """The run's ``dp.*`` options (ConfigError on unknown keys or bad values)."""
    return PrivacyOptions.from_options(cfg.method_options(NAMESPACE))


def privacy_refused(method: str, reason: str) -> ConfigError:
    """The error that refuses ``dp.*`` to a method whose upload cannot be bounded (``reason``: why)."""
    return ConfigError(f"strategy {method!r} does not support differential privacy (dp.*): {reason}")


def check_privacy(opts: PrivacyOptions, num_clients: int, method: str, refusal: str) -> PrivacyOptions:
    """The run's options ``opts``, refused when DP is on and the method cannot bound its upload
    (``refusal`` says why; "" when it can) or ``dp.delta`` is not below 1 / num-clients
    (client-level: a delta that large allows releasing one client's data outright). Called by
    strategies/platform/run_checks.py, the one check of a run."""
    if opts.enabled and refusal:
        raise privacy_refused(method, refusal)
    if opts.enabled and opts.delta >= 1 / num_clients:
        raise ConfigError(f"dp.delta = {opts.delta} must be below 1 / num-clients = {1 / num_clients:.3g}")
    return opts


@dataclass(frozen=True)
class PrivateRecord:
    """How a method's extra upload record is privatised: which arrays hold one bounded quantity
    per row (name -> (power, factor): each row's L2 bound is factor * C**power) and which are
    public metadata (classes, counts, ids). Any other array in the record is an error."""

    bounded: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    public: tuple[str, ...] = ()


def clip_rows(x: np.ndarray, bound: float) -> np.ndarray:
    """``x`` (float64) with every row (``x[i]``, flattened; a 1-D array is one row) scaled down to
    L2 norm <= ``bound``, direction kept; rows already inside are unchanged."""
    x = np.asarray(x, dtype=np.float64)
    rows = x.reshape(x.shape[0], math.prod(x.shape[1:])) if x.ndim > 1 else x.reshape(1, -1)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    scale = np.minimum(1.0, bound / np.maximum(norms, np.finfo(np.float64).tiny))
    return (rows * scale).reshape(x.shape)


def gaussian_mechanism(quantities: list[np.ndarray], bounds: list[float], noise_multiplier: float,
                       rng: np.random.Generator) -> list[np.ndarray]:
    """Clip quantity j to L2 norm ``bounds[j]`` and add N(0, (z sqrt(k) bounds[j])^2) per coordinate.

    The k quantities together are one Gaussian mechanism with noise multiplier z w.r.t. their
    joint sensitivity (module docstring). Returns float64 arrays of the quantities' shapes.
    """
    scale = noise_multiplier * math.sqrt(len(quantities))
    out = []
    for q, bound in zip(quantities, bounds):
        clipped = clip_rows(np.asarray(q).reshape(-1), bound).reshape(np.shape(q))
        out.append(clipped + rng.normal(0.0, scale * bound, clipped.shape) if scale > 0 else clipped)
    return out


def privatise_reply(reply: RecordDict, received: ArrayRecord, records: Mapping[str, PrivateRecord],
                    opts: PrivacyOptions, rng: np.random.Generator) -> RecordDict:
    """A client's train reply as the Gaussian mechanism releases it (in place; returned).

    ``arrays`` becomes received + the noisy clipped update (the server sees arrays as before);
    every row of each bounded array of ``records`` is clipped and noised; ``train-loss`` is
    zeroed. ``received`` is the ``arrays`` record the client was sent.
    """
    sent = from_array_record(received)
    mine = from_array_record(arrays_of(reply))
    if list(mine) != list(sent) or any(mine[k].shape != sent[k].shape for k in mine):
        raise ValueError("dp: the reply's arrays do not match the arrays received, so there is no update to clip")
    update = np.concatenate([(mine[k].astype(np.float64) - sent[k]).reshape(-1) for k in mine])
    quantities, bounds, places = [update], [opts.clip], []  # places: (record, array, row) of each later quantity
    extras: dict[str, dict[str, np.ndarray]] = {}
    for name in reply.array_records:
        if name == ARRAYS:
            continue
        spec = records.get(name)
        if spec is None:
            raise ValueError(f"dp: upload record {name!r} has no declared privacy bound")
        extras[name] = arrays = {k: np.array(v) for k, v in from_array_record(arrays_of(reply, name)).items()}
        for key, value in arrays.items():
            if key in spec.public:
                continue
            if key not in spec.bounded:
                raise ValueError(f"dp: array {key!r} of record {name!r} has no declared privacy bound")
            power, factor = spec.bounded[key]
            for row in range(len(value)):
                quantities.append(value[row])
                bounds.append(factor * opts.clip ** power)
                places.append((name, key, row))
    released = gaussian_mechanism(quantities, bounds, opts.noise_multiplier, rng)
    offset = 0
    for k in mine:
        size = mine[k].size
        mine[k] = (sent[k] + released[0][offset:offset + size].reshape(mine[k].shape)).astype(mine[k].dtype)
        offset += size
    reply[ARRAYS] = to_array_record(mine)
    for (name, key, row), value in zip(places, released[1:]):
        extras[name][key][row] = value  # cast to the array's dtype (float16 transport included)
    for name, arrays in extras.items():
        reply[name] = to_array_record(arrays)
    if METRICS in reply.metric_records and "train-loss" in reply.metric_records[METRICS]:
        reply.metric_records[METRICS]["train-loss"] = 0.0  # data-dependent, outside the mechanism: not released
    return reply


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float | None:
    """Epsilon of ``steps`` compositions of the sampled Gaussian mechanism (opacus's RDP accountant);
    0 before any step, None (no guarantee) without noise."""
    if steps == 0:
        return 0.0
    if noise_multiplier <= 0:
        return None
    # opacus is slow to import: only a run with dp.* builds an accountant
    from opacus.accountants import RDPAccountant  # heavy import: only runs with DP on pay it

    accountant = RDPAccountant()
    accountant.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    return float(accountant.get_epsilon(delta))


def composed_epsilon(noise_multiplier: float, sample_rates: Sequence[float], delta: float) -> float | None:
    """Epsilon of one sampled Gaussian mechanism per entry of ``sample_rates``, each at its own rate
    (opacus's RDP accountant composes the steps of each rate); 0 before any step, None without noise."""
    if not sample_rates:
        return 0.0
    if noise_multiplier <= 0:
        return None
    # opacus is slow to import: only a run with dp.* builds an accountant
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    steps = Counter(float(q) for q in sample_rates)
    accountant.history = [(float(noise_multiplier), q, n) for q, n in sorted(steps.items())]
    return float(accountant.get_epsilon(delta))


def privacy_report(opts: PrivacyOptions, sample_rates: Sequence[float], nominal_rate: float,
                   most_uploads: int | None = None) -> dict[str, Any]:
    """results.json's ``privacy``: ``{"enabled": false}`` with DP off, else the guarantee so far.

    Parameters
    ----------
    opts : PrivacyOptions
        The run's ``dp.*`` options.
    sample_rates : sequence of float
        The sampling rate of every training attempt so far, as it was at sampling time.
    nominal_rate : float
        clients-per-round / num-clients, what the rates are without drop-outs.
    most_uploads : int, optional
        Uploads of the most-sampled client (the guarantee against the server).
    """
    if not opts.enabled:
        return {"enabled": False}
    steps = len(sample_rates)
    return {
        "enabled": True,
        "epsilon": composed_epsilon(opts.noise_multiplier, sample_rates, opts.delta),
        # against an observer who knows which clients were sampled (the server, or anyone holding
        # the run's seed): no amplification, composed over the uploads of the most-sampled client
        "epsilon_against_server": epsilon(
            opts.noise_multiplier, 1.0, steps if most_uploads is None else most_uploads, opts.delta
        ),
        "most_uploads_per_client": most_uploads,
        "delta": opts.delta,
        "mechanism": MECHANISM,
        "accountant": ACCOUNTANT,
        "clip": opts.clip,
        "noise_multiplier": opts.noise_multiplier,
        # the highest rate any attempt had (the nominal one when nodes dropped out nowhere)
        "sample_rate": max(sample_rates, default=nominal_rate),
        "sample_rate_nominal": nominal_rate,
        "rounds": steps,
    }


__all__ = [
    "ACCOUNTANT",
    "MECHANISM",
    "NAMESPACE",
    "PrivacyOptions",
    "PrivateRecord",
    "check_privacy",
    "clip_rows",
    "composed_epsilon",
    "epsilon",
    "gaussian_mechanism",
    "privacy_options",
    "privacy_refused",
    "privacy_report",
    "privatise_reply",
]
