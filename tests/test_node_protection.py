"""A deployment across organisations: what a node machine can reach, and what a node accepts.

What a node machine can send the SuperLink is tested in tests/test_fleet_gate.py; here: a node
reads only the data its own node config names, refuses runs beyond the sizes it allows, and
obeys a run's fault switch only when its operator enabled fault injection
(client/node_policy.py); class names from the server never leave the node's data folder;
``promptfcl resume`` never takes where to run from a checkpoint; and every method's
aggregation caps one node's weight. The end-to-end counterparts over real processes are in
tests/test_deploy.py.
"""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from promptfcl.client.message_context import MessageContext
from promptfcl.client.node_data import NodeDataError, export_digits, node_data, parse_node_config
from promptfcl.client.node_policy import LIMITS, NodePolicy, NodeRefusal
from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.errors import DataError
from promptfcl.common.files import class_folder
from promptfcl.common.model.runtime import model_spec
from tests.conftest import tiny_config
from tests.helpers import client_app, run_in_process


# ----------------------------------------------------------------------------- class names stay in the folder
def test_class_names_from_the_server_never_leave_the_nodes_data_folder(tmp_path):
    from promptfcl.common.data.sources import read_class_folders

    (node,) = export_digits(tmp_path / "data", 1)
    outside = tmp_path / "outside"
    export_digits(outside, 1)  # images a hostile run would like the node to read and summarise
    for name in ("../outside", str(outside / "node0" / "train" / "3"), "..", ".", "a/b", "a\\b", "x\x00y", ""):
        with pytest.raises(DataError, match="refused"):
            class_folder(node / "train", name)
        with pytest.raises(DataError, match="refused"):
            read_class_folders(node / "train", ["0", name], 16, skip_missing=True)
    # the run config refuses such names before any node sees them
    with pytest.raises(ConfigError, match="cannot be a class folder's name"):
        tiny_config(**{"class-names": "0,1,2,3,4,5,6,7,8,../../etc"})
    # and a plain name is read as before
    split = read_class_folders(node / "train", ["0", "1"], 16, skip_missing=False)
    assert len(split) > 0 and set(split.labels.tolist()) == {0, 1}


# ----------------------------------------------------------------------------- data location, limits, faults
def test_a_node_reads_only_the_data_its_node_config_names(tmp_path):
    # partition nodes name the copy they hold; the run's dataset / data-dir are not taken
    cfg = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3})
    with pytest.raises(NodeDataError, match="does not name the copy it holds"):
        node_data(cfg, {"partition-id": 0, "num-partitions": 3})
    with pytest.raises(NodeDataError, match="holds dataset 'fashion-mnist', but the run partitions 'digits'"):
        node_data(cfg, {"partition-id": 0, "num-partitions": 3, "dataset": "fashion-mnist"})
    own = node_data(cfg, {"partition-id": 0, "num-partitions": 3, "dataset": "digits"})
    trusting = node_data(cfg, {"partition-id": 0, "num-partitions": 3, "data-from-run": True})
    assert own.data.fingerprint == trusting.data.fingerprint
    # a node with its own source never takes the run's data-dir
    run = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3,
                                             "data-dir": str(tmp_path / "run-chose-this")})
    spec = parse_node_config({"dataset": "digits"})
    assert spec.data_dir == "" and not spec.data_from_run
    assert node_data(run, {"dataset": "digits"}).cfg.data.data_dir == ""
    with pytest.raises(NodeDataError, match="data-from-run must be true or false|must be true or false"):
        parse_node_config({"dataset": "digits", "data-from-run": "yes"})


def message(cfg, **config) -> Message:
    """A train message of ``cfg``'s first round for client 0, with the initial prompts and head."""
    from promptfcl.common.model.prompted import CodaPrompt, initial_trainable_state
    from promptfcl.common.records import to_array_record

    return Message(content=RecordDict({
        "arrays": to_array_record(initial_trainable_state(model_spec(cfg, cfg.data.num_classes), CodaPrompt)),
        "config": ConfigRecord({"task": 0, "round": 0, "client-id": 0, "config-digest": cfg.digest(), **config})}),
        dst_node_id=1, message_type=MessageType.TRAIN)


