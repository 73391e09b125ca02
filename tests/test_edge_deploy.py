"""A deployed node with a memory budget: it trains within it and says what it chose, in a real
loopback deployment (SuperLink, SuperNodes, the warm executor's forked children); a budget too small
for any round is refused when the node starts, naming the setting."""

from __future__ import annotations

import pytest

from tests.deployment import RUN


@pytest.mark.deploy
def test_a_budgeted_node_trains_within_its_budget_and_a_starved_one_refuses_to_start(tmp_path):
    from promptfcl.server.loopback import run_deployed, run_script, script_env, toml_file

    # one round: the budget is the node's, the same for every message it runs
    run = {**RUN, "num-clients": 3, "clients-per-round": 3, "min-replies": 1, "rounds-per-task": 1,
           "out-dir": "runs/edge"}
    budget = 2500
    results = run_deployed(tmp_path, run, 3, node_args={1: ["--node", f"memory-budget-mb={budget}"]})
    assert len(results["rounds"]) == 1
    for record in results["rounds"]:
        plans = record["memory_plans"]
        assert len(plans) == 1, plans  # node 1's reply; nodes 2 and 3 have no budget
        plan = plans[0]
        assert plan["memory-budget-mb"] == budget
        assert plan["micro-batch"] == RUN["batch-size"] and plan["checkpointed-blocks"] == 0  # room for the whole batch
        assert plan["backbone-bits"] == 32
        # the forked child's peak (its zygote's imports included) stayed within the budget, and its
        # frozen weights are pages of the node's mapped cache file, not a copy of its own
        assert 0 < plan["peak-rss-mb"] <= budget and "over-budget-mb" not in plan
        assert plan["backbone-mapped-mb"] > 0
        assert record["clients_aggregated"] == 3

    # less than the interpreter alone: start-client.sh's check of the run refuses before the node starts
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "k").write_text("x")
    done = run_script("start-client.sh", "--superlink", "127.0.0.1:1", "--ca", str(tmp_path / "ca.crt"),
                      "--key", str(tmp_path / "k"), "--config", str(toml_file(tmp_path / "starved.toml", run)),
                      "--data-dir", str(tmp_path / "data" / "node2"), "--node", "memory-budget-mb=50",
                      env=script_env(), cwd=tmp_path)
    assert done.returncode != 0
    assert "node-config memory-budget-mb = 50 is too small for its round" in done.stderr, done.stderr[-2000:]
