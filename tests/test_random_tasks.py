"""Powder's asynchronous benchmark (Powder, section 5.1): random tasks, their schedule,
their data, the section's metrics, and an end-to-end simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from promptfcl.common import metrics
from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.data.partitions import client_indices
from promptfcl.common.data.schedule import RandomTaskSchedule, task_schedule
from promptfcl.common.data.sources import load_dataset
from promptfcl.common.model.runtime import layout_of, partition_of
from tests.conftest import tiny_config

RANDOM = {"task-generator": "random", "num-clients": 3, "clients-per-round": 3, "num-rounds": 4,
          "switch-every": 2, "switch-fraction": 0.3, "num-tasks": 4, "classes-per-task": 3,
          "min-overlap": 0.34, "task-data-fraction": 0.25, "pool-size": 8}


def random_config(**overrides):
    return tiny_config(**{**RANDOM, **overrides})


# ---------------------------------------------------------------------------- tasks
@pytest.mark.parametrize("tau", [0.0, 0.5, 1.0])
def test_every_later_task_reuses_at_least_tau_of_its_classes(tau):
    cfg = random_config(num_clients=10, clients_per_round=5, num_rounds=12, switch_every=3, switch_fraction=0.4,
                        num_tasks=22, classes_per_task=4, min_overlap=tau, task_data_fraction=0.01, pool_size=44)
    tasks = layout_of(cfg, 50).random_tasks()
    assert len(tasks) == 22 and all(len(t) == 4 == len(set(t.tolist())) for t in tasks)
    seen = set(tasks[0].tolist())
    for t in tasks[1:]:
        assert len(seen & set(t.tolist())) >= min(math.ceil(tau * 4), len(seen))
        seen |= set(t.tolist())
    if tau == 1.0:  # nothing new after the first task
        assert seen == set(tasks[0].tolist())
    if tau == 0.0:  # 50 classes: uniform draws reach well beyond the first task's 4
        assert len(seen) > 20


def test_random_tasks_are_a_function_of_the_seed():
    a, b = layout_of(random_config(), 10).random_tasks(), layout_of(random_config(), 10).random_tasks()
    c = layout_of(random_config(seed=1), 10).random_tasks()
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_task_classes_and_seen_classes_follow_the_random_tasks():
    cfg = random_config()
    tasks = layout_of(cfg, 10).random_tasks()
    assert layout_of(cfg, 10).classes(2).tolist() == tasks[2].tolist()
    assert layout_of(cfg, 10).seen(1).tolist() == sorted(set(tasks[0].tolist()) | set(tasks[1].tolist()))


def test_tasks_sharing_a_class_hold_disjoint_shares_of_its_images():
    cfg = random_config()
    data = load_dataset(cfg)
    labels, tasks = data.train.labels, layout_of(cfg, 10).random_tasks()
    schedule = task_schedule(cfg.data, cfg.federation, cfg.run.seed)
    shares = [layout_of(cfg, 10).random_task_indices(labels, g) for g in range(cfg.data.num_tasks)]
    for g, share in enumerate(shares):
        assert set(np.unique(labels[share]).tolist()) == set(tasks[g].tolist())
        for y in tasks[g]:  # a quarter of the class's images, rounded down
            assert np.sum(labels[share] == y) == int(0.25 * np.sum(labels == y))
    for g in range(len(shares)):
        for h in range(g):
            assert not set(shares[g].tolist()) & set(shares[h].tolist()), f"tasks {h} and {g} share an image"

    owner = schedule.owner(3)
    assert np.array_equal(client_indices(labels, layout_of(cfg, 10), partition_of(cfg), owner, 3, 0), shares[3])
    with pytest.raises(ValueError, match="belongs to client"):
        client_indices(labels, layout_of(cfg, 10), partition_of(cfg), (owner + 1) % 3, 3, 0)


def test_too_many_shares_of_a_class_is_a_clear_error_unless_shares_are_independent():
    with pytest.raises(ConfigError, match="task-data-sharing = independent"):
        layout_of(random_config(task_data_fraction=1.0, min_overlap=1.0), 10).random_tasks()
    cfg = random_config(task_data_fraction=0.6, min_overlap=1.0, task_data_sharing="independent")
    labels = load_dataset(cfg).train.labels
    tasks = layout_of(cfg, 10).random_tasks()
    shares = [layout_of(cfg, 10).random_task_indices(labels, g) for g in range(cfg.data.num_tasks)]
    for g, share in enumerate(shares):
        for y in tasks[g]:
            assert np.sum(labels[share] == y) == int(0.6 * np.sum(labels == y))
    assert set(shares[0].tolist()) & set(shares[1].tolist())  # 60 % of the same classes: they overlap


def test_overlap_reuses_the_least_reused_classes_first():
    cfg = random_config(num_clients=10, clients_per_round=5, num_rounds=12, switch_every=3, switch_fraction=0.4,
                        num_tasks=22, classes_per_task=20, min_overlap=0.9, task_data_fraction=0.01, pool_size=44)
    holders = np.zeros(200, dtype=int)
    for j, task in enumerate(layout_of(cfg, 200).random_tasks()):
        if j:  # 18 of the task's classes were seen before, none used more often than a seen class left out
            seen = set(np.flatnonzero(holders).tolist())
            reused = sorted(holders[sorted(seen & set(task.tolist()))])
            left_out = holders[sorted(seen - set(task.tolist()))]
            assert len(reused) >= 18
            assert not len(left_out) or reused[17] <= left_out.min()
        holders[task] += 1


# ---------------------------------------------------------------------------- schedule
def test_schedule_switches_a_random_fraction_every_k_rounds():
    s = RandomTaskSchedule(num_tasks=10 + 5 * 4, num_clients=10, num_rounds=17, switch_every=3,
                           switch_fraction=0.4, seed=2)
    assert s.switch_rounds == [3, 6, 9, 12, 15] and s.movers == 4
    for r in range(17):
        tasks = [s.assignment(c, r)[0] for c in range(10)]
        assert len(set(tasks)) == 10  # every client on a task of its own
        if r in s.switch_rounds:
            before = [s.assignment(c, r - 1)[0] for c in range(10)]
            moved = [c for c in range(10) if tasks[c] != before[c]]
            assert len(moved) == 4 and s.tasks_starting(r) == sorted(set(tasks) - set(before))
        elif r > 0:
            assert tasks == [s.assignment(c, r - 1)[0] for c in range(10)]
    # tasks are numbered in the order they start; each lasts from its start to its client's next switch
    assert [s.start(g) for g in range(30)] == sorted(s.start(g) for g in range(30))
    for g in range(30):
        c = s.owner(g)
        assert all(s.assignment(c, r)[0] == g for r in range(s.start(g), s.finish(g) + 1))
        assert s.finish(g) == 16 or s.assignment(c, s.finish(g) + 1)[0] != g
    movers = [sorted(c for c in range(10) if s.assignment(c, r)[0] != s.assignment(c, r - 1)[0])
              for r in s.switch_rounds]
    assert len({tuple(m) for m in movers}) > 1  # random, not the same clients every time
    again = RandomTaskSchedule(30, 10, 17, 3, 0.4, seed=2)
    other = RandomTaskSchedule(30, 10, 17, 3, 0.4, seed=3)
    assert all(again.owner(g) == s.owner(g) for g in range(30))
    assert any(other.owner(g) != s.owner(g) for g in range(30))


def test_schedule_names_the_number_of_tasks_it_needs():
    with pytest.raises(ConfigError, match="set num-tasks = 13"):  # the paper's 5 clients, 15 rounds
        RandomTaskSchedule(num_tasks=10, num_clients=5, num_rounds=15, switch_every=3, switch_fraction=0.4)
    assert RandomTaskSchedule(13, 5, 15, 3, 0.4).switch_rounds == [3, 6, 9, 12]


def test_random_generator_needs_its_keys():
    with pytest.raises(ConfigError, match="num-rounds"):
        random_config(num_rounds=0)
    with pytest.raises(ConfigError, match="classes-per-task"):
        random_config(classes_per_task=0)
    with pytest.raises(ConfigError, match="num-rounds applies"):
        tiny_config(num_rounds=4)
    with pytest.raises(ConfigError, match="classes-per-task and min-overlap apply"):
        tiny_config(min_overlap=0.5)
    with pytest.raises(ConfigError, match="partition, dirichlet-beta, dirichlet-balance, partition-scope and "
                                          "classes-per-client do not apply"):
        random_config(partition="iid")
    with pytest.raises(ConfigError, match="partition-scope"):
        random_config(partition_scope="dataset")
    from promptfcl.strategies.platform.run_checks import check_run

    with pytest.raises(ConfigError, match="needs the shared task stream"):
        check_run(random_config(switch_every=0, num_tasks=3, pool_size=6, strategy="hgp"))
    with pytest.raises(ConfigError, match="raise task-data-fraction"):  # every class's share empty: at load time
        load_dataset(random_config(task_data_fraction=0.001))


def test_checkpoints_from_before_the_random_keys_still_resume():
    from promptfcl.server import checkpoint
    from tests.helpers import make_ckpt

    ckpt = make_ckpt(1)
    for key in ("task-generator", "num-rounds", "classes-per-task", "min-overlap", "task-data-fraction",
                "task-data-sharing"):
        ckpt.config.pop(key)
    checkpoint.check_compatible(ckpt, tiny_config(resume=True).to_dict())


# ---------------------------------------------------------------------------- metrics
def test_asynchronous_metrics_by_hand():
    nan = np.nan
    # task 0 rounds 0-3; task 1 rounds 2-3 (finished at round 2: its client moved on)
    acc = np.array([[50.0, 70.0, 60.0, 65.0],
                    [nan, nan, 40.0, 45.0]])
    finish = np.array([3, 2])
    out = metrics.asynchronous_summary(acc, finish, evaluation_rounds=[1, 3], single_task=np.array([60.0, 50.0]))
    assert out["average_incremental_accuracy"] == pytest.approx((70.0 + (65.0 + 45.0) / 2) / 2)
    # r=1: task 0 max before 50 -> 50-70 = -20; r=3: task 0 max 70 -> 5, task 1 max 40 -> -5
    assert out["forgetting_measure"] == pytest.approx((-20.0 + 0.0) / 2)
    assert out["forward_transfer"] == pytest.approx(((65 - 60) + (40 - 50)) / 2)
    assert out["backward_transfer"] == pytest.approx((0 + 5) / 2)
    assert out["combined_transfer"] == pytest.approx(out["forward_transfer"] + out["backward_transfer"])
    assert "forward_transfer" not in metrics.asynchronous_summary(acc, finish, [3])


def test_a_head_row_shared_by_two_tasks_averages_both():
    from promptfcl.strategies.platform.aggregation import aggregate_per_task

    cfg = random_config(head="per-class")
    tasks = layout_of(cfg, 10).random_tasks()
    g, h = next((g, h) for g in range(4) for h in range(g) if set(tasks[g].tolist()) & set(tasks[h].tolist())
                 and set(tasks[g].tolist()) != set(tasks[h].tolist()))
    base = {"head.weight": np.zeros((10, 2), np.float32)}
    updates = [(h, {"head.weight": np.ones((10, 2))}, 1.0), (g, {"head.weight": np.full((10, 2), 4.0)}, 3.0)]
    out = aggregate_per_task(layout_of(cfg, 10), base, updates)["head.weight"]
    for y in range(10):  # rows of both tasks: (1 + 3 x 4) / 4; of one: its value; of neither: the base
        in0, in3 = y in tasks[h], y in tasks[g]
        expected = (1.0 * in0 + 12.0 * in3) / (1.0 * in0 + 3.0 * in3) if in0 or in3 else 0.0
        np.testing.assert_allclose(out[y], expected, rtol=1e-6)


def test_a_per_task_head_gives_every_task_its_own_block():
    from promptfcl.strategies.platform.aggregation import aggregate_per_task

    cfg = random_config(head="per-task")
    per_class = random_config(head="per-class")
    tasks = layout_of(cfg, 10).random_tasks()
    assert layout_of(cfg, 10).head_size == 4 * 3 and layout_of(per_class, 10).head_size == 10
    assert random_config().per_task_head and not tiny_config().per_task_head  # auto: per task on random tasks
    head = np.zeros((12, 2), np.float32)
    for g in range(4):
        assert layout_of(cfg, 10).head_rows(g).tolist() == [3 * g, 3 * g + 1, 3 * g + 2]
        assert layout_of(cfg, 10).head_targets(g, tasks[g][::-1]).tolist() == [3 * g + 2, 3 * g + 1, 3 * g]  # class order
        assert layout_of(cfg, 10).task_rows("head.weight", head, g).tolist() == layout_of(cfg, 10).head_rows(g).tolist()
        assert layout_of(per_class, 10).head_rows(g).tolist() == tasks[g].tolist()  # per-class: the classes' rows
    with pytest.raises(ValueError, match="outside task"):
        layout_of(cfg, 10).head_targets(0, np.setdiff1d(np.arange(10), tasks[0])[:1])
    # two tasks sharing a class: with a per-task head each keeps its own rows (per-class: averaged, above)
    g, h = next((g, h) for g in range(4) for h in range(g) if set(tasks[g].tolist()) & set(tasks[h].tolist()))
    updates = [(h, {"head.weight": np.ones((12, 2))}, 1.0), (g, {"head.weight": np.full((12, 2), 4.0)}, 3.0)]
    out = aggregate_per_task(layout_of(cfg, 10), {"head.weight": head}, updates)["head.weight"]
    np.testing.assert_array_equal(out[layout_of(cfg, 10).head_rows(h)], 1.0)
    np.testing.assert_array_equal(out[layout_of(cfg, 10).head_rows(g)], 4.0)
    with pytest.raises(ConfigError, match="head = per-task applies to task-generator = random only"):
        tiny_config(head="per-task")
    with pytest.raises(ConfigError, match="head must be one of"):
        random_config(head="per-client")


@pytest.mark.parametrize("head", ["per-class", "per-task"])
def test_training_a_task_moves_only_the_head_rows_it_owns(head):
    """Per class, a task trains the rows of its classes, which other tasks holding them are scored
    with; per task, only its own block moves."""
    import torch
    from flwr.app import RecordDict

    from promptfcl.common.model.runtime import get_runtime
    from promptfcl.common.records import ARRAYS, from_array_record, to_array_record
    from promptfcl.strategies.platform.learner import LocalLearner

    cfg = random_config(head=head, lr=0.05)
    rt = get_runtime(cfg)
    start = {k: v.detach().clone() for k, v in rt.model.trainable_state().items()}
    assert start["head.weight"].shape[0] == (12 if head == "per-task" else 10)
    g = 3
    out = from_array_record(LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: to_array_record(start)}), g,
                                                 0, task_schedule(cfg.data, cfg.federation, cfg.run.seed).owner(g))[ARRAYS])
    moved = np.flatnonzero(np.abs(out["head.weight"] - start["head.weight"].numpy()).sum(axis=1) > 0)
    assert moved.tolist() == sorted(layout_of(cfg, 10).head_rows(g).tolist())
    # scoring: task i's classes compete through its own rows; a bias on one row decides every prediction
    from promptfcl.common.model.evaluation import correct_counts

    state = {k: v.clone() for k, v in start.items()}
    state["head.weight"].zero_()
    state["head.bias"].zero_()
    tasks = layout_of(cfg, 10).random_tasks()
    for i in range(4):
        state["head.bias"][int(layout_of(cfg, 10).head_rows(i)[1])] += 10.0 * (i + 1)  # task i: always its second class
    rt.model.load_trainable_state(state)
    correct, total = correct_counts(rt, 3)
    labels = rt.data.test.labels
    for i in range(4):
        mine = labels[np.isin(labels, tasks[i])]
        assert total[i] == len(mine)
        if head == "per-task":  # independent blocks: each task predicts its own second class
            assert correct[i] == int(np.sum(mine == tasks[i][1]))
    torch.testing.assert_close(rt.model.head.bias, state["head.bias"])


def test_single_task_reference_is_cached_and_reused(tmp_path, monkeypatch):
    from promptfcl.server.transfer import single_task_accuracies

    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path))
    cfg = random_config()
    first = single_task_accuracies(cfg, task_schedule(cfg.data, cfg.federation, cfg.run.seed))
    assert first.shape == (4,) and np.all((first >= 0) & (first <= 100))
    files = list((tmp_path / "single-task").glob("*.json"))
    assert len(files) == 1
    files[0].write_text("[1, 2, 3, 4]")  # what is read back is the file, not a recomputation
    assert single_task_accuracies(cfg.replace(strategy="powder"), task_schedule(cfg.data, cfg.federation, cfg.run.seed)).tolist() == [1, 2, 3, 4]
    assert single_task_accuracies(cfg.replace(lr=0.5), task_schedule(cfg.data, cfg.federation, cfg.run.seed)).tolist() != [1, 2, 3, 4]


def test_powders_single_task_reference_trains_its_local_pools_components(tmp_path, monkeypatch):
    """Powder trains k slices per task: its reference trains as many (a task's slice k times as large);
    reference = task-slice keeps FedAvg-Prompt's one slice."""
    from promptfcl.server import transfer
    from promptfcl.strategies.powder.strategy import PowderStrategy

    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path))
    cfg = random_config(strategy="powder", **{"powder.k": 3})
    per_task = cfg.model.pool_size // cfg.data.num_tasks
    powder = PowderStrategy.of(cfg, 10, cfg.method_options("powder"))
    assert powder.reference_components() == 3 * per_task
    cfg_slice = random_config(strategy="powder", **{"powder.reference": "task-slice"})
    assert PowderStrategy.of(cfg_slice, 10, cfg_slice.method_options("powder")).reference_components() == per_task
    built = []
    real = transfer.get_runtime
    monkeypatch.setattr(transfer, "get_runtime", lambda c, p: built.append(c.model.pool_size) or real(c, p))
    larger = transfer.single_task_accuracies(cfg, task_schedule(cfg.data, cfg.federation, cfg.run.seed), powder.reference_components())
    assert built == [3 * cfg.model.pool_size] and larger.shape == (cfg.data.num_tasks,)
    assert len(list((tmp_path / "single-task").glob("*.json"))) == 1  # cached apart from the one-slice reference