def test_a_node_refuses_runs_beyond_its_own_limits(flower_identity):
    from promptfcl.client.app import client_runtime

    cfg = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3})
    ctx = Context(run_id=1, node_id=1, node_config={"dataset": "digits", "max-image-size": 8}, state=RecordDict(),
                  run_config=cfg.to_dict())
    with pytest.raises(NodeRefusal, match="image-size = 16 exceeds this node's limit max-image-size = 8"):
        client_runtime(MessageContext.from_flower(ctx), ConfigRecord({}))
    # the defaults take a paper-scale run (ViT-B/16, 224 px, pools of 100 x 20) and refuse absurd ones
    paper = {"image-size": 224, "batch-size": 128, "pool-size": 100, "prompt-length": 20, "num-classes": 345,
             "embed-dim": 768, "depth": 12, "num-heads": 12, "local-epochs": 10, "num-tasks": 20}
    policy = NodePolicy.from_node_config({})
    policy.check_run(tiny_config(**{"image-size": 224, "batch-size": 128, "local-epochs": 10}))
    assert all(paper[k] <= LIMITS[k] for k in LIMITS)
    for key, value in (("batch-size", 10**6), ("pool-size", 10**6), ("local-epochs", 10**5)):
        with pytest.raises(NodeRefusal, match=f"{key} = {value}"):
            policy.check_run(tiny_config(**{key: value, "pool-size": 4} if key != "pool-size" else {key: value}))
    with pytest.raises(NodeRefusal, match="num-classes = 10000000"):
        policy.check_run(cfg, 10**7)  # the head size a message names
    with pytest.raises(NodeRefusal, match="positive integer"):
        NodePolicy.from_node_config({"max-batch-size": 0})
    # a deployed node never loads the run's own dataset (population = virtual) unless its operator says so
    virtual = tiny_config()
    ctx = Context(run_id=1, node_id=1, node_config={"dataset": "digits"}, state=RecordDict(), run_config=virtual.to_dict())
    with pytest.raises(NodeRefusal, match="population = virtual loads the run's own dataset"):
        client_runtime(MessageContext.from_flower(ctx), ConfigRecord({}))


def test_a_node_bounds_the_tokens_and_estimated_memory_a_run_asks_for(flower_identity):
    from promptfcl.client.app import client_runtime

    policy = NodePolicy.from_node_config({})
    # a paper-scale run, its sizes left to the model's name (ViT-B/16), fits the defaults
    paper = tiny_config(backbone="vit_base_patch16_224.augreg_in21k", **{
        "image-size": 224, "patch-size": 0, "embed-dim": 0, "depth": 0, "num-heads": 0, "batch-size": 128,
        "prompt-length": 20})
    policy.check_run(paper)
    # each size within its own limit, together a million tokens per image: refused by the token limit
    with pytest.raises(NodeRefusal, match="gives 1048576 tokens per image, above this node's limit max-tokens = 4096"):
        policy.check_run(tiny_config(**{"image-size": 1024, "patch-size": 1, "batch-size": 2048}))
    # within the token limit, but batch x tokens x width x depth beyond the memory ceiling
    wide = {"image-size": 1024, "patch-size": 16, "batch-size": 2048, "embed-dim": 768, "depth": 12, "num-heads": 12}
    with pytest.raises(NodeRefusal, match=r"needs an estimated .* GB, above this node's limit max-memory-gb = 64"):
        policy.check_run(tiny_config(**wide))
    # the node's operator sets both ceilings
    with pytest.raises(NodeRefusal, match="max-memory-gb = 1"):
        NodePolicy.from_node_config({"max-memory-gb": 1}).check_run(tiny_config(**{"image-size": 224,
                                                                                   "batch-size": 128}))
    NodePolicy.from_node_config({"max-memory-gb": 10**6}).check_run(tiny_config(**wide))
    # a size left to a model whose name does not say it cannot be estimated: refused
    with pytest.raises(NodeRefusal, match="embed-dim = 0 .* does not say it"):
        policy.check_run(tiny_config(backbone="my_vit_patch16", **{"embed-dim": 0}))
    # the ClientApp's own path refuses before anything is built
    cfg = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3})
    ctx = Context(run_id=1, node_id=1, node_config={"dataset": "digits", "max-tokens": 8}, state=RecordDict(),
                  run_config=cfg.to_dict())
    with pytest.raises(NodeRefusal, match="16 tokens per image, above this node's limit max-tokens = 8"):
        client_runtime(MessageContext.from_flower(ctx), ConfigRecord({}))


