"""LoRM: the closed-form merges (round and task) against their least-squares problems, the
alternation of the factors, the Gram pass against a hand computation, and a short federation whose
evaluation model is its closed form."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.prompted import build_model
from promptfcl.common.model.runtime import get_runtime, model_spec
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.lorm.learner import LoRMLearner
from promptfcl.strategies.lorm.merge import merge_a, merge_b, pack_triu, regmean_head, regularised, task_weights
from promptfcl.strategies.lorm.options import LoRMOptions, trained_factor
from promptfcl.strategies.lorm.prompt import LoRMAdapters
from promptfcl.strategies.lorm.records import GRAMS, HEAD_GRAM, SAMPLES, diagonal_name
from promptfcl.strategies.lorm.strategy import LoRMStrategy
from tests.conftest import PLAIN_MEAN, tiny_config
from tests.helpers import accepted_of

NUM_CLASSES = 10


def problem(seed=0, n_in=6, n_out=5, r=2, clients=3):
    """Clients' inputs X_i (20-40 rows), a shared A, the clients' B_i and A_i."""
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(int(rng.integers(20, 41)), n_in)) for _ in range(clients)]
    a = rng.normal(size=(r, n_in))
    bs = [rng.normal(size=(n_out, r)) for _ in range(clients)]
    as_ = [rng.normal(size=(r, n_in)) for _ in range(clients)]
    return xs, a, bs, as_


# ---------------------------------------------------------------------------- round merges
def test_b_merge_is_the_least_squares_solution_of_the_stacked_problem():
    xs, a, bs, _ = problem()
    merged = merge_b(a, bs, [x.T @ x for x in xs])
    lhs = np.concatenate([x @ a.T for x in xs])
    rhs = np.concatenate([x @ a.T @ b.T for x, b in zip(xs, bs)])
    np.testing.assert_allclose(merged.T, np.linalg.lstsq(lhs, rhs, rcond=None)[0], rtol=1e-10, atol=1e-10)
    gradient = sum((x @ a.T).T @ (x @ a.T @ merged.T - x @ a.T @ b.T) for x, b in zip(xs, bs))
    np.testing.assert_allclose(gradient, 0, atol=1e-10)
    # diagonal Grams: the same problem with X_i = diag(sqrt(d_i))
    ds = [np.square(x).sum(0) for x in xs]
    lhs = np.concatenate([np.sqrt(d)[:, None] * a.T for d in ds])
    rhs = np.concatenate([np.sqrt(d)[:, None] * a.T @ b.T for d, b in zip(ds, bs)])
    np.testing.assert_allclose(merge_b(a, bs, ds).T, np.linalg.lstsq(lhs, rhs, rcond=None)[0], atol=1e-10)


def test_a_merge_is_independent_of_b_and_a_column_weighted_mean_for_diagonal_grams():
    xs, _, _, as_ = problem(1)
    grams = [x.T @ x for x in xs]
    merged = merge_a(as_, grams)
    rng = np.random.default_rng(2)
    for _ in range(2):  # two full-column-rank B: the objective's gradient vanishes at the same A
        b = rng.normal(size=(5, 2))
        gradient = sum(b.T @ b @ (merged @ x.T - a_i @ x.T) @ x for x, a_i in zip(xs, as_))
        np.testing.assert_allclose(gradient, 0, atol=1e-9)
    lhs, rhs = np.concatenate(xs), np.concatenate([x @ a_i.T for x, a_i in zip(xs, as_)])
    np.testing.assert_allclose(merged.T, np.linalg.lstsq(lhs, rhs, rcond=None)[0], atol=1e-10)
    # alpha = 0: the diagonal of each Gram, a per-column weighted mean; the same as the full solve of diag G
    ds = [np.diag(g).copy() for g in grams]
    column_mean = sum(a_i * d for a_i, d in zip(as_, ds)) / sum(ds)
    np.testing.assert_allclose(merge_a(as_, ds), column_mean, rtol=1e-12)
    np.testing.assert_allclose(merge_a(as_, [regularised(g, 0.0) for g in grams]), column_mean, rtol=1e-10)
    # the mix alpha G + (1 - alpha) diag G is a full Gram like any other
    mixed = [regularised(g, 0.3) for g in grams]
    np.testing.assert_allclose(merge_a(as_, mixed) @ sum(mixed), sum(a_i @ g for a_i, g in zip(as_, mixed)), atol=1e-9)
    # a column no client's data reaches keeps the factor sent (the pseudo-inverse would zero it)
    ds[0][2] = ds[1][2] = ds[2][2] = 0.0
    kept = merge_a(as_, ds, keep=np.full((2, 6), 7.0))
    assert (kept[:, 2] == 7.0).all()


@pytest.mark.parametrize("diagonal", [False, True])
def test_equal_factors_come_back_and_one_client_returns_its_own(diagonal):
    xs, a, bs, as_ = problem(3)
    grams = [np.square(x).sum(0) if diagonal else x.T @ x for x in xs]
    np.testing.assert_allclose(merge_b(a, [bs[0]] * 3, grams), bs[0], atol=1e-10)
    np.testing.assert_allclose(merge_a([as_[0]] * 3, grams), as_[0], atol=1e-10)
    np.testing.assert_allclose(merge_b(a, bs[:1], grams[:1]), bs[0], atol=1e-10)
    np.testing.assert_allclose(merge_a(as_[:1], grams[:1]), as_[0], atol=1e-10)


def test_head_regmean_is_its_closed_form():
    rng = np.random.default_rng(4)
    feats = [rng.normal(size=(30, 4)) for _ in range(3)]
    ws = [rng.normal(size=(3, 4)) for _ in range(3)]
    grams = [f.T @ f for f in feats]
    merged = regmean_head(ws, grams, 0.5)
    regs = [0.5 * g + 0.5 * np.diag(np.diag(g)) for g in grams]
    np.testing.assert_allclose(merged, sum(w @ g for w, g in zip(ws, regs)) @ np.linalg.inv(sum(regs)), rtol=1e-10)
    np.testing.assert_allclose(regmean_head([ws[0]] * 3, grams, 0.5), ws[0], atol=1e-12)
    # alpha = 1 is RegMean proper: the least-squares fit of every client's outputs
    lhs, rhs = np.concatenate(feats), np.concatenate([f @ w.T for f, w in zip(feats, ws)])
    np.testing.assert_allclose(regmean_head(ws, grams, 1.0).T, np.linalg.lstsq(lhs, rhs, rcond=None)[0], atol=1e-10)


# ---------------------------------------------------------------------------- task merge
def test_task_merge_one_task_keeps_its_delta_and_disjoint_tasks_keep_their_columns():
    rng = np.random.default_rng(5)
    deltas = [rng.normal(size=(5, 6)) for _ in range(2)]
    d0, d1 = rng.uniform(1, 2, 6), rng.uniform(1, 2, 6)
    np.testing.assert_array_equal(task_weights([d0], "regmean"), np.ones((1, 6)))
    d0[3:], d1[:3] = 0.0, 0.0  # disjoint supports
    w = task_weights([d0, d1], "regmean")
    merged = deltas[0] * w[0] + deltas[1] * w[1]
    np.testing.assert_allclose(merged[:, :3], deltas[0][:, :3], rtol=1e-15)
    np.testing.assert_allclose(merged[:, 3:], deltas[1][:, 3:], rtol=1e-15)
    # the factored form is the dense RegMean (sum_tau dW_tau D_tau) (sum D)^+
    d0, d1 = rng.uniform(0, 2, 6), rng.uniform(0, 2, 6)
    w = task_weights([d0, d1], "regmean")
    dense = (deltas[0] @ np.diag(d0) + deltas[1] @ np.diag(d1)) @ np.linalg.pinv(np.diag(d0 + d1))
    np.testing.assert_allclose(deltas[0] * w[0] + deltas[1] * w[1], dense, rtol=1e-12)
    np.testing.assert_allclose(task_weights([d0, d1, d1], "running-mean"), np.full((3, 6), 1 / 3))
    np.testing.assert_array_equal(task_weights([d0, d1], "sum"), np.ones((2, 6)))


def strategy_and_model(**overrides):
    cfg = tiny_config(strategy="lorm", **{"prompt-layers": "0,1", **overrides})
    model, _ = build_model(model_spec(cfg, NUM_CLASSES), LoRMAdapters)
    return LoRMStrategy.of(cfg, NUM_CLASSES, cfg.method_options("lorm")), model.double().eval()


def test_task_hooks_set_the_filler_then_the_regmean_weights_and_the_model_computes_them():
    s, model = strategy_and_model()
    arrays = s.on_task_start(0, to_array_record(model.trainable_state()))
    rng = np.random.default_rng(6)
    state = from_array_record(arrays)
    keys = [k for k, _, _ in s.adapters(state)]
    diagonals = {}
    for task in range(2):
        if task:
            arrays = s.on_task_start(task, arrays)
            w = from_array_record(arrays)["prompt.lora_qkv0_w"]
            assert (w[:2] == np.float32(0.5)).all()  # the in-task filler: running mean of the two deltas
        state = from_array_record(arrays)
        for k in keys:  # the task's trained set
            state[f"prompt.lora_{k}_b"][task] = rng.normal(size=state[f"prompt.lora_{k}_b"].shape[1:])
        s.round_grams = {k: rng.uniform(0, 3, state[f"prompt.lora_{k}_a"].shape[-1]) for k in keys}
        diagonals[task] = dict(s.round_grams)
        arrays = s.on_task_end(task, to_array_record(state))
    model.load_trainable_state({k: torch.from_numpy(v.astype(np.float64)) for k, v in from_array_record(arrays).items()})
    model.prompt.set_task(1)
    state = from_array_record(arrays)
    for k, layer, target in s.adapters(state):
        a, b = state[f"prompt.lora_{k}_a"].astype(np.float64), state[f"prompt.lora_{k}_b"].astype(np.float64)
        d0, d1 = diagonals[0][k], diagonals[1][k]
        dense = (b[0] @ a[0] @ np.diag(d0) + b[1] @ a[1] @ np.diag(d1)) @ np.linalg.pinv(np.diag(d0 + d1))
        np.testing.assert_allclose(model.prompt.merged_delta(target, layer).numpy(), dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(s.task_grams["qkv0"], np.stack([diagonals[0]["qkv0"], diagonals[1]["qkv0"]]))


# ---------------------------------------------------------------------------- the server's round
def reply(state, task, factor, n, head_shift, grams_seed):
    """A client reply as LoRMLearner uploads it: the head and the trained factor's row of ``task``."""
    rng = np.random.default_rng(grams_seed)
    arrays = {}
    for name, value in state.items():
        if name.startswith("head."):
            arrays[name] = value.copy()
        elif name.endswith(f"_{factor}"):
            arrays[name] = (value[task : task + 1] + rng.normal(size=value[task : task + 1].shape)).astype(value.dtype)
    arrays["head.weight"][5:] += np.float32(head_shift)  # task 1's rows
    arrays["head.bias"][5:] += np.float32(head_shift)
    dim = state["head.weight"].shape[1]
    feats = rng.normal(size=(n, dim))
    grams = {"blocks": np.array([0, 1], np.int64), SAMPLES: np.array([n], np.int64), "tokens": np.array([n * 17]),
             HEAD_GRAM: pack_triu(feats.T @ feats / n)[None].astype(np.float32)}
    for target in LoRMAdapters.targets:
        width = state[f"prompt.lora_{target}0_a"].shape[-1]
        grams[diagonal_name(target)] = rng.uniform(0.5, 2, size=(2, width)).astype(np.float32)
    return RecordDict({ARRAYS: to_array_record(arrays), GRAMS: to_array_record(grams),
                       METRICS: MetricRecord({"num-examples": n, "train-loss": 1.0, "train-seconds": 0.1})})


