"""Fed-CPrompt: C2L, frozen past/future slices, per-slice aggregation, options, end to end."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.runtime import get_runtime, layout_of
from promptfcl.common.records import ARRAYS, CONFIG, METRICS, from_array_record, to_array_record
from promptfcl.strategies.fedcprompt.learner import FedCPromptLearner, c2l_loss
from promptfcl.strategies.fedcprompt.options import FedCPromptOptions
from promptfcl.strategies.fedcprompt.prompt import FedCPromptPrompt
from promptfcl.strategies.fedcprompt.records import KNOWN_TASKS
from promptfcl.strategies.fedcprompt.strategy import FedCPromptStrategy
from promptfcl.strategies.platform.aggregation import aggregate_per_task, weighted_average
from promptfcl.strategies.registry import learner_class, prompt_class, strategy_class
from tests.conftest import PLAIN_MEAN, reply_from, tiny_config

ROOT = Path(__file__).resolve().parents[1]


class NodeList:
    def __init__(self, n: int) -> None:
        self.ids = list(range(100, 100 + n))

    def get_node_ids(self):
        return self.ids


def start(cfg, tasks: int):
    """Runtime with Fed-CPrompt's prompt, strategy, and arrays with ``tasks`` slices initialised."""
    rt = get_runtime(cfg, FedCPromptPrompt)
    s = FedCPromptStrategy.of(cfg, rt.data.num_classes)
    arrays = to_array_record(rt.model.trainable_state())
    for t in range(tasks):
        arrays = s.on_task_start(t, arrays)
    return rt, s, arrays


#: the project's early-stopping rule before issue 58 (options since; the authors' code's is the default)
EARLIER_RULE = {"early-stopping-metric": "accuracy", "patience": 2, "early-stopping-keep": "best",
                "early-stopping-skip": 0}


def train_content(arrays, task: int, known: int) -> RecordDict:
    return RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({"task": task, "round": 0, "client-id": 0,
                                                              KNOWN_TASKS: known})})


# ---------------------------------------------------------------------------- options
def test_options_defaults_validation_and_registry():
    o = FedCPromptOptions.from_options({})
    assert (o.gamma, o.alpha, o.lambda_, o.c2l, o.c2l_params, o.prox_mu) == (0.1, 0.5, 1.0, True, "p", 0.0)
    o = FedCPromptOptions.from_options({"lambda": "0.3", "c2l": "false", "prox-mu": 0.01, "c2l_params": "pka"})
    assert (o.lambda_, o.c2l, o.prox_mu, o.c2l_params) == (0.3, False, 0.01, "pka")
    for bad in ({"gamma": 0}, {"alpha": -1}, {"lambda": -0.1}, {"prox-mu": -1}, {"c2l-params": "q"},
                {"gamma": "x"}, {"c2l": "maybe"}, {"beta": 1.0}):
        with pytest.raises(ConfigError, match="fedcprompt"):
            FedCPromptOptions.from_options(bad)
    with pytest.raises(ConfigError, match="unknown option fedcprompt.nope"):
        FedCPromptStrategy.of(tiny_config(), 10, {"nope": 1})
    with pytest.raises(ConfigError, match="gamma"):
        FedCPromptStrategy.parse_options({"gamma": -1})  # what the CLI runs before any training
    assert FedCPromptStrategy.parse_options({"lambda": 0.5}).lambda_ == 0.5
    assert strategy_class("fedcprompt") is FedCPromptStrategy
    assert learner_class("fedcprompt") is FedCPromptLearner
    assert prompt_class("fedcprompt") is FedCPromptPrompt


def test_paper_scale_config_loads():
    from promptfcl.server.cli import load_config

    cfg = load_config(str(ROOT / "configs/fedcprompt-cifar100.toml"), [], None, None)
    assert cfg.run.strategy == "fedcprompt" and cfg.data.dataset == "hf:cifar100" and cfg.data.num_tasks == 10
    assert (cfg.federation.num_clients, cfg.federation.clients_per_round, cfg.federation.rounds_per_task, cfg.training.local_epochs) == (10, 10, 40, 5)
    assert (cfg.training.lr, cfg.training.batch_size, cfg.model.pool_size, cfg.model.prompt_length) == (1e-4, 128, 100, 8)
    assert cfg.model.layers == [0, 1, 2, 3, 4] and cfg.model.prompt_mode == "prefix" and cfg.model.weights == "timm"
    assert (cfg.federation.partition, cfg.federation.dirichlet_beta) == ("dirichlet", 0.5)
    assert cfg.training.augment == "resized-crop-flip" and cfg.model.input_norm == "unit"  # CODA-P's code
    opts = FedCPromptOptions.from_options(cfg.method_options("fedcprompt"))
    assert opts == FedCPromptOptions()  # the file spells out the defaults


