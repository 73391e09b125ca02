"""Deployment across machines, tried on loopback with real processes (deploy/README.md).

A SuperLink with TLS (an openssl CA and server certificate) and SuperNode authentication,
three SuperNodes each with its own image folder, started and driven by the deploy/
scripts exactly as the README says; a recording TLS proxy (tests/wiretap.py) between the
nodes and the SuperLink sees every byte of every message. Also: the server side killed
mid-run and restarted resumes the run to the same results, an unregistered node key
is refused, a node without the CA cannot connect, a node with missing or foreign data
refuses to start, and the pieces underneath (node data, the on-disk query cache,
federated evaluation, node sampling) are checked in-process.

The end-to-end tests are marked ``deploy`` (about 5 minutes on 2 cores):
``make test PYTEST_ARGS='-m "not deploy"'`` leaves them out. They use free ports, their own
FLWR_HOME and cache directories, and stop every process they started (and its
descendants) even when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from promptfcl.client.node_data import NodeDataError, export_digits, node_data, parse_node_config
from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.common.data.tasks import class_order
from promptfcl.common.node.startup import PHASES, metric_name
from promptfcl.server.loopback import (
    DEPLOY,
    ROOT,
    VENV_BIN,
    Ports,
    Processes,
    descendants,
    free_port,
    make_credentials,
    register_node,
    run_script,
    script_env,
    start_node,
    start_superlink,
    submit,
    toml_file,
    wait_for_node,
)
from tests.conftest import TINY, tiny_config
from tests.helpers import PushPullGrid

NUM_HONEST = 3  # nodes with a share of the digits each
NUM_NODES = NUM_HONEST + 1  # and one hostile node (tests/hostile_app.py): inflated counts, bounded by the server
HOSTILE = NUM_NODES  # node<HOSTILE> is the hostile one

# The tiny two-task run the deployed federation executes (deploy/run.toml's keys, tiny sizes).
RUN = {
    **{k: v for k, v in TINY.items() if k not in ("num-clients", "clients-per-round")},
    "population": "nodes", "evaluation": "federated", "num-classes": 10,
    "class-names": ",".join(str(d) for d in range(10)), "num-clients": NUM_NODES, "clients-per-round": NUM_NODES,
    # one task of two rounds: round 1 is evaluated with round 2's training (evaluate-with-train),
    # round 2 by evaluate messages; several tasks over the wire: test_random_tasks_run_on_deployed_nodes
    "num-tasks": 1, "rounds-per-task": 2, "out-dir": "runs/deployed", "round-timeout": 600.0,
}


# ----------------------------------------------------------------------------- the deployed federation
@dataclass
class Deployment:
    root: Path
    ports: Ports  # the SuperLink's: node-facing (Fleet API only) and control (the operator's)
    tap_port: int
    results: dict
    submit_output: str
    exchanges: list
    started: float
    finished: float
    processes: Processes
    superlink: subprocess.Popen  # the SuperLink now serving ``port`` ...
    superlink_log: Path  # ... and its log
    forged: dict  # finding 1 of issue 54, pushed during the run with the hostile node's key: name -> (status, answer)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Deployment:
    import shutil

    from tests.wiretap import WireTap

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the TLS certificates (deploy/make-certs.sh)")

    root = tmp_path_factory.mktemp("deploy")
    env = script_env(FLWR_HOME=str(root / "cli-home"))
    # Each node's data directory: a disjoint share of the digits as PNG folders.
    export_digits(root / "data", NUM_HONEST)
    app = hostile_app_dir(root / "app")
    make_credentials(root, env, [f"node{i}" for i in range(1, NUM_NODES + 1)] + ["stranger"])
    run_toml = toml_file(root / "run.toml", RUN)

    procs = Processes()
    tap = None
    try:
        ports = Ports.free()
        link = start_superlink(root, procs, env, ports)
        for i in range(1, NUM_NODES + 1):
            register_node(root, env, ports.control, f"node{i}")

        # Every node talks to the SuperLink's node-facing address through the recording proxy.
        tap = WireTap(("127.0.0.1", ports.fleet), str(root / "certs/server.pem"), str(root / "certs/server.key"),
                      str(root / "certs/ca.crt"))
        tap_port = tap.start()
        nodes = []
        for i in range(1, NUM_NODES + 1):
            node_env = script_env(PROMPTFCL_CACHE=str(root / f"cache{i}"),
                                  PROMPTFCL_TEST_HOSTILE="1" if i == HOSTILE else "0")
            data = f"data/node{i - 1}" if i != HOSTILE else "data/node0"  # a copy of someone's data
            extra = ["--threads", "1"] + (["--device", "cpu"] if i == 1 else [])  # the others: device auto
            nodes.append(start_node(root, procs, node_env, f"127.0.0.1:{tap_port}", f"node{i}", data, run_toml,
                                    extra, wait=False))
        for i, node in enumerate(nodes, start=1):
            wait_for_node(root, f"node{i}", node)

        forged: dict = {}
        forger = forge_during_the_run(root, ports.fleet, forged)
        started = time.time()
        submitted = submit(root, env, ports.control, run_toml, app)
        finished = time.time()
        forger.join(timeout=60)
        procs.remember_descendants()
        output = submitted.stdout + submitted.stderr
        superlink_log = (root / "superlink.log").read_text(errors="replace")
        assert submitted.returncode == 0, f"{output[-4000:]}\n--- superlink.log (tail) ---\n{superlink_log[-6000:]}"
        results_path = root / "server" / RUN["out-dir"] / "results.json"
        assert results_path.is_file(), f"no results.json; submit output:\n{output[-4000:]}"
        yield Deployment(root, ports, tap_port, json.loads(results_path.read_text()), output, list(tap.exchanges),
                         started, finished, procs, link, root / "superlink.log", forged)
    finally:
        if tap is not None:
            tap.stop()
        procs.stop_all()


def node_id_of(root: Path, name: str) -> int:
    """The Flower node id a SuperNode started as ``name`` was given (its log says)."""
    import re

    return int(re.search(r"SuperNode ID:? *(\d+)", (root / f"{name}.log").read_text(errors="replace")).group(1))


def post(port: int, cafile: Path, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """One HTTPS POST of ``body`` to 127.0.0.1:``port``; (status, answer)."""
    import http.client
    import ssl

    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ssl.create_default_context(cafile=str(cafile)),
                                       timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/protobuf", **headers})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def forge_during_the_run(root: Path, fleet: int, out: dict) -> threading.Thread:
    """Finding 1 of issue 54, replayed with the hostile node's own key and signed headers while the
    run is running (once its SuperNode has its first train message): a train message "from the
    server" (src = the SuperLink, no reply_to) to node1, and an error message "from the server" to
    the ServerApp (dst = the SuperLink). ``out``: name -> (status, answer), or "error"."""
    import re

    from promptfcl.common.flower_internals import internal
    from tests.test_fleet_gate import push_body

    def forge() -> None:
        log, deadline = root / f"node{HOSTILE}.log", time.time() + 1200
        while "Receiving: train message" not in log.read_text(errors="replace"):
            if time.time() > deadline:
                out["error"] = "the hostile node never received a train message"
                return
            time.sleep(0.2)
        run_id = int(re.search(r"\[RUN (\d+)", log.read_text(errors="replace")).group(1))
        own, victim, superlink = node_id_of(root, f"node{HOSTILE}"), node_id_of(root, "node1"), \
            internal("superlink_node_id")
        messages = {"a train message from the server to node1": push_body(own, superlink, victim, run_id),
                    "an error to the ServerApp": push_body(own, superlink, superlink, run_id,
                                                           error=f"forged by node{HOSTILE}")}
        for name, body in messages.items():
            out[name] = post(fleet, root / "certs" / "ca.crt", "/v1/fleet/push-messages", body,
                             node_headers(root / "keys" / f"node{HOSTILE}"))

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    return thread


def hostile_app_dir(out: Path) -> Path:
    """This app with tests/hostile_app.py as its ClientApp (every node runs it; only the node whose
    environment says so misbehaves). The app's code is the installed ``promptfcl`` on every machine;
    the bundle carries the configuration and the test's own ClientApp."""
    import shutil

    (out / "tests").mkdir(parents=True)
    for name in ("__init__.py", "helpers.py", "hostile_app.py"):
        if (ROOT / "tests" / name).exists():
            shutil.copy(ROOT / "tests" / name, out / "tests" / name)
    text = (ROOT / "pyproject.toml").read_text()
    (out / "pyproject.toml").write_text(text.replace('clientapp = "promptfcl.client.app:app"', 'clientapp = "tests.hostile_app:app"'))
    return out