@pytest.mark.parametrize("round_", [0, 1])
def test_round_merge_solves_the_trained_factor_and_the_head_and_leaves_the_rest_bit_identical(round_):
    s, model = strategy_and_model(**PLAIN_MEAN)
    arrays = s.on_task_start(1, s.on_task_start(0, to_array_record(model.float().trainable_state())))
    s.round_start(2 + round_, 1, round_, arrays)
    s.round_arrays = arrays
    sent = from_array_record(arrays)
    factor = "b" if round_ == 0 else "a"
    contents = [reply(sent, 1, factor, n, shift, i) for i, (n, shift) in enumerate([(10, 0.1), (30, -0.2)])]
    accepted = accepted_of(contents, tasks=1)
    averaged = s.aggregate(accepted)
    out = from_array_record(s.consolidate(3, averaged, accepted))
    replies = [from_array_record(c[ARRAYS]) for c in contents]
    grams = [from_array_record(c[GRAMS]) for c in contents]
    ns = [10, 30]
    for key, layer, target in s.adapters(sent):
        ds = [n * g[diagonal_name(target)][layer].astype(np.float64) for g, n in zip(grams, ns)]
        name = f"prompt.lora_{key}_{factor}"
        mine = [r[name][0] for r in replies]
        expected = merge_b(sent[f"prompt.lora_{key}_a"][1], mine, ds) if factor == "b" else merge_a(mine, ds)
        np.testing.assert_allclose(out[name][1], expected, rtol=1e-5, atol=1e-6)
        other = f"prompt.lora_{key}_{'a' if factor == 'b' else 'b'}"
        np.testing.assert_array_equal(out[other], sent[other])  # the untrained factor, every task's row
        np.testing.assert_array_equal(np.delete(out[name], 1, 0), np.delete(sent[name], 1, 0))
        np.testing.assert_array_equal(out[f"prompt.lora_{key}_w"], sent[f"prompt.lora_{key}_w"])
    # head: task 0's rows as sent (no client changed them), task 1's RegMean, the bias sample-weighted
    np.testing.assert_array_equal(out["head.weight"][:5], sent["head.weight"][:5])
    dim = sent["head.weight"].shape[1]
    from promptfcl.strategies.lorm.merge import unpack_triu

    head_grams = [n * unpack_triu(g[HEAD_GRAM][0].astype(np.float64), dim) for g, n in zip(grams, ns)]
    np.testing.assert_allclose(out["head.weight"][5:], regmean_head([r["head.weight"][5:] for r in replies],
                                                                    head_grams, 0.5), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["head.bias"], (10 * replies[0]["head.bias"] + 30 * replies[1]["head.bias"]) / 40,
                               rtol=1e-6)
    assert set(s.round_grams) == {k for k, _, _ in s.adapters(sent)}


