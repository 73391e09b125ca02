"""One memory estimate for a run, whole: counted against what is really allocated, and checked
by every entry point before anything is built (strategies/platform/run_memory.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, RecordDict

from promptfcl.client.node_policy import NodePolicy, NodeRefusal
from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.common.model.prompted import initial_trainable_state
from promptfcl.common.model.runtime import model_spec
from promptfcl.common.node.footprint import MemoryEstimate, machine_memory_gb, memory_problem
from promptfcl.common.node.memory_plan import process_memory_mb, processes_line, round_after_mb
from promptfcl.common.records import array_view, array_views, to_array, to_array_record
from promptfcl.strategies.platform import replies
from promptfcl.strategies.platform.replies import Update, combine, median_cosines, update_norm
from promptfcl.strategies.platform.run_checks import load_config
from promptfcl.strategies.platform.run_memory import (
    method_memory,
    node_memory,
    run_sizes,
    server_memory,
    trainable_bytes,
)
from promptfcl.strategies.registry import methods, prompt_class
from tests.conftest import tiny_config

#: CODA-P at a moderate size: pool 60 x 16 tokens at width 64 over blocks 0-2
MODERATE = {"embed-dim": 64, "depth": 3, "num-heads": 2, "prompt-layers": "0,1,2", "pool-size": 60,
            "prompt-length": 16, "num-tasks": 3, "num-classes": 12}
HUGE_POOL = {"pool-size": 4095, "prompt-length": 1024}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---------------------------------------------------------------------------- the estimate, counted
@pytest.mark.parametrize("strategy", sorted(methods()))
def test_the_trainable_state_is_counted_as_the_model_allocates_it(strategy):
    cfg = tiny_config(strategy=strategy, **{k.replace("-", "_"): v for k, v in MODERATE.items()})
    built = initial_trainable_state(model_spec(cfg, 12), prompt_class(strategy))  # the real prompt and head
    assert trainable_bytes(cfg, 64, 12) == nbytes(built)
    estimate = node_memory(cfg)
    assert estimate.part_gb("trainable state x4 (parameters, gradients, Adam's moments)") * 1e9 == 4 * nbytes(built)
    # what the reply carries: the Arrays' bytes (an .npy header each beside the values)
    sent = sum(len(a.data) for a in to_array_record(built).values())
    assert nbytes(built) <= estimate.part_gb("messages x2 (received, reply)") * 1e9 / 2 <= sent


def test_the_gradients_and_optimiser_moments_are_what_adam_allocates():
    cfg = tiny_config(**{k.replace("-", "_"): v for k, v in MODERATE.items()})
    params = [torch.nn.Parameter(t.clone()) for t in initial_trainable_state(model_spec(cfg, 12)).values()]
    optimiser = torch.optim.Adam(params)
    sum(p.sum() for p in params).backward()
    optimiser.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    moments = sum(v.numel() * v.element_size() for s in optimiser.state.values() for k, v in s.items() if k != "step")
    trained = trainable_bytes(cfg, 64, 12)
    assert grads + moments == 3 * trained
    assert round_after_mb(trained, trained) * 1e6 == pytest.approx(grads + moments + trained)


@pytest.mark.parametrize("cov_type", ["full", "diag", "lowrank"])
def test_hgps_uploaded_statistics_are_counted_by_cov_type(cov_type):
    from promptfcl.strategies.hgp.gaussians import class_statistics
    from promptfcl.strategies.hgp.options import HGPOptions

    cfg = tiny_config(strategy="hgp", **{k.replace("-", "_"): v for k, v in MODERATE.items()},
                      **{"hgp.cov-type": cov_type})
    sizes = run_sizes(cfg)
    per_reply, server = method_memory(cfg, sizes)
    # one client's statistics of a task's 4 classes, as its learner builds them
    labels = torch.arange(40) % sizes.per_task
    record = class_statistics(torch.randn(40, 64), labels, HGPOptions.from_options({"cov-type": cov_type}))
    real = sum(array_view(record[k]).nbytes for k in record.keys())
    assert real <= per_reply <= 1.1 * real  # counts and classes as float32 rows: within a few bytes a class
    # the server keeps each class's statistics from every client, and (full) their D x D float64 mixtures
    assert server >= sizes.classes * sizes.clients * real / sizes.per_task
    if cov_type == "full":
        assert server >= sizes.classes * sizes.clients * 64 * 64 * 8


def test_the_serverapps_estimate_is_clients_plus_4_trainable_states_and_the_method():
    cfg = tiny_config(**{k.replace("-", "_"): v for k, v in MODERATE.items()}, evaluation="federated",
                      population="nodes", clients_per_round=5, num_clients=5)
    t = trainable_bytes(cfg, 64, 12)
    assert server_memory(cfg).total_gb * 1e9 == pytest.approx((5 + 4) * t)
    hepco = server_memory(cfg.replace(strategy="hepco"))
    assert hepco.part_gb("method state") * 1e9 > (5 + 2) * trainable_bytes(cfg.replace(strategy="hepco"), 64, 12)


# ---------------------------------------------------------------------------- refused up front
def test_a_4095_by_1024_pool_is_refused_up_front_with_its_figure_and_the_limit(monkeypatch, tmp_path):
    pairs = [f"{k}={v}" for k, v in HUGE_POOL.items()]
    monkeypatch.setenv("PROMPTFCL_MAX_MEMORY_GB", "16")
    with pytest.raises(ConfigError, match=r"ServerApp would not fit: the run needs an estimated 4\d\.\d GB, above "
                                          r"the server's limit max-memory-gb = 16 \(replies \(5 per round"):
        load_config(None, pairs, "fedavg", str(tmp_path))
    monkeypatch.delenv("PROMPTFCL_MAX_MEMORY_GB")
    if machine_memory_gb() < 48:  # this machine's memory bounds it without a setting
        with pytest.raises(ConfigError, match="above this machine's memory"):
            load_config(None, pairs, "fedavg", str(tmp_path))
    # every node refuses it too: 4.8 GB of prompts four times over, and the message's copies
    policy = NodePolicy.from_node_config({"max-memory-gb": 16})
    with pytest.raises(NodeRefusal, match=r"needs an estimated 30\.\d GB, above this node's limit max-memory-gb = 16 "
                                          r"\(trainable state x4"):
        policy.check_run(ExperimentConfig.from_dict(HUGE_POOL))


def test_the_serverapp_and_submit_run_refuse_the_huge_pool_before_building_anything(tmp_path, monkeypatch):
    from promptfcl.server.app import main
    from promptfcl.server.loopback import run_script, script_env
    from tests.helpers import Built, refuse_to_build_the_server

    refuse_to_build_the_server(monkeypatch)
    monkeypatch.setenv("PROMPTFCL_MAX_MEMORY_GB", "4")  # 1.6 GB of prompts at the tiny width, 2 clients a round
    huge = tiny_config(**{**HUGE_POOL, "num-tasks": 5, "out-dir": str(tmp_path / "out"), "population": "nodes",
                          "evaluation": "federated", "num-classes": 10})
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=huge.to_dict())
    with pytest.raises(ConfigError, match="ServerApp would not fit: .* above the server's limit max-memory-gb = 4 "):
        main(None, ctx)
    monkeypatch.setenv("PROMPTFCL_MAX_MEMORY_GB", "1000")
    with pytest.raises(Built):  # the server's operator raises its ceiling: past the check
        main(None, ctx)
    env = script_env(FLWR_HOME=str(tmp_path / "flwr"), PROMPTFCL_MAX_MEMORY_GB="16")
    done = run_script("submit-run.sh", "--superlink", "127.0.0.1:1", "--insecure", "--set", "pool-size=4095",
                      "--set", "prompt-length=1024", env=env, cwd=tmp_path)
    assert done.returncode != 0 and "above the server's limit max-memory-gb = 16" in done.stderr, done.stderr
    assert "flwr run" not in done.stdout + done.stderr


def test_a_refusal_names_what_this_machine_has_unless_the_operator_set_a_ceiling():
    estimate = MemoryEstimate((("backbone", 30e9), ("copies", 20e9)), accelerated=frozenset({"backbone"}))
    assert "machine's memory, 16 GB" in memory_problem(estimate, 64, "x", "y", False, machine_gb=16)
    assert memory_problem(estimate, 64, "x", "y", True, machine_gb=24) is None  # the backbone on a GPU
    assert memory_problem(estimate, 64, "x", "y", False, machine_gb=0) is None  # the operator's own ceiling
    assert "max-memory-gb = 40" in memory_problem(estimate, 40, "x", "y", True, machine_gb=0)


# ---------------------------------------------------------------------------- the node's processes
def test_the_start_up_line_reports_rss_and_pss_of_each_process():
    import os

    from promptfcl.client.warm_executor import node_processes

    rss, pss = process_memory_mb(os.getpid())
    assert rss > 50 and 0 < pss <= rss
    assert node_processes(4242, ["promptfcl-superexec", "--parent-pid", "77"]) == [
        ("SuperNode", 77), ("executor", os.getpid()), ("zygote", 4242)]
    line = processes_line([("executor", os.getpid())])
    assert f"executor (pid {os.getpid()}) RSS" in line and "PSS" in line and "together RSS" in line


def test_a_budgeted_process_hands_back_library_pages_and_still_computes(tmp_path):
    import subprocess
    import sys

    code = ("import torch, json; from promptfcl.common.node.memory_plan import release_library_pages, resident_mb\n"
            "torch.manual_seed(0); x = torch.randn(4, 50, 64, requires_grad=True); w = torch.nn.Linear(64, 64)\n"
            "before = resident_mb(); w(x).relu().sum().backward(); g = x.grad.clone(); x.grad = None\n"
            "released = release_library_pages(); after = resident_mb()\n"
            "w(x).relu().sum().backward()\n"
            "print(json.dumps([before, released, after, bool(torch.equal(g, x.grad))]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    before, released, after, same = json.loads(done.stdout.strip().splitlines()[-1])
    assert released > 20 and after < before - 20  # the libraries' pages left this process
    assert same  # and the pages a computation needs came back from the files


# ---------------------------------------------------------------------------- the ServerApp's copies
def test_arrays_are_read_from_their_bytes_and_written_as_flower_writes_them():
    for value in (np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((0, 5), np.int64), np.ones((), np.float64),
                  np.arange(6, dtype=">i4"), np.asfortranarray(np.arange(6.0).reshape(2, 3))):
        ours, flower = to_array(np.ascontiguousarray(value)), Array(np.ascontiguousarray(value))
        assert ours.data == flower.data and ours.object_id == flower.object_id  # the same bytes on the wire
        view = array_view(Array(value))  # another sender's order too
        assert np.array_equal(view, value) and view.dtype == value.dtype and not view.flags.writeable
    record = ArrayRecord({"a": Array(np.arange(4, dtype=np.float32))})
    assert np.shares_memory(array_views(record)["a"], array_views(record)["a"])  # no copy made per read


def test_chunked_norms_cosines_and_averages_are_the_whole_arrays(monkeypatch):
    rng = np.random.default_rng(0)
    updates = [{"p": rng.normal(size=(7, 11)).astype(np.float32), "h": rng.normal(size=13).astype(np.float32)}
               for _ in range(5)]
    start = {"p": np.ones((7, 11), np.float32), "h": np.zeros(13, np.float32)}
    whole = np.stack([np.concatenate([(u[n].astype(np.float64) - start[n]).ravel() for n in ("p", "h")])
                      for u in updates])
    median = np.median(whole, axis=0)
    expected = [float(r @ median / (np.linalg.norm(r) * np.linalg.norm(median))) for r in whole]
    mean = np.average(np.stack([u["p"] for u in updates]).astype(np.float64), axis=0, weights=[1, 2, 3, 4, 5])
    monkeypatch.setattr(replies, "CHUNK", 6)  # many chunks per array
    assert median_cosines([Update(u, start) for u in updates]) == pytest.approx(expected, rel=1e-12)
    assert update_norm(updates[0], start) == pytest.approx(np.linalg.norm(whole[0]), rel=1e-12)
    assert np.array_equal(combine([u["p"] for u in updates], np.array([1, 2, 3, 4, 5.0])), mean.astype(np.float32))
    median_p = np.median(np.stack([u["p"] for u in updates]).astype(np.float64), axis=0).astype(np.float32)
    assert np.array_equal(combine([u["p"] for u in updates], np.ones(5), "median"), median_p)