# ---------------------------------------------------------------------------- C2L (eq. 3)
def test_c2l_is_zero_past_the_margin_and_grows_with_drift():
    gen = torch.Generator().manual_seed(0)
    prev = torch.randn(50, generator=gen)
    others = torch.stack([prev + 3.0, prev - 5.0])  # nearest other task at distance 3*sqrt(50)
    direction = torch.randn(50, generator=gen)
    direction /= direction.norm()
    # no drift, nearest other far away: the hinge is inactive
    assert c2l_loss(prev, prev, others, gamma=1.0, alpha=0.5).item() == 0.0
    values = [c2l_loss(prev + d * direction, prev, others, gamma=0.5, alpha=0.5).item() for d in (0, 5, 20, 30, 40)]
    assert values[0] == 0.0 and values[1] == 0.0  # still past the margin
    assert 0 < values[2] < values[3] < values[4]  # grows with drift once active
    # exactly the formula when active: drift - gamma * nearest + alpha
    cur = prev + 40 * direction
    nearest = torch.linalg.vector_norm(cur[None] - others, dim=1).min()
    assert values[-1] == pytest.approx((40 - 0.5 * nearest + 0.5).item(), rel=1e-5)
    # drifting towards another task's prompt activates it sooner than drifting away
    toward = (others[0] - prev) / (others[0] - prev).norm()
    assert c2l_loss(prev + 12 * toward, prev, others, 1.0, 0.5) > 0 == c2l_loss(prev - 12 * toward, prev, others, 1.0, 0.5)
    # a closer other task raises the loss; a larger gamma lowers it
    near = torch.stack([prev + 0.01])
    assert c2l_loss(prev + direction, prev, near, 1.0, 0.5) > c2l_loss(prev + direction, prev, others, 1.0, 0.5)
    assert c2l_loss(cur, prev, others, 0.6, 0.5) < c2l_loss(cur, prev, others, 0.5, 0.5)
    # no other task known: drift + alpha, the gradient is the drift's (zero, not NaN, at no drift)
    x = prev.clone().requires_grad_(True)
    loss = c2l_loss(x, prev, prev.new_zeros((0, 50)), 1.0, 0.5)
    loss.backward()
    assert loss.item() == pytest.approx(0.5) and torch.equal(x.grad, torch.zeros(50))


def test_first_task_c2l_is_a_drift_penalty_or_off():
    """c2l-first-task: with no other known task, "drift" keeps ||P_c - P_s(r-1)|| + alpha, "off" gives 0."""
    prev = torch.zeros(50)
    none = prev.new_zeros((0, 50))
    moved = prev + 0.3  # drift 0.3 * sqrt(50)
    drift = c2l_loss(moved, prev, none, 1.0, 0.5, first_task="drift").item()
    assert drift == pytest.approx(0.3 * 50 ** 0.5 + 0.5, rel=1e-5)
    assert c2l_loss(moved, prev, none, 1.0, 0.5, first_task="off").item() == 0.0
    others = torch.stack([prev + 10.0])
    for mode in ("drift", "off"):  # once another task is known, the option changes nothing
        assert c2l_loss(moved, prev, others, 0.1, 0.5, first_task=mode).item() == pytest.approx(
            max(0.3 * 50 ** 0.5 - 0.1 * 9.7 * 50 ** 0.5 + 0.5, 0.0), abs=1e-5)
    assert FedCPromptOptions().c2l_first_task == "drift"
    with pytest.raises(ConfigError, match="c2l-first-task"):
        FedCPromptOptions.from_options({"c2l-first-task": "zero"})
    # in the learner: the first task of a synchronous run, with "off" the loss is CE alone
    cfg = tiny_config(num_tasks=2, centralised=True)
    rt, _, arrays = start(cfg, tasks=1)
    results = {}
    for mode in ("drift", "off"):
        learner = FedCPromptLearner.of(cfg, rt, {"c2l-first-task": mode})
        reply = learner.fit(train_content(arrays, 0, 1), task=0, round_=0, client_id=0)
        results[mode] = (learner.last_c2l, reply[ARRAYS]["prompt.p0"].numpy())
    assert results["drift"][0] > 0.5 and results["off"][0] == 0.0
    plain = FedCPromptLearner.of(cfg, rt, {"c2l": False}).fit(train_content(arrays, 0, 1), task=0, round_=0, client_id=0)
    np.testing.assert_array_equal(results["off"][1], plain[ARRAYS]["prompt.p0"].numpy())
    assert not np.array_equal(results["drift"][1], results["off"][1])


def test_c2l_in_the_learner_uses_the_server_prompts_of_this_round():
    cfg = tiny_config(num_tasks=5, centralised=True)
    rt, _, arrays = start(cfg, tasks=3)
    learner = FedCPromptLearner.of(cfg, rt, {"gamma": 1.0, "alpha": 0.5})
    rt.model.load_trainable_state({k: torch.from_numpy(v.copy()) for k, v in from_array_record(arrays).items()})
    rt.model.prompt.set_task(1)
    learner.round_start(train_content(arrays, 1, 3), 1)
    assert learner.others.shape[0] == 2  # tasks 0 and 2 (a known future task) are the "other" prompts
    assert learner.c2l(1).item() == 0.0  # the incoming prompt: no drift, orthogonal slices far apart
    s = rt.model.prompt.slice_of(1)
    losses = []
    for step in (1.0, 2.0, 3.0):
        with torch.no_grad():
            for layer in cfg.model.layers:
                getattr(rt.model.prompt, f"p{layer}")[s] += 1.0
        losses.append(learner.c2l(1).item())
    assert losses[-1] > 0 and losses == sorted(losses) and losses[-1] > losses[-2]
    # only the task's own slice gets the C2L gradient
    rt.model.prompt.zero_grad()
    learner.c2l(1).backward()
    for layer in cfg.model.layers:
        g = getattr(rt.model.prompt, f"p{layer}").grad
        assert g[s].abs().sum() > 0
        assert g[: s.start].abs().sum() == 0 and g[s.stop :].abs().sum() == 0
    rt.model.prompt.zero_grad(set_to_none=True)
    rt.model.prompt.known_tasks = None  # the runtime is shared with the other tests