def seen_test_images(data_root: Path, task: int, seed: int = 0) -> int:
    """Held-out images of the classes seen up to ``task`` across the honest nodes' folders."""
    per_task = 10 // RUN["num-tasks"]
    seen = class_order(10, seed)[: (task + 1) * per_task]  # original digits of remapped classes seen so far
    return sum(len(list((data_root / f"node{i}" / "test" / str(d)).glob("*.png")))
               for i in range(NUM_HONEST) for d in seen)


@pytest.mark.deploy
def test_deployed_run_completes_and_evaluates_on_the_nodes_held_out_data(deployment):
    r = deployment.results
    acc = r["accuracy_matrix"]
    assert len(acc) == 1 and acc[0][0] is not None
    assert all(0.0 <= v <= 100.0 for row in acc for v in row if v is not None)
    assert [x["server_round"] for x in r["rounds"]] == [1, 2]
    # evaluate-with-train: round 1's counts came with round 2's train replies (the hostile node's
    # forged ones left out), round 2, the task's end, by evaluate messages
    assert [x["eval_carried"] for x in r["rounds"]] == [NUM_HONEST, 0]
    hostile = hostile_node_id(deployment)
    for rnd in r["rounds"]:
        # the hostile node's claim of 10^12 samples exceeds what it declared: excluded, under its own id
        assert rnd["clients_sampled"] == NUM_NODES and rnd["clients_aggregated"] == NUM_HONEST
        assert [(x["node"], "exceeds the node's declared train-size" in x["reason"]) for x in rnd["rejected"]] \
            == [(hostile, True)]
        # federated evaluation: every honest node answered; the counts cover exactly their held-out
        # images of the classes seen so far (the server itself holds no data); the hostile node's
        # inflated counts (10^9 correct of 10^9) are left out
        assert rnd["eval_nodes"] == NUM_HONEST
        assert [(x["node"], "declared test-size" in x["reason"]) for x in rnd["eval_failed"]] == [(hostile, True)]
        assert rnd["eval_test_size"] == seen_test_images(deployment.root / "data", rnd["task"])
        assert rnd["client_process_seconds_max"] > 0  # a fresh ClientApp process per message
        # deployed placement: each accepted node reports its own Flower node id, the id the server sent to
        placed = [p for p in rnd["placement"] if p["node"] is not None]
        assert len({p["node"] for p in placed}) == NUM_HONEST and len(rnd["placement"]) == NUM_NODES
        assert all(int(p["node"]) & ((1 << 62) - 1) == p["client"] for p in placed)
        assert {p["device"] for p in placed} == {"cpu"}
    assert all(v < 100.0 for row in acc for v in row if v is not None)  # not the hostile node's 100 %
    assert r["dataset"]["train_size"] is None and "held by the nodes" in r["backbone"]
    assert r["config"]["population"] == "nodes" and r["config"]["evaluation"] == "federated"
    # the ServerApp's log reached the submitter (flwr run --stream)
    assert "results written to" in deployment.submit_output