def test_the_server_checks_a_runs_footprint_before_building_anything(tmp_path, monkeypatch):
    from promptfcl.server.app import main
    from promptfcl.server.loopback import run_script, script_env
    from tests.helpers import Built, refuse_to_build_the_server

    refuse_to_build_the_server(monkeypatch)
    for population in ({}, {"population": "nodes", "evaluation": "federated", "num-classes": 10}):
        huge = tiny_config(**{"image-size": 1024, "patch-size": 1, "out-dir": str(tmp_path / "out"), **population})
        ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=huge.to_dict())
        with pytest.raises(ConfigError, match="max-tokens = 4096 .*PROMPTFCL_MAX_TOKENS"):
            main(None, ctx)
        monkeypatch.setenv("PROMPTFCL_MAX_TOKENS", str(2**20))  # the server's operator raises its ceilings
        with pytest.raises(ConfigError, match="estimated 258 GB, above the server's limit max-memory-gb = 64"):
            main(None, ctx)
        monkeypatch.setenv("PROMPTFCL_MAX_MEMORY_GB", "300")
        with pytest.raises(Built):
            main(None, ctx)
        monkeypatch.delenv("PROMPTFCL_MAX_TOKENS")
        monkeypatch.delenv("PROMPTFCL_MAX_MEMORY_GB")
    # submit-run.sh refuses it before anything is sent (no SuperLink listens on port 1)
    done = run_script("submit-run.sh", "--superlink", "127.0.0.1:1", "--insecure", "--set", "image-size=1024",
                      "--set", "patch-size=1", env=script_env(FLWR_HOME=str(tmp_path / "flwr")), cwd=tmp_path)
    assert done.returncode != 0 and "above the server's limit max-tokens = 4096" in done.stderr, done.stderr
    assert "flwr run" not in done.stdout + done.stderr


@pytest.mark.e2e
def test_the_server_logs_a_nodes_refusal_with_its_id(tmp_path, flower_identity, caplog):
    cfg = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3, "num-tasks": 1,
                                             "out-dir": str(tmp_path / "out")})
    configs = {1001 + i: {"partition-id": i, "num-partitions": 3, "dataset": "digits"} for i in range(3)}
    configs[1003]["max-batch-size"] = 8  # this node's operator allows smaller batches than the run's 32
    with caplog.at_level("WARNING", logger="promptfcl"):
        results = run_in_process(cfg, nodes=3, node_configs=configs)
    record = results["rounds"][0]
    assert record["clients_aggregated"] == 2
    assert [(x["node"], "batch-size = 32 exceeds this node's limit max-batch-size = 8" in x["reason"])
            for x in record["rejected"]] == [(1003, True)]
    assert any("node 1003 excluded" in m and "max-batch-size" in m for m in caplog.messages)


def test_a_node_refuses_a_message_that_does_not_carry_its_runs_config_digest(flower_identity):
    """A message "from the server" that a node could push to another (finding 1 of issue 54: the
    run's initial arrays, no config-digest) trains nothing: every message of this run's server says
    its run config's digest (train, query and evaluate alike)."""
    from promptfcl.client.app import check_same_config, evaluate, query, train

    cfg = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3})
    ctx = Context(run_id=1, node_id=1, node_config={"dataset": "digits", "partition-id": 0, "num-partitions": 3},
                  state=RecordDict(), run_config=cfg.to_dict())
    for handler, kind in ((train, MessageType.TRAIN), (evaluate, MessageType.EVALUATE), (query, MessageType.QUERY)):
        forged = message(cfg)
        del forged.content["config"]["config-digest"]
        forged.metadata.__dict__["_message_type"] = kind
        with pytest.raises(ValueError, match="carries no config-digest"):
            handler(forged, ctx)
    with pytest.raises(ValueError, match="differs from the server's"):
        check_same_config(cfg.digest(), ConfigRecord({"config-digest": "0" * 16}))
    check_same_config(cfg.digest(), ConfigRecord({"config-digest": cfg.digest()}))


