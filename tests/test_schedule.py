"""Task arrival (common/data/schedule.py): the synchronous stream and asynchronous switching."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.data.schedule import TaskSchedule
from tests.conftest import tiny_config


def tasks_at(schedule: TaskSchedule, round_index: int) -> list[int]:
    return [schedule.position(c, round_index) for c in range(schedule.num_clients)]


def test_synchronous_stream_is_the_special_case():
    s = TaskSchedule(num_tasks=4, num_clients=7, rounds_per_task=3)
    assert s.synchronous
    for r in range(s.total_rounds):
        for c in range(7):
            assert s.assignment(c, r) == (r // 3, r % 3)
    assert [s.tasks_starting(r) for r in range(s.total_rounds)] == [[0], [], [], [1], [], [], [2], [], [], [3], [], []]


def test_asynchronous_switching_moves_the_right_fraction_at_the_right_rounds():
    # Powder's setting: every 3 rounds 40 % of the clients move on
    s = TaskSchedule(num_tasks=20, num_clients=10, rounds_per_task=8, switch_every=3, switch_fraction=0.4, seed=1)
    assert not s.synchronous and s.movers == 4
    for r in range(1, s.total_rounds):
        before, now = tasks_at(s, r - 1), tasks_at(s, r)
        moved = [c for c in range(10) if now[c] != before[c]]
        if r % 3:
            assert moved == []
        elif max(before) < s.num_tasks - 1:  # nobody at the end of the stream yet: exactly 40 %
            assert len(moved) == 4 and all(now[c] == before[c] + 1 for c in moved)
        assert max(now) - min(now) <= 1  # turns go round: never more than one task apart


def test_half_the_clients_one_task_ahead_as_in_fed_cprompt():
    s = TaskSchedule(num_tasks=5, num_clients=10, rounds_per_task=4, switch_every=2, switch_fraction=0.5, seed=0)
    for r in range(s.total_rounds):
        tasks = tasks_at(s, r)
        nominal = r // 4
        # the slowest half leaves task j exactly when the synchronous stream does
        assert min(tasks) == nominal
        if r % 4 >= 2 and nominal < 4:
            assert sorted(tasks) == [nominal] * 5 + [nominal + 1] * 5
    # every client spends its rounds on a task from its first one there
    for c in range(10):
        seen = [s.assignment(c, r) for r in range(s.total_rounds)]
        for (t0, k0), (t1, k1) in zip(seen, seen[1:]):
            assert (t1, k1) in ((t0, k0 + 1), (t0 + 1, 0))
    starts = [t for r in range(s.total_rounds) for t in s.tasks_starting(r)]
    assert starts == list(range(5))  # each task initialised once, in order


def test_schedule_is_reproducible_by_seed():
    kw = dict(num_tasks=6, num_clients=12, rounds_per_task=4, switch_every=2, switch_fraction=0.5)
    a, b, c = TaskSchedule(**kw, seed=3), TaskSchedule(**kw, seed=3), TaskSchedule(**kw, seed=4)
    grid = lambda s: [tasks_at(s, r) for r in range(s.total_rounds)]  # noqa: E731
    assert grid(a) == grid(b)
    assert grid(a) != grid(c)


def test_a_schedule_that_cannot_finish_the_stream_is_a_config_error():
    with pytest.raises(ConfigError, match="slowest client reaches only task"):
        TaskSchedule(num_tasks=5, num_clients=10, rounds_per_task=3, switch_every=3, switch_fraction=0.5)
    with pytest.raises(ConfigError, match="switch-fraction"):
        tiny_config(switch_fraction=0.0)
    with pytest.raises(ConfigError, match="switch-every"):
        tiny_config(switch_every=-1)


def test_every_method_takes_asynchronous_arrival_on_the_stream():
    from promptfcl.strategies.registry import strategy_class

    cfg = tiny_config(num_clients=4, clients_per_round=4, rounds_per_task=2, switch_every=1, switch_fraction=0.5)
    for name in ("fedavg", "fedcprompt", "powder", "hepco", "fppl", "hgp", "c2prompt"):
        assert not strategy_class(name).of(cfg, 10).schedule.synchronous


@pytest.mark.parametrize("name", ["hepco", "fppl", "hgp", "lorm"])
def test_stream_methods_refuse_random_tasks(name):
    from promptfcl.strategies.platform.run_checks import check_run

    cfg = tiny_config(task_generator="random", num_clients=2, clients_per_round=2, num_rounds=2, switch_every=0,
                      num_tasks=2, classes_per_task=2, min_overlap=0.0, task_data_fraction=0.5, strategy=name)
    with pytest.raises(ConfigError, match="needs the shared task stream"):
        check_run(cfg)


def test_each_client_is_sent_its_own_task(flower_identity):
    import numpy as np

    from promptfcl.strategies.registry import strategy_class
    from tests.helpers import NodeList

    cfg = tiny_config(num_clients=4, clients_per_round=4, rounds_per_task=2, switch_every=1, switch_fraction=0.5)
    strategy = strategy_class("fedavg").of(cfg, 10)
    from promptfcl.common.records import to_array_record

    arrays = to_array_record({"w": np.zeros(2, np.float32)})
    messages = list(strategy.configure_train(2, arrays, ConfigRecord({"task": 0, "round": 1}), NodeList(4)))
    sent = {int(m.content["config"]["client-id"]): (int(m.content["config"]["task"]), int(m.content["config"]["round"]))
            for m in messages}
    assert sent == {c: strategy.schedule.assignment(c, 1) for c in range(4)}
    assert sorted(t for t, _ in sent.values()) == [0, 0, 1, 1]
