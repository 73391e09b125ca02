"""The pieces under a deployment, checked in process (and in fresh processes where a deployed
message runs in one): deploy/start-client.sh refusing missing or foreign data, a node's
configuration and data, the on-disk query cache, federated evaluation and node sampling. Their
end-to-end counterparts over real SuperLink and SuperNodes: tests/test_deploy.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from promptfcl.client.node_data import NodeDataError, export_digits, node_data, parse_node_config
from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.common.data.tasks import class_order
from promptfcl.server.loopback import ROOT, run_script, script_env, toml_file
from tests.conftest import tiny_config
from tests.deployment import RUN
from tests.helpers import PushPullGrid


# ----------------------------------------------------------------------------- refusing bad node data
@pytest.mark.simulation
def test_start_client_refuses_missing_or_foreign_data(tmp_path):
    env = script_env(PROMPTFCL_CACHE=str(tmp_path / "cache"))
    run_toml = toml_file(tmp_path / "run.toml", RUN)
    common = ["--superlink", "127.0.0.1:1", "--ca", str(tmp_path / "ca.crt"), "--key", str(tmp_path / "k"),
              "--config", str(run_toml)]
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "k").write_text("x")
    done = run_script("start-client.sh", *common, "--data-dir", str(tmp_path / "nowhere"), env=env, cwd=tmp_path)
    assert done.returncode != 0 and "does not exist" in done.stderr
    done = run_script("start-client.sh", *common, env=env, cwd=tmp_path)
    assert done.returncode != 0 and "needs data" in done.stderr
    foreign = tmp_path / "pets"
    export_digits(tmp_path / "digits", 1)
    (tmp_path / "digits/node0/train/cat").mkdir()
    done = run_script("start-client.sh", *common, "--data-dir", str(tmp_path / "digits/node0"), env=env, cwd=tmp_path)
    assert done.returncode != 0 and "['cat'] that are not among the run's classes" in done.stderr, done.stderr
    del foreign


# ----------------------------------------------------------------------------- in-process pieces
def nodes_config(**overrides) -> ExperimentConfig:
    return tiny_config(**{"population": "nodes", "num-clients": 3, "clients-per-round": 3, **overrides})


def test_node_config_errors_say_what_to_do(tmp_path):
    with pytest.raises(NodeDataError, match="started without data"):
        parse_node_config({})
    with pytest.raises(NodeDataError, match="does not exist"):
        parse_node_config({"data-dir": str(tmp_path / "missing")})
    with pytest.raises(NodeDataError, match="unknown node-config keys \\['data_dir'\\]"):
        parse_node_config({"data_dir": str(tmp_path)})
    with pytest.raises(NodeDataError, match="partition-id"):
        parse_node_config({"partition-id": 3, "num-partitions": 3})
    with pytest.raises(NodeDataError, match="device"):
        parse_node_config({"partition-id": 0, "num-partitions": 3, "device": "tpu"})
    spec = parse_node_config({"data-dir": str(tmp_path), "device": "cpu"})
    assert spec.kind == "local" and spec.dataset == f"folder:{tmp_path}" and spec.device == "cpu"
    with pytest.raises(NodeDataError, match="num-clients = 3"):
        node_data(nodes_config(), {"partition-id": 0, "num-partitions": 4})


def test_config_requires_what_federated_evaluation_needs():
    with pytest.raises(ConfigError, match="needs population=nodes"):
        tiny_config(evaluation="federated", num_classes=10)
    with pytest.raises(ConfigError, match="set num-classes"):
        nodes_config(evaluation="federated")
    with pytest.raises(ConfigError, match="class-names lists 3 classes"):
        nodes_config(num_classes=10, class_names="a,b,c")


def test_folder_data_is_matched_to_the_run_classes_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path / "cache"))
    (node,) = export_digits(tmp_path / "data", 1)
    names = ",".join(str(d) for d in range(10))
    cfg = nodes_config(num_classes=10, class_names=names)
    full = node_data(cfg, {"data-dir": str(node)})
    assert full.data.num_classes == 10 and len(full.data.train) + len(full.data.test) == 1797
    assert full.partition.whole and full.partition.own_data and not full.cfg.federation.centralised  # its own data: all its share
    # a node that lacks some classes keeps the others' labels (matched by name, not position)
    import shutil

    from promptfcl.client import node_data as node_data_module

    shutil.rmtree(node / "train" / "0")
    shutil.rmtree(node / "test" / "0")
    node_data_module._loaded.clear()  # a new process, as in deployment (the file listing changed)
    partial = node_data(cfg, {"data-dir": str(node)})
    order = list(class_order(10, 0))
    assert partial.data.num_classes == 10 and order.index(0) not in set(partial.data.train.labels.tolist())
    label_of_7 = order.index(7)
    assert (partial.data.train.labels == label_of_7).sum() == (full.data.train.labels == label_of_7).sum()
    # without class-names the folders define the classes, and the server's count is enforced
    from promptfcl.client.node_data import check_classes, original_names

    sorted_cfg = nodes_config()
    nine = node_data(sorted_cfg, {"data-dir": str(node)})
    with pytest.raises(NodeDataError, match="has 9 classes but the run has 10"):
        check_classes(nine.data.num_classes, original_names(nine.data, 0), "this node",
                      sorted_cfg.data.num_classes or 10, sorted_cfg.data.class_name_list)


def test_partition_nodes_evaluate_disjoint_shards_covering_the_test_split():
    cfg = nodes_config()
    shards = [node_data(cfg, {"partition-id": i, "num-partitions": 3, "dataset": "digits"}).data.test for i in range(3)]
    from promptfcl.common.data.cache import load_dataset_cached

    full = load_dataset_cached(cfg).test
    assert sum(len(s) for s in shards) == len(full)
    assert sorted(np.concatenate([s.labels for s in shards]).tolist()) == sorted(full.labels.tolist())


DISK_CACHE_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
from flwr.app import ConfigRecord
from promptfcl.client.app import client_runtime
from promptfcl.client.message_context import MessageContext
from promptfcl.common.config.experiment import ExperimentConfig
cfg = ExperimentConfig.from_dict(json.loads(sys.argv[1]))
t1 = time.perf_counter()
rt, _ = client_runtime(MessageContext.of(cfg, {"data-dir": sys.argv[2]}), ConfigRecord({"num-classes": 10}))
q = rt.queries("train", __import__("numpy").arange(len(rt.data.train)))
t2 = time.perf_counter()
c = rt.query_cache("train")
print(json.dumps({"computed": c.computed, "loaded": c.loaded, "imports_s": t1 - t0, "setup_s": t2 - t1,
                  "checksum": float(q.sum())}))
"""