@pytest.mark.e2e
def test_the_server_records_no_forged_message_as_a_clients_but_names_a_dead_node(tmp_path, flower_identity, caplog):
    """Messages under the SuperLink's node id that the SuperLink did not make (a node's forged error
    "to the ServerApp", pulled as an instruction addressed to it; a non-error "report" on a message
    it sent) are dropped and logged as forged, in training and in federated evaluation alike; the
    SuperLink's real report on a node that died still names that node, by the message it was sent."""
    from flwr.app import Error

    from promptfcl.common.flower_internals import internal
    from tests.helpers import InProcessGrid

    superlink = internal("superlink_node_id")

    class ForgingGrid(InProcessGrid):
        """Each batch's first pull also returns the two forged messages, as Flower's runtime API
        returns instructions addressed to the SuperLink with the replies it was asked for."""

        def push_messages(self, messages):
            messages = list(messages)
            ids = super().push_messages(messages)
            error = Message(Error(code=0, reason="forged by node 1003"), reply_to=messages[0])
            error.metadata.__dict__.update(_src_node_id=superlink, _dst_node_id=superlink, _reply_to_message_id="")
            report = Message(RecordDict({"metrics": MetricRecord({"num-examples": 10**9})}), reply_to=messages[-1])
            report.metadata.__dict__["_src_node_id"] = superlink
            self.forged = [error, report]
            return ids

        def pull_messages(self, message_ids):
            got, self.forged = super().pull_messages(message_ids) + self.forged, []
            return got

    cfg = tiny_config(population="nodes", evaluation="federated", **{
        "num-classes": 10, "num-clients": 3, "clients-per-round": 3, "num-tasks": 1, "rounds-per-task": 1,
        "out-dir": str(tmp_path / "out")})
    configs = {1001 + i: {"partition-id": i, "num-partitions": 3, "dataset": "digits"} for i in range(3)}
    with caplog.at_level("WARNING", logger="promptfcl"):
        results = run_in_process(cfg, nodes=3, node_configs=configs, dead={1002: "lost"}, grid_class=ForgingGrid)
    (record,) = results["rounds"]
    assert record["clients_aggregated"] == 2
    assert [(x["node"], x["reason"]) for x in record["rejected"]] == [(1002, "client error: node lost")]
    assert [(x["node"], x["reason"]) for x in record["eval_failed"]] == [(1002, "client error: node lost")]
    assert record["eval_nodes"] == 2
    forged = [m for m in caplog.messages if "dropped as forged" in m]
    assert len(forged) == 4 and all(f"from node {superlink}" in m for m in forged)  # 2 in training, 2 in evaluation
    assert sum("yet answers no message sent" in m and "forged by node 1003" in m for m in forged) == 2
    assert sum("yet is not an error report" in m for m in forged) == 2


def test_fault_injection_obeys_the_node_not_the_run(tmp_path, flower_identity):
    from promptfcl.client.app import NodeError
    from promptfcl.client.faults import InjectedFault

    cfg = tiny_config(fault="raise", **{"fault-clients": "0", "num-classes": 10})
    msg = message(cfg)
    deployed = client_app(operated=False)  # a node started by its operator, without fault-injection
    ctx = Context(run_id=1, node_id=1, node_config={"data-from-run": True}, state=RecordDict(),
                  run_config=cfg.to_dict())
    reply = deployed(msg, ctx)
    assert not reply.has_error() and reply.content["metrics"]["num-examples"] > 0  # trained normally
    ctx = Context(run_id=1, node_id=1, node_config={"data-from-run": True, "fault-injection": True},
                  state=RecordDict(), run_config=cfg.to_dict())
    with pytest.raises(NodeError, match="InjectedFault: injected failure of client 0") as failed:
        deployed(message(cfg), ctx)
    assert isinstance(failed.value.__cause__, InjectedFault)