# ---------------------------------------------------------------------------- eq. 2: frozen past and future
def test_frozen_past_and_future_slices_get_no_gradient():
    torch.manual_seed(0)
    prompt = FedCPromptPrompt(embed_dim=8, layers=[0], pool_size=8, length=2, num_tasks=4)
    prompt.set_task(1)
    prompt.known_tasks = 3  # task 2 is known (a client is ahead); task 3 is not
    prompt.train()
    q = torch.randn(5, 8)
    out = prompt(q, 0)
    assert prompt.weights(q, 0).shape == (5, 6)  # slices 0, 1, 2 take part
    out.pow(2).sum().backward()
    for kind in "pka":
        g = getattr(prompt, f"{kind}0").grad
        assert g[2:4].abs().sum() > 0  # the current task's slice learns
        assert g[0:2].abs().sum() == 0 and g[4:8].abs().sum() == 0  # past, future and unknown: frozen
    # the future slice is used (eq. 2's third term); the unknown one is not
    with torch.no_grad():
        prompt.eval()
        before = prompt(q, 0)
        prompt.p0[4:6] += 1.0
        assert not torch.allclose(prompt(q, 0), before)
        after_future = prompt(q, 0)
        prompt.p0[6:8] += 1.0
        torch.testing.assert_close(prompt(q, 0), after_future)
    # without a known-tasks value it is plain CODA-P: slices 0..task
    prompt.known_tasks = None
    assert prompt.weights(q, 0).shape == (5, 4)


def test_fit_trains_only_its_slice_and_head_rows_with_future_slices_known():
    cfg = tiny_config(num_tasks=5, centralised=True, lr=0.05, local_epochs=2)
    rt, _, arrays = start(cfg, tasks=3)  # tasks 3 and 4 not known yet
    learner = FedCPromptLearner.of(cfg, rt, {"alpha": 1.0, "gamma": 0.05, "prox-mu": 0.01})  # C2L active from the start
    before = from_array_record(arrays)
    reply = learner.fit(train_content(arrays, 1, 3), task=1, round_=0, client_id=0)
    after = from_array_record(reply[ARRAYS])
    assert learner.last_c2l is not None and learner.last_c2l > 0
    per_task = cfg.model.pool_size // cfg.data.num_tasks
    mine = slice(per_task, 2 * per_task)
    for layer in cfg.model.layers:
        for kind in "pka":
            name = f"prompt.{kind}{layer}"
            np.testing.assert_array_equal(after[name][: mine.start], before[name][: mine.start])  # past
            np.testing.assert_array_equal(after[name][mine.stop :], before[name][mine.stop :])  # future
            assert not np.array_equal(after[name][mine], before[name][mine])
    k = rt.data.num_classes // cfg.data.num_tasks
    other_rows = np.r_[0:k, 2 * k : rt.data.num_classes]
    np.testing.assert_array_equal(after["head.weight"][other_rows], before["head.weight"][other_rows])
    assert not np.array_equal(after["head.weight"][k : 2 * k], before["head.weight"][k : 2 * k])
    assert rt.model.prompt.known_tasks is None  # the shared runtime is left as plain CODA-P


def test_c2l_changes_training_and_off_switch_matches_fedavg_prompt():
    from promptfcl.strategies.platform.learner import LocalLearner

    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.05)
    rt, _, arrays = start(cfg, tasks=2)
    content = train_content(arrays, 1, 2)
    plain = from_array_record(LocalLearner.of(cfg, rt).fit(content, 1, 0, 0)[ARRAYS])
    off = from_array_record(FedCPromptLearner.of(cfg, rt, {"c2l": False, "early-stopping": False}).fit(content, 1, 0, 0)[ARRAYS])
    on = from_array_record(FedCPromptLearner.of(cfg, rt, {"gamma": 0.05, "alpha": 1.0, "early-stopping": False}).fit(
        content, 1, 0, 0)[ARRAYS])
    for name in plain:  # synchronous, C2L and early stopping off: FedAvg-Prompt's client
        np.testing.assert_array_equal(off[name], plain[name])
    drift = lambda st: sum(np.linalg.norm(st[f"prompt.p{l}"] - from_array_record(arrays)[f"prompt.p{l}"])  # noqa: E731
                           for l in cfg.model.layers)
    assert drift(on) < drift(plain)  # C2L restrains the drift from the previous round