@pytest.mark.simulation
def test_a_fresh_clientapp_process_reuses_the_disk_caches(tmp_path):
    """Two fresh processes, as two messages in deployment: the second decodes and computes nothing."""
    (node,) = export_digits(tmp_path / "data", 1)
    cfg = nodes_config(num_classes=10, class_names=",".join(str(d) for d in range(10)))
    env = script_env(PROMPTFCL_CACHE=str(tmp_path / "cache"))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", DISK_CACHE_PROBE, json.dumps(cfg.to_dict()), str(node)],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["computed"] > 1000 and first["loaded"] == 0
    assert second["computed"] == 0 and second["loaded"] == first["computed"]
    assert second["checksum"] == first["checksum"]  # exactly the same queries
    assert list((tmp_path / "cache" / "data").glob("*/meta.json")), "decoded images are cached too"
    print(f"\nfresh ClientApp process: cold {first['setup_s']:.2f} s, warm {second['setup_s']:.2f} s "
          f"(imports {first['imports_s']:.2f} / {second['imports_s']:.2f} s)")


def test_disk_query_cache_merges_concurrent_writers_and_survives_bad_files(tmp_path):
    import torch

    from promptfcl.common.data.sources import ArraySplit
    from promptfcl.common.model.runtime import QueryCache

    class Model:  # q(x) = mean pixel, enough to tell entries apart
        def preprocess(self, x, evaluation=False):
            return x.float()

        def query(self, x):
            return x.mean(dim=(1, 2, 3), keepdim=False)[:, None].repeat(1, 4)

    split = ArraySplit(np.arange(10 * 4, dtype=np.uint8).reshape(10, 1, 2, 2), np.zeros(10, np.int64))
    path = tmp_path / "q.npz"
    a, b = QueryCache(split, 4, path), QueryCache(split, 4, path)
    a.get(Model(), np.array([0, 1, 2]), torch.device("cpu"))
    b.get(Model(), np.array([7, 8]), torch.device("cpu"))  # b merges a's entries before writing
    c = QueryCache(split, 4, path)
    assert c.loaded == 5 and c.filled.sum() == 5
    torch.testing.assert_close(c.get(Model(), np.array([8]), torch.device("cpu"))[0],
                               torch.full((4,), float(split.images[8].mean())))
    assert c.computed == 0  # read from disk, not computed again
    path.write_bytes(b"not a cache")
    assert QueryCache(split, 4, path).loaded == 0  # unreadable: recomputed, not a crash


class FakeGrid(PushPullGrid):
    """A Grid whose nodes answer evaluation messages with given counts (or an error), declaring
    ``test_size`` held-out samples (default: the sum of their totals)."""

    def __init__(self, answers: dict[int, tuple[list[int], list[int]] | str], test_size: dict[int, int] | None = None) -> None:
        self.answers = answers
        self.test_size = test_size or {}
        self.sent: list = []

    def get_node_ids(self):
        return list(self.answers)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Error, Message, MetricRecord, RecordDict

        self.sent = list(messages)
        out = []
        for m in self.sent:
            answer = self.answers[m.metadata.dst_node_id]
            if isinstance(answer, str):
                out.append(Message(Error(code=0, reason=answer), reply_to=m))
            else:
                correct, total = answer
                node = m.metadata.dst_node_id
                out.append(Message(RecordDict({"metrics": MetricRecord(
                    {"correct": correct, "total": total, "num-examples": sum(total), "train-size": 100,
                     "test-size": self.test_size.get(node, sum(total))})}), reply_to=m))
        return out


