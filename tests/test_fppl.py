"""FPPL: fused task prompts, unified-representation loss, global prototypes, pool and debiasing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Array, ConfigRecord, Message, MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.prompted import build_model
from promptfcl.common.model.runtime import get_runtime, layout_of, model_spec
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record, to_torch
from promptfcl.strategies.fppl.learner import FPPLLearner, unified_representation_loss
from promptfcl.strategies.fppl.options import FPPLOptions
from promptfcl.strategies.fppl.prompt import FPPLPrompt
from promptfcl.strategies.fppl.prototypes import PrototypeSet, debias_head
from promptfcl.strategies.fppl.records import GLOBAL_PROTOTYPES, LOCAL_PROTOTYPES
from promptfcl.strategies.fppl.strategy import FPPLStrategy
from promptfcl.strategies.registry import learner_class, prompt_class, strategy_class
from tests.conftest import PLAIN_MEAN, tiny_config
from tests.helpers import accepted_of

NUM_CLASSES = 10  # digits: 2 tasks x 5 classes in the tiny configuration


class NodeList:
    """The one Grid query configure_train makes: which nodes are connected."""

    def __init__(self, n: int) -> None:
        self.ids = list(range(100, 100 + n))

    def get_node_ids(self):
        return self.ids


def fppl_config(**overrides):
    return tiny_config(strategy="fppl", **overrides)


def strategy_at_task(task: int = 0, options: dict | None = None, **overrides) -> tuple[FPPLStrategy, object]:
    """An FPPL strategy and the global arrays after ``on_task_start`` of tasks 0..task."""
    cfg = fppl_config(**overrides)
    model, _ = build_model(model_spec(cfg, NUM_CLASSES), FPPLPrompt)
    s = FPPLStrategy.of(cfg, NUM_CLASSES, options or {})
    arrays = to_array_record(model.trainable_state())
    for t in range(task + 1):
        if t:
            s.on_task_end(t - 1, arrays)
        arrays = s.on_task_start(t, arrays)
    return s, arrays


def accepted(replies: list[RecordDict], classes_per_task: int = 5) -> list:
    """The replies as the platform hands them to the hooks: each from the client its prototype record
    names, on the task of its prototypes' classes."""
    clients = [int(r[LOCAL_PROTOTYPES]["client"].numpy()[0]) for r in replies]
    tasks = [int(r[LOCAL_PROTOTYPES]["classes"].numpy()[0]) // classes_per_task for r in replies]
    return accepted_of(replies, tasks=tasks, clients=clients)


def answered(s: FPPLStrategy, arrays, make, nodes: int, server_round: int = 1) -> list[Message]:
    """Round ``server_round``'s train messages to ``nodes`` nodes (task 0), each answered by
    ``make(client_id, i)`` (the i-th message's reply content)."""
    config = ConfigRecord({"task": 0, "round": server_round - 1})
    msgs = list(s.configure_train(server_round, arrays, config, NodeList(nodes)))
    return [Message(make(int(m.content["config"]["client-id"]), i), reply_to=m) for i, m in enumerate(msgs)]


def client_reply(arrays, n: int, classes, means, client: int = 0, head_shift: float = 0.0) -> RecordDict:
    """A well-formed FPPL client reply: parameters (of the task prompts only the row of the task of
    its classes, as FPPLLearner.uploaded sends), metrics and local prototypes."""
    state = from_array_record(arrays)
    state["head.bias"] = state["head.bias"] + np.float32(head_shift)
    task = int(classes[0]) // 5 if len(classes) else 0
    state = {k: v[task : task + 1] if k.startswith("prompt.p") else v for k, v in state.items()}
    return RecordDict({
        ARRAYS: to_array_record(state),
        METRICS: MetricRecord({"num-examples": n, "train-loss": 1.0, "train-seconds": 0.1}),
        LOCAL_PROTOTYPES: to_array_record({
            "classes": np.asarray(classes, np.int64), "means": np.asarray(means, np.float32),
            "counts": np.ones(len(classes), np.int64), "client": np.array([client], np.int64)}),
    })


def test_replies_carry_only_the_trained_prompt_and_aggregate_as_complete_ones(flower_identity):
    """C2S leaves out the other tasks' frozen prompts; the server completes each reply with the
    prompts it sent, so the average is that of the complete replies. A reply that sends every
    prompt no longer has the expected shapes and is refused."""
    s, arrays = strategy_at_task(1, num_clients=3, clients_per_round=3, **PLAIN_MEAN)
    state = from_array_record(arrays)
    rng = np.random.default_rng(0)
    trained = [rng.normal(size=state["prompt.p0"].shape[1:]).astype(np.float32) for _ in range(3)]

    def make(client, i):
        content = client_reply(arrays, 10 * (i + 1), [5, 6], np.zeros((2, state["prompt.fusion"].shape[1])),
                               client=client)
        if i < 2:
            content[ARRAYS]["prompt.p0"] = Array(trained[i][None])
        else:  # the old format: every task's prompt
            full = state["prompt.p0"].copy()
            full[1] = trained[i]
            content[ARRAYS]["prompt.p0"] = Array(full)
        return content

    config = ConfigRecord({"task": 1, "round": 0})
    msgs = list(s.configure_train(1, arrays, config, NodeList(3)))
    replies = [Message(make(int(m.content["config"]["client-id"]), i), reply_to=m) for i, m in enumerate(msgs)]
    assert [r.content[ARRAYS]["prompt.p0"].numpy().shape[0] for r in replies] == [1, 1, state["prompt.p0"].shape[0]]
    outcome = s.aggregate_round(1, replies)
    out = outcome.arrays
    assert [node for node, _ in outcome.rejected] == [102] and "prompt.p0: float32(2" in outcome.rejected[0][1]
    merged = from_array_record(out)["prompt.p0"]
    np.testing.assert_array_equal(merged[0], state["prompt.p0"][0])  # task 0's frozen prompt as sent
    np.testing.assert_allclose(merged[1], (10 * trained[0] + 20 * trained[1]) / 30, rtol=1e-5, atol=1e-7)
    assert not (merged[2:] != state["prompt.p0"][2:]).any()


def test_stateful_count_is_the_papers_quarter_million_at_imagenet_r_dimensions():
    """FPPL's 0.25 M parameters per round (ImageNet-R, 20 tasks, 5 blocks x 20 tokens, D = 768):
    one task prompt per block, psi, the head and a task's global prototypes = 253,640."""
    s, _ = strategy_at_task(0)
    wide = fppl_config().replace(num_tasks=20, pool_size=20, prompt_layers="0,1,2,3,4")
    s.data, s.model, s.num_classes = wide.data, wide.model, 200
    s.layout = layout_of(wide, 200)  # what the strategy counts with: 10 classes per task
    d, t, length = 768, 20, 20
    state = {**{f"prompt.p{layer}": np.zeros((t, length, d), np.float32) for layer in range(5)},
             "prompt.fusion": np.zeros((t, d), np.float32), "prompt.fusion_scale": np.ones(1, np.float32),
             "prompt.hard_selection": np.zeros(1, np.float32),
             "head.weight": np.zeros((200, d), np.float32), "head.bias": np.zeros(200, np.float32)}
    assert s.stateful_parameters(to_array_record(state)) == 253_640


# ---------------------------------------------------------------------------- prompt and fusion
def test_fusion_weights_sum_to_one_over_seen_tasks_and_unseen_tasks_get_none():
    torch.manual_seed(0)
    prompt = FPPLPrompt(embed_dim=8, layers=[0, 1], pool_size=4, length=3, num_tasks=4)
    q = torch.randn(16, 8)
    for task in range(4):
        prompt.set_task(task)
        w = prompt.weights(q)
        assert w.shape == (16, 4)
        torch.testing.assert_close(w.sum(dim=1), torch.ones(16))
        assert (w[:, task + 1 :] == 0).all() and (w[:, : task + 1] > 0).all()
    # eq. 2: softmax of the cosine of q with psi over the seen tasks, weighting the task prompts
    prompt.set_task(2)
    cos = F.normalize(q, dim=-1) @ F.normalize(prompt.fusion[:3], dim=-1).T
    torch.testing.assert_close(prompt.weights(q)[:, :3], torch.softmax(cos, dim=1))
    prompt.eval()
    expected = torch.einsum("bt,tld->bld", torch.softmax(cos, dim=1), prompt.p1[:3])
    torch.testing.assert_close(prompt(q, 1), expected)


def test_only_the_current_task_prompt_and_seen_fusion_rows_get_gradients():
    prompt = FPPLPrompt(embed_dim=8, layers=[0], pool_size=4, length=2, num_tasks=4)
    prompt.train()
    prompt.set_task(2)
    prompt(torch.randn(5, 8), 0).pow(2).sum().backward()
    grad = prompt.p0.grad
    assert (grad[:2] == 0).all() and (grad[3] == 0).all()  # finished tasks frozen, future unused
    assert grad[2].abs().sum() > 0
    assert prompt.fusion.grad[:3].abs().sum() > 0 and (prompt.fusion.grad[3] == 0).all()


def test_new_task_prompt_starts_as_a_copy_of_the_previous_one():
    s, a0 = strategy_at_task(0)
    p0 = from_array_record(a0)["prompt.p0"]
    assert np.abs(p0[0]).max() <= 1.0 and p0[0].std() > 0.3  # task 0: uniform in [-1, 1]
    trained = from_array_record(a0)
    trained["prompt.p0"][0] += 0.5  # as if task 0 had been learnt
    a1 = s.on_task_start(1, to_array_record(trained))
    p1 = from_array_record(a1)["prompt.p0"]
    np.testing.assert_array_equal(p1[1], trained["prompt.p0"][0])  # p_1 <- p_0
    np.testing.assert_array_equal(p1[0], trained["prompt.p0"][0])  # p_0 itself untouched


def test_local_training_freezes_finished_prompts_and_uploads_prototypes():
    cfg = fppl_config(centralised=True, lr=0.01)
    rt = get_runtime(cfg, FPPLPrompt)
    s = FPPLStrategy.of(cfg, rt.data.num_classes)
    arrays = s.on_task_start(1, s.on_task_start(0, to_array_record(rt.model.trainable_state())))
    before = from_array_record(arrays)
    content = RecordDict({ARRAYS: arrays, "config": ConfigRecord({"client-id": 0})})
    reply = FPPLLearner.of(cfg, rt).fit(content, task=1, round_=0, client_id=0)
    after = from_array_record(reply[ARRAYS])
    for layer in cfg.model.layers:  # only task 1's prompt travels back: the frozen ones stay home
        assert after[f"prompt.p{layer}"].shape == (1,) + before[f"prompt.p{layer}"].shape[1:]
        assert not np.array_equal(after[f"prompt.p{layer}"][0], before[f"prompt.p{layer}"][1])
    assert not np.array_equal(after["prompt.fusion"][:2], before["prompt.fusion"][:2])  # psi learns
    np.testing.assert_array_equal(after["prompt.fusion_scale"], [1.0])  # the paper's plain cosine
    np.testing.assert_array_equal(after["head.weight"][:5], before["head.weight"][:5])  # task 0's rows

    # eq. 3: the uploaded prototypes are the per-class means of the trained model's features
    protos = reply[LOCAL_PROTOTYPES]
    classes, means = protos["classes"].numpy(), protos["means"].numpy()
    np.testing.assert_array_equal(classes, np.arange(5, 10))
    rt.model.prompt.set_task(1)  # the runtime's model holds what the fit trained
    rt.model.eval()
    idx = np.flatnonzero(rt.data.train.labels == 7)
    x = rt.model.preprocess(torch.from_numpy(rt.data.train.images[idx]))
    with torch.no_grad():
        direct = rt.model.features(x, rt.model.query(x)).mean(0).numpy()
    np.testing.assert_allclose(means[2], direct, rtol=1e-4, atol=1e-5)
    assert protos["counts"].numpy()[2] == len(idx) and protos["client"].numpy()[0] == 0


def test_prototypes_average_over_augmented_views_by_default_as_the_authors_code():
    """augment on: the local prototypes are the per-class means over one seeded augmented view
    of each image (q(x) on the view; the authors' code averages over its training loader);
    fppl.prototype-views = "stored" takes the stored images; without augmentation both agree."""
    from promptfcl.common.data.augment import augment_images

    protos = {}
    for augment, views in (("none", "augmented"), ("crop-flip", "stored"), ("crop-flip", "augmented")):
        cfg = fppl_config(augment=augment, **{"fppl.prototype-views": views})
        rt = get_runtime(cfg, FPPLPrompt)
        learner = FPPLLearner.of(cfg, rt, cfg.method_options("fppl"))
        learner.seed = [cfg.run.seed, 3, 0, 1]  # as fit sets it: (seed, client, task, round)
        index = np.flatnonzero(rt.data.train.labels < 5)[:40]
        rt.model.prompt.set_task(0)
        record = learner.round_end(index, task=0)[LOCAL_PROTOTYPES]
        protos[augment, views] = record["means"].numpy()
        np.testing.assert_array_equal(record["counts"].numpy(), np.bincount(rt.data.train.labels[index])[:5])
    np.testing.assert_allclose(protos["crop-flip", "stored"], protos["none", "augmented"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(protos["crop-flip", "augmented"], protos["none", "augmented"], atol=1e-4)
    views = augment_images(rt.data.train.images[index], "crop-flip", np.random.default_rng([cfg.run.seed, 3, 0, 1, 0x9207]))
    with torch.no_grad():
        x = rt.model.preprocess(torch.from_numpy(views))
        feats = rt.model.features(x, rt.model.query(x)).numpy()
    labels = rt.data.train.labels[index]
    expected = np.stack([feats[labels == c].mean(0) for c in range(5)])
    np.testing.assert_allclose(protos["crop-flip", "augmented"], expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- unified-representation loss
def test_infonce_is_lowest_when_features_sit_on_their_class_prototype():
    gen = torch.Generator().manual_seed(0)
    classes = torch.arange(5, 10)
    protos = torch.randn(5, 32, generator=gen)
    labels = classes.repeat(4)
    on_prototype = 2.5 * protos[labels - 5]  # cosine ignores the scale
    tau = FPPLOptions().temperature
    assert tau == 0.2
    best = unified_representation_loss(on_prototype, labels, classes, protos, tau)
    for eps in (0.3, 1.0, 3.0):
        noisy = on_prototype + eps * torch.randn(on_prototype.shape, generator=gen)
        assert unified_representation_loss(noisy, labels, classes, protos, tau) > best
    wrong = protos[(labels - 5 + 1) % 5]
    assert unified_representation_loss(wrong, labels, classes, protos, tau) > best
    # exactly -log softmax(cos / tau) at the positive
    sims = F.normalize(on_prototype, dim=-1) @ F.normalize(protos, dim=-1).T / tau
    torch.testing.assert_close(best, -torch.log_softmax(sims, dim=1)[torch.arange(20), labels - 5].mean())


def test_infonce_leaves_out_samples_whose_class_has_no_global_prototype():
    protos, classes = torch.randn(3, 8), torch.tensor([0, 1, 2])
    feats = torch.randn(4, 8)
    with_stranger = unified_representation_loss(feats, torch.tensor([0, 1, 2, 7]), classes, protos, 0.2)
    without = unified_representation_loss(feats[:3], torch.tensor([0, 1, 2]), classes, protos, 0.2)
    torch.testing.assert_close(with_stranger, without)
    assert unified_representation_loss(feats, torch.tensor([7, 7, 8, 9]), classes, protos, 0.2) is None


# ---------------------------------------------------------------------------- server: prototypes
def test_global_prototypes_are_the_per_class_mean_over_holders_and_reach_every_client(flower_identity):
    s, arrays = strategy_at_task(0, rounds_per_task=2)
    d = from_array_record(arrays)["prompt.fusion"].shape[1]
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, d)), rng.normal(size=(2, d))
    # the first client holds many samples, the second few
    replies = answered(s, arrays, lambda client, i: client_reply(arrays, (900, 10)[i], ([0, 1], [1, 2])[i], (a, b)[i],
                                                                 client=client), nodes=2)
    s.aggregate_train(1, replies)
    np.testing.assert_array_equal(s.global_classes, [0, 1, 2])
    np.testing.assert_allclose(s.global_means[0], a[0], rtol=1e-6)
    np.testing.assert_allclose(s.global_means[1], (a[1] + b[0]) / 2, rtol=1e-6)  # holders, not samples
    np.testing.assert_allclose(s.global_means[2], b[1], rtol=1e-6)

    messages = list(s.configure_train(2, arrays, ConfigRecord({"task": 0, "round": 1}), NodeList(2)))
    for m in messages:
        record = m.content[GLOBAL_PROTOTYPES]
        np.testing.assert_array_equal(record["classes"].numpy(), [0, 1, 2])
        np.testing.assert_array_equal(record["means"].numpy(), s.global_means)

    # a new task starts without global prototypes (eq. 6 only uses the current task's classes)
    s.on_task_end(0, arrays)
    a1 = s.on_task_start(1, arrays)
    messages = list(s.configure_train(3, a1, ConfigRecord({"task": 1, "round": 0}), NodeList(2)))
    assert all(GLOBAL_PROTOTYPES not in m.content.array_records for m in messages)


def test_learner_uses_the_global_prototypes_of_the_current_task_only():
    cfg = fppl_config()
    rt = get_runtime(cfg, FPPLPrompt)
    learner = FPPLLearner.of(cfg, rt)
    d = rt.model.embed_dim
    record = to_array_record({"classes": np.array([3, 5, 6], np.int64), "means": np.ones((3, d), np.float32)})
    learner.round_start(RecordDict({GLOBAL_PROTOTYPES: record}), task=1)
    np.testing.assert_array_equal(learner.proto_classes.numpy(), [5, 6])  # class 3 is task 0's


def test_malformed_prototypes_are_rejected(flower_identity):
    s, arrays = strategy_at_task(0, num_clients=4, clients_per_round=4)
    d = from_array_record(arrays)["prompt.fusion"].shape[1]

    def make(client: int, i: int) -> RecordDict:
        means = [np.zeros((1, d)), np.full((1, d), np.nan), np.zeros((1, d + 1)), np.zeros((1, d))][i]
        content = client_reply(arrays, 10, [0], means, client=client)
        if i == 3:
            del content[LOCAL_PROTOTYPES]
        return content

    outcome = s.aggregate_round(1, answered(s, arrays, make, nodes=4))
    reasons = dict(outcome.rejected)  # nodes 101, 102, 103 sent a NaN, a wrong width, no prototypes
    assert set(reasons) == {101, 102, 103}
    assert "non-finite" in reasons[101] and "shape" in reasons[102] and "missing" in reasons[103]


# ---------------------------------------------------------------------------- server: debiasing
def _biased_setup(options: dict):
    """Task 1 of 2; the pool holds task 0's prototypes (class 3 from one client only) and the
    averaged head favours the current task's classes 5-9, as local CE on new data leaves it."""
    s, arrays = strategy_at_task(0, options)
    state = from_array_record(arrays)
    d = state["prompt.fusion"].shape[1]
    rng = np.random.default_rng(1)
    centres = 3.0 * rng.normal(size=(NUM_CLASSES, d)) / np.sqrt(d)
    holders = {0: 4, 1: 4, 2: 3, 3: 1, 4: 2}  # class 3 is under-represented
    old = PrototypeSet(
        np.repeat(list(holders), list(holders.values())),
        np.concatenate([centres[c] + 0.3 * rng.normal(size=(n, d)) / np.sqrt(d) for c, n in holders.items()]),
        np.concatenate([np.arange(n) for n in holders.values()]))
    s.current = old.concat(PrototypeSet.empty())
    s.on_task_end(0, arrays)
    state["head.weight"] = (0.5 * centres).astype(np.float32)
    state["head.bias"] = np.where(np.arange(NUM_CLASSES) >= 5, 5.0, 0.0).astype(np.float32)
    arrays = s.on_task_start(1, to_array_record(state))
    replies = [client_reply(arrays, 50, np.arange(5, 10), centres[5:] + 0.3 * rng.normal(size=(5, d)) / np.sqrt(d),
                            client=k) for k in range(3)]
    return s, arrays, replies, old


def _accuracy(arrays, protos: PrototypeSet, classes) -> float:
    state = from_array_record(arrays)
    logits = protos.means @ state["head.weight"].T + state["head.bias"]
    masked = np.full_like(logits, -np.inf)
    masked[:, classes] = logits[:, classes]
    return float((masked.argmax(1) == protos.classes).mean())


def test_debiasing_improves_the_head_on_held_prototypes_of_under_represented_classes():
    s, arrays, replies, old = _biased_setup({"server-epochs": 40, "server-lr": 0.02})
    seen = np.arange(10)
    rare = PrototypeSet(old.classes[old.classes == 3], old.means[old.classes == 3], old.clients[old.classes == 3])
    assert _accuracy(arrays, old, seen) < 0.5 and _accuracy(arrays, rare, seen) == 0.0
    out = s.consolidate(1, arrays, accepted(replies))
    assert _accuracy(out, old, seen) > 0.9
    assert _accuracy(out, rare, seen) == 1.0
    assert _accuracy(out, s.current, seen) == 1.0  # current classes still right


def test_debias_head_touches_only_classes_with_prototypes():
    w, b = np.zeros((6, 4), np.float32), np.zeros(6, np.float32)
    feats = np.eye(4, dtype=np.float32)[:2]
    w2, b2 = debias_head(w, b, feats, np.array([1, 2]), epochs=3, lr=0.1, batch_size=2, seed=0)
    changed = np.flatnonzero(np.abs(w2 - w).sum(1) + np.abs(b2 - b) > 0)
    np.testing.assert_array_equal(changed, [1, 2])


# ---------------------------------------------------------------------------- ablation switches
def test_without_unified_loss_no_prototypes_are_sent_and_no_loss_is_added(flower_identity):
    cfg = fppl_config()
    rt = get_runtime(cfg, FPPLPrompt)
    d = rt.model.embed_dim
    record = to_array_record({"classes": np.arange(5, 10), "means": np.ones((5, d), np.float32)})
    batch = type("B", (), {"features": torch.randn(4, d), "labels": torch.tensor([5, 6, 7, 8]), "share": 1.0,
                           "step_labels": None, "rows": None})()
    on, off = FPPLLearner.of(cfg, rt), FPPLLearner.of(cfg, rt, {"unified-loss": False})
    for learner in (on, off):
        learner.round_start(RecordDict({GLOBAL_PROTOTYPES: record}), task=1)
    assert on.extra_loss(batch, 1) is not None
    assert off.extra_loss(batch, 1) is None

    for flag, expect in ((True, True), (False, False)):
        s, arrays = strategy_at_task(0, {"unified-loss": flag}, rounds_per_task=2)
        s.aggregate_train(1, answered(s, arrays, lambda c, i: client_reply(arrays, 10, [0, 1], np.zeros((2, d)), client=c),
                                      nodes=2))
        messages = list(s.configure_train(2, arrays, ConfigRecord({"task": 0, "round": 1}), NodeList(2)))
        assert (GLOBAL_PROTOTYPES in messages[0].content.array_records) is expect


def test_without_fusion_each_sample_uses_one_task_prompt():
    for fusion in (True, False):
        s, arrays = strategy_at_task(2, {"fusion": fusion}, num_tasks=4, pool_size=4)
        state = to_torch(arrays)
        np.testing.assert_array_equal(state["prompt.hard_selection"].numpy(), [0.0 if fusion else 1.0])
        prompt = FPPLPrompt(state["prompt.fusion"].shape[1], [0, 1], 4, 4, 4)
        prompt.load_state_dict({k[7:]: v for k, v in state.items() if k.startswith("prompt.")})
        prompt.p0.data = torch.randn_like(prompt.p0)  # distinct task prompts
        prompt.set_task(2)
        prompt.eval()
        q = torch.randn(12, prompt.embed_dim)
        w = prompt.weights(q)
        if fusion:
            assert ((w[:, :3] > 0) & (w[:, :3] < 1)).all()
        else:
            chosen = prompt.task_scores(q)[:, :3].argmax(1)
            torch.testing.assert_close(w, F.one_hot(chosen, 4).float())
            torch.testing.assert_close(prompt(q, 0), prompt.p0[chosen])


def test_without_debias_the_head_is_the_plain_average():
    s, arrays, replies, _ = _biased_setup({"debias": False})
    out = s.consolidate(1, arrays, accepted(replies))
    for name in ("head.weight", "head.bias"):
        np.testing.assert_array_equal(from_array_record(out)[name], from_array_record(arrays)[name])
    s, arrays, replies, _ = _biased_setup({})
    out = s.consolidate(1, arrays, accepted(replies))
    assert not np.array_equal(from_array_record(out)["head.bias"], from_array_record(arrays)["head.bias"])


def test_without_pool_debiasing_uses_only_current_prototypes():
    s, arrays, replies, old = _biased_setup({"pool": False, "server-epochs": 40, "server-lr": 0.02})
    assert len(s.pool) == 0  # task 0's prototypes were not kept
    out = s.consolidate(1, arrays, accepted(replies))
    np.testing.assert_array_equal(np.unique(s.debias_set().classes), np.arange(5, 10))
    before, after = from_array_record(arrays), from_array_record(out)
    np.testing.assert_array_equal(after["head.weight"][:5], before["head.weight"][:5])  # old rows untouched
    assert _accuracy(out, old, np.arange(10)) < 0.5  # so old classes stay under-predicted

    s, arrays, replies, old = _biased_setup({"server-epochs": 40, "server-lr": 0.02})
    assert len(s.pool) == len(old)
    s.consolidate(1, arrays, accepted(replies))
    np.testing.assert_array_equal(np.unique(s.debias_set().classes), np.arange(10))


# ---------------------------------------------------------------------------- state and options
def test_pool_and_global_prototypes_survive_a_checkpoint():
    s, arrays, replies, _ = _biased_setup({})
    s.consolidate(1, arrays, accepted(replies))
    from promptfcl.server.checkpoint import _join, _split

    tensors: dict = {}
    saved = _join(_split(s.state_dict(), "strategy", tensors), tensors)  # as a checkpoint stores it
    restored = FPPLStrategy.of(fppl_config(), NUM_CLASSES, {})
    restored.load_state_dict(saved)
    for a, b in ((s.pool, restored.pool), (s.current, restored.current)):
        for field in ("classes", "means", "clients"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    np.testing.assert_array_equal(restored.global_means, s.global_means)
    assert restored.task == 1
    # the next round behaves identically
    out_a, out_b = s.consolidate(2, arrays, accepted(replies)), restored.consolidate(2, arrays, accepted(replies))
    np.testing.assert_array_equal(from_array_record(out_a)["head.weight"], from_array_record(out_b)["head.weight"])


def test_latest_per_client_keeps_each_clients_newest_prototypes():
    s, arrays = strategy_at_task(0, {"latest-per-client": True}, rounds_per_task=3)
    d = from_array_record(arrays)["prompt.fusion"].shape[1]
    s.consolidate(1, arrays, accepted([client_reply(arrays, 5, [0, 1], np.zeros((2, d)), client=c) for c in (1, 2)]))
    s.consolidate(2, arrays, accepted([client_reply(arrays, 5, [0], np.ones((1, d)), client=2)]))
    assert sorted(zip(s.current.clients.tolist(), s.current.classes.tolist())) == [(1, 0), (1, 1), (2, 0)]
    np.testing.assert_allclose(s.global_means[0], np.full(d, 0.5))  # client 1's old, client 2's new


def test_with_partial_participation_only_latest_per_client_keeps_every_class_in_the_pool():
    """5 of 10 clients per round: a class held only by clients of an earlier round of the task
    stays in the pool with latest-per-client (default), and is lost with the literal reading."""
    pools = {}
    for latest in (True, False):
        s, arrays = strategy_at_task(0, {"latest-per-client": latest}, rounds_per_task=2)
        d = from_array_record(arrays)["prompt.fusion"].shape[1]
        s.consolidate(1, arrays, accepted([client_reply(arrays, 5, [0], np.zeros((1, d)), client=1),
                                           client_reply(arrays, 5, [1], np.ones((1, d)), client=2)]))
        s.consolidate(2, arrays, accepted([client_reply(arrays, 5, [0], np.zeros((1, d)), client=3)]))  # last round
        s.on_task_end(0, arrays)
        pools[latest] = sorted(set(s.pool.classes.tolist()))
    assert FPPLOptions().latest_per_client is True
    assert pools[True] == [0, 1] and pools[False] == [0]


def test_options_are_validated():
    assert FPPLOptions.from_options({}) == FPPLOptions()
    opts = FPPLOptions.from_options({"fusion": "false", "server-epochs": 3, "temperature": "0.5"})
    assert opts.fusion is False and opts.server_epochs == 3 and opts.temperature == 0.5
    for bad in ({"temprature": 0.2}, {"temperature": 0}, {"server-epochs": 1.5}, {"fusion": "maybe"},
                {"fusion-scale": "huge"}, {"prototype-views": "both"}):
        with pytest.raises(ConfigError):
            FPPLOptions.from_options(bad)
    with pytest.raises(ConfigError):
        FPPLStrategy.of(fppl_config(), NUM_CLASSES, {"debias": "sometimes"})
    with pytest.raises(ConfigError, match="fppl.bogus"):
        FPPLStrategy.parse_options({"bogus": 1})  # what the CLI runs before any training


def test_registered():
    assert strategy_class("fppl") is FPPLStrategy
    assert learner_class("fppl") is FPPLLearner
    assert prompt_class("fppl") is FPPLPrompt


# ---------------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_fppl_end_to_end_simulation(tmp_path):
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "fppl", strategy="fppl", lr=0.01, **PLAIN_MEAN)  # no reply judged
    acc = results["accuracy_matrix"]
    assert acc[0][0] is not None and acc[1][1] is not None and acc[1][0] is None
    assert results["config"]["strategy"] == "fppl"
    rounds = results["rounds"]
    assert len(rounds) == 4 and all(r["clients_aggregated"] == 3 and not r["rejected"] for r in rounds)
    d = results["config"]["embed-dim"]
    for first, second in ((rounds[0], rounds[1]), (rounds[2], rounds[3])):
        assert first["round"] == 0 and second["round"] == 1
        # the second round of a task carries the global prototypes (<= 5 classes x D floats per client)
        extra = second["bytes_s2c"] - first["bytes_s2c"]
        assert second["clients_sampled"] * d * 4 <= extra <= second["clients_sampled"] * (5 * (d * 4 + 8) + 2048)
    # clients upload prototypes on top of the parameters
    n_params = results["communication"]["trainable_parameters"]
    assert all(r["bytes_c2s"] / r["clients_aggregated"] > 4 * n_params + d * 4 for r in rounds)


# ---------------------------------------------------------------------------- asynchronous arrival
ASYNC = {"num-clients": 4, "clients-per-round": 4, "rounds-per-task": 2, "switch-every": 1, "switch-fraction": 0.5}


def test_async_prototypes_enter_the_pool_as_each_client_leaves_its_task():
    """Two tasks of 5 classes, 4 clients, every round 2 of them move on: tasks 0 and 1 in flight in round 2."""
    s, arrays = strategy_at_task(0, **{k.replace("-", "_"): v for k, v in ASYNC.items()})
    d = from_array_record(arrays)["prompt.fusion"].shape[1]
    fast = sorted(c for c in range(4) if s.schedule.position(c, 1) == 1)
    slow = sorted(set(range(4)) - set(fast))

    def protos(client: int, classes: list[int], version: int = 0) -> RecordDict:
        """Prototypes whose value encodes (client, class, version)."""
        means = np.stack([np.full(d, 100.0 * client + c + 0.5 * version) for c in classes])
        return client_reply(arrays, 5, classes, means, client=client)

    # round 1: every client on task 0
    s.consolidate(1, arrays, accepted([protos(c, [0, 1]) for c in range(4)]))
    s.pool_departed(1)  # as round 2's configure_train does
    # the fast clients leave task 0 now: their prototypes are pooled, the slow ones' stay current
    assert sorted(set(s.pool.clients.tolist())) == fast and sorted(set(s.current.clients.tolist())) == slow
    np.testing.assert_array_equal(s.global_classes, [0, 1])  # task 0 still has clients; task 1 none yet
    np.testing.assert_allclose(s.global_means[0], np.full(d, 100.0 * np.mean(range(4))))  # over all holders
    # round 2: the fast clients' first round of task 1; slow[0] sends newer prototypes of task 0
    arrays = s.on_task_start(1, arrays)
    p = from_array_record(arrays)
    np.testing.assert_array_equal(p["prompt.p0"][1], p["prompt.p0"][0])  # task 1 starts from task 0's prompt
    s.consolidate(2, arrays, accepted([protos(fast[0], [5, 6]), protos(fast[1], [5]), protos(slow[0], [0, 1], version=1)]))
    s.pool_departed(2)
    # now every client has left task 0: the pool holds one set per client, slow[0]'s newest
    pool0 = sorted(zip(s.pool.clients.tolist(), s.pool.classes.tolist(), s.pool.means[:, 0].tolist()))
    assert pool0 == sorted((c, y, 100.0 * c + y + 0.5 * (c == slow[0])) for c in range(4) for y in (0, 1))
    assert sorted(zip(s.current.clients.tolist(), s.current.classes.tolist())) == sorted(
        [(fast[0], 5), (fast[0], 6), (fast[1], 5)])
    np.testing.assert_array_equal(s.global_classes, [5, 6])  # only task 1 is in flight in round 3
    np.testing.assert_allclose(s.global_means[0], np.full(d, 100.0 * np.mean(fast) + 5))
    assert sorted(set(s.debias_set().classes.tolist())) == [0, 1, 5, 6]  # every class with prototypes
    # round 3: a client's newer prototypes of task 1 replace its older ones; its task 0 ones stay pooled
    s.consolidate(3, arrays, accepted([protos(fast[0], [5, 6], version=1), protos(slow[1], [7])]))
    s.pool_departed(3)
    assert sorted(zip(s.current.clients.tolist(), s.current.classes.tolist(), s.current.means[:, 0].tolist())) == \
        sorted([(fast[0], 5, 100.0 * fast[0] + 5.5), (fast[0], 6, 100.0 * fast[0] + 6.5), (fast[1], 5, 100.0 * fast[1] + 5),
                (slow[1], 7, 100.0 * slow[1] + 7)])
    assert len(s.pool) == 8
    s.on_task_end(1, arrays)  # the run's end: everything left is pooled
    assert len(s.current) == 0 and len(s.pool) == 12


def test_async_replies_are_checked_against_the_task_and_client_the_server_sent(flower_identity):
    from flwr.app import Message

    s, arrays = strategy_at_task(1, **{k.replace("-", "_"): v for k, v in ASYNC.items()})
    d = from_array_record(arrays)["prompt.fusion"].shape[1]
    sent = list(s.configure_train(2, arrays, ConfigRecord({"task": 0, "round": 1}), NodeList(4)))
    for msg in sent:
        client, task = int(msg.content["config"]["client-id"]), int(msg.content["config"]["task"])
        own, other = ([0, 1], [5, 6]) if task == 0 else ([5, 6], [0, 1])
        ok = Message(content=client_reply(arrays, 5, own, np.zeros((2, d)), client=client), reply_to=msg)
        assert s.check_reply(ok) is None
        wrong_task = Message(content=client_reply(arrays, 5, other, np.zeros((2, d)), client=client), reply_to=msg)
        assert "outside the task" in s.check_reply(wrong_task)
        spoofed = Message(content=client_reply(arrays, 5, own, np.zeros((2, d)), client=client + 1), reply_to=msg)
        assert "another client" in s.check_reply(spoofed)
        twice = Message(content=client_reply(arrays, 5, own[:1] * 2, np.zeros((2, d)), client=client), reply_to=msg)
        assert "repeat a class" in s.check_reply(twice)


@pytest.mark.e2e
def test_fppl_asynchronous_end_to_end(tmp_path):
    """Every round 2 of 3 clients move on (3 clients, 2 rounds per task): round 2 has both tasks in flight."""
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "fppl", strategy="fppl", lr=0.01, **PLAIN_MEAN, **{"switch-every": 1, "switch-fraction": 0.5})
    rounds = results["rounds"]
    assert [sorted(r["client_tasks"]) for r in rounds] == [[0, 0, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert all(r["clients_aggregated"] == 3 and not r["rejected"] for r in rounds)
    acc = results["accuracy_matrix"]
    assert acc[1][0] is None and all(v is not None and 0 <= v <= 100 for v in (acc[0][0], acc[0][1], acc[1][1]))