@pytest.mark.deploy
def test_a_node_cannot_speak_as_the_server(deployment):
    """Finding 1 of issue 54 with a registered node's real key, during the run: a train message
    "from the server" to another node and an error "from the server" to the ServerApp are both
    refused at the gate (403, logged under the node's registered name, counted); node1 ran only
    the server's messages, and results.json is what the run gives without them (the first test's
    exact records: no node 1, only the hostile node's own rejected replies)."""
    from tests.wiretap import wire_messages

    forged = deployment.forged
    assert "error" not in forged, forged
    status, answer = forged["a train message from the server to node1"]
    assert status == 403 and b"sender is the SuperLink, not itself (to node " in answer, (status, answer)
    status, answer = forged["an error to the ServerApp"]
    assert status == 403 and b"sender is the SuperLink, not itself (to the SuperLink)" in answer, (status, answer)
    hostile, log = hostile_node_id(deployment), deployment.superlink_log.read_text(errors="replace")
    refused = [line for line in log.splitlines()
               if "refused POST /v1/fleet/push-messages" in line and "sender is the SuperLink" in line]
    assert len(refused) == 2 and all(f"of node {hostile} (node{HOSTILE}))" in line for line in refused), refused
    assert f"refusal 2 of node {hostile} (node{HOSTILE})" in refused[1]
    # node1 pulled and ran the server's messages only: one train message per round (the wire holds
    # every node's), and its log counts as many
    rounds = len(deployment.results["rounds"])
    assert [kind for direction, kind, _ in wire_messages(deployment.exchanges)
            if direction == "s2c"].count("train") == rounds * NUM_NODES
    assert "Receiving: train message" in (deployment.root / "node1.log").read_text(errors="replace")
    for record in deployment.results["rounds"]:
        assert {x["node"] for x in record["rejected"] + record["eval_failed"]} == {hostile}
    assert "forged" not in json.dumps(deployment.results)


def hostile_node_id(deployment: Deployment) -> int:
    """The Flower node id of the hostile SuperNode (its log names it)."""
    import re

    text = (deployment.root / f"node{HOSTILE}.log").read_text(errors="replace")
    return int(re.search(r"SuperNode ID:? *(\d+)", text).group(1))


COUNTS = {"correct", "total", "num-examples", "train-size", "test-size"}
STARTUP = {"process-seconds", *(metric_name(p) for p in PHASES)}