# ----------------------------------------------------------------------------- resume
def test_resume_takes_where_to_run_from_the_command_line_not_the_checkpoint(tmp_path, caplog):
    from promptfcl.server import checkpoint
    from promptfcl.server.cli import _resume_config
    from tests.helpers import make_ckpt

    ckpt = make_ckpt(1)
    ckpt.config.update({"ray-address": "203.0.113.9:6379", "device": "cuda", "threads": 7, "client-cpus": "3",
                        "client-gpus": "0.5"})
    checkpoint.save(ckpt, tmp_path)
    with caplog.at_level("INFO", logger="promptfcl"):
        cfg = _resume_config(str(tmp_path), [])
    assert (cfg.placement.ray_address, cfg.placement.device, cfg.placement.client_cpus, cfg.placement.client_gpus) == ("", "auto", "auto", "auto")
    assert cfg.placement.threads == 7  # kept: a thread count can change what the rest of the run computes
    assert any("ray-address = ''" in m and "203.0.113.9:6379" in m for m in caplog.messages)
    cfg = _resume_config(str(tmp_path), ["ray-address=auto", "threads=2"])
    assert cfg.placement.ray_address == "auto" and cfg.placement.threads == 2


def test_resuming_a_run_stopped_at_max_rounds_goes_on(tmp_path):
    """A checkpoint kept by max-rounds = 1 resumes to the end (it stopped at once before), unless
    the command line sets max-rounds again."""
    from promptfcl.server import checkpoint
    from promptfcl.server.cli import _resume_config
    from tests.helpers import make_ckpt

    ckpt = make_ckpt(1)
    ckpt.config.update({"max-rounds": 1})
    checkpoint.save(ckpt, tmp_path)
    assert _resume_config(str(tmp_path), []).output.max_rounds == 0
    assert _resume_config(str(tmp_path), ["max-rounds=3"]).output.max_rounds == 3


# ----------------------------------------------------------------------------- one weighting path
def claims_more(factor: int):
    """A mod: the node's train replies claim ``factor`` times their samples (num-examples, every method's
    per-class counts), and it declares a train-size that makes the claim its declared maximum."""
    from promptfcl.common.records import to_array_record

    def mod(msg, context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        content = reply.content
        metrics = dict(content["metrics"])
        metrics["num-examples"] = metrics["train-size"] = int(metrics["num-examples"]) * factor
        content["metrics"] = MetricRecord(metrics)
        for name in list(content.array_records):
            record = content.array_records[name]
            if name != "arrays" and "counts" in record:
                arrays = {k: record[k].numpy() for k in record.keys()}
                arrays["counts"] = arrays["counts"] * factor
                content[name] = to_array_record(arrays)
        return Message(content=content, reply_to=msg)

    return mod


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["fedavg", "fppl", "hgp", "hepco", "fedcprompt", "powder", "c2prompt", "lorm",
                                      "pilora"])
def test_every_method_caps_one_nodes_share_of_a_round(tmp_path, flower_identity, strategy):
    """A node claiming 1000 times its samples (within what it declared) gets at most
    max-client-weight of the round, from 2 replies on, whatever the method."""
    options = {"hepco": {"hepco.averaging": "samples", "hepco.generator-epochs": 1, "hepco.distill-epochs": 1},
               "powder": {"pool-size": 4}}.get(strategy, {})
    for nodes in (3, 2):
        cfg = tiny_config(strategy=strategy, population="nodes", **{
            "num-clients": nodes, "clients-per-round": nodes, "num-tasks": 1, "pool-size": 2,
            "out-dir": str(tmp_path / f"{nodes}"), **options})
        configs = {1001 + i: {"partition-id": i, "num-partitions": nodes, "dataset": "digits"} for i in range(nodes)}
        greedy = 1000 + nodes
        apps = {greedy: client_app([claims_more(1000)])}
        results = run_in_process(cfg, nodes=nodes, apps=apps, node_configs=configs)
        record = results["rounds"][0]
        assert record["clients_aggregated"] == nodes, record["rejected"]
        shares = record["reply_shares"]
        assert len(shares) == nodes and sum(shares) == pytest.approx(1.0)
        assert max(shares) == pytest.approx(cfg.robustness.max_client_weight)  # the greedy node, capped
        placed = [p["node"] for p in record["placement"]]
        assert shares[placed.index(str(greedy))] == pytest.approx(0.5), (placed, shares)