def test_federated_evaluation_sums_counts_over_nodes(flower_identity):
    from promptfcl.common.records import to_array_record
    from promptfcl.server.evaluation import FederatedEvaluator
    from promptfcl.strategies.fedavg.strategy import FedAvgStrategy

    cfg = nodes_config(evaluation="federated", num_classes=10)
    strategy = FedAvgStrategy.of(cfg, 10)
    grid = FakeGrid({11: ([5, 1], [10, 10]), 12: ([10, 9], [20, 10]), 13: "node 13 crashed", 14: ([1], [1])})
    acc = FederatedEvaluator(grid, strategy)(to_array_record({"head.weight": np.zeros((10, 4), np.float32)}), 1)
    # (5 + 10) / 30 and (1 + 9) / 20; the crashed node and the malformed reply are left out
    np.testing.assert_allclose(acc, [50.0, 50.0])
    assert {m.metadata.message_type for m in grid.sent} == {"evaluate"}
    evaluator = FederatedEvaluator(grid, strategy)
    evaluator(to_array_record({"head.weight": np.zeros((10, 4), np.float32)}), 1)
    rec = evaluator.last_record
    assert rec["eval_nodes"] == 2 and rec["eval_test_size"] == 50 and len(rec["eval_failed"]) == 2


def test_federated_evaluation_bounds_what_a_node_can_claim(flower_identity):
    """Counts beyond what a node declared, correct above total, and one node's weight above
    max-client-weight: none of them decides the accuracy."""
    from promptfcl.common.records import to_array_record
    from promptfcl.server.evaluation import FederatedEvaluator
    from promptfcl.strategies.fedavg.strategy import FedAvgStrategy

    cfg = nodes_config(evaluation="federated", num_classes=10)
    strategy = FedAvgStrategy.of(cfg, 10)
    head = to_array_record({"head.weight": np.zeros((10, 4), np.float32)})
    honest = {11: ([5, 1], [10, 10]), 12: ([10, 9], [20, 10]), 13: ([3, 3], [10, 10])}
    FederatedEvaluator(FakeGrid(honest), strategy)(head, 1)  # each node declares its sizes once
    inflated = {**honest, 14: ([10**9, 10**9], [10**9, 10**9])}
    evaluator = FederatedEvaluator(FakeGrid(inflated, test_size={14: 20}), strategy)
    acc = evaluator(head, 1)
    np.testing.assert_allclose(acc, [100 * 18 / 40, 100 * 13 / 30])  # node 14 left out
    assert [f["node"] for f in evaluator.last_record["eval_failed"]] == [14]
    assert "declared test-size 20" in evaluator.last_record["eval_failed"][0]["reason"]
    # a node within its declaration but holding most of a task's samples weighs at most one half
    big = {**honest, 15: ([0, 0], [1000, 10])}
    acc = FederatedEvaluator(FakeGrid(big), strategy)(head, 1)
    assert acc[0] == pytest.approx(100 * (0.5 * 0.0 + 0.5 * 18 / 40))  # capped: the others share the rest
    assert acc[1] == pytest.approx(100 * 13 / 40)  # no node above half of task 2's samples: pooled as is
    bad = {**honest, 16: ([11, 0], [10, 10])}
    evaluator = FederatedEvaluator(FakeGrid(bad), strategy)
    evaluator(head, 1)
    assert "correct > total" in evaluator.last_record["eval_failed"][0]["reason"]


def test_node_population_sampling_is_seeded_over_sorted_node_ids(flower_identity):
    from flwr.app import ConfigRecord

    from promptfcl.common.records import to_array_record
    from promptfcl.strategies.fedavg.strategy import FedAvgStrategy

    cfg = nodes_config(clients_per_round=2, num_clients=3)
    strategy = FedAvgStrategy.of(cfg, 10)
    grid = FakeGrid({30: "", 10: "", 20: ""})
    arrays = to_array_record({"head.weight": np.zeros((10, 4), np.float32)})
    msgs = strategy.configure_train(1, arrays, ConfigRecord({"task": 0, "round": 0}), grid)
    chosen = sorted(m.metadata.dst_node_id for m in msgs)
    assert len(chosen) == 2 and set(chosen) <= {10, 20, 30}
    assert chosen == strategy.sample_nodes([10, 20, 30], 0, 0)  # a pure function of the sorted ids
    assert all(m.content["config"]["num-classes"] == 10 for m in msgs)
    # fewer nodes than the population: the first round waits, then says how many came
    strategy = FedAvgStrategy.of(nodes_config(num_clients=3, round_timeout=1.5), 10)
    with pytest.raises(RuntimeError, match="only 2 of the 3 nodes"):
        strategy.configure_train(1, arrays, ConfigRecord({"task": 0, "round": 0}), FakeGrid({1: "", 2: ""}))