def test_single_task_reference_uses_the_methods_prompt_token_handling(tmp_path, monkeypatch):
    """prompt-tokens = auto with prompt-tuning: the reference is built with the run's method's token
    handling (Powder accumulates), and cached apart from a truncating one."""
    from promptfcl.server import transfer

    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path))
    built = []

    class Built(Exception):
        pass

    def capture(c, p):
        built.append(c.model.prompt_tokens)
        raise Built

    monkeypatch.setattr(transfer, "get_runtime", capture)
    cfg = random_config(prompt_mode="prompt")
    for tokens in ("accumulate", None):
        with pytest.raises(Built):
            transfer.single_task_accuracies(cfg, task_schedule(cfg.data, cfg.federation, cfg.run.seed), None, tokens)
    with pytest.raises(Built):
        transfer.single_task_accuracies(cfg.replace(prompt_tokens="truncate"), task_schedule(cfg.data, cfg.federation, cfg.run.seed), None, "accumulate")
    assert built == ["accumulate", "auto", "truncate"]


# ---------------------------------------------------------------------------- end to end
@pytest.mark.e2e
@pytest.mark.parametrize("strategy, head", [("powder", "per-class"), ("fedavg", "per-class"),
                                            ("powder", "per-task"), ("fedcprompt", "per-task")])