@pytest.mark.deploy
def test_only_prompts_heads_and_statistics_cross_the_wire(deployment):
    """Decode every message the nodes received and sent; fail on any backbone tensor or raw input."""
    import torch

    from promptfcl.common.model.prompted import CodaPrompt, build_backbone, initial_trainable_state
    from promptfcl.common.model.runtime import backbone_of, model_spec
    from promptfcl.common.records import to_array_record
    from tests.wiretap import fab_files, wire_messages, wire_objects

    cfg = ExperimentConfig.from_dict(RUN)
    trainable = to_array_record(initial_trainable_state(model_spec(cfg, cfg.data.num_classes), CodaPrompt))
    shapes = {name: tuple(trainable[name].shape) for name in trainable.keys()}
    backbone, _ = build_backbone(backbone_of(cfg))
    backbone_bytes = {np.ascontiguousarray(t.detach().numpy()).tobytes() for t in backbone.state_dict().values()
                      if t.numel() > 8}
    messages = wire_messages(deployment.exchanges)
    kinds = [(d, t) for d, t, _ in messages]
    rounds = len(deployment.results["rounds"])
    # per round: a train message to every node and a reply from every node; an evaluate message to
    # every node at a task's end only (within a task, the next train messages carry the evaluation)
    for direction in ("s2c", "c2s"):
        assert kinds.count((direction, "train")) == rounds * NUM_NODES
        assert kinds.count((direction, "evaluate")) == RUN["num-tasks"] * NUM_NODES

    for direction, kind, content in messages:
        assert content is not None, f"{direction} {kind} message without content"
        assert set(content.keys()) <= {"arrays", "config", "metrics", "placement", "evaluation"}, sorted(content)
        for name, record in content.array_records.items():
            assert set(record.keys()) <= set(shapes), f"{direction} {kind}: unexpected arrays {set(record) - set(shapes)}"
            for arr_name in record.keys():
                arr = record[arr_name].numpy()
                assert arr.dtype == np.float32, f"{arr_name}: {arr.dtype} (raw images are uint8)"
                assert arr.shape == shapes[arr_name], f"{arr_name}: {arr.shape} != {shapes[arr_name]}"
                assert np.ascontiguousarray(arr).tobytes() not in backbone_bytes, f"{arr_name} is a backbone tensor"
        for record in (*content.config_records.values(), *content.metric_records.values()):
            for key, value in record.items():
                if isinstance(value, (list, bytes, str)):
                    assert len(value) <= 64, f"{direction} {kind}: {key} carries {len(value)} values"
        if direction == "s2c":
            assert set(content["arrays"].keys()) == set(shapes)  # the whole prompt + head, nothing else
        elif kind == "train":  # the update, its metrics, where it was trained (and evaluation counts)
            assert set(content.keys()) - {"evaluation"} == {"arrays", "metrics", "placement"}
            assert set(content["placement"].keys()) == {"node", "device", "config-digest"}
            if "evaluation" in content:
                assert set(content["evaluation"].keys()) == COUNTS
        else:  # evaluation replies: counts only (the node's declared data sizes, its process's start-up)
            assert set(content.keys()) == {"metrics"}
            assert COUNTS <= set(content["metrics"].keys()) <= COUNTS | STARTUP

    # every object on the wire belongs to one of those messages (nothing smuggled beside them)
    from promptfcl.common.flower_internals import internal

    get_object_type_from_object_content = internal("object_type")

    down, up = wire_objects(deployment.exchanges)
    types = {get_object_type_from_object_content(c) for c in (*down.values(), *up.values())}
    assert types <= {"Message", "RecordDict", "ArrayRecord", "Array", "ArrayChunk", "ConfigRecord", "MetricRecord"}
    # the app bundle nodes fetched: code and text only, no weights, no data
    files = fab_files(deployment.exchanges)
    assert "pyproject.toml" in files and "tests/hostile_app.py" in files
    assert all(f.startswith(".info/") or f.endswith((".py", ".toml", ".md", ".yaml", ".yml", ".json", ".jsonl"))
               for f in files), files
    assert max(files.values()) < 200_000
    del torch


@pytest.mark.deploy
def test_bytes_on_the_wire_per_round(deployment, capsys):
    """What crosses the wire per round: message objects match the server's accounting."""
    from tests.wiretap import bytes_by_call, wire_objects

    r = deployment.results
    rounds = len(r["rounds"])
    calls = bytes_by_call(deployment.exchanges)
    down, up = wire_objects(deployment.exchanges)
    wire_down = sum(len(c) for c in down.values())  # distinct objects; a node pulls each one once
    accounted_down = sum(x["bytes_s2c"] + x["eval_bytes_s2c"] for x in r["rounds"])
    accounted_up = sum(x["bytes_c2s"] + x["eval_bytes_c2s"] for x in r["rounds"])
    pulled = calls["pull-object"]["down"]
    pushed = calls["push-object"]["up"]
    # every message content byte the server counted crossed the wire (plus protobuf framing),
    # and nothing much else did: no more than the counted bytes plus 10% framing per object
    assert accounted_down <= pulled <= 1.10 * accounted_down + 20_000
    assert pushed <= 1.10 * accounted_up + 20_000
    assert wire_down <= pulled
    total = sum(c["up"] + c["down"] for c in calls.values())
    import re

    flower_count = re.search(r"SuperLink traffic: (\d+) bytes", deployment.submit_output)
    summary = {
        "superlink_reported_traffic_total": int(flower_count.group(1)) if flower_count else None,
        "rounds": rounds,
        "fleet_bytes_total": total,
        "fleet_bytes_per_round": total / rounds,
        "message_objects_down_per_round": pulled / rounds,
        "message_objects_up_per_round": pushed / rounds,
        "server_accounted_down_per_round": accounted_down / rounds,
        "server_accounted_up_per_round": accounted_up / rounds,
        "by_call": calls,
        "round_seconds": [x["round_seconds"] for x in r["rounds"]],
        "eval_seconds": [x["eval_seconds"] for x in r["rounds"]],
        "client_process_seconds_max": [x["client_process_seconds_max"] for x in r["rounds"]],
        "run_seconds": deployment.finished - deployment.started,
    }
    (deployment.root / "wire.json").write_text(json.dumps(summary, indent=1))
    with capsys.disabled():
        print(f"\nwire summary ({deployment.root / 'wire.json'}): " + json.dumps(
            {k: v for k, v in summary.items() if k != "by_call"}))