class ScriptedValidation(FedCPromptLearner):
    """Validation accuracies by epoch from a script; records the state after each epoch."""

    script: list[float] = []

    def accuracy(self, index, task, batch_size=256):
        self.states.append({k: v.clone() for k, v in self.rt.model.trainable_state().items()})
        return self.script[len(self.states) - 1]


def test_early_stopping_holds_out_a_fixed_share_and_replies_with_the_best_epoch():
    """The paper's early stopping on a validation set: 10% of the task's samples held out (the same
    every round, never trained on); after 2 epochs without a gain training stops, and the reply
    carries the parameters of the best epoch."""
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.05, local_epochs=5)
    rt, _, arrays = start(cfg, tasks=1)
    learner = ScriptedValidation.of(cfg, rt, {"c2l": False, "early-stopping-scope": "local", **EARLIER_RULE})
    learner.states, learner.script = [], [0.5, 0.7, 0.6, 0.65, 0.9]
    seen = []
    learner.held_out = lambda index, f=learner.held_out: seen.append(f(index)) or seen[-1]
    reply = learner.fit(train_content(arrays, 0, 1), task=0, round_=0, client_id=0)
    assert learner.epochs_run == 4  # best at epoch 2, no gain at 3 and 4: stop before epoch 5
    after = from_array_record(reply[ARRAYS])
    for name, value in learner.states[1].items():  # epoch 2's parameters
        np.testing.assert_array_equal(after[name], value.numpy())
    assert not np.array_equal(after["head.weight"], learner.states[3]["head.weight"].numpy())
    trained, validation = seen[0]
    everything = np.concatenate([trained, validation])
    assert len(np.intersect1d(trained, validation)) == 0 and len(validation) == round(0.1 * len(everything))
    learner.seed = [cfg.run.seed, 0, 0, 7]  # another round of the same client and task: the same share
    np.testing.assert_array_equal(FedCPromptLearner.held_out(learner, np.sort(everything))[1], validation)
    off = FedCPromptLearner.of(cfg, rt, {"early-stopping": False})
    assert len(off.held_out(np.sort(everything))[1]) == 0
    # the held-out samples are not trained on, so they do not weigh in FedAvg
    assert reply[METRICS]["num-examples"] == len(trained)
    assert FedCPromptStrategy.of(cfg, 10).trained_examples(len(everything)) == len(trained)
    assert FedCPromptStrategy.of(cfg, 10, {"early-stopping": False}).trained_examples(len(everything)) == len(everything)


@pytest.mark.parametrize(("metric", "field"), [("loss", "val-loss"), ("accuracy", "val-correct")])
def test_task_scope_clients_report_the_received_models_validation_and_train_every_epoch(flower_identity, metric,
                                                                                         field):
    """early-stopping-scope = task (default): the client scores the global model it received on its
    held-out share (reply metrics val-loss, the default, or val-correct, with val-total), trains
    every local epoch on the rest, and replies what it trained (no best-epoch selection)."""
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.05, local_epochs=3)
    rt, _, arrays = start(cfg, tasks=1)
    options = {"c2l": False, "early-stopping-metric": metric}
    learner = FedCPromptLearner.of(cfg, rt, options)
    seen = []
    learner.held_out = lambda index, f=learner.held_out: seen.append(f(index)) or seen[-1]
    reply = learner.fit(train_content(arrays, 0, 1), task=0, round_=0, client_id=0)
    trained, validation = seen[0]
    assert learner.epochs_run == 3 and len(validation) and reply[METRICS]["num-examples"] == len(trained)
    metrics = reply[METRICS]
    received = FedCPromptLearner.of(cfg, rt, options)
    rt.model.load_trainable_state({k: torch.from_numpy(v) for k, v in from_array_record(arrays).items()})
    rt.model.prompt.set_task(0)
    rt.model.prompt.known_tasks = 1
    score = received.validation_loss(validation, 0) if metric == "loss" else received.correct(validation, 0)
    assert {k: metrics[k] for k in ("val-total", field)} == {field: score, "val-total": len(validation)}
    assert ({"val-loss", "val-correct"} - {field}).isdisjoint(metrics.keys())
    server = FedCPromptStrategy.of(cfg, 10, {"early-stopping-metric": metric})
    assert server.check_records(Message(content=reply, dst_node_id=1, message_type="train"), None) is None
    other = FedCPromptStrategy.of(cfg, 10, {"early-stopping-metric": "accuracy" if metric == "loss" else "loss"})
    assert "this run's early stopping reads" in other.check_records(
        Message(content=reply, dst_node_id=1, message_type="train"), None)
    bad = RecordDict({METRICS: MetricRecord({"num-examples": 5, "val-correct": 3, "val-total": 2})})
    assert "exceeds" in FedCPromptStrategy.of(cfg, 10, EARLIER_RULE).check_records(
        Message(content=bad, dst_node_id=1, message_type="train"), None)