@pytest.mark.e2e
def test_logs_and_records_name_nodes_as_their_operator_registered_them(tmp_path, flower_identity, caplog):
    """Where Flower's NodeInfo says (Grid.get_nodes, deployment), the weight cap, rejections and
    round records name a node by its registered name, or its key's fingerprint."""
    import hashlib
    import types

    from promptfcl.server.report import write_outputs
    from promptfcl.server.run import run_experiment
    from tests.helpers import InProcessGrid

    class RegisteredGrid(InProcessGrid):
        def get_nodes(self):
            return [types.SimpleNamespace(node_id=1001, name="clinic", public_key=b"pk-1"),
                    types.SimpleNamespace(node_id=1002, name="", public_key=b"pk-2"),
                    types.SimpleNamespace(node_id=1003, name="greedy-lab", public_key=b"pk-3"),
                    types.SimpleNamespace(node_id=1004, name="gone", public_key=b"pk-4")]

    cfg = tiny_config(population="nodes", **{"num-clients": 4, "clients-per-round": 4, "num-tasks": 1,
                                             "pool-size": 2, "out-dir": str(tmp_path / "out"),
                                             "round-timeout": 1.0})  # the silent node: waited for 1 s
    configs = {1001 + i: {"partition-id": i, "num-partitions": 4, "dataset": "digits"} for i in range(4)}
    grid = RegisteredGrid(cfg, 4, {1003: client_app([claims_more(1000)])}, node_configs=configs,
                          dead={1004: "silent"})
    with caplog.at_level("INFO", logger="promptfcl"):
        results = run_experiment(grid, cfg)  # type: ignore[arg-type]
    write_outputs(results, cfg.output.out_dir)
    record = results["rounds"][0]
    fingerprint = hashlib.sha256(b"pk-2").hexdigest()[:12]
    assert sorted(record["reply_nodes"]) == sorted(["node 1001 (clinic)", f"node 1002 (key {fingerprint})",
                                                    "node 1003 (greedy-lab)"])
    assert record["reply_shares"][record["reply_nodes"].index("node 1003 (greedy-lab)")] == pytest.approx(0.5)
    assert any(m.startswith("round 1: max-client-weight 0.5: node 1003 (greedy-lab) claimed ") and
               m.endswith("weighted 50%") for m in caplog.messages), caplog.messages
    assert [(r["node"], r.get("name")) for r in record["rejected"]] == [(1004, "gone")]


# ----------------------------------------------------------------------------- the app's run config
def test_simulated_app_dir_declares_every_key_it_sets(tmp_path):
    """What `promptfcl simulate` writes for Flower passes Flower's own fusion unchanged."""
    from promptfcl.common.flower_internals import internal

    get_fused_config_from_dir = internal("fused_run_config")

    from promptfcl.server.simulation import write_app_dir

    cfg = tiny_config(strategy="hgp", **{"hgp.cov-type": "diag", "dp.clip": 1.0})
    app = write_app_dir(cfg.to_dict(), tmp_path / "app")
    assert get_fused_config_from_dir(app, {}) == cfg.to_dict()
    assert cfg.to_dict()["hgp.cov-type"] == "diag"


# ----------------------------------------------------------------------------- the backbone: the node's own
class OpenedFiles:
    """Records every path this process opens or stats (builtins.open, io.open, os.stat), and lets it happen."""

    def __init__(self, monkeypatch) -> None:
        import builtins
        import io
        import os

        self.paths: list[str] = []
        for module, name in ((builtins, "open"), (io, "open"), (os, "stat")):
            real = getattr(module, name)

            def observed(file, *args, _real=real, **kwargs):
                self.paths.append(str(file))
                return _real(file, *args, **kwargs)

            monkeypatch.setattr(module, name, observed)

    def touched(self, path) -> bool:
        return any(str(path) in p for p in self.paths)


def secret_checkpoint(path):
    """A weights file beside the node's data, with key names and shapes no reply may carry."""
    import torch

    torch.save({"model": {"SECRET_KEY_OF_THE_NODE": torch.zeros(7, 13)}}, path)
    return path