def test_the_reply_must_carry_only_the_trained_factor_and_well_formed_grams(flower_identity):
    from flwr.app import Message

    from tests.helpers import NodeList

    s, model = strategy_and_model(**PLAIN_MEAN, **{"num-clients": 2, "clients-per-round": 2})
    arrays = s.on_task_start(0, to_array_record(model.float().trainable_state()))
    msgs = list(s.configure_train(1, arrays, ConfigRecord({"task": 0, "round": 0}), NodeList(2)))
    sent = from_array_record(arrays)
    good, bad = reply(sent, 0, "b", 10, 0.0, 0), reply(sent, 0, "a", 10, 0.0, 1)  # an A-upload in a B-round
    outcome = s.aggregate_round(1, [Message(good, reply_to=msgs[0]), Message(bad, reply_to=msgs[1])])
    assert len(outcome.rejected) == 1
    negative = reply(sent, 0, "b", 10, 0.0, 2)
    negative[GRAMS]["diag-fc1"].numpy()  # decoded below with a negative entry
    record = from_array_record(negative[GRAMS])
    record["diag-fc1"][0, 0] = -1.0
    negative[GRAMS] = to_array_record(record)
    msgs = list(s.configure_train(2, arrays, ConfigRecord({"task": 0, "round": 0}), NodeList(2)))
    outcome = s.aggregate_round(2, [Message(good, reply_to=msgs[0]), Message(negative, reply_to=msgs[1])])
    assert len(outcome.rejected) == 1 and "negative" in outcome.rejected[0][1]