def test_server_stops_a_task_after_patience_rounds_and_restores_its_best_model(flower_identity):
    """The server sums the replies' counts per task (its validation of the model the round started
    from), keeps the best, and after `patience` rounds without a gain puts the task's slice and
    head rows back at the best model and sends the task's clients nothing more; a round with no
    client to train keeps the arrays; the state survives a checkpoint."""
    from tests.helpers import accepted_of

    cfg, s, shapes, base = async_setup(num_tasks=3, known=3, options=EARLIER_RULE)
    s.task_of_client = {0: 0, 1: 1, 2: 0, 3: 1}
    models, correct = [], {0: [5, 8, 7, 6], 1: [4, 5, 6, 7]}  # task 0 peaks in round 2; task 1 keeps gaining
    out = base
    for r in range(4):
        s.round_arrays = out
        models.append(from_array_record(out))
        contents = []
        for client in range(4):
            task = s.task_of_client[client]
            state = {k: np.full(v, 10.0 * (r + 1) + task, np.float32) for k, v in shapes.items()}
            contents.append(RecordDict({ARRAYS: to_array_record(state), METRICS: MetricRecord({
                "num-examples": 9, "train-loss": 1.0, "train-seconds": 0.1,
                "val-correct": correct[task][r], "val-total": 10})}))
        accepted = accepted_of(contents, tasks=[s.task_of_client[c] for c in range(4)])
        averaged = s.aggregate(accepted)
        out = s.consolidate(r + 1, averaged, accepted)
        assert s.validation == {0: correct[0][r] / 10, 1: correct[1][r] / 10} or r == 3
    assert s.stopped == {0}  # best at round 2 (8/10), no gain in rounds 3 and 4
    final, best = from_array_record(out), models[1]  # round 2 validated the model round 1 produced
    for name in shapes:
        np.testing.assert_array_equal(final[name][0:2], best[name][0:2])  # task 0 back at its best
        np.testing.assert_array_equal(final[name][2:4], 41.0)  # task 1 keeps this round's average
    msgs = list(s.configure_train(5, out, ConfigRecord({"task": 0, "round": 4}), NodeList(4)))
    assert sorted(m.content[CONFIG]["task"] for m in msgs) == [1, 1] and s._sent_round.skipped == 2
    s.task_of_client = {c: 0 for c in range(4)}  # every sampled client on the stopped task
    assert list(s.configure_train(6, out, ConfigRecord({"task": 0, "round": 5}), NodeList(4))) == []
    arrays, metrics = s.aggregate_train(6, [])
    assert arrays is out and metrics["clients"] == 0
    again = ScheduledStrategy.of(cfg, 6, EARLIER_RULE)
    again.load_state_dict(s.state_dict())
    assert again.stopped == {0} and again.best_score == s.best_score and again.stale == s.stale
    assert again.scored == s.scored == {0: 4, 1: 4}
    for name, rows in s.best_rows[1].items():
        np.testing.assert_array_equal(again.best_rows[1][name], rows)


# ---------------------------------------------------------------------------- the stopping rules, toy runs
def authors_stop(losses: list[float]) -> int:
    """The round after which the authors' code stops a task, whose model it keeps (Fed-CPrompt
    trainer.py: best_loss 1e8, patience 5, round 0 never compared, break, save the last model).
    ``losses[r]``: the validation loss of the model averaged in round r."""
    best_loss, patience, stale = 100000000, 5, 0
    for round_, loss in enumerate(losses):
        if round_ > 0:
            if loss < best_loss:
                best_loss, stale = loss, 0
            else:
                stale += 1
                if stale >= patience:
                    return round_
    return len(losses) - 1


def earlier_stop(accuracies: list[float]) -> tuple[int, int]:
    """The project's rule before issue 58: (the round that stops the task, the index of the model it
    restores), ``accuracies[j]``: round j's validation of the model it started from (j = 0: the task's
    start model), higher is better, patience 2, every score compared."""
    best, stale = 0, 0
    for j, accuracy in enumerate(accuracies):
        if j == 0 or accuracy > accuracies[best]:
            best, stale = j, 0
            continue
        stale += 1
        if stale >= 2:
            return j, best
    return len(accuracies), -1


def run_one_task(options: dict, field: str, scores: list[float]) -> tuple[int | None, list[dict], dict]:
    """Rounds of one task on the server, four clients, every round's average a new model M_r (all its
    values r + 1); round r's replies score the model it started from, M_(r-1) (``scores[r]``; r = 0:
    the task's start model). The round that stopped the task (None: none did), the model each round
    started from, and the arrays after the last round."""
    from tests.helpers import accepted_of

    _, s, shapes, base = async_setup(num_tasks=3, known=1, options=options)
    s.task_of_client = {c: 0 for c in range(4)}
    started, out = [], base
    for r, score in enumerate(scores):
        s.round_arrays = out
        started.append(from_array_record(out))
        value = score if field == "val-loss" else int(round(10 * score))
        contents = [RecordDict({ARRAYS: to_array_record({k: np.full(v, r + 1.0, np.float32) for k, v in shapes.items()}),
                                METRICS: MetricRecord({"num-examples": 9, "train-loss": 1.0, "train-seconds": 0.1,
                                                       field: value, "val-total": 10})}) for _ in range(4)]
        accepted = accepted_of(contents, tasks=[0] * 4)
        out = s.consolidate(r + 1, s.aggregate(accepted), accepted)
        if 0 in s.stopped:
            return r, started, from_array_record(out)
    return None, started, from_array_record(out)


def task_rows(state: dict, layout) -> dict:
    return {name: value[layout.task_rows(name, value, 0)] for name, value in state.items()}