def test_a_deployed_node_never_opens_the_weights_file_or_hub_source_a_run_names(tmp_path, monkeypatch, caplog,
                                                                               flower_identity):
    from promptfcl.client.app import NodeError

    (node,) = export_digits(tmp_path / "data", 1)
    secret = secret_checkpoint(tmp_path / "data" / "secret.pt")
    deployed = client_app(operated=False)  # a node started by its operator: nothing trusted from the run
    for key, overrides in [("weights", {"weights": str(secret)}), ("weights", {"weights": "timm"}),
                           ("backbone", {"backbone": "local-dir:" + str(tmp_path / "data")}),
                           ("backbone", {"backbone": "hf-hub:someone/vit"})]:
        cfg = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3, **overrides})
        ctx = Context(run_id=1, node_id=1, node_config={"data-dir": str(node)}, state=RecordDict(),
                      run_config=cfg.to_dict())
        sent = message(tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3}))
        sent.content["config"]["config-digest"] = cfg.digest()  # the server built its arrays without a backbone
        opened = OpenedFiles(monkeypatch)
        caplog.clear()
        with caplog.at_level("WARNING", logger="promptfcl"), pytest.raises(NodeError) as refused:
            deployed(sent, ctx)
        monkeypatch.undo()
        reason = str(refused.value)  # what Flower sends the server
        assert f"NodeRefusal: node refuses the run: its {key} " in reason, reason
        assert "/" not in reason.split("(")[0] and str(tmp_path) not in reason and "secret" not in reason
        assert "SECRET_KEY" not in reason and "13" not in reason
        assert not opened.touched(secret) and not opened.touched(tmp_path / "data" / "config.json"), opened.paths
        assert not opened.touched(node), "refused before the node's data was even read"
        assert any(f"node refuses the run: {key} = " in m for m in caplog.messages), caplog.messages  # logged, key named
    # the node's own weights win, and the run's file is still never opened
    cfg = tiny_config(population="nodes", weights=str(secret), **{"num-clients": 3, "clients-per-round": 3,
                                                                   "num-classes": 10})
    ctx = Context(run_id=1, node_id=1, node_config={"data-dir": str(node), "weights": "random"}, state=RecordDict(),
                  run_config=cfg.to_dict())
    sent = message(cfg)
    opened = OpenedFiles(monkeypatch)
    reply = deployed(sent, ctx)
    monkeypatch.undo()
    assert not reply.has_error() and reply.content["metrics"]["num-examples"] > 0
    assert not opened.touched(secret)


def test_the_backbone_comes_from_the_nodes_config_or_cache_unless_it_trusts_the_run():
    from promptfcl.client.node_policy import NodePolicy

    own = NodePolicy.from_node_config({})
    backbone = tiny_config().model.backbone
    for weights in ("random", "pretrained:fashion-mnist"):  # the node's cache: nothing the server names is opened
        assert own.backbone_weights(backbone, weights) == weights
    for weights in ("timm", "/etc/shadow", "~/.ssh/id_rsa.pt", "ckpt.pt"):
        with pytest.raises(NodeRefusal, match="its weights names a"):
            own.backbone_weights(backbone, weights)
    chosen = NodePolicy.from_node_config({"weights": "/srv/vit.pt"})
    assert chosen.backbone_weights(backbone, "timm") == "/srv/vit.pt"
    trusting = NodePolicy.from_node_config({"weights-from-run": True})  # simulated nodes: the run is the operator's
    assert trusting.backbone_weights(backbone, "/x/vit.pt") == "/x/vit.pt"
    with pytest.raises(NodeRefusal, match="must be a checkpoint path"):
        NodePolicy.from_node_config({"weights": 3})
    parse_node_config({"dataset": "digits", "weights": "timm", "weights-from-run": False})  # known node-config keys


# ----------------------------------------------------------------------------- what errors tell the server
def test_error_replies_name_the_error_without_the_nodes_paths(tmp_path, flower_identity):
    from promptfcl.client.app import NodeError, public_reason

    (node,) = export_digits(tmp_path / "private-site-name", 1)
    (node / "train" / "cat").mkdir()  # a class folder that is not the run's: only the node's log names it
    cfg = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3, "num-classes": 10,
                                             "class-names": ",".join(map(str, range(10)))})
    ctx = Context(run_id=1, node_id=1, node_config={"data-dir": str(node)}, state=RecordDict(), run_config=cfg.to_dict())
    with pytest.raises(NodeError) as failed:
        client_app(operated=False)(message(cfg), ctx)
    reason = str(failed.value)
    assert reason.startswith("NodeDataError: this node's data <data-dir>/train has class folders that are not among "
                             "the run's classes"), reason
    assert "cat" not in reason  # the folder's name stays on the node (tests/test_node_replies.py)
    assert str(tmp_path) not in reason and "private-site-name" not in reason
    assert "private-site-name" in str(failed.value.__cause__)  # the node's own log keeps the whole error
    # any other absolute or home path goes too, and a newline cannot forge the server's log
    reason = public_reason(OSError("cannot read /etc/ssl/private/k.pem\nINFO round 9 finished; ~/x.pt"), {})
    assert reason == "OSError: cannot read <path>\\nINFO round 9 finished; <path>", reason
    assert public_reason(ValueError("see https://flower.ai/docs and <class>/*.png"), {}).endswith(
        "see https://flower.ai/docs and <class>/*.png")