@pytest.mark.deploy
def test_unregistered_node_key_is_refused(deployment):
    root = deployment.root
    code, out = deployment.processes.run_to_exit(
        ["bash", str(DEPLOY / "start-client.sh"), "--superlink", f"127.0.0.1:{deployment.ports.fleet}", "--ca",
         "certs/ca.crt", "--key", "keys/stranger", "--data-dir", "data/node0", "--config", "run.toml",
         "--state", "stranger", "--port", str(free_port())],
        root / "stranger.log", script_env(PROMPTFCL_CACHE=str(root / "cache-stranger")), root, timeout=180)
    assert code != 0
    assert "Failed to activate SuperNode" in out and "public key is not registered with the SuperLink" in out, \
        out[-3000:]
    # refused on its headers, before Flower's app read the request
    assert "refused POST /v1/fleet/activate-node from 127.0.0.1" in deployment.superlink_log.read_text()


@pytest.mark.deploy
def test_a_crashed_node_restarted_at_once_rejoins_as_soon_as_its_session_has_ended(deployment, capsys):
    """A node killed hard (no deactivation: its identity stays marked online) is, right after,
    still held by a session that may be live (its last heartbeat is recent), and the SuperLink
    says so, not that its key is unregistered. Restarted at once, it rejoins under its own id
    once its last heartbeat is older than a live SuperNode leaves at its declared 10 s interval
    (10.5 s): the SuperLink ends the old session itself, before Flower's patience (2 intervals)
    would, unless the restart took that long anyway."""
    import re

    import deploy.supernode as launcher

    root, procs = deployment.root, deployment.processes
    log = root / "node2.log"
    node_id = node_id_of(root, "node2")
    node = next(p for p in procs.procs if p.poll() is None and "keys/node2" in p.args)
    kill_hard(node)
    killed = time.time()
    said = launcher.rejoin_refusal(f"127.0.0.1:{deployment.ports.fleet}", str(root / "keys" / "node2"),
                                   str(root / "certs" / "ca.crt"), False)
    assert said is not None and said.startswith(f"node {node_id} (node2) is still marked online: its last heartbeat"), said
    assert "a copy of its key" in said and "not registered" not in said
    start_node(root, procs, script_env(PROMPTFCL_CACHE=str(root / "cache2"), PROMPTFCL_TEST_HOSTILE="0"),
               f"127.0.0.1:{deployment.tap_port}", "node2", "data/node1", root / "run.toml", ["--threads", "1"])
    back = time.time() - killed
    out = log.read_text(errors="replace")
    assert re.findall(r"SuperNode ID: (\d+)", out)[-1] == str(node_id)  # the same identity, back
    link_log = deployment.superlink_log.read_text(errors="replace")
    ended = re.search(rf"rejoin: node {node_id} \(node2\): last heartbeat (\d+) s ago", link_log)
    # Flower itself marks the identity offline 20 s after its last heartbeat, at least 15.5 s after
    # the kill: a restart back sooner was let in by the SuperLink's own decision
    assert ended is not None or back > 15.5, (back, link_log[-3000:])
    assert f"(node {node_id} (node2) is still marked online: its last heartbeat" in link_log
    with capsys.disabled():
        print(f"\nnode2 killed and restarted: back under its id {back:.1f} s after the kill"
              + (f" (the SuperLink ended its session {ended.group(1)} s after its last heartbeat)" if ended else ""))