# the loss of the model after each round r (M_r); round 0's 0.9 is the lowest, which the code never compares
LOSSES = [0.9, 1.5, 1.2, 1.3, 1.1, 1.15, 1.2, 1.12, 1.3, 1.25, 1.4, 1.0, 0.95]


def test_the_default_stops_as_the_authors_code_on_validation_loss_and_keeps_the_last_model(flower_identity):
    """Issue 58: the authors' rule is the default: the loss of M_1 (2 rounds trained) is the first
    compared; 5 scores without a lower loss stop the task, which keeps the last model validated."""
    k = authors_stop(LOSSES)
    assert k == 9  # best 1.1 after round 4; 1.15, 1.2, 1.12, 1.3, 1.25 do not beat it
    start_model_loss = 0.5  # lower than any: compared, it would stop the task at once
    stopped, started, final = run_one_task({}, "val-loss", [start_model_loss] + LOSSES)
    # round k + 1 scored M_k and stopped the task: M_k's rows are kept (the authors' saved model),
    # the update of round k + 1 discarded, so M_0..M_k trained the task, as rounds 0..k in the code
    assert stopped == k + 1
    layout = async_setup(num_tasks=3, known=1)[1].layout
    for name, rows in task_rows(final, layout).items():
        np.testing.assert_array_equal(rows, task_rows(started[k + 1], layout)[name])
        np.testing.assert_array_equal(rows, k + 1.0)  # M_k's values
    # without the code's guard (every score compared) the start model's 0.5 would stop it at round 5
    assert run_one_task({"early-stopping-skip": 0}, "val-loss", [start_model_loss] + LOSSES)[0] == 5


def test_a_loss_that_keeps_falling_never_stops_the_task(flower_identity):
    falling = [1.0 - 0.05 * r for r in range(12)]
    assert authors_stop(falling) == len(falling) - 1
    stopped, _, final = run_one_task({}, "val-loss", [2.0] + falling)
    assert stopped is None
    np.testing.assert_array_equal(final["head.weight"][0:2], len(falling) + 1.0)  # the last round's model


def test_the_earlier_rule_stops_on_accuracy_after_two_rounds_and_restores_the_best_model(flower_identity):
    accuracies = [0.1, 0.5, 0.7, 0.6, 0.65, 0.9]  # of the start model, M_0, M_1, ...
    j, best = earlier_stop(accuracies)
    assert (j, best) == (4, 2)  # M_1 (score 2) is the best; rounds 3 and 4 do not beat it
    stopped, started, final = run_one_task(EARLIER_RULE, "val-correct", accuracies)
    assert stopped == j
    layout = async_setup(num_tasks=3, known=1)[1].layout
    for name, rows in task_rows(final, layout).items():
        np.testing.assert_array_equal(rows, task_rows(started[best], layout)[name])  # M_1 restored
        np.testing.assert_array_equal(rows, best)
    # the same scores under keep = "last": the model round 4 scored, M_2
    _, started, last = run_one_task({**EARLIER_RULE, "early-stopping-keep": "last"}, "val-correct", accuracies)
    np.testing.assert_array_equal(last["head.weight"][0:2], started[j]["head.weight"][0:2])
    np.testing.assert_array_equal(last["head.weight"][0:2], j)


def test_validation_accuracy_is_the_models_on_the_tasks_rows():
    cfg = tiny_config(num_tasks=2, centralised=True)
    rt, _, arrays = start(cfg, tasks=1)
    learner = FedCPromptLearner.of(cfg, rt)
    rt.model.load_trainable_state({k: torch.from_numpy(v) for k, v in from_array_record(arrays).items()})
    rt.model.prompt.set_task(0)
    index = np.flatnonzero(rt.data.train.labels < 5)[:40]
    with torch.no_grad():
        x = rt.model.preprocess(torch.from_numpy(rt.data.train.images[index]))
        logits = rt.model(x, rt.model.query(x))[:, :5]
    expected = float((logits.argmax(1).numpy() == rt.data.train.labels[index]).mean())
    assert learner.accuracy(index, 0) == pytest.approx(expected)


def test_validation_takes_each_image_as_evaluation_does(monkeypatch):
    """With eval-crop < 1 the held-out share is scored on the evaluation's central crop (q(x) of the
    crop, not the training split's cached q of the whole image), as a test image is."""
    cfg = tiny_config(num_tasks=2, centralised=True, eval_crop=0.5)
    rt, _, arrays = start(cfg, tasks=1)
    rt.model.load_trainable_state({k: torch.from_numpy(v) for k, v in from_array_record(arrays).items()})
    rt.model.prompt.set_task(0)
    index = np.flatnonzero(rt.data.train.labels < 5)[:40]
    with torch.no_grad():
        x = rt.model.preprocess(torch.from_numpy(rt.data.train.images[index]), evaluation=True)
        logits = rt.model(x, rt.model.query(x))[:, :5]
    expected = int((logits.argmax(1).numpy() == rt.data.train.labels[index]).sum())
    calls = []
    real = rt.model.preprocess
    monkeypatch.setattr(rt.model, "preprocess", lambda *a, **k: calls.append(k.get("evaluation")) or real(*a, **k))
    assert FedCPromptLearner.of(cfg, rt).correct(index, 0) == expected
    assert calls and all(calls)