def test_log_lines_quote_untrusted_text_with_control_characters_escaped(caplog):
    import logging

    from promptfcl.common.text import escape_log_args, printable
    from promptfcl.deploy.fleet_gate import FleetOnly
    from tests.test_fleet_gate import asgi_call

    log = escape_log_args(logging.getLogger("promptfcl"))
    with caplog.at_level("INFO"):
        log.warning("reply from node %s excluded: %s (%r)", 7, "bad\nINFO forged line\r\x1b[2K", "a\u2028b")
        log.info("%d of %.1f", 3, 2.5)  # numbers stay numbers
        asgi_call(FleetOnly, "/v1/control/x\nWARNING forged")  # %0a in a refused URL path arrives as a newline
    assert caplog.messages[0] == "reply from node 7 excluded: bad\\nINFO forged line\\r\\x1b[2K ('a\\u2028b')"
    assert caplog.messages[1] == "3 of 2.5"
    assert "\n" not in caplog.messages[2] and "x\\nWARNING forged" in caplog.messages[2]
    assert printable("x" * 50, 10) == "xxxxxxxxxx... (40 more characters)"


# ----------------------------------------------------------------------------- the operator's side
def test_start_server_keeps_the_unauthenticated_control_api_on_loopback(tmp_path):
    from promptfcl.server.loopback import run_script, script_env

    certs = tmp_path / "certs"
    certs.mkdir()
    for name in ("ca.crt", "server.pem", "server.key"):
        (certs / name).write_text("x")  # a dry run reads none of them
    env = script_env()

    def start(*args: str):
        return run_script("start-server.sh", "--certs", str(certs), "--state", str(tmp_path / "state"), "--dry-run",
                          *args, env=env, cwd=tmp_path, timeout=60)

    for host in ("127.0.0.1", "localhost", "::1"):
        done = start("--control-host", host)
        assert done.returncode == 0 and "dry run: would start" in done.stdout, done.stderr
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700  # state.db and results: the operator's alone
    for host in ("0.0.0.0", "203.0.113.5", "127.example.org"):
        done = start("--control-host", host)
        assert done.returncode == 2 and "no authentication" in done.stderr and "ssh -L" in done.stderr, done.stderr
    done = start("--control-host", "0.0.0.0", "--i-know-control-api-is-unauthenticated")
    assert done.returncode == 0 and "UNAUTHENTICATED" in done.stderr, done.stderr
    done = run_script("start-server.sh", "--insecure", "--control-host", "0.0.0.0",
                      "--i-know-control-api-is-unauthenticated", "--dry-run", env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "without TLS" in done.stderr
    # the node-facing listener's bound on an object push (the rest: 256 KiB)
    done = start("--max-object-bytes", "1000000")
    assert done.returncode == 0 and "--max-object-bytes 1000000" in done.stdout, done.stderr
    done = start("--max-object-bytes", "0")
    assert done.returncode == 2 and "--max-object-bytes must be a positive number" in done.stderr


def test_results_are_readable_by_the_group_at_most(tmp_path):
    import os

    from promptfcl.common.files import results_umask, write_atomic

    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "results.json", lambda fh: fh.write(b"{}"), shared=True)
        with results_umask():  # what the ServerApp runs under: plots and tables written by any library
            (tmp_path / "out").mkdir()
            (tmp_path / "out" / "table.md").write_text("x")
        assert os.umask(0o022) == 0o022  # restored
    finally:
        os.umask(old)
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "out" / "table.md").stat().st_mode & 0o777 == 0o640
