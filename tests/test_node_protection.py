"""A deployment across organisations: what a node machine can reach, and what a node accepts.

The SuperLink's node-facing listener serves the Fleet API only (deploy/superlink.py); a node
reads only the data its own node config names, refuses runs beyond the sizes it allows, and
obeys a run's fault switch only when its operator enabled fault injection
(client/node_policy.py); class names from the server never leave the node's data folder;
``promptfcl resume`` never takes where to run from a checkpoint; and every method's
aggregation caps one node's weight. The end-to-end counterparts over real processes are in
tests/test_deploy.py.
"""

from __future__ import annotations

import asyncio

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from promptfcl.client.node_data import NodeDataError, export_digits, node_data, parse_node_config
from promptfcl.client.node_policy import LIMITS, NodePolicy, NodeRefusal
from promptfcl.common.config import ConfigError
from promptfcl.common.errors import DataError
from promptfcl.common.files import class_folder
from tests.conftest import tiny_config
from tests.helpers import client_app, run_in_process


# ----------------------------------------------------------------------------- the node-facing listener
def asgi_call(app, path: str, method: str = "POST") -> tuple[int, bytes, bool]:
    """(status, body, whether the wrapped app was called) for one HTTP request to ``app``."""
    called, sent = [], []

    async def inner(scope, receive, send):
        called.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"flower"})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "client": ("10.0.0.7", 5555),
             "headers": [], "query_string": b""}
    asyncio.run(app(inner)(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, bool(called)


def test_node_facing_listener_passes_fleet_calls_and_refuses_everything_else():
    from deploy.superlink import FleetOnly

    for path in ("/v1/fleet/pull-messages", "/v1/fleet/push-object", "/v1/fleet/activate-node", "/health"):
        assert asgi_call(FleetOnly, path) == (200, b"flower", True), path
    for path in ("/v1/control/list-runs", "/v1/control/start-run", "/v1/control/stop-run", "/v1/runtime/get-nodes",
                 "/v1/fleet/../control/list-runs", "/v1/fleet//pull-messages", "/v1/fleet/", "/docs",
                 "/openapi.json", "/", "/v1/fleet/pull-messages/x", "/healthz"):
        status, body, called = asgi_call(FleetOnly, path)
        assert status == 403 and not called and b"only the Fleet API" in body, path


# ----------------------------------------------------------------------------- class names stay in the folder
def test_class_names_from_the_server_never_leave_the_nodes_data_folder(tmp_path):
    from promptfcl.common.data import read_class_folders

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
    assert node_data(run, {"dataset": "digits"}).cfg.data_dir == ""
    with pytest.raises(NodeDataError, match="data-from-run must be true or false|must be true or false"):
        parse_node_config({"dataset": "digits", "data-from-run": "yes"})


def message(cfg, **config) -> Message:
    """A train message of ``cfg``'s first round for client 0, with the initial prompts and head."""
    from promptfcl.common.model import CodaPrompt, initial_trainable_state
    from promptfcl.common.records import to_array_record

    return Message(content=RecordDict({
        "arrays": to_array_record(initial_trainable_state(cfg, CodaPrompt)),
        "config": ConfigRecord({"task": 0, "round": 0, "client-id": 0, "config-digest": cfg.digest(), **config})}),
        dst_node_id=1, message_type=MessageType.TRAIN)


def test_a_node_refuses_runs_beyond_its_own_limits(flower_identity):
    from promptfcl.client.app import client_runtime

    cfg = tiny_config(population="nodes", **{"num-clients": 3, "clients-per-round": 3})
    ctx = Context(run_id=1, node_id=1, node_config={"dataset": "digits", "max-image-size": 8}, state=RecordDict(),
                  run_config=cfg.to_dict())
    with pytest.raises(NodeRefusal, match="image-size = 16 exceeds this node's limit max-image-size = 8"):
        client_runtime(cfg, ctx, ConfigRecord({}))
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
        client_runtime(virtual, ctx, ConfigRecord({}))


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


def test_fault_injection_obeys_the_node_not_the_run(tmp_path, flower_identity):
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
    with pytest.raises(InjectedFault):
        deployed(message(cfg), ctx)


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
    assert (cfg.ray_address, cfg.device, cfg.threads, cfg.client_cpus, cfg.client_gpus) == ("", "auto", 0, "auto", "auto")
    assert any("ray-address = ''" in m and "203.0.113.9:6379" in m for m in caplog.messages)
    cfg = _resume_config(str(tmp_path), ["ray-address=auto", "threads=2"])
    assert cfg.ray_address == "auto" and cfg.threads == 2


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
@pytest.mark.parametrize("strategy", ["fedavg", "fppl", "hgp", "hepco", "fedcprompt", "powder"])
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
        assert max(shares) == pytest.approx(cfg.max_client_weight)  # the greedy node, capped
        placed = [p["node"] for p in record["placement"]]
        assert shares[placed.index(str(greedy))] == pytest.approx(0.5), (placed, shares)


# ----------------------------------------------------------------------------- the app's run config
def test_simulated_app_dir_declares_every_key_it_sets(tmp_path):
    """What `promptfcl simulate` writes for Flower passes Flower's own fusion unchanged."""
    from promptfcl.common.flower_internals import internal

    get_fused_config_from_dir = internal("fused_run_config")

    from promptfcl.server.simulation import write_app_dir

    cfg = tiny_config(strategy="hgp", **{"hgp.cov-type": "diag", "dp.clip": 1.0})
    app = write_app_dir(cfg, tmp_path / "app")
    assert get_fused_config_from_dir(app, {}) == cfg.to_dict()
    assert cfg.to_dict()["hgp.cov-type"] == "diag"
