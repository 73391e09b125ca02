"""bench compare's bookkeeping: reusing finished runs, and the summary table's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from promptfcl.server.bench import finished_run, summary_table
from tests.conftest import TINY

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _write_results(run_dir, settings):
    from promptfcl.common.config.experiment import ExperimentConfig

    run_dir.mkdir(parents=True)
    cfg = ExperimentConfig.from_dict({**settings, "out-dir": str(run_dir)})
    (run_dir / "results.json").write_text(json.dumps({"config": cfg.to_dict(), "final_average_accuracy": 42.0}))


def test_a_finished_run_is_reused_only_with_the_same_configuration(tmp_path):
    settings = {**TINY, "seed": 3, "strategy": "fedavg"}
    run_dir = tmp_path / "fedavg-seed3"
    assert finished_run(run_dir, settings) is None  # nothing there yet
    _write_results(run_dir, settings)
    assert finished_run(run_dir, settings)["final_average_accuracy"] == 42.0
    assert finished_run(run_dir, {**settings, "seed": 4}) is None
    assert finished_run(run_dir, {**settings, "strategy": "hgp"}) is None
    assert finished_run(run_dir, {**settings, "threads": 2}) is not None  # result-neutral key
    (run_dir / "results.json").write_text("{ truncated")
    assert finished_run(run_dir, settings) is None  # unreadable: run again, no crash


def test_summary_table_reports_mean_and_spread_per_setting_and_method():
    rows = [{"method": "fedavg", "setting": "iid", "seed": s, "A_N": a, "AIA": a + 10, "forgetting": 5.0,
             "bytes_s2c_per_round": 2000.0, "bytes_c2s_per_round": 1000.0,
             "client_seconds_per_round": 0.5, "server_seconds_per_round": 0.01} for s, a in ((0, 40.0), (1, 50.0))]
    table = summary_table(rows)
    line = [l for l in table.splitlines() if l.startswith("| iid | fedavg")][0]
    assert "| 2 | 45.0 ± 5.0 | 55.0 ± 5.0 | 5.0 ± 0.0 | 2 | 1 |" in line


def test_a_failing_run_is_reported_and_the_comparison_goes_on(tmp_path, monkeypatch):
    from promptfcl.server import bench

    def fake_run(settings, out, strategy="fedavg", **_):
        if strategy == "hgp":
            raise RuntimeError("simulation failed (hgp): boom")
        return {"final_average_accuracy": 50.0 + settings["seed"], "average_incremental_accuracy": 60.0,
                "average_forgetting": 5.0, "communication": {"bytes_s2c_per_round": 1.0, "bytes_c2s_per_round": 1.0},
                "timing": {"client_seconds_per_round": 0.1, "server_seconds_per_round": 0.01}}

    monkeypatch.setattr("promptfcl.server.bench.grid_parts.run_simulation_subprocess", fake_run)
    rows = bench.compare(tmp_path, dict(TINY), ["fedavg", "hgp"], [0, 1], [{"partition": "iid"}], upper_bound=False)
    assert [(r["method"], r["seed"]) for r in rows] == [("fedavg", 0), ("fedavg", 1)]
    md = (tmp_path / "compare.md").read_text()
    assert "| iid | fedavg | 2 | 50.5 ± 0.5" in md
    assert "failed, left out: hgp, iid, seed 0" in md and "failed, left out: hgp, iid, seed 1" in md


def test_a_method_variant_carries_its_options():
    from promptfcl.server.bench import parse_method

    assert parse_method("powder") == ("powder", {})
    assert parse_method("powder/dual=false/k=1/selection=random") == (
        "powder", {"powder.dual": False, "powder.k": 1, "powder.selection": "random"})


def test_summary_table_of_random_task_runs_has_section_5_1_columns():
    rows = [{"method": m, "setting": "default", "seed": s, "A_N": 80.0, "AIA": 80.0 + s, "forgetting": 1.0,
             "FM": 1.0, "FT": -2.0 + s, "BT": 1.0, "CT": -1.0 + s, "bytes_s2c_total": 2e6, "bytes_c2s_total": 1e6,
             "bytes_s2c_per_round": 1e5, "bytes_c2s_per_round": 1e5, "client_seconds_per_round": 1.0,
             "server_seconds_per_round": 0.1} for m in ("powder", "powder/dual=false") for s in (0, 1)]
    table = summary_table(rows)
    assert "| AIA | FM | FT | BT | CT |" in table
    assert "| default | powder/dual=false | 2 | 80.50 ± 0.50 | 1.00 ± 0.00 | -1.50 ± 0.50 | 1.00 ± 0.00 | " \
           "-0.50 ± 0.50 | 2.00 | 1.00 |" in table


@pytest.mark.slow
@pytest.mark.simulation
def test_paper_dims_runs_a_paper_configuration_at_vit_b16_size(tmp_path):
    """One real simulated round of Fed-CPrompt's CIFAR-100 configuration at the paper's size."""
    from promptfcl.server.bench import paper_dims

    report = paper_dims(tmp_path, [CONFIGS / "fedcprompt-cifar100.toml"])
    v = report["methods"]["fedcprompt"]
    # ViT-B/16 width 768; CODA-P: 100 components of length 8 with keys and attention vectors on
    # 5 blocks; a head over CIFAR-100's classes
    params = 5 * (100 * 8 * 768 + 2 * 100 * 768) + 100 * (768 + 1)
    assert v["trainable_parameters"] == params
    for key in ("bytes_s2c_per_client", "bytes_c2s_per_client"):  # float32 arrays and a little framing
        assert 4 * params <= v[key] <= 4 * params * 1.01 + 8192, key
    assert v["classes"] == 100 and v["device"] == "cpu"
    assert v["client_seconds_per_image"] > 0 and v["server_seconds"] > 0
    assert v["client_peak_memory_mb"] > 0 and v["server_peak_memory_mb"] > 0
    assert v["extrapolated_round_seconds"] > v["server_seconds"]
    assert json.loads((tmp_path / "paper_dims.json").read_text())["methods"]["fedcprompt"] == v
def test_compare_reports_the_incremental_and_the_joint_upper_bound(tmp_path, monkeypatch):
    """Both centralised references run once per seed, whatever the setting, under their own names."""
    from promptfcl.server import bench

    calls = []

    def fake_run(settings, out, strategy="fedavg", **_):
        calls.append((strategy, settings.get("centralised", False), settings.get("centralised-mode"),
                      settings.get("partition")))
        score = {"joint": 90.0, "incremental": 30.0}.get(settings.get("centralised-mode"), 50.0)
        (out / "results.json").parent.mkdir(parents=True, exist_ok=True)
        return {"final_average_accuracy": score, "average_incremental_accuracy": score, "average_forgetting": 1.0,
                "communication": {"bytes_s2c_per_round": 1.0, "bytes_c2s_per_round": 1.0},
                "timing": {"client_seconds_per_round": 0.1, "server_seconds_per_round": 0.01}}

    monkeypatch.setattr("promptfcl.server.bench.grid_parts.run_simulation_subprocess", fake_run)
    rows = bench.compare(tmp_path, dict(TINY), ["fedavg"], [0], [{"partition": "iid"},
                                                                 {"partition": "quantity-skew", "dirichlet-beta": 0.5}])
    assert {(r["method"], r["setting"]) for r in rows} == {
        (m, s) for m in ("fedavg", "upper-bound-incremental", "upper-bound-joint") for s in ("iid", "quantity-skew-0.5")}
    refs = [c for c in calls if c[1]]
    assert sorted(c[2] for c in refs) == ["incremental", "incremental", "joint", "joint"]
    assert all(c[0] == "fedavg" and c[3] is None for c in refs)  # the partition plays no part
    md = (tmp_path / "compare.md").read_text()
    assert "| iid | upper-bound-joint | 1 | 90.0" in md and "| iid | upper-bound-incremental | 1 | 30.0" in md


def test_quantity_skew_is_a_heterogeneity_setting():
    from promptfcl.server.cli import _parse_setting

    assert _parse_setting("quantity-skew:0.5") == {"partition": "quantity-skew", "dirichlet-beta": 0.5}
    assert _parse_setting("quantity:2") == {"partition": "quantity", "classes-per-client": 2}


def test_a_run_past_its_timeout_is_stopped_not_left_training(tmp_path, monkeypatch):
    import signal
    import subprocess

    import pytest

    from promptfcl.server import bench

    started = []
    real_popen = subprocess.Popen

    def sigint_default() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def slow(args, **kwargs):  # stands in for a simulation that takes too long
        # with SIGINT at its default: a suite started in the background inherits SIGINT ignored,
        # which left the stand-in to the kill that follows 60 s after the SIGINT
        started.append(real_popen(["sleep", "60"], preexec_fn=sigint_default, **kwargs))
        return started[-1]

    monkeypatch.setattr(bench.subprocess, "Popen", slow)
    with pytest.raises(subprocess.TimeoutExpired):
        bench.run_simulation_subprocess({"seed": 0}, tmp_path / "run", timeout=1)
    assert started[0].poll() is not None  # the child is gone


def test_an_interrupted_benchmark_run_is_resumed_not_refused(tmp_path, monkeypatch):
    """A run directory left with a checkpoint (the benchmark was stopped) continues with resume;
    a fresh one starts without it."""
    import subprocess

    from promptfcl.server import bench, checkpoint

    seen = []
    real_popen = subprocess.Popen

    def record(args, **kwargs):
        seen.append(args)
        return real_popen(["false"], **kwargs)  # fails: only the arguments matter here

    monkeypatch.setattr(bench.subprocess, "Popen", record)
    for name, interrupted in (("fresh", False), ("stopped", True)):
        out = tmp_path / name
        out.mkdir()
        if interrupted:
            (out / checkpoint.FILENAME).write_bytes(b"x")
        try:
            bench.run_simulation_subprocess({"seed": 0}, out)
        except RuntimeError:
            pass
    assert "resume=True" not in seen[0] and "resume=True" in seen[1]


def test_a_chatty_failing_run_with_memory_watched_does_not_hang(tmp_path, monkeypatch):
    """A child that prints far more than a pipe holds (client tracebacks of a failing run) and
    fails: its error comes back with the end of its log, instead of the watcher waiting for ever
    on a child blocked writing to a pipe nobody reads (seen on a GPU machine)."""
    import subprocess
    import sys

    from promptfcl.server import bench

    real_popen = subprocess.Popen

    def chatty(args, **kwargs):
        script = "import sys; sys.stdout.write('x' * 1_000_000 + '\\nlast words\\n'); sys.exit(3)"
        return real_popen([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(bench.subprocess, "Popen", chatty)
    with pytest.raises(RuntimeError, match="last words"):
        bench.run_simulation_subprocess({"seed": 0}, tmp_path / "run", watch_memory=True, timeout=60)


def test_every_robustness_defence_and_attack_is_a_valid_configuration():
    from promptfcl.client.faults import STATISTICS_ATTACKS
    from promptfcl.common.config.experiment import FAULTS, ExperimentConfig
    from promptfcl.server.bench.attacks import DEFENCES, robustness_table

    for defence in DEFENCES.values():
        for attack in ("poison", "sign-flip", "poison-under-filter", *STATISTICS_ATTACKS):
            assert attack in FAULTS
            ExperimentConfig.from_dict({**defence, "fault": attack, "fault-clients": "0,1"})  # checked, or raises
    rows = [{"method": m, "attack": a, "defence": "bounded", "seed": s, "A_N": 40.0 + s, "forgetting": 10.0,
             "replies_excluded": 1, "replies_aggregated": 9} for m in ("fedavg", "hgp") for a in ("clean", "poison")
            for s in (0, 1)]
    table = robustness_table(rows, "2 of 10 clients").splitlines()
    assert len(table) == 2 + 4 and table[2].startswith("| fedavg | clean | bounded | 2 | 40.5 ± 0.5 |")
    assert table[-1].startswith("| hgp | poison | bounded | 2 |") and table[-1].endswith("| 2 / 18 |")


def test_statistics_attacks_run_only_against_methods_that_upload_statistics():
    from promptfcl.server.bench.attacks import uploads_statistics
    from promptfcl.strategies.registry import methods

    assert {m for m in methods() if uploads_statistics(m)} == {"hgp", "fppl", "powder", "c2prompt", "lorm", "pilora"}


def test_a_benchmarked_simulation_started_with_sigint_ignored_still_stops_on_sigint():
    """A benchmark run in the background hands its simulation SIGINT ignored; the simulation
    takes it back (only where a benchmark marked it), so stop_run's SIGINT stops it."""
    import os
    import signal
    import subprocess
    import sys

    from promptfcl.server.bench.common import RUN_MARK

    child = ("import os, signal, time\n"
             "from promptfcl.server.bench.common import interruptible_when_benchmarked as restore\n"
             "print(restore(), flush=True)\n"
             "try:\n    os.kill(os.getpid(), signal.SIGINT); time.sleep(5); print('kept-going')\n"
             "except KeyboardInterrupt:\n    print('interrupted')\n")

    def ignored() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def run(env: dict[str, str]) -> list[str]:
        out = subprocess.run([sys.executable, "-c", child], env=env, preexec_fn=ignored, capture_output=True,
                             text=True, check=True)
        return out.stdout.split()

    env = {k: v for k, v in os.environ.items() if k != RUN_MARK}
    assert run({**env, RUN_MARK: "x"}) == ["True", "interrupted"]
    assert run(env) == ["False", "kept-going"]  # not a benchmark's child: left as its parent set it


