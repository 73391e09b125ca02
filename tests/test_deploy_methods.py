"""The methods beyond the fixture's FedAvg over real SuperLink and SuperNodes (deploy/README.md):
random tasks (Powder), namespaced method options with differential privacy, and the newer methods
(LoRM, its task-end pass, PILoRA, C2Prompt), each a run submitted to one federation of this file's
own (tests/deployment.py: three honest nodes and a hostile one, whose replies are rejected or
bounded, never fatal). Marked ``deploy``."""

from __future__ import annotations

import json

import pytest

from promptfcl.server.loopback import script_env, submit, toml_file
from tests.deployment import NUM_HONEST, RUN, Deployment, federation


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Deployment:
    yield from federation(tmp_path_factory, first_run=False)


@pytest.mark.deploy
def test_random_tasks_run_on_deployed_nodes(deployment):
    """Powder's benchmark (random tasks, Powder section 5.1) with ``population = "nodes"``: each node
    plays the schedule's client of its turn, trains its task on its own images, and scores every
    task through the task's own local pool on its held-out data (the hostile node included: its
    replies are rejected or bounded, never fatal)."""
    root = deployment.root
    env = script_env(FLWR_HOME=str(root / "cli-home"))
    run = {**RUN, "strategy": "powder", "task-generator": "random", "num-rounds": 2, "switch-every": 1,
           "switch-fraction": 0.25, "num-tasks": 5, "classes-per-task": 3, "min-overlap": 0.34,
           "task-data-fraction": 0.25, "pool-size": 10, "out-dir": "runs/random", "rounds-per-task": 1}
    done = submit(root, env, deployment.ports.control, toml_file(root / "random.toml", run), root / "app")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((root / "server" / "runs" / "random" / "results.json").read_text())
    rounds = results["rounds"]
    assert len(rounds) == 2
    # round 1: every node on its own first task; round 2: one node moved on to a new task
    assert sorted(rounds[0]["client_tasks"]) == [0, 1, 2, 3] and len(set(rounds[1]["client_tasks"])) == 4
    assert max(rounds[1]["client_tasks"]) == 4
    for record in rounds:
        assert record["eval_nodes"] >= NUM_HONEST
        assert all(a is not None and 0 <= a <= 100 for a in record["task_accuracies"])
    assert len(rounds[1]["task_accuracies"]) == 5
    assert results["asynchronous"]["average_incremental_accuracy"] is not None
    assert all(None not in row for row in results["client_accuracy_by_round"])


@pytest.mark.deploy
def test_method_options_and_differential_privacy_run_deployed(deployment):
    """Namespaced run-config keys pass Flower's own check on the SuperLink and reach every node:
    HGP with a non-default option (``hgp.cov-type = "diag"``: a node without it would upload
    full covariances, which the server refuses) and differential privacy on (``dp.*``)."""
    root = deployment.root
    env = script_env(FLWR_HOME=str(root / "cli-home"))
    run = {**RUN, "strategy": "hgp", "hgp.cov-type": "diag", "hgp.rebalance-epochs": 1,
           "dp.clip": 1.0, "dp.noise-multiplier": 0.5, "dp.delta": 1e-3, "rounds-per-task": 1,
           "out-dir": "runs/hgp-dp"}
    done = submit(root, env, deployment.ports.control, toml_file(root / "hgp-dp.toml", run), root / "app")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((root / "server" / "runs" / "hgp-dp" / "results.json").read_text())
    cfg = results["config"]
    assert cfg["strategy"] == "hgp" and cfg["hgp.cov-type"] == "diag" and cfg["hgp.rebalance-epochs"] == 1
    assert cfg["dp.clip"] == 1.0 and cfg["dp.noise-multiplier"] == 0.5
    assert not any(k.startswith(("powder.", "fppl.", "hepco.", "fedcprompt.")) for k in cfg)
    (record,) = results["rounds"]
    # every honest node trained under exactly the server's configuration, and its diagonal
    # statistics were accepted (the hostile node's inflated count is refused as before)
    assert record["clients_aggregated"] == NUM_HONEST
    placed = [p for p in record["placement"] if p["node"] is not None]
    assert len(placed) == NUM_HONEST and {p["config_digest"] for p in placed} == {results["config_digest"]}
    assert not any("covariance" in x["reason"] for x in record["rejected"])
    assert results["privacy"]["epsilon"] is not None and results["privacy"]["delta"] == 1e-3

NEWER_METHOD_ROUNDS = {"lorm": 2, "pilora": 1, "c2prompt": 2, "lorm-task-end-pass": 1}
#: a variant's method and options: LoRM with the platform's task-end exchange (its Gram pass)
VARIANTS = {"lorm-task-end-pass": ("lorm", {"lorm.task-grams": "task-end-pass"})}


@pytest.mark.deploy
@pytest.mark.parametrize("method", sorted(NEWER_METHOD_ROUNDS))
def test_the_newer_methods_run_deployed(deployment, method):
    """The methods beyond the seed papers on real SuperLink and SuperNodes: LoRM's and PILoRA's
    low-rank adapters (their sets, Grams, prototypes and class means) and C2Prompt's class
    statistics and histograms travel, pass the server's checks from every honest node, and the
    run ends with its accuracy matrix (LoRM's read after its merge across tasks)."""
    root = deployment.root
    env = script_env(FLWR_HOME=str(root / "cli-home"))
    # two tasks (LoRM's merge across them); two rounds each where a task's second round differs
    # from its first (LoRM trains B, then A; C2Prompt's exchange is its first round's only), one
    # for PILoRA (every round of a task carries the same records) and for LoRM's task-end pass
    # (the exchange after each task's last round is its point; [lorm] runs the alternation)
    rounds = NEWER_METHOD_ROUNDS[method]
    strategy, options = VARIANTS.get(method, (method, {}))
    run = {**RUN, "strategy": strategy, **options, "num-tasks": 2, "rounds-per-task": rounds,
           "out-dir": f"runs/{method}"}
    done = submit(root, env, deployment.ports.control, toml_file(root / f"{method}.toml", run), root / "app")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    results = json.loads((root / "server" / "runs" / method / "results.json").read_text())
    assert results["config"]["strategy"] == strategy
    assert [r["task"] for r in results["rounds"]] == [t for t in (0, 1) for _ in range(rounds)]
    for index, record in enumerate(results["rounds"]):
        assert record["clients_aggregated"] == NUM_HONEST, record["rejected"]
        assert record["eval_nodes"] >= NUM_HONEST
        # the task-end exchange (QUERY messages after a task's last round): every honest node that
        # trained the task answers, and every answer passes the checks; none for the other methods
        exchange = record.get("task_end_exchange")
        if options and index % rounds == rounds - 1:
            assert exchange is not None and exchange["clients"] == exchange["answers"] == NUM_HONEST, exchange
            assert not exchange["rejected"]
        else:
            assert exchange is None
    matrix = results["accuracy_matrix"]
    assert all(v is not None and 0 <= v <= 100 for row in matrix for v in row if v is not None)
    assert results["final_average_accuracy"] is not None