# ---------------------------------------------------------------------------- the client
def test_alternation_schedule_resets_each_task():
    assert [trained_factor("alt", r) for r in range(5)] == ["b", "a", "b", "a", "b"]
    assert {trained_factor("A", r) for r in range(3)} == {"a"} and {trained_factor("B", r) for r in range(3)} == {"b"}
    s, _ = strategy_and_model()
    s.round_start(4, 1, 0, to_array_record({}))  # task 1's first round: B again
    assert s.factor == "b"


@pytest.mark.parametrize("round_", [0, 1])
def test_a_fit_trains_one_factor_uploads_it_alone_and_restores_the_shared_model(round_):
    cfg = tiny_config(strategy="lorm", centralised=True, lr=0.01, **{"prompt-layers": "0,1"})
    rt = get_runtime(cfg, LoRMAdapters)
    s = LoRMStrategy.of(cfg, rt.data.num_classes, cfg.method_options("lorm"))
    arrays = s.on_task_start(0, to_array_record(rt.model.trainable_state()))
    before = from_array_record(arrays)
    with torch.no_grad():  # a non-zero B, so that an A-round has a gradient
        for name, value in rt.model.prompt.named_parameters():
            if name.endswith("_b"):
                value.normal_(0, 0.1)
    arrays = to_array_record({**before, **{f"prompt.{k}": v.detach().numpy() for k, v in
                                           rt.model.prompt.named_parameters() if k.endswith("_b")}})
    before = from_array_record(arrays)
    learner = LoRMLearner.of(cfg, rt, cfg.method_options("lorm"))
    content = RecordDict({ARRAYS: arrays, "config": ConfigRecord({"client-id": 0, "round": round_})})
    out = learner.fit(content, task=0, round_=round_, client_id=0)
    after = from_array_record(out[ARRAYS])
    trained, frozen = ("b", "a") if round_ == 0 else ("a", "b")
    assert not any(name.endswith(f"_{frozen}") or name.endswith("_w") for name in after)
    for name, value in after.items():
        if name.endswith(f"_{trained}"):
            assert value.shape == (1,) + before[name].shape[1:] and not np.array_equal(value[0], before[name][0])
    state = rt.model.trainable_state()
    for name in before:  # the untrained factor is bit-identical on the model after the fit
        if name.endswith(f"_{frozen}"):
            np.testing.assert_array_equal(state[name].numpy(), before[name])
    assert all(p.requires_grad for n, p in rt.model.prompt.named_parameters() if not n.endswith("_w"))
    assert out[GRAMS][SAMPLES].numpy()[0] == out[METRICS]["num-examples"]  # every trained sample


