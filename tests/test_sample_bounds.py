"""What the server knows each virtual client holds is given to the strategy when it is made
(``held``: server/run.py passes it through ``build_strategy``), and every train reply's sample
count is checked against it: exactly what the client trains on, never above what all hold."""

from __future__ import annotations

from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from promptfcl.strategies.platform.checks import HeldSamples
from promptfcl.strategies.registry import build_strategy
from tests.conftest import tiny_config
from tests.test_strikes import _replies  # five replies of 10 samples each


def test_a_reply_claiming_other_than_its_clients_share_is_rejected(flower_identity):
    cfg = tiny_config(num_clients=5, clients_per_round=5)
    exact = FedAvgStrategy.of(cfg, 10, held=HeldSamples(100, lambda client, task, round_: 10))
    assert len(exact.aggregate_round(1, _replies(exact, 1, reversed_client=-1)).accepted) == 5
    short = build_strategy(cfg, 10, None, HeldSamples(100, lambda client, task, round_: 9 if client == 2 else 10))
    outcome = short.aggregate_round(1, _replies(short, 1, reversed_client=-1))
    assert len(outcome.accepted) == 4 and "num-examples 10, but client 2 holds 9 for this task" in outcome.rejected[0][1]
    few = FedAvgStrategy.of(cfg, 10, held=HeldSamples(8, lambda client, task, round_: 10))
    outcome = few.aggregate_round(1, _replies(few, 1, reversed_client=-1))
    assert not outcome.accepted and all("implausible num-examples 10" in r for _, r in outcome.rejected)
    assert FedAvgStrategy.of(cfg, 10).bounds.examples_of is None  # nothing known: nothing checked
