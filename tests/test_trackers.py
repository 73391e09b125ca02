"""MLflow and W&B trackers: a short in-process run logged to each, read back through the tracker's
own client (MLflow's ``MlflowClient``; W&B's ``wandb leet inspect`` on the offline run's files):
the configuration, every round's accuracy, bytes and seconds, the accuracy matrix per task and the
final metrics. Skipped where the optional package (extra ``mlflow`` / ``wandb``) is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from promptfcl.common.config.experiment import ConfigError
from promptfcl.server.progress import RunTrackers
from tests.conftest import tiny_config

ROUND_KEYS = ("accuracy", "bytes_s2c", "bytes_c2s", "client_seconds", "server_seconds")


def expected_rounds(results: dict, key: str) -> list[tuple[int, float]]:
    return [(r["server_round"], float(r[key])) for r in results["rounds"] if r[key] is not None]


def test_tracker_values_are_checked_and_a_missing_package_names_its_extra(tmp_path, monkeypatch):
    assert tiny_config(tracker="mlflow").output.tracker == "mlflow" and tiny_config(tracker="wandb").output.tracker == "wandb"
    with pytest.raises(ConfigError, match="tracker must be one of"):
        tiny_config(tracker="neptune")
    for name in ("mlflow", "mlflow.exceptions", "mlflow.tracking", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ConfigError, match=r"promptfcl\[mlflow\]"):
        RunTrackers(tmp_path, "mlflow", 2)
    with pytest.raises(ConfigError, match=r"promptfcl\[wandb\]"):
        RunTrackers(tmp_path, "wandb", 2)


# ------------------------------------------------------------------------------------------ MLflow
def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def only_run(client, experiment: str = "promptfcl"):
    found = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([found.experiment_id])
    return run


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.mark.e2e
def test_mlflow_tracker_logs_a_run_into_its_own_sqlite_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from tests.helpers import simulate_in_process

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    out = tmp_path / "mlrun"
    results = simulate_in_process(out, "fedavg", tracker="mlflow")
    client = mlflow_client(f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    run = only_run(client)
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "mlrun"
    assert (out / "mlflow" / "run-id").read_text().strip() == run_id
    params = run.data.params
    assert params["strategy"] == "fedavg" and params["dataset"] == "digits"
    assert json.loads(params["num-tasks"]) == 2 and json.loads(params["lr"]) == results["config"]["lr"]
    assert json.loads(params["splits"]) == "" and len(params) == len(results["config"])
    for key in ROUND_KEYS:
        logged = history(client, run_id, key)
        assert [s for s, _ in logged] == [s for s, _ in expected_rounds(results, key)] == [1, 2, 3, 4]
        np.testing.assert_allclose([v for _, v in logged], [v for _, v in expected_rounds(results, key)])
    np.testing.assert_allclose([v for _, v in history(client, run_id, "A_t")], results["average_accuracy_per_task"])
    matrix = results["accuracy_matrix"]
    assert [s for s, _ in history(client, run_id, "accuracy_matrix/T1")] == [1, 2]
    np.testing.assert_allclose([v for _, v in history(client, run_id, "accuracy_matrix/T1")], matrix[0])
    assert history(client, run_id, "BWT")[0] == (2, pytest.approx(results["backward_transfer"]))
    for key in ("final_average_accuracy", "average_incremental_accuracy", "average_forgetting", "backward_transfer"):
        assert run.data.metrics[key] == pytest.approx(results[key]), key
    artifact = client.download_artifacts(run_id, "accuracy_matrix.json", str(tmp_path))
    logged_matrix = json.loads(Path(artifact).read_text())
    assert logged_matrix["after_task"] == 2
    np.testing.assert_allclose(np.array(logged_matrix["accuracy_matrix"], dtype=float),
                               np.array(matrix, dtype=float))


def test_mlflow_tracker_uses_the_tracking_uri_of_the_environment_and_a_resume_continues_its_run(tmp_path,
                                                                                                monkeypatch):
    pytest.importorskip("mlflow")
    # a store named by the environment keeps its artifacts where MLflow's defaults say: for a
    # database without a server, ./mlruns of the working directory
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "study")
    out = tmp_path / "run"
    config = {"strategy": "hgp", "lr": 0.01, "splits": ""}
    first = RunTrackers(out, "mlflow", total_rounds=2, config=config)
    first.round({"server_round": 1, "accuracy": 40.0, "bytes_s2c": 10, "client_seconds": 0.5, "train_loss": float("nan")})
    first.close()  # killed after round 1: no finish
    client = mlflow_client(uri)
    assert only_run(client, "study").info.status == "FAILED"
    assert not (out / "mlflow" / "mlflow.db").exists()  # nothing in the out-dir's own store

    resumed = RunTrackers(out, "mlflow", total_rounds=2, done=1, config=config)
    resumed.round({"server_round": 2, "accuracy": 55.0, "bytes_s2c": 10, "client_seconds": 0.4})
    resumed.task_end(0, np.array([[55.0]]))
    resumed.finish({"final_average_accuracy": 55.0, "average_forgetting": 0.0, "backward_transfer": None,
                    "rounds": [{"server_round": 1}, {"server_round": 2}]})
    resumed.close()
    run = only_run(client, "study")  # the same run, continued
    assert run.info.status == "FINISHED" and run.data.params["strategy"] == "hgp"
    assert history(client, run.info.run_id, "accuracy") == [(1, 40.0), (2, 55.0)]
    assert client.get_metric_history(run.info.run_id, "train_loss") == []  # NaN is not logged
    assert run.data.metrics["final_average_accuracy"] == 55.0 and "backward_transfer" not in run.data.metrics


# -------------------------------------------------------------------------------------------- W&B
def wandb_inspect(path: Path, *args: str) -> str:
    """W&B's own reader of a run's .wandb transaction log (its temporary folders beside the run)."""
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *args, str(path)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(path.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.e2e
def test_wandb_tracker_logs_an_offline_run_under_the_out_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tests.helpers import simulate_in_process

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written to the home directory
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    out = tmp_path / "wbrun"
    results = simulate_in_process(out, "fedavg", tracker="wandb")
    (run_dir,) = (out / "wandb").glob("offline-run-*")  # offline: nothing left the machine
    summary = json.loads(wandb_inspect(run_dir, "--summary"))
    assert summary["state"] == "finished" and summary["project"] == "promptfcl" and summary["name"] == "wbrun"
    assert summary["run_id"] == (out / "wandb" / "promptfcl-run-id").read_text().strip()
    assert summary["config"]["strategy"] == "fedavg" and summary["config"]["num-tasks"] == 2
    assert summary["config"]["lr"] == results["config"]["lr"]
    final = summary["summary"]
    for key in ("final_average_accuracy", "average_incremental_accuracy", "average_forgetting", "backward_transfer"):
        assert final[key] == pytest.approx(results[key]), key
    np.testing.assert_allclose(np.array(final["accuracy_matrix"], dtype=float),
                               np.array(results["accuracy_matrix"], dtype=float))
    records = [json.loads(line) for line in wandb_inspect(run_dir).splitlines() if line.strip()]
    logged = [r["history"]["item"] for r in records if r["type"] == "history"]
    rounds = [item for item in logged if "server_round" in item]
    tasks = [item for item in logged if "task" in item]
    for key in ROUND_KEYS:
        assert [(item["server_round"], item[key]) for item in rounds] == [
            (s, pytest.approx(v)) for s, v in expected_rounds(results, key)]
    assert [item["task"] for item in tasks] == [1, 2]
    np.testing.assert_allclose([item["A_t"] for item in tasks], results["average_accuracy_per_task"])
    assert "BWT" not in tasks[0] and tasks[1]["BWT"] == pytest.approx(results["backward_transfer"])
    np.testing.assert_allclose([item["accuracy_matrix/T1"] for item in tasks], results["accuracy_matrix"][0])