def test_end_to_end_on_random_tasks(tmp_path, strategy, head, monkeypatch):
    from tests.helpers import simulate_in_process as simulate

    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path / "cache"))
    # the schedule is what is checked: every client trains every round (Fed-CPrompt's task-level
    # early stopping would leave a stopped task's client out)
    stopping = {"fedcprompt.early-stopping-scope": "local"} if strategy == "fedcprompt" else {}
    results = simulate(tmp_path / "run", strategy=strategy, lr=0.05, head=head, **RANDOM, **stopping)
    prompt_params = 2 * (8 * 4 * 48 + 2 * 8 * 48)  # two prompted blocks: P, K, A of 8 components
    head_rows = 4 * 3 if head == "per-task" else 10  # a block per task, or a row per class
    assert results["communication"]["trainable_parameters"] == prompt_params + head_rows * (48 + 1)
    cfg = random_config()
    schedule = task_schedule(cfg.data, cfg.federation, cfg.run.seed)
    rounds = results["rounds"]
    assert len(rounds) == 4
    for r, record in enumerate(rounds):
        assert sorted(record["client_tasks"]) == sorted(schedule.assignment(c, r)[0] for c in range(3))
        assert len(record["task_accuracies"]) == schedule.newest_task(r) + 1
        assert record["clients_aggregated"] == 3 and not record["rejected"]
    a = results["asynchronous"]
    assert a["combined_transfer"] == pytest.approx(a["forward_transfer"] + a["backward_transfer"])
    assert results["average_incremental_accuracy"] == a["average_incremental_accuracy"]
    assert [t["client"] for t in a["tasks"]] == [schedule.owner(g) for g in range(4)]
    assert len(a["single_task_accuracy"]) == 4 and a["evaluation_rounds"] == [2, 4]
    per_client = results["client_accuracy_by_round"]
    assert len(per_client) == 3 and all(len(row) == 4 for row in per_client)
    c = schedule.owner(3)  # the client that switched: its mean covers its two tasks
    assert per_client[c][3] == pytest.approx(np.mean([rounds[3]["task_accuracies"][g]
                                                      for g in schedule.client_tasks(c, 3)]))
    assert "| CT |" in (tmp_path / "run" / "table.md").read_text()
    if strategy == "powder":  # S2C per client below the whole pool once nobody measures
        assert rounds[-1]["strategy_metrics"]["tasks-measured"] == 0
        assert rounds[-1]["bytes_s2c"] < rounds[2]["bytes_s2c"]


