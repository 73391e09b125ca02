"""Differential privacy (common/privacy.py): accountant, clipping, noise scale, configuration, end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from promptfcl.client.app import private_upload
from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.privacy import (
    PrivacyOptions,
    PrivateRecord,
    clip_rows,
    epsilon,
    gaussian_mechanism,
    privacy_options,
    privacy_report,
    privatise_reply,
)
from promptfcl.common.records import ARRAYS, CONFIG, METRICS, from_array_record, to_array_record
from promptfcl.server.report import table
from promptfcl.strategies.fppl.strategy import LOCAL_PROTOTYPES
from promptfcl.strategies.hgp.strategy import STATS, HGPStrategy
from promptfcl.strategies.platform.run_checks import load_config
from promptfcl.strategies.registry import learner_class, prompt_class
from tests.conftest import TINY, tiny_config
from tests.helpers import simulate_in_process


def opacus_epsilon(z: float, q: float, steps: int, delta: float) -> float:
    """The library's own figure, computed step by step through its RDP analysis functions."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    alphas = RDPAccountant.DEFAULT_ALPHAS
    eps, _ = get_privacy_spent(orders=alphas, rdp=compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=alphas),
                               delta=delta)
    return float(eps)


def norms(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return np.linalg.norm(x.reshape(x.shape[0], math.prod(x.shape[1:])), axis=1)


# ---------------------------------------------------------------------------- (a) accountant
@pytest.mark.parametrize("z,q,steps,delta", [(1.1, 0.3, 40, 1e-5), (0.8, 1.0, 10, 1e-6), (2.0, 0.05, 500, 1e-5)])
def test_epsilon_is_the_libraries_figure(z, q, steps, delta):
    assert epsilon(z, q, steps, delta) == pytest.approx(opacus_epsilon(z, q, steps, delta), rel=1e-9)


def test_dp_off_reports_disabled():
    assert privacy_report(PrivacyOptions(), [0.5] * 10, 0.5) == {"enabled": False}


def test_epsilon_grows_with_rounds_and_shrinks_with_noise_and_sampling():
    assert epsilon(1.0, 0.5, 0, 1e-5) == 0.0 and epsilon(0.0, 0.5, 10, 1e-5) is None  # no noise: no guarantee
    assert epsilon(1.0, 0.5, 10, 1e-5) < epsilon(1.0, 0.5, 20, 1e-5)
    assert epsilon(2.0, 0.5, 10, 1e-5) < epsilon(1.0, 0.5, 10, 1e-5)
    assert epsilon(1.0, 0.2, 10, 1e-5) < epsilon(1.0, 1.0, 10, 1e-5)


# ---------------------------------------------------------------------------- (b) clipping bounds
def test_clipping_bounds_every_row_and_leaves_rows_inside_unchanged():
    rng = np.random.default_rng(7)
    for case in range(400):
        rows, dim = int(rng.integers(1, 20)), int(rng.integers(1, 300))
        x = rng.normal(size=(rows, dim)) * 10.0 ** rng.uniform(-6, 6, size=(rows, 1))
        bound = 10.0 ** rng.uniform(-3, 3)
        clipped = clip_rows(x, bound)
        assert (norms(clipped) <= bound * (1 + 1e-12)).all(), case
        inside = norms(x) <= bound
        np.testing.assert_array_equal(clipped[inside], x[inside])
        outside = ~inside  # clipped rows keep their direction and land on the bound
        np.testing.assert_allclose(norms(clipped[outside]), bound, rtol=1e-12)
        np.testing.assert_allclose(clipped[outside] * norms(x[outside])[:, None] / bound, x[outside], rtol=1e-9)
    assert (clip_rows(np.zeros((3, 4)), 1.0) == 0).all()


def test_noiseless_mechanism_is_the_identity_inside_the_bounds():
    rng = np.random.default_rng(8)
    for _ in range(100):
        bounds = list(10.0 ** rng.uniform(-2, 2, size=int(rng.integers(1, 8))))
        quantities = [rng.normal(size=int(rng.integers(1, 50))) for _ in bounds]
        quantities = [q * rng.uniform(0, b) / np.linalg.norm(q) for q, b in zip(quantities, bounds)]
        for q, out in zip(quantities, gaussian_mechanism(quantities, bounds, 0.0, rng)):
            np.testing.assert_allclose(out, q, rtol=1e-12, atol=0)


def fit_and_release(strategy: str, clip: float, **options):
    """One real client fit (task 0, client 0, tiny configuration) and its upload through the
    ClientApp's shared DP path with no noise: (raw reply, released reply, received arrays)."""
    from promptfcl.common.model.runtime import get_runtime

    cfg = tiny_config(strategy=strategy, **{"dp.clip": clip, **options})
    rt = get_runtime(cfg, prompt_class(strategy))
    learner = learner_class(strategy).of(cfg, rt, cfg.method_options(strategy))
    received = to_array_record(rt.model.trainable_state())
    content = RecordDict({ARRAYS: received, CONFIG: ConfigRecord({"task": 0, "round": 0, "client-id": 0})})
    raw = learner.fit(content, task=0, round_=0, client_id=0)
    raw_copy = RecordDict({name: to_array_record(from_array_record(raw[name])) for name in raw.array_records})
    reference = learner.update_reference(received, 0)  # what the reply's arrays update (FPPL: its task's prompt)
    released = private_upload(raw, reference, np.random.default_rng(0), privacy_options(cfg), strategy)
    return raw_copy, released, from_array_record(reference)


def update_norm(reply: RecordDict, received: dict[str, np.ndarray]) -> float:
    arrays = from_array_record(reply[ARRAYS])
    return float(np.sqrt(sum(((arrays[k].astype(np.float64) - received[k]) ** 2).sum() for k in arrays)))


@pytest.mark.parametrize("strategy", ["fedavg", "fppl", "hgp"])
def test_a_real_fit_uploads_only_bounded_quantities(strategy):
    clip = 0.05
    raw, released, received = fit_and_release(strategy, clip, **{"dp.noise-multiplier": 0.0})
    assert update_norm(raw, received) > clip  # the bound binds: training moved further than C
    assert update_norm(released, received) <= clip * (1 + 1e-5)
    assert released[METRICS]["train-loss"] == 0.0
    if strategy == "fppl":
        assert (norms(from_array_record(released[LOCAL_PROTOTYPES])["means"]) <= clip * (1 + 1e-5)).all()
    if strategy == "hgp":
        # the features were clipped before the statistics: the raw statistics are inside the
        # declared bounds already (C for means, 2 C^2 for covariances)
        for reply in (raw, released):
            stats = from_array_record(reply[STATS])
            assert (norms(stats["means"]) <= clip * (1 + 1e-5)).all()
            assert (norms(stats["cov-triu"]) <= 2 * clip**2 * (1 + 1e-5)).all()
        assert HGPStrategy.private_records[STATS].bounded["cov-triu"] == (2, 2.0)


def test_every_uploaded_array_needs_a_declared_bound():
    opts = PrivacyOptions(clip=1.0)
    arrays = to_array_record({"w": np.zeros(3, np.float32)})
    reply = RecordDict({ARRAYS: arrays, "extra": to_array_record({"means": np.ones((2, 3))})})
    with pytest.raises(ValueError, match="record 'extra' has no declared privacy bound"):
        privatise_reply(reply, arrays, {}, opts, np.random.default_rng(0))
    with pytest.raises(ValueError, match="array 'means' of record 'extra'"):
        privatise_reply(reply, arrays, {"extra": PrivateRecord(public=("classes",))}, opts, np.random.default_rng(0))


# ---------------------------------------------------------------------------- (c) noise scale
def test_noise_has_the_calibrated_scale_for_the_whole_upload():
    rng = np.random.default_rng(11)
    clip, z, classes, dim, size = 0.5, 0.7, 3, 4000, 30000
    received = to_array_record({"a": rng.normal(size=size // 2).astype(np.float32),
                                "b": rng.normal(size=(size // 200, 100)).astype(np.float32)})
    trained = {k: v + 1e-4 * rng.normal(size=v.shape).astype(np.float32) for k, v in from_array_record(received).items()}
    stats = {"classes": np.arange(classes), "counts": np.full(classes, 5),
             "means": 1e-4 * rng.normal(size=(classes, dim)), "cov-diag": 1e-4 * rng.normal(size=(classes, dim))}
    reply = RecordDict({ARRAYS: to_array_record(trained), STATS: to_array_record(stats),
                        METRICS: MetricRecord({"num-examples": 15, "train-loss": 1.0})})
    out = privatise_reply(reply, received, HGPStrategy.private_records, PrivacyOptions(clip=clip, noise_multiplier=z),
                          np.random.default_rng(12))
    k = 1 + 2 * classes  # the update, each class's mean and each class's covariance
    sent = from_array_record(received)
    noise = {"update": np.concatenate([(from_array_record(out[ARRAYS])[n].astype(np.float64) - sent[n]
                                        - (trained[n] - sent[n])).ravel() for n in sent]),
             "means": (from_array_record(out[STATS])["means"] - stats["means"]).ravel(),
             "cov-diag": (from_array_record(out[STATS])["cov-diag"] - stats["cov-diag"]).ravel()}
    expected = {"update": z * math.sqrt(k) * clip, "means": z * math.sqrt(k) * clip,
                "cov-diag": z * math.sqrt(k) * 2 * clip**2}
    for name, values in noise.items():
        std = expected[name]
        # float32 arrays round the update's noise (relative 1e-7); the std estimate's standard
        # error is std / sqrt(2 n): 5 of them, and 5 standard errors for the mean
        assert values.std() == pytest.approx(std, rel=5 / math.sqrt(2 * values.size)), name
        assert abs(values.mean()) < 5 * std / math.sqrt(values.size), name
    np.testing.assert_array_equal(from_array_record(out[STATS])["counts"], stats["counts"])  # public


# ---------------------------------------------------------------------------- (d) configuration
def config_pairs(**settings) -> list[str]:
    return [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in {**TINY, **settings}.items()]


@pytest.mark.parametrize("settings,message", [
    ({"dp.clip": -1.0}, "dp.clip must be a finite number >= 0"),
    ({"dp.clip": 1.0, "dp.noise-multiplier": -0.5}, "dp.noise-multiplier must be a finite number >= 0"),
    ({"dp.noise-multiplier": 1.0}, "dp.noise-multiplier is set but dp.clip is 0"),
    ({"dp.clip": 1.0, "dp.delta": 0.0}, r"dp.delta must be in \(0, 1\)"),
    ({"dp.clip": 1.0, "dp.delta": 1.0}, r"dp.delta must be in \(0, 1\)"),
    ({"dp.clip": 1.0, "dp.delta": 0.4}, "must be below 1 / num-clients"),
    ({"dp.clipp": 1.0}, "unknown option dp.clipp"),
    ({"dp.clip": "big"}, "dp.clip = 'big' is not a valid float"),
])
def test_bad_privacy_settings_are_refused_naming_the_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, config_pairs(**settings), "fedavg")


def test_methods_that_cannot_bound_their_upload_refuse_dp():
    with pytest.raises(ConfigError, match="strategy 'powder' does not support differential privacy.*measuring"):
        load_config(None, config_pairs(**{"dp.clip": 1.0, "dp.noise-multiplier": 1.0}), "powder")
    with pytest.raises(ConfigError, match="strategy 'hgp' does not support .*lowrank"):
        load_config(None, config_pairs(**{"dp.clip": 1.0, "hgp.cov-type": "lowrank"}), "hgp")
    for method in ("fedavg", "fedcprompt", "hepco", "hgp", "fppl"):
        cfg = load_config(None, config_pairs(**{"dp.clip": 1.0, "dp.noise-multiplier": 1.0}), method)
        assert cfg.method_options("dp") == {"clip": 1.0, "noise-multiplier": 1.0}
    load_config(None, config_pairs(), "powder")  # DP off: every method runs


# ---------------------------------------------------------------------------- (e) end to end
@pytest.mark.e2e
def test_fedavg_with_dp_reports_the_accountants_epsilon(tmp_path):
    z, clip = 1.0, 0.5
    results = simulate_in_process(tmp_path / "dp", "fedavg", **{"rounds-per-task": 1, "clients-per-round": 2,
                                                               "dp.clip": clip, "dp.noise-multiplier": z})
    privacy = results["privacy"]
    steps = len(results["rounds"])
    assert privacy["enabled"] and privacy["rounds"] == steps == 2
    assert privacy["sample_rate"] == pytest.approx(2 / 3)
    assert privacy["epsilon"] == pytest.approx(opacus_epsilon(z, 2 / 3, steps, 1e-5), rel=1e-9)
    uploads = privacy["most_uploads_per_client"]  # the most-sampled client's, from the round records
    assert uploads == max(sum(c == client for r in results["rounds"] for c in {p["client"] for p in r["placement"]})
                          for client in range(3))
    assert 0 < uploads <= steps
    assert privacy["epsilon_against_server"] == pytest.approx(opacus_epsilon(z, 1.0, uploads, 1e-5), rel=1e-9)
    assert [r["epsilon"] for r in results["rounds"]] == pytest.approx(
        [opacus_epsilon(z, 2 / 3, s, 1e-5) for s in (1, 2)], rel=1e-9)
    assert {k: privacy[k] for k in ("delta", "clip", "noise_multiplier", "mechanism")} == {
        "delta": 1e-5, "clip": clip, "noise_multiplier": z, "mechanism": "gaussian, client-side, client-level"}
    assert "| differential privacy | epsilon" in table(results)


@pytest.mark.e2e
def test_a_node_dropping_out_raises_the_sampling_rate_the_accountant_composes(tmp_path, flower_identity, caplog):
    """population = nodes samples among the nodes connected now: 2 of 3 (q = 2/3), then, with one
    gone, 2 of 2 (q = 1). The headline epsilon, each round's and the log's compose those rates."""
    from flwr.app import MessageType
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    from promptfcl.server.run import run_experiment
    from tests.helpers import InProcessGrid

    class DropAfterFirstRound(InProcessGrid):
        def get_node_ids(self) -> list[int]:
            trained = sum(m.metadata.message_type == MessageType.TRAIN for m in self.sent)
            return self.node_ids if trained < 2 else self.node_ids[:2]

    z = 1.0
    cfg = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 2, "dp.clip": 0.5,
                                             "dp.noise-multiplier": z, "out-dir": str(tmp_path / "out")})
    grid = DropAfterFirstRound(cfg, 3, node_configs={1001 + i: {"partition-id": i, "num-partitions": 3,
                                                                "dataset": "digits"} for i in range(3)})
    with caplog.at_level("INFO", logger="promptfcl"):
        results = run_experiment(grid, cfg)  # type: ignore[arg-type]
    assert [r["sample_rates"] for r in results["rounds"]] == [[pytest.approx(2 / 3)], [1.0]]
    alphas = RDPAccountant.DEFAULT_ALPHAS
    rdp = compute_rdp(q=2 / 3, noise_multiplier=z, steps=1, orders=alphas) + compute_rdp(
        q=1.0, noise_multiplier=z, steps=1, orders=alphas)
    expected = float(get_privacy_spent(orders=alphas, rdp=rdp, delta=1e-5)[0])
    privacy = results["privacy"]
    assert privacy["epsilon"] == pytest.approx(expected, rel=1e-9) == results["rounds"][-1]["epsilon"]
    assert privacy["epsilon"] > opacus_epsilon(z, 2 / 3, 2, 1e-5)  # what clients-per-round / num-clients said
    assert results["rounds"][0]["epsilon"] == pytest.approx(opacus_epsilon(z, 2 / 3, 1, 1e-5), rel=1e-9)
    assert privacy["sample_rate"] == 1.0 and privacy["sample_rate_nominal"] == pytest.approx(2 / 3)
    logged = [m for m in caplog.messages if "eps so far" in m]
    assert len(logged) == 2 and "sampling rate q" not in logged[0]
    assert f"eps so far {expected:.3g} (sampling rate q 1 this round, not the nominal 0.667" in logged[1]
    assert "q up to 1 (nominal 0.667)" in table(results)


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["hgp", "fppl"])
def test_noisy_statistics_pass_the_servers_checks_end_to_end(tmp_path, strategy):
    """Noisy means and covariances (no longer positive semi-definite) are accepted and used."""
    results = simulate_in_process(tmp_path / strategy, strategy, **{"rounds-per-task": 1, "dp.clip": 1.0,
                                                                   "dp.noise-multiplier": 0.5})
    assert all(not r["rejected"] and r["clients_aggregated"] == 3 for r in results["rounds"])
    assert results["privacy"]["epsilon"] == pytest.approx(opacus_epsilon(0.5, 1.0, 2, 1e-5), rel=1e-9)
    assert all(np.isfinite(v) for v in results["average_accuracy_per_task"])


@pytest.mark.e2e
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_hgp_with_dp_and_float16_covariances_warns_of_nothing(tmp_path):
    """A float16 covariance's check was compared with a float64 bound cast to float16 (an overflow
    warning every DP round, and a failed check where warnings are errors)."""
    from tests.helpers import simulate_in_process

    results = simulate_in_process(tmp_path, "hgp", **{"dp.clip": 1.0, "dp.noise-multiplier": 1.0,
                                                       "hgp.samples-per-class": 16, "hgp.cov-type": "diag",
                                                       "hgp.cov-dtype": "float16"})
    assert not [r for rnd in results["rounds"] for r in rnd["rejected"] if r["reason"] != "no training examples"]