def test_gram_pass_equals_a_hand_computation_on_a_two_block_vit():
    """Forward hooks on the frozen Linear modules see each projection's input; the recorder's
    diagonals and the head's Gram equal their sums over every token (CLS included)."""
    s, model = strategy_and_model()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.prompt.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    model.prompt.set_task(1)
    hand: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for layer in (0, 1):
        block = model.backbone.blocks[layer]
        for target, linear in (("qkv", block.attn.qkv), ("proj", block.attn.proj), ("fc1", block.mlp.fc1),
                               ("fc2", block.mlp.fc2)):
            def hook(module, inputs, output, key=(layer, target)):
                x = inputs[0].reshape(-1, inputs[0].shape[-1])
                hand[key] = hand.get(key, 0) + (x * x).sum(0)
            hooks.append(linear.register_forward_hook(hook))
    head_inputs = []
    hooks.append(model.head.register_forward_hook(lambda m, i, o: head_inputs.append(i[0])))
    x = torch.randn(5, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad(), model.prompt.recording() as recorder:
        features = model.features(x, model.query(x))
        model.logits(features)
    for h in hooks:
        h.remove()
    tokens = 5 * (16 // 4) ** 2 + 5  # patches and CLS
    assert set(recorder.sums) == set(hand) and set(recorder.tokens.values()) == {tokens}
    for key, value in hand.items():
        torch.testing.assert_close(recorder.sums[key], value, rtol=1e-12, atol=1e-12)
    f = head_inputs[0]
    torch.testing.assert_close(f, features)  # the head's input is the pre-logit feature the pass sums
    assert model.prompt._recorder is None  # nothing left on the shared module


def test_options_refuse_what_is_not_implemented():
    with pytest.raises(ConfigError, match="alpha-backbone"):
        LoRMOptions.from_options({"alpha-backbone": 1.0})
    with pytest.raises(ConfigError, match="train-matrix"):
        LoRMOptions.from_options({"train-matrix": "C"})
    from promptfcl.strategies.platform.run_checks import load_config

    with pytest.raises(ConfigError, match="differential privacy.*Gram"):
        load_config(None, ["dp.clip=1.0"], "lorm")


# ---------------------------------------------------------------------------- a short federation
@pytest.mark.simulation
def test_short_federation_evaluates_the_closed_form_of_its_stored_sets(tmp_path, monkeypatch):
    """Two tasks of three rounds (B, A, B): each round leaves the untrained factor as sent, and after
    each task the evaluated model is the RegMean of the tasks' deltas with their Grams."""
    from tests.helpers import simulate_in_process as simulate

    seen: dict[str, list] = {"rounds": [], "tasks": []}
    consolidate, on_task_end = LoRMStrategy.consolidate, LoRMStrategy.on_task_end

    def spy_consolidate(self, server_round, arrays, accepted):
        out = consolidate(self, server_round, arrays, accepted)
        seen["rounds"].append((self.task, self.factor, from_array_record(self.round_arrays), from_array_record(out)))
        return out

    def spy_task_end(self, task, arrays):
        out = on_task_end(self, task, arrays)
        seen["tasks"].append((task, {k: v.copy() for k, v in self.task_grams.items()}, from_array_record(out)))
        return out

    monkeypatch.setattr(LoRMStrategy, "consolidate", spy_consolidate)
    monkeypatch.setattr(LoRMStrategy, "on_task_end", spy_task_end)
    results = simulate(tmp_path / "lorm", strategy="lorm", lr=0.01, **{**PLAIN_MEAN, "rounds-per-task": 3})
    assert results["accuracy_matrix"][1][1] is not None
    assert [factor for _, factor, _, _ in seen["rounds"]] == ["b", "a", "b"] * 2
    for task, factor, sent, out in seen["rounds"]:
        frozen = "a" if factor == "b" else "b"
        for name in sent:
            if name.endswith(f"_{frozen}") or name.endswith("_w"):
                np.testing.assert_array_equal(out[name], sent[name])
    task, grams, state = seen["tasks"][-1]
    assert task == 1
    for name in state:
        if not name.endswith("_a"):
            continue
        key = name[len("prompt.lora_"):-2]
        a, b, w = (state[f"prompt.lora_{key}_{p}"].astype(np.float64) for p in "abw")
        d = grams[key]
        np.testing.assert_allclose(w[:2], d / d.sum(0), rtol=1e-6)
        dense = sum(b[t] @ a[t] @ np.diag(d[t]) for t in range(2)) @ np.linalg.pinv(np.diag(d.sum(0)))
        factored = sum(b[t] @ (a[t] * w[t][None, :]) for t in range(2))
        np.testing.assert_allclose(factored, dense, rtol=1e-5, atol=1e-7)