# ---------------------------------------------------------------------------- per-slice aggregation
def reply_content(value: float, n: int, shapes: dict[str, tuple]) -> RecordDict:
    """A reply whose every array is ``value`` (it "changed" every slice: only its own may count)."""
    return RecordDict({
        ARRAYS: to_array_record({k: np.full(s, value, np.float32) for k, s in shapes.items()}),
        METRICS: MetricRecord({"num-examples": n, "train-loss": value, "train-seconds": 0.1}),
    })


class ScheduledStrategy(FedCPromptStrategy):
    """Clients on different tasks in the same round, each client's task set by hand."""

    task_of_client: dict[int, int] = {}

    def payload(self, sent, arrays):
        sent.task = self.task_of_client.get(sent.client, sent.task)
        sent.config["task"] = sent.task
        return super().payload(sent, arrays)


def async_setup(num_tasks=3, known=2, options=None):
    cfg = tiny_config(num_tasks=num_tasks, num_clients=4, clients_per_round=4, pool_size=2 * num_tasks, **PLAIN_MEAN)
    num_classes = 2 * num_tasks
    s = ScheduledStrategy.of(cfg, num_classes, options)
    shapes = {"prompt.p0": (cfg.model.pool_size, 4, 3), "prompt.k0": (cfg.model.pool_size, 3),
              "head.weight": (num_classes, 3), "head.bias": (num_classes,)}
    base = to_array_record({k: np.full(v, -1.0, np.float32) for k, v in shapes.items()})
    s.known_tasks = known  # as if on_task_start had run for tasks 0..known-1 (values irrelevant here)
    return cfg, s, shapes, base


def test_per_slice_aggregation_with_clients_on_different_tasks(flower_identity):
    cfg, s, shapes, base = async_setup(num_tasks=3, known=2)
    s.task_of_client = {0: 0, 1: 1, 2: 0, 3: 1}  # clients 0 and 2 on task 0, clients 1 and 3 a task ahead
    msgs = list(s.configure_train(5, base, ConfigRecord({"task": 0, "round": 3}), NodeList(2)))
    assert [m.content[CONFIG]["task"] for m in msgs] == [0, 1, 0, 1]
    assert all(m.content[CONFIG][KNOWN_TASKS] == 2 for m in msgs)
    assert {sent.client: sent.task for sent in s._sent_round.sent} == {0: 0, 1: 1, 2: 0, 3: 1}
    for m in msgs:  # the grid gives every sent message an id
        m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    # nodes 100 and 101 each play a task-0 and a task-1 client: only message ids can tell them apart
    values, counts = {0: 1.0, 1: 10.0, 2: 3.0, 3: 20.0}, {0: 10, 1: 10, 2: 30, 3: 30}
    replies = [Message(content=reply_content(values[i], counts[i], shapes), reply_to=m) for i, m in enumerate(msgs)]
    stray = reply_from(100, reply_content(99.0, 5, shapes))  # answers no message of this round
    outcome = s.aggregate_round(5, replies[::-1] + [stray])
    arrays, metrics = outcome.arrays, outcome.metrics
    out = from_array_record(arrays)
    t0, t1 = (10 * 1.0 + 30 * 3.0) / 40, (10 * 10.0 + 30 * 20.0) / 40
    for name in ("prompt.p0", "prompt.k0"):
        np.testing.assert_allclose(out[name][0:2], t0)  # task 0: clients 0 and 2 only
        np.testing.assert_allclose(out[name][2:4], t1)  # task 1: clients 1 and 3 only
        np.testing.assert_array_equal(out[name][4:6], -1.0)  # task 2: nobody trained it, unchanged
    for name in ("head.weight", "head.bias"):
        np.testing.assert_allclose(out[name][0:2], t0)  # head rows of task 0's classes
        np.testing.assert_allclose(out[name][2:4], t1)
        np.testing.assert_array_equal(out[name][4:6], -1.0)
    assert metrics["clients"] == 4 and metrics["tasks-aggregated"] == 2 and metrics["num-examples"] == 80
    assert sorted(a.task for a in outcome.accepted) == [0, 0, 1, 1]
    assert len(outcome.rejected) == 1 and "no matching message" in outcome.rejected[0][1]


def test_per_slice_aggregation_reuses_the_base_validation(flower_identity):
    cfg, s, shapes, base = async_setup(num_tasks=3, known=3)
    s.task_of_client = {0: 2, 1: 0, 2: 0, 3: 0}
    s.configure_train(1, base, ConfigRecord({"task": 0, "round": 0}), NodeList(4))
    # no message ids (as in a unit test): replies are matched by node, one client per node here
    nan = reply_content(1.0, 5, shapes)
    nan[ARRAYS] = to_array_record({k: np.full(v, np.nan, np.float32) for k, v in shapes.items()})
    replies = [reply_from(100, reply_content(7.0, 10, shapes)), reply_from(101, nan),
               reply_from(102, reply_content(2.0, 10, shapes)), reply_from(103, error="boom")]
    outcome = s.aggregate_round(1, replies)
    arrays, metrics = outcome.arrays, outcome.metrics
    out = from_array_record(arrays)
    np.testing.assert_allclose(out["prompt.p0"][4:6], 7.0)  # task 2 from client 0 alone
    np.testing.assert_allclose(out["prompt.p0"][0:2], 2.0)  # task 0: the NaN reply is excluded
    np.testing.assert_array_equal(out["prompt.p0"][2:4], -1.0)  # task 1: nobody
    reasons = dict(outcome.rejected)
    assert "non-finite" in reasons[101] and "boom" in reasons[103] and metrics["clients"] == 2
    assert s.aggregate_train(2, [reply_from(100, error="x")]) == (None, None)


