"""C2Prompt's readings taken from its sources (issue 58, item 4): the figures' whole correlation
matrix and keep-all pool, a paper note's softmax weighting, the statistics-only round 0 through
the exchange before training, compensation prompts trained once per task and frozen, Powder's
distillation term, and a short run with those options."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.data.partitions import client_indices
from promptfcl.common.model.prompted import build_model
from promptfcl.common.model.runtime import get_runtime, model_spec
from promptfcl.common.records import ARRAYS, CONFIG, METRICS, from_array_record, to_array_record
from promptfcl.strategies.c2prompt.cpa import cpa_matrix
from promptfcl.strategies.c2prompt.distributions import class_statistics
from promptfcl.strategies.c2prompt.learner import C2PromptLearner
from promptfcl.strategies.c2prompt.options import C2PromptOptions
from promptfcl.strategies.c2prompt.prompt import C2PromptPrompt
from promptfcl.strategies.c2prompt.records import CLASS_STATS, GLOBAL_STATS, PART, UPLOAD_STATS
from promptfcl.strategies.platform.rounds import Sent
from promptfcl.strategies.platform.run_checks import check_options
from tests.conftest import PLAIN_MEAN, tiny_config
from tests.helpers import accepted_of
from tests.test_c2prompt import NUM_CLASSES, _batch, _learner_with_compensation, global_content, reply, strategy

#: K = 2 clients, N = 2 components, C = 2 classes; unit rows [1, 0], [0, 1], [1, 1] / sqrt 2, [1, 0]
HISTS = np.array([[[3.0, 0.0], [0.0, 2.0]], [[1.0, 1.0], [2.0, 0.0]]])
R = 1 / math.sqrt(2)
GRAM = np.array([[1, 0, R, 1], [0, 1, R, 0], [R, R, 1, R], [1, 0, R, 1]])  # H H^T of the unit rows, by hand


# ---------------------------------------------------------------------------- W
def test_softmax_rows_are_a_softmax_of_the_unit_histograms_gram_over_tau_and_cosine_rows_are_its_normalised_rows():
    tau = 0.5
    w = cpa_matrix(HISTS, np.ones(2), "all", "softmax", tau)
    e = np.exp(GRAM / tau)
    np.testing.assert_allclose(w, e / e.sum(1, keepdims=True), rtol=1e-12)  # the note's W, uniform weights
    np.testing.assert_allclose(w[0], np.array([math.e**2, 1, math.exp(2 * R), math.e**2])
                               / (2 * math.e**2 + 1 + math.exp(2 * R)), rtol=1e-12)
    # sample weights (1, 3) multiply each column of client 1 before the row is normalised
    weighted = cpa_matrix(HISTS, np.array([1.0, 3.0]), "all", "softmax", tau)
    row = np.array([math.e**2, 1, 3 * math.exp(2 * R), 3 * math.e**2])
    np.testing.assert_allclose(weighted[0], row / row.sum(), rtol=1e-12)
    cosine = cpa_matrix(HISTS, np.array([1.0, 3.0]), "all", "cosine")
    np.testing.assert_allclose(cosine[1], np.array([0, 1, 3 * R, 0]) / (1 + 3 * R), rtol=1e-12)
    # component scope: row (0, 0) sees only copies of component 0, (0, 0) and (1, 0)
    component = cpa_matrix(HISTS, np.ones(2), "component", "softmax", tau)
    np.testing.assert_allclose(component[0], [math.e**2 / (math.e**2 + math.exp(2 * R)), 0,
                                              math.exp(2 * R) / (math.e**2 + math.exp(2 * R)), 0], rtol=1e-12)
    # a smaller tau concentrates each row on its most similar copies
    assert cpa_matrix(HISTS, np.ones(2), "all", "softmax", 0.05)[1, 1] > w[1, 1]


# ---------------------------------------------------------------------------- keep-all pool
def keep_all_strategy():
    """2 clients, 2 tasks of 4 components: each client trains a part of 2 (K N = 4 rows kept)."""
    return strategy(num_clients=2, clients_per_round=2, pool_size=8,
                    **{"c2prompt.cpa-pool": "keep-all", "c2prompt.cpa-weighting": "uniform"})


def test_keep_all_writes_each_clients_rows_of_w_times_p_into_its_part_of_the_slice():
    s, arrays = keep_all_strategy()
    layers, base = s.model.layers, from_array_record(arrays)
    # client 0 (part 0: rows 0-1) and client 1 (part 1: rows 2-3) hold P = 1, 2 and 4, 10 in every entry;
    # hand computation with uniform weights and cosine rows: W = [[1,0,1,1]/3, [0,1,0,0], [1,0,1,1]/3, [1,0,1,1]/3]
    hists = [np.zeros((len(layers), 2, 5)) for _ in range(2)]
    hists[0][:, 0, 0], hists[0][:, 1, 1] = 1.0, 1.0
    hists[1][:, 0, 0], hists[1][:, 1, 0] = 1.0, 1.0
    np.testing.assert_allclose(cpa_matrix(np.stack([h[0] for h in hists]), np.ones(2)),
                               [[1 / 3, 0, 1 / 3, 1 / 3], [0, 1, 0, 0], [1 / 3, 0, 1 / 3, 1 / 3], [1 / 3, 0, 1 / 3, 1 / 3]])
    replies = []
    for client, values in ((0, (1.0, 2.0)), (1, (4.0, 10.0))):
        content = reply(s, arrays, 0, hists[client], 0.0)
        state = from_array_record(content[ARRAYS])
        for name in state:
            if name.startswith("prompt."):
                for i, v in enumerate(values):
                    state[name][2 * client + i] = v
        content[ARRAYS] = to_array_record(state)
        replies.append(content)
    accepted = accepted_of(replies, tasks=0)
    for a in accepted:
        a.sent.config[PART] = a.client  # the virtual population's slot is its client id
        assert s.check_records(a.reply, a.sent) is None
    s.round_arrays = arrays
    out = from_array_record(s.aggregate(accepted))
    for layer in layers:
        for kind in "pka":
            name = f"prompt.{kind}{layer}"
            assert out[name].shape == base[name].shape  # the pool: 2 tasks x K N = 4 rows
            for row, expected in enumerate((5.0, 2.0, 5.0, 5.0)):  # W P: (1+4+10)/3, 2, 5, 5
                np.testing.assert_allclose(out[name][row], expected, rtol=1e-6)
            np.testing.assert_allclose(out[name][4:], base[name][4:], rtol=1e-6)  # task 1 untouched
    # a histogram over the whole slice is not a client's part
    wrong = accepted_of([reply(s, arrays, 0, np.ones((len(layers), 4, 5)), 0.0)], tasks=0)[0]
    wrong.sent.config[PART] = 0
    assert "shape" in s.check_records(wrong.reply, wrong.sent)


def test_a_keep_all_client_trains_and_weighs_only_its_part_and_evaluation_reads_every_part():
    cfg = tiny_config(strategy="c2prompt", num_clients=2, pool_size=8, prompt_mode="prompt",
                      **{"c2prompt.cpa-pool": "keep-all"})
    model, _ = build_model(model_spec(cfg, NUM_CLASSES), C2PromptPrompt)
    prompt = model.prompt
    assert isinstance(prompt, C2PromptPrompt)
    prompt.set_task(1)
    x = torch.rand(4, 3, 16, 16)
    q = model.query(x)
    prompt.eval()
    assert prompt.weights(q, cfg.model.layers[0]).shape == (4, 8)  # tasks 0 and 1, every part
    prompt.train()
    prompt.restrict(slice(6, 8))  # client 1's part of task 1's slice (rows 4-7)
    assert prompt.weights(q, cfg.model.layers[0]).shape == (4, 6) and prompt.task_columns() == slice(4, 6)
    model.features(x, q).square().sum().backward()
    grad = getattr(prompt, f"p{cfg.model.layers[0]}").grad
    assert grad[6:8].abs().sum() > 0
    assert grad[:6].abs().sum() == 0  # task 0 (detached) and client 0's part of task 1
    prompt.restrict(None)
    with pytest.raises(ValueError, match="not part"):
        prompt.restrict(slice(2, 4))  # task 0's rows while on task 1
    with pytest.raises(ConfigError, match="multiple of num-clients"):
        check_options(C2PromptOptions.from_options({"cpa-pool": "keep-all"}), tiny_config(num_clients=3, pool_size=8))
    with pytest.raises(ConfigError, match="virtual population"):
        check_options(C2PromptOptions.from_options({"cpa-pool": "keep-all"}),
                      tiny_config(population="nodes", num_clients=2, pool_size=8))


# ---------------------------------------------------------------------------- round 0 and frozen compensation
def sent_to(client: int, task: int = 0, round_: int = 0) -> Sent:
    return Sent(client, task, round_, client, ConfigRecord({"task": task, "round": round_, "client-id": client}))


def test_round_0_is_a_statistics_only_exchange_and_the_first_training_round_carries_the_global_distributions():
    s, arrays = strategy()
    s.round_arrays = arrays
    assert s.uses_exchange()
    message = s.exchange_payload(sent_to(1), arrays)
    assert set(message.keys()) == {CONFIG} and message[CONFIG][UPLOAD_STATS] is True  # no arrays go out
    # the client's answer: its class statistics of q(x) over its share of the task, nothing else
    cfg = tiny_config(strategy="c2prompt")
    rt = get_runtime(cfg, C2PromptPrompt)
    learner = C2PromptLearner.of(cfg, rt, {})
    answers = [learner.answer(s.exchange_payload(sent_to(c), arrays), 0, 0, c) for c in (0, 1)]
    index = client_indices(rt.data.train.labels, rt.layout, rt.partition, 1, 0, 0)
    assert set(answers[1].keys()) == {CLASS_STATS, METRICS}
    assert answers[1][METRICS]["num-examples"] == len(index)
    expected = from_array_record(class_statistics(learner.queries_of(index).double().numpy(),
                                                  rt.data.train.labels[index]))
    got = from_array_record(answers[1][CLASS_STATS])
    np.testing.assert_array_equal(got["counts"], expected["counts"])
    np.testing.assert_allclose(got["means"], expected["means"], rtol=1e-6)
    with pytest.raises(ValueError, match="must ask"):
        learner.answer(RecordDict({CONFIG: ConfigRecord({"task": 0})}), 0, 0, 0)  # one that asks for nothing
    accepted = accepted_of(answers, tasks=0)
    for a in accepted:
        a.sent.config[UPLOAD_STATS] = True
        assert s.check_exchange(a.reply, a.sent) is None
    s.use_exchange(1, accepted)
    # the task's first training round: no statistics asked again, the pooled Gaussians sent
    content = s.payload(sent_to(0), arrays)
    assert content[CONFIG][UPLOAD_STATS] is False
    classes = sorted(set(np.concatenate([from_array_record(a[CLASS_STATS])["classes"] for a in answers]).tolist()))
    np.testing.assert_array_equal(from_array_record(content[GLOBAL_STATS])["classes"], classes)
    assert s.exchange_payload(sent_to(0), arrays) is None  # reported: no second exchange this task
    # an answer carrying arrays besides the statistics is refused
    answers[0][ARRAYS] = arrays
    assert "records" in s.check_exchange(accepted_of([answers[0]])[0].reply, sent_to(0))


def test_a_clients_global_distributions_are_frozen_once_its_own_report_is_in():
    s, arrays = strategy()
    dim = from_array_record(arrays)["head.weight"].shape[1]
    rng = np.random.default_rng(4)

    def report(client: int, loc: float):
        x, labels = rng.normal(loc, 1.0, (6, dim)), np.array([0, 0, 1, 1, 2, 2])
        stats = from_array_record(class_statistics(x, labels))
        return accepted_of([reply(s, arrays, 0, np.ones((1, 1, 1)), 0.0, stats, n=6)], tasks=0, clients=[client])

    s.use_exchange(1, report(0, 0.0) + report(1, 1.0))
    first = from_array_record(s.payload(sent_to(0), arrays)[GLOBAL_STATS])
    assert s.frozen[(0, 0)] == ((0, 0), (1, 0))
    s.use_exchange(2, report(2, 50.0))  # a later client's report
    again = from_array_record(s.payload(sent_to(0, round_=1), arrays)[GLOBAL_STATS])
    np.testing.assert_array_equal(again["means"], first["means"])  # client 0's stay as first sent
    latest = from_array_record(s.payload(sent_to(2, round_=1), arrays)[GLOBAL_STATS])
    assert not np.allclose(latest["means"], first["means"])  # client 2's pool every report
    restored, _ = strategy()
    restored.load_state_dict(s.state_dict())
    assert restored.frozen == s.frozen
    np.testing.assert_array_equal(from_array_record(restored.payload(sent_to(0, round_=2), arrays)[GLOBAL_STATS])
                                  ["means"], first["means"])


@pytest.mark.parametrize("schedule", ["once", "every-round"])
def test_compensation_prompts_trained_once_are_the_same_in_every_round_of_the_task(schedule):
    learner = _learner_with_compensation({"comp-epochs": 1, "comp-schedule": schedule})
    first = {k: v.clone() for k, v in learner.compensation.items()}
    # a later round: other discriminative prompts (the server's aggregate) and another fit seed
    with torch.no_grad():
        for p in learner.prompt.parameters():
            p.add_(0.3 * torch.randn_like(p))
    learner.seed = [0, 0, 0, 3]
    learner.round_start(global_content(learner.rt.model.embed_dim), 0)
    later = learner.compensation
    same = all(torch.equal(first[k], later[k]) for k in first)
    assert same if schedule == "once" else not same


def test_dp_runs_report_statistics_in_the_training_reply():
    dp = {"dp.clip": 1.0, "dp.noise-multiplier": 1.0}
    with pytest.raises(ConfigError, match="stats-round = first-training"):
        check_options(C2PromptOptions.from_options({}), tiny_config(**dp))
    check_options(C2PromptOptions.from_options({"stats-round": "first-training"}), tiny_config(**dp))
    s, arrays = strategy(**{"c2prompt.stats-round": "first-training"})
    assert not s.uses_exchange() and s.payload(sent_to(0), arrays)[CONFIG][UPLOAD_STATS] is True


# ---------------------------------------------------------------------------- Powder's distillation term
def test_the_distillation_term_is_zero_at_the_round_start_and_grows_as_the_model_moves():
    learner = _learner_with_compensation({"distill": "classic", "distill-lambda": 2.0, "comp-prob": 0.0})
    batch, _ = _batch(learner)
    assert float(learner.extra_loss(batch, 0).detach()) == pytest.approx(0.0, abs=1e-6)  # the teacher is the student
    with torch.no_grad():
        learner.rt.model.head.weight.add_(torch.randn_like(learner.rt.model.head.weight))
    moved, _ = _batch(learner)
    loss = float(learner.extra_loss(moved, 0).detach())
    learner.opts = C2PromptOptions.from_options({"distill": "classic", "distill-lambda": 1.0, "comp-prob": 0.0})
    assert loss > 0 and loss == pytest.approx(2.0 * float(learner.extra_loss(moved, 0).detach()), rel=1e-6)


# ---------------------------------------------------------------------------- end to end
@pytest.mark.simulation
def test_a_short_run_with_the_sources_options_completes(tmp_path):
    """The figures' keep-all pool, the note's softmax W and length-2 compensation prompts with
    Powder's dual term: three clients, two tasks of three components (one per client)."""
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "c2", strategy="c2prompt", lr=0.01, **PLAIN_MEAN, **{
        "pool-size": 6, "prompt-mode": "prompt", "c2prompt.cpa-pool": "keep-all", "c2prompt.cpa-similarity": "softmax",
        "c2prompt.comp-length": 2, "c2prompt.distill": "dual"})
    rounds = results["rounds"]
    assert all(r["clients_aggregated"] == 3 and not r["rejected"] for r in rounds)
    assert [r["strategy_metrics"]["global-classes"] for r in rounds] == [5.0, 5.0, 10.0, 10.0]
    assert all(0 < r["strategy_metrics"]["cpa-self-weight"] <= 1 for r in rounds)
    acc = results["accuracy_matrix"]
    assert all(v is not None and 0 <= v <= 100 for v in (acc[0][0], acc[0][1], acc[1][1]))
