"""Deployment across machines, tried on loopback with real processes (deploy/README.md).

The federation of tests/deployment.py (TLS, SuperNode authentication, three SuperNodes with image
folders of their own and a hostile one, a recording TLS proxy that sees every byte) runs its tiny
FedAvg run; then: what crossed the wire, a node speaking as the server, an unregistered key, a
node without the CA, a crashed node rejoining, the node-facing gate under floods, and the server
killed mid-run resuming to the same results. The methods' deployed runs: test_deploy_methods.py;
the pieces underneath, in process: test_deploy_pieces.py.

Marked ``deploy`` (minutes on 2 cores): ``make test PYTEST_ARGS='-m "not deploy"'`` leaves them
out. They use free ports, their own FLWR_HOME and cache directories, and stop every process they
started (and its descendants) even when a test fails.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from promptfcl.common.config.experiment import ExperimentConfig
from promptfcl.common.node.startup import PHASES, metric_name
from promptfcl.server.loopback import (
    DEPLOY,
    VENV_BIN,
    free_port,
    run_script,
    script_env,
    start_node,
    start_superlink,
    toml_file,
)
from tests.deployment import (
    HOSTILE,
    NUM_HONEST,
    NUM_NODES,
    RUN,
    Deployment,
    PeakRss,
    federation,
    hostile_node_id,
    kill_hard,
    node_headers,
    node_id_of,
    seen_test_images,
    train_messages_received,
    upload,
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Deployment:
    yield from federation(tmp_path_factory)


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