def test_bench_deploy_attributes_a_messages_time_to_named_phases():
    """``bench deploy``'s breakdown: every start-up phase a reply reports (common/node/startup.py),
    ``other`` only what none covers, and Flower's transport as the round's wait beyond the slowest
    message's process."""
    from promptfcl.common.node.startup import PHASES
    from promptfcl.server.bench.deploy import PHASE_NAMES, _path_figures, deploy_table

    phases = {"imports": 1.0, "flower_receive": 0.25, "context": 0.125, "model_build": 0.5, "data": 0.25,
              "reply": 0.0625}
    rounds = [{"client_overhead_seconds": 2.5, "client_startup": phases, "client_seconds": 3.0, "eval_seconds": 0.5,
               "round_seconds": 7.0, "server_seconds": 0.5, "client_process_seconds_max": 6.0, "eval_carried": False}
              for _ in range(3)]
    figures = _path_figures({"rounds": rounds, "accuracy_matrix": [[1.0]]})
    breakdown = figures["overhead_breakdown"]
    assert set(breakdown) == {*PHASES, "other"}
    assert breakdown["weights"] == breakdown["query_cache"] == 0.0  # not timed: none
    assert breakdown["other"] == pytest.approx(2.5 - sum(phases.values()))
    assert figures["flower_transport_seconds"] == pytest.approx(0.5)  # 7 - 0.5 (server) - 6 (slowest process)
    report = {**figures, "stock": figures, "deployed_round_seconds": 7.5, "deployed_eval_seconds": 0.5,
              "simulated_round_seconds": 5.0, "simulated_eval_seconds": 0.4, "rounds": 3, "ratio": 1.5,
              "same_accuracy_matrix": True, "empty_clientapp_process_seconds": 0.75,
              "torch_clientapp_process_seconds": 1.5}
    figures["ratio"] = 1.5
    table = deploy_table(report)
    assert all(f"| {PHASE_NAMES[name]} |" in table for name in (*PHASES, "other"))
    assert "| Flower transport: the round's wait beyond the slowest message's process | 0.50 | 0.50 |" in table
    assert "above the first: 1.75 s (warm)" in table
