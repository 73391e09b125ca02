"""A deployed node with a memory budget: it trains within it, says what it chose, and refuses a budget
too small, in a real loopback deployment (SuperLink, SuperNodes, the warm executor's forked children)."""

from __future__ import annotations

import pytest

from tests.test_deploy import RUN


@pytest.mark.deploy
def test_a_budgeted_node_trains_within_its_budget_and_a_starved_one_refuses(tmp_path):
    from promptfcl.server.loopback import run_deployed

    run = {**RUN, "num-clients": 3, "clients-per-round": 3, "min-replies": 1, "out-dir": "runs/edge"}
    budget = 2500
    results = run_deployed(tmp_path, run, 3, node_args={
        1: ["--node", f"memory-budget-mb={budget}"],
        2: ["--node", "memory-budget-mb=50"],  # less than the interpreter alone: every message refused
    })
    assert len(results["rounds"]) == 2
    for record in results["rounds"]:
        plans = record["memory_plans"]
        assert len(plans) == 1, plans  # node 1's reply; node 3 has no budget, node 2's replies are errors
        plan = plans[0]
        assert plan["memory-budget-mb"] == budget
        assert plan["micro-batch"] == RUN["batch-size"] and plan["checkpointed-blocks"] == 0  # room for the whole batch
        assert plan["backbone-bits"] == 32
        # the forked child's peak (its zygote's imports included) stayed within the budget, and its
        # frozen weights are pages of the node's mapped cache file, not a copy of its own
        assert 0 < plan["peak-rss-mb"] <= budget
        assert plan["backbone-mapped-mb"] > 0
        assert record["clients_aggregated"] == 2
        refused = [r for r in record["rejected"] if "memory-budget-mb" in r["reason"]]
        assert len(refused) == 1 and "too small" in refused[0]["reason"], record["rejected"]