@pytest.mark.deploy
def test_node_without_the_ca_certificate_cannot_connect(deployment):
    root = deployment.root
    # the script refuses outright ...
    done = run_script("start-client.sh", "--superlink", f"127.0.0.1:{deployment.ports.fleet}", "--key", "keys/node1",
                      "--data-dir", "data/node0", env=script_env(), cwd=root)
    assert done.returncode != 0 and "--ca" in done.stderr
    # ... and a SuperNode started by hand without --root-certificates fails the TLS handshake
    code, out = deployment.processes.run_to_exit(
        [str(VENV_BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{deployment.ports.fleet}",
         "--auth-supernode-private-key", "keys/node1", "--port", str(free_port()),
         "--node-config", f'data-dir="{root / "data/node0"}"'],
        root / "noca.log", script_env(FLWR_HOME=str(root / "noca-home")), root, timeout=180)
    assert code != 0
    assert "CERTIFICATE_VERIFY_FAILED" in out, out[-3000:]


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


@pytest.mark.deploy
def test_superlink_keeps_idle_connections_longer_than_its_clients(deployment):
    """Idle past httpx's 5 s keep-alive expiry, a connection to the SuperLink still serves requests.

    With uvicorn's default (5 s, equal to the clients' expiry) a client could reuse a connection
    as the server closed it and die on an SSL EOF (deploy/superlink.py).
    """
    import http.client
    import ssl

    import httpx

    assert httpx.Limits().keepalive_expiry == 5.0  # the clients' expiry this guards against
    context = ssl.create_default_context(cafile=str(deployment.root / "certs" / "ca.crt"))
    conns = [http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
             for port in (deployment.ports.fleet, deployment.ports.control)]  # both listeners
    try:
        for pause in (0.0, 6.5):
            time.sleep(pause)
            for conn in conns:
                conn.request("GET", "/health")  # a reply at all means the connection stayed open
                reply = conn.getresponse()
                reply.read()
                assert reply.status == 200, reply.status
                assert not reply.will_close
    finally:
        for conn in conns:
            conn.close()


@pytest.mark.deploy
def test_node_facing_address_serves_the_fleet_api_only(deployment):
    """What a node machine reaches (the node-facing address) cannot drive the SuperLink: an anonymous
    Control API call is refused there and answered on the operator's (loopback) address; registering
    a key through it fails; the nodes still registered, ran and completed over it (the fixture)."""
    import http.client
    import ssl

    context = ssl.create_default_context(cafile=str(deployment.root / "certs" / "ca.crt"))

    def call(port: int, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
        try:
            conn.request("POST", path, body=b"", headers={"content-type": "application/protobuf"})
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    for path in ("/v1/control/list-runs", "/v1/control/list-runs?x=/v1/fleet/get-run",
                 "/v1/fleet/../control/list-runs", "/v1/runtime/get-nodes", "/docs"):
        status, body = call(deployment.ports.fleet, path)
        assert status == 403 and b"only the Fleet API" in body, (path, status, body[:200])
    assert call(deployment.ports.control, "/v1/control/list-runs")[0] == 200  # the operator's address answers
    log = deployment.superlink_log.read_text(errors="replace")
    assert "node-facing address: refused POST /v1/control/list-runs from 127.0.0.1" in log
    # a node machine that tries to register another key through the node-facing address fails
    done = run_script("register-node.sh", "--superlink", f"127.0.0.1:{deployment.ports.fleet}", "--ca", "certs/ca.crt",
                      "--name", "intruder", "keys/stranger.pub",
                      env=script_env(FLWR_HOME=str(deployment.root / "intruder-home")), cwd=deployment.root)
    assert done.returncode != 0 and "registered successfully" not in done.stdout
    # the nodes themselves came in over the node-facing address (through the tap) and trained
    assert deployment.results["rounds"][-1]["clients_aggregated"] == NUM_HONEST


def node_headers(private_key_file: Path) -> dict[str, str]:
    """The node-authentication headers a SuperNode holding ``private_key_file`` sends (a signed
    fresh timestamp), made as flwr's NodeAuthHttpInterceptor makes them."""
    import base64
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = serialization.load_ssh_private_key(private_key_file.read_bytes(), password=None)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    stamp = datetime.datetime.now(datetime.UTC).isoformat()
    return {"flwr-public-key": base64.b64encode(public).decode(), "flwr-timestamp": stamp,
            "flwr-signature": base64.b64encode(key.sign(stamp.encode(), ec.ECDSA(hashes.SHA256()))).decode()}


def upload(port: int, cafile: Path, path: str, size: int, headers: dict[str, str], chunked: bool = False,
           body: bytes | None = None) -> int:
    """POST ``size`` bytes (zeros, or ``body``) to ``path`` on 127.0.0.1:``port`` (TLS) in 1 MiB
    chunks until the server stops reading; the status it answered (0: none readable, the
    connection was cut)."""
    import socket
    import ssl

    zeros = b"\0" * (1 << 20)
    total = size if body is None else len(body)
    context = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(("127.0.0.1", port), timeout=60) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
        length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
        head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/protobuf", length,
                *(f"{k}: {v}" for k, v in headers.items())]
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            for start in range(0, total, 1 << 20):  # bounded: the whole body at most
                chunk = zeros[:total - start] if body is None else body[start:start + (1 << 20)]
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
        except OSError:  # the server answered and closed without reading the rest
            pass
        try:
            reply = conn.recv(4096)
        except OSError:
            return 0
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


class PeakRss:
    """A process's resident MB now (``idle``) and, while the block runs, its highest (``peak``),
    sampled every 20 ms from /proc (the SuperLink's memory under hostile uploads)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.done = pid, threading.Event()
        self.idle = self.peak = self.now()
        self.sampler = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> float:
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024

    def _sample(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.02)

    def __enter__(self) -> PeakRss:
        self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.sampler.join()


@pytest.mark.deploy
def test_node_facing_address_reads_no_body_before_it_knows_the_node(deployment):
    """Anonymous and oversized uploads cost the SuperLink nothing: 8 concurrent anonymous 50 MB
    bodies (4 declaring their length, 4 chunked), 2 from a well-signed but unregistered key, and 2
    oversized bodies from a registered node's key to a small call, all at once. Its memory stays
    within 100 MB of idle, each is refused (401 unread, or 413 at the limit), and it still serves
    the nodes, which ran the fixture's deployment through the same checks."""
    import http.client
    import ssl
    from concurrent.futures import ThreadPoolExecutor

    root, fleet = deployment.root, deployment.ports.fleet
    cafile = root / "certs" / "ca.crt"
    size = 50 * (1 << 20)
    calls = [("/v1/fleet/push-object", {}, i % 2 == 1) for i in range(8)]  # anonymous
    calls += [("/v1/fleet/push-object", node_headers(root / "keys" / "stranger"), False)] * 2  # unregistered
    calls += [("/v1/fleet/send-node-heartbeat", node_headers(root / "keys" / "node1"), chunked)
              for chunked in (False, True)]  # registered, but far beyond a heartbeat's size
    # start-server.sh execs the SuperLink
    with PeakRss(deployment.superlink.pid) as rss, ThreadPoolExecutor(len(calls)) as pool:
        statuses = list(pool.map(lambda c: upload(fleet, cafile, c[0], size, c[1], c[2]), calls))
    assert rss.peak - rss.idle < 100, f"SuperLink RSS {rss.idle:.0f} MB idle, {rss.peak:.0f} MB under the uploads"
    assert all(status in (0, 401) for status in statuses[:10]), statuses
    assert statuses[10:] == [413, 413], statuses
    log = deployment.superlink_log.read_text(errors="replace")
    assert log.count("refused POST /v1/fleet/push-object from 127.0.0.1") >= 10
    assert log.count("(no node-authentication headers)") >= 8
    assert "(a public key that is not registered)" in log
    assert "(declared body of 52428800 bytes, above its limit 262144)" in log
    assert "(body streamed past its limit of 262144 bytes)" in log
    # it still serves: the health probe, and (the fixture) a whole run of authenticated nodes
    conn = http.client.HTTPSConnection("127.0.0.1", fleet, context=ssl.create_default_context(cafile=str(cafile)),
                                       timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    assert deployment.results["rounds"][-1]["clients_aggregated"] == NUM_HONEST


@pytest.mark.deploy
def test_one_node_cannot_make_the_superlink_hold_more_than_its_share(deployment, capsys):
    """A registered node's one signed header set replayed for 8 concurrent 50 MB object pushes (a
    well-formed push naming its own node): 2 at a time are read (a SuperNode's own concurrency),
    the others refused unread (503, Retry-After), and the SuperLink stays within 300 MB of idle
    and returns to it; 8 such bodies to the control address are refused there unread (403, the
    Fleet API is not served on it)."""
    from concurrent.futures import ThreadPoolExecutor

    from promptfcl.common.flower_internals import internal

    root = deployment.root
    cafile = root / "certs" / "ca.crt"

    request = internal("push_object_request")()
    request.node.node_id = hostile_node_id(deployment)
    request.run_id, request.session_id, request.object_id = 1, "s", "ab" * 32
    request.object_content = b"\0" * (50 << 20)
    body = request.SerializeToString()
    headers = node_headers(root / "keys" / f"node{HOSTILE}")  # one signed timestamp, replayed 8 times
    before = deployment.superlink_log.read_text(errors="replace")
    with PeakRss(deployment.superlink.pid) as rss:
        with ThreadPoolExecutor(8) as pool:
            fleet = list(pool.map(lambda _: upload(deployment.ports.fleet, cafile, "/v1/fleet/push-object", 0,
                                                   headers, body=body), range(8)))
        with ThreadPoolExecutor(8) as pool:
            control = list(pool.map(lambda _: upload(deployment.ports.control, cafile, "/v1/fleet/push-object", 0,
                                                     headers, body=body), range(8)))
    after = []
    for _ in range(20):  # the SuperLink goes on serving its nodes meanwhile
        time.sleep(0.5)
        after.append(rss.now())
    with capsys.disabled():
        print(f"\nSuperLink RSS: idle {rss.idle:.0f} MB, {rss.peak:.0f} MB under one node's 8 x 50 MB pushes, "
              f"{min(after):.0f} MB after; statuses {fleet} (node-facing), {control} (control)")
    assert rss.peak - rss.idle < 300, (rss.idle, rss.peak)
    assert min(after) - rss.idle < 60, (rss.idle, after)
    # each refused one is answered 503 (0: the answer was lost as the SuperLink closed the
    # connection on the unread body); Flower refuses the ones it read (no such push session)
    assert sum(status in (0, 503) for status in fleet) >= 4 and 200 not in fleet, fleet
    assert set(control) <= {0, 403} and control.count(403) >= 4, control
    log = deployment.superlink_log.read_text(errors="replace")[len(before):]
    busy = [line for line in log.splitlines() if "object pushes of this node in flight already, its limit" in line]
    assert len(busy) >= 4 and all(f"of node {hostile_node_id(deployment)} (node{HOSTILE}))" in line for line in busy)
    assert log.count("control address: refused POST /v1/fleet/push-object from 127.0.0.1") == 8


# ----------------------------------------------------------------------------- the server machine dies mid-run
def kill_hard(proc: subprocess.Popen) -> list[str]:
    """SIGKILL ``proc``, its process group and every descendant at once, as a dying machine would;
    return their command lines. Descendants are listed first: once their parent dies, nothing
    links them to it (SuperExec and ServerApp run in sessions of their own)."""
    pids = [proc.pid, *descendants(proc.pid)]
    commands = []
    for pid in pids:
        try:
            commands.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    return commands


def train_messages_received(root: Path) -> list[int]:
    """Per node, the training messages its SuperNode has pulled so far (its log)."""
    return [(root / f"node{i}.log").read_text(errors="replace").count("Receiving: train message")
            for i in range(1, NUM_NODES + 1)]


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


@pytest.mark.deploy
def test_server_killed_mid_run_resumes_to_the_same_accuracy_matrix(deployment):
    """The server machine dies mid-run and the run is resumed: no round lost, none applied twice,
    and exactly the accuracy matrix of the uninterrupted run.

    The run is the fixture's (1 task x 2 rounds) with another out-dir, which is result-neutral:
    the fixture's run is the uninterrupted reference, same nodes and so the same client ids.
    SuperLink, SuperExec and ServerApp are SIGKILLed while the nodes hold round 2's training
    messages (round 1 checkpointed with its evaluation still to come with round 2's training;
    the nodes' replies to the dead run are never aggregated). A SuperLink restarted on the same state directory and port gets the
    still-running SuperNodes back by itself (they retry every failed call and heartbeat, keep
    their node ids, and state.db keeps their registration), and the run submitted again with
    resume = true does round 2 only, after waiting for all its nodes as any first round does.
    Runs last: it leaves the restarted SuperLink serving ``deployment.ports`` (stopped with the
    fixture's processes).
    """
    from promptfcl.server import checkpoint

    root, procs = deployment.root, deployment.processes
    env = script_env(FLWR_HOME=str(root / "cli-home"), TMPDIR=str(root))  # the killed submitter leaves its temp dir
    out = root / "server" / "runs" / "killed"
    toml_file(root / "killed.toml", {**RUN, "out-dir": "runs/killed"})
    submit_args = ["bash", str(DEPLOY / "submit-run.sh"), "--superlink", f"127.0.0.1:{deployment.ports.control}",
                   "--ca", "certs/ca.crt", "--config", "killed.toml", "--app", str(root / "app")]

    before = train_messages_received(root)
    submitter = procs.start(submit_args, root / "submit-killed.log", env, cwd=root)
    deadline = time.time() + 900
    while any(n < b + 2 for n, b in zip(train_messages_received(root), before)):  # round 2 reached every node
        assert submitter.poll() is None and time.time() < deadline, \
            f"the run ended or stalled before it could be killed:\n{(root / 'submit-killed.log').read_text()[-3000:]}"
        time.sleep(0.5)
    killed = kill_hard(deployment.superlink) + kill_hard(submitter)
    assert any("flwr-serverapp" in c for c in killed), killed
    saved = checkpoint.load(out)
    assert saved is not None and saved.server_round == 1 and not saved.task_finished
    assert saved.rounds[0]["eval_pending"] and saved.rounds[0]["accuracy"] is None
    assert not (out / "results.json").exists()

    deployment.superlink_log = root / "superlink-restarted.log"
    deployment.superlink = start_superlink(root, procs, env, deployment.ports, log=deployment.superlink_log.name)
    code, output = procs.run_to_exit([*submit_args, "--set", "resume=true"], root / "submit-resumed.log", env, root,
                                     timeout=900)
    assert code == 0, (f"{output[-4000:]}\n--- superlink-restarted.log (tail) ---\n"
                       f"{deployment.superlink_log.read_text(errors='replace')[-6000:]}")
    assert "resuming after task 1 round 1 (server round 1)" in output
    results = json.loads((out / "results.json").read_text())
    assert [r["server_round"] for r in results["rounds"]] == [1, 2]
    # round 1 once; round 2 for the killed run and again for the resumed one (which carries
    # round 1's evaluation)
    assert train_messages_received(root) == [b + 3 for b in before]
    assert results["rounds"][0]["eval_carried"] == NUM_HONEST
    assert results["accuracy_matrix"] == deployment.results["accuracy_matrix"]
    assert [r["task_accuracies"] for r in results["rounds"]] == \
        [r["task_accuracies"] for r in deployment.results["rounds"]]
    assert not (out / checkpoint.FILENAME).exists()


NEWER_METHOD_ROUNDS = {"lorm": 2, "pilora": 1, "c2prompt": 2, "lorm-task-end-pass": 2}
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
    # for PILoRA (every round of a task carries the same records)
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