def test_powder_scores_each_random_task_with_its_top_k_local_pool():
    from promptfcl.common.records import from_array_record, to_array_record
    from promptfcl.strategies.powder.strategy import PowderStrategy, first_step_aggregation

    cfg = random_config(strategy="powder")
    s = PowderStrategy.of(cfg, 10, {"k": 2})
    rng = np.random.default_rng(0)
    state = {"prompt.p0": rng.normal(size=(8, 4, 6)).astype(np.float32),
             "prompt.k0": rng.normal(size=(8, 6)).astype(np.float32),
             "head.weight": rng.normal(size=(10, 6)).astype(np.float32)}
    s.known_tasks, s.width = 4, 4
    s.task_alpha = np.array([[1, 0, 0, 0], [0.9, 0.1, 0, 0], [0, 0, 1, 0], [0, 0, 0.8, 0.2]], dtype=float)
    s.task_measured = np.ones(4, bool)
    arrays, pools = s.evaluation_pools(to_array_record(state), upto=3)
    assert pools == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}  # itself and its most correlated task
    expected = first_step_aggregation(state, s.mixing_matrix(), 4, 8, 4)
    for name, value in from_array_record(arrays).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-6)
    assert PowderStrategy.of(cfg, 10, {"evaluation": "global"}).evaluation_pools(to_array_record(state), 3) is None
    stream = PowderStrategy.of(tiny_config(strategy="powder", num_tasks=4, pool_size=8), 8, {})
    assert stream.evaluation_pools(to_array_record(state), 3) is None


def test_evaluate_messages_name_each_tasks_local_pool():
    """Federated evaluation of random tasks: the server sends ``pool-<task>`` (the prompt slices a
    task is scored with, Powder's local pools); a node reads them back and refuses malformed ones."""
    from flwr.app import ConfigRecord

    from promptfcl.client.app import evaluation_pools

    config = ConfigRecord({"task": 2, "pool-0": [0], "pool-2": [2, 0], "num-classes": 10})
    assert evaluation_pools(config, 2, 4) == {0: [0], 2: [2, 0]}
    assert evaluation_pools(ConfigRecord({"task": 2}), 2, 4) == {}
    for bad in ({"pool-3": [0]}, {"pool-x": [0]}, {"pool-1": []}, {"pool-1": [4]}, {"pool-1": [True]},
                {"pool-1": 1}):
        with pytest.raises(ValueError, match="evaluate message"):
            evaluation_pools(ConfigRecord({"task": 2, **bad}), 2, 4)