def test_synchronous_rounds_equal_fedavg_on_what_was_trained(flower_identity):
    gen = np.random.default_rng(0)
    cfg, s, shapes, base = async_setup(num_tasks=3, known=2)
    msgs = list(s.configure_train(1, base, ConfigRecord({"task": 1, "round": 0}), NodeList(4)))
    contents, base_np = [], from_array_record(base)
    for i, m in enumerate(msgs):
        state = {k: v.copy() for k, v in base_np.items()}
        for name in ("prompt.p0", "prompt.k0", "head.weight", "head.bias"):
            state[name][2:4] = gen.normal(size=state[name][2:4].shape)  # each client changes task 1 only
        contents.append(RecordDict({ARRAYS: to_array_record(state),
                                    METRICS: MetricRecord({"num-examples": 5 + 7 * i, "train-loss": 1.0, "train-seconds": 0.1})}))
    arrays, _ = s.aggregate_train(1, [reply_from(100 + i, c) for i, c in enumerate(contents)])
    fedavg = from_array_record(weighted_average([c[ARRAYS] for c in contents], np.array([5 + 7 * i for i in range(4)])))
    for name, value in from_array_record(arrays).items():
        np.testing.assert_allclose(value, fedavg[name], rtol=1e-6, atol=1e-7)


def test_aggregate_per_task_averages_other_arrays_over_everyone():
    base = {"prompt.p0": np.zeros((4, 2), np.float32), "extra": np.zeros(3, np.float32)}
    updates = [(0, {"prompt.p0": np.ones((4, 2)), "extra": np.full(3, 2.0)}, 1.0),
               (1, {"prompt.p0": np.full((4, 2), 3.0), "extra": np.full(3, 4.0)}, 3.0)]
    out = aggregate_per_task(layout_of(tiny_config(num_tasks=2, pool_size=4), 2), base, updates)
    np.testing.assert_allclose(out["prompt.p0"], [[1, 1], [1, 1], [3, 3], [3, 3]])
    np.testing.assert_allclose(out["extra"], 3.5)
    assert out["extra"].dtype == np.float32 and out["prompt.p0"].dtype == np.float32


def test_known_tasks_travel_and_survive_a_checkpoint(flower_identity):
    cfg = tiny_config(num_tasks=5)
    rt, s, arrays = start(cfg, tasks=2)
    assert s.known_tasks == 2
    msgs = list(s.configure_train(1, arrays, ConfigRecord({"task": 1, "round": 0}), NodeList(2)))
    assert all(m.content[CONFIG][KNOWN_TASKS] == 2 for m in msgs)
    with pytest.raises(RuntimeError, match="never initialised"):
        list(s.configure_train(2, arrays, ConfigRecord({"task": 2, "round": 0}), NodeList(2)))
    again = FedCPromptStrategy.of(cfg, rt.data.num_classes)
    again.load_state_dict(s.state_dict())
    assert again.known_tasks == 2


# ---------------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_end_to_end_synchronous_simulation(tmp_path):
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "run", strategy="fedcprompt", lr=0.05, **{"fedcprompt.gamma": 0.5})
    assert results["config"]["strategy"] == "fedcprompt" and results["config"]["fedcprompt.gamma"] == 0.5
    assert len(results["rounds"]) == 2 * 2
    for r in results["rounds"]:
        assert r["clients_aggregated"] == r["clients_sampled"] == 3 and not r["rejected"]
    acc = results["accuracy_matrix"]
    assert acc[1][0] is None and all(0.0 <= v <= 100.0 for row in acc for v in row if v is not None)
    assert results["final_average_accuracy"] == pytest.approx((acc[0][1] + acc[1][1]) / 2)


@pytest.mark.e2e
def test_end_to_end_asynchronous_simulation(tmp_path):
    """Every round 2 of 3 clients move on: in round 2 two clients train task 2 while one is on task 1."""
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "run", strategy="fedcprompt", lr=0.05, **{"switch-every": 1, "switch-fraction": 0.5})
    rounds = results["rounds"]
    assert [sorted(r["client_tasks"]) for r in rounds] == [[0, 0, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    for r in rounds:
        assert r["clients_aggregated"] == 3 and not r["rejected"]
    assert rounds[1]["strategy_metrics"]["tasks-aggregated"] == 2  # two task slices averaged in parallel
    acc = results["accuracy_matrix"]
    assert acc[0][0] is not None and acc[1][1] is not None and acc[1][0] is None
