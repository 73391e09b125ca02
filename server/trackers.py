"""Experiment trackers beside TensorBoard: MLflow (``tracker = "mlflow"``) and Weights & Biases
(``tracker = "wandb"``), and the figures every tracker takes from a run.

Both log the same things under the same names: the run configuration (once, at the start); every
round's ``accuracy``, ``bytes_s2c``, ``bytes_c2s``, ``client_seconds``, ``server_seconds`` (and
``train_loss`` where a method reports it), step = the server round; after every task ``A_t``,
``BWT`` (from the second task on) and the accuracy matrix so far, as one curve per task
(``accuracy_matrix/T<i>``) and as the whole matrix; at the end the final metrics of results.json
(:func:`final_metrics`). Each is an optional package (the extras ``mlflow`` and ``wandb``): a run
that names one without it stops before training, and the core install stays lean.

MLflow: the run's own SQLite store, ``<out-dir>/mlflow/mlflow.db`` with artifacts under
``<out-dir>/mlflow/artifacts`` (MLflow 3 refuses a plain file store unless told otherwise), or
``$MLFLOW_TRACKING_URI`` when it is set (a tracking server or a shared database, whose artifacts go
where MLflow's own defaults put them: the server's artifact root, or ``./mlruns``); experiment
``$MLFLOW_EXPERIMENT_NAME`` or "promptfcl", run name = the out-dir's name. ``mlflow ui
--backend-store-uri sqlite:///<out-dir>/mlflow/mlflow.db`` shows it.

W&B: offline, under ``<out-dir>/wandb``, unless ``WANDB_MODE`` says otherwise or ``WANDB_API_KEY``
is set (then online); project ``$WANDB_PROJECT`` or "promptfcl". ``wandb sync <out-dir>/wandb``
uploads offline runs later.

A resumed run (``promptfcl resume``) continues the tracker's run: MLflow's run id and W&B's are
kept in the out-dir (``mlflow/run-id``, ``wandb/promptfcl-run-id``). Rounds between the last
checkpoint and a crash are trained again and so logged twice, at the same steps.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..common.config.experiment import ConfigError
from ..common.metrics import backward_transfer
from .results import SUMMARY_KEYS

#: a round record's figures that trackers plot, by their results.json names
ROUND_METRICS = ("accuracy", "bytes_s2c", "bytes_c2s", "client_seconds", "server_seconds", "train_loss")
#: MLflow takes at most this many parameters in one batch
MLFLOW_BATCH = 100


def round_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The plotted figures of a round record; one it does not have (a round not evaluated:
    ``accuracy`` None) is left out rather than logged as NaN."""
    return {key: float(record[key]) for key in ROUND_METRICS if _finite(record.get(key))}


def task_metrics(task: int, matrix: np.ndarray) -> dict[str, float]:
    """After task ``task``: A_t, backward transfer (undefined after the first task: left out) and
    column ``task`` of the accuracy matrix, one value per task seen (``accuracy_matrix/T<i>``,
    numbered from 1 as in table.md)."""
    out = {"A_t": float(np.nanmean(matrix[: task + 1, task]))}
    bwt = backward_transfer(matrix, upto=task)
    if bwt is not None:
        out["BWT"] = bwt
    for i in range(task + 1):
        if not np.isnan(matrix[i, task]):
            out[f"accuracy_matrix/T{i + 1}"] = float(matrix[i, task])
    return out


def final_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The summary figures of results.json a tracker shows, by name; those a run does not have
    (None: before the first task ended, backward transfer after one task) are left out.

    A_N, average incremental accuracy, forgetting and backward transfer for every run; forward
    and combined transfer only where a reference exists (Powder's random tasks, against the
    single-task runs: common/metrics.py).
    """

    values = {key: results.get(key) for key in SUMMARY_KEYS}
    for key in ("forward_transfer", "combined_transfer"):
        values[key] = (results.get("asynchronous") or {}).get(key)
    return {key: float(v) for key, v in values.items() if v is not None and _finite(v)}


def matrix_rows(matrix: np.ndarray | list[list[float | None]]) -> list[list[float | None]]:
    """The accuracy matrix as JSON rows, None where a cell was not (yet) evaluated."""
    return [[None if v is None or np.isnan(v) else float(v) for v in row] for row in matrix]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _saved_id(path: Path, resume: bool) -> str | None:
    """The tracker's run id an earlier process of this run kept in ``path`` (resume only)."""
    if not resume or not path.is_file():
        return None
    return path.read_text().strip() or None


class MLflowTracker:
    """The run as one MLflow run (module docstring): parameters, per-round and per-task metrics,
    the accuracy matrix as the artifact ``accuracy_matrix.json``, the final metrics."""

    def __init__(self, out_dir: str | Path, config: dict[str, Any], resume: bool = False) -> None:
        try:
            # mlflow is optional (promptfcl[mlflow])
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError("tracker = mlflow needs the mlflow-skinny package "
                              "(pip install 'promptfcl[mlflow]')") from exc
        self.dir = Path(out_dir) / "mlflow"
        self.dir.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:  # the run's own store: nothing to set up, nothing shared with other runs
            uri = f"sqlite:///{(self.dir / 'mlflow.db').resolve()}"
            artifacts = (self.dir / "artifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri
        self.finished = False
        id_file = self.dir / "run-id"
        run_id = _saved_id(id_file, resume)
        if run_id is not None:
            try:
                self.client.update_run(run_id, status="RUNNING")
            except MlflowException:  # the store changed (another MLFLOW_TRACKING_URI): a new run there
                run_id = None
        if run_id is None:
            experiment = self._experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or "promptfcl", artifacts)
            run_id = self.client.create_run(experiment, run_name=Path(out_dir).name, tags={
                "promptfcl.strategy": str(config.get("strategy", "")),
                "promptfcl.dataset": str(config.get("dataset", "")),
                "promptfcl.out_dir": str(Path(out_dir).resolve()),
            }).info.run_id
            self._log_params(run_id, config)
            id_file.write_text(run_id + "\n")
        self.run_id = run_id

    def _experiment(self, name: str, artifacts: str | None) -> str:
        # mlflow is optional (promptfcl[mlflow])
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name, artifact_location=artifacts))
        except MlflowException:  # another run on a shared store created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _log_params(self, run_id: str, config: dict[str, Any]) -> None:
        # mlflow is optional (promptfcl[mlflow])
        from mlflow.entities import Param

        # MLflow's parameters are strings: a string stays itself, anything else is JSON, so that
        # true, 0.5 and "" (written '""') read back as what the configuration held
        params = [Param(key, value if isinstance(value, str) and value else json.dumps(value))
                  for key, value in sorted(config.items())]
        for start in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(run_id, params=params[start:start + MLFLOW_BATCH])

    def _metrics(self, values: dict[str, float], step: int) -> None:
        # mlflow is optional (promptfcl[mlflow])
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def round(self, record: dict[str, Any]) -> None:
        self._metrics(round_metrics(record), int(record["server_round"]))

    def task_end(self, task: int, matrix: np.ndarray) -> None:
        self._metrics(task_metrics(task, matrix), task + 1)
        self.client.log_dict(self.run_id, {"after_task": task + 1, "accuracy_matrix": matrix_rows(matrix)},
                             "accuracy_matrix.json")

    def finish(self, results: dict[str, Any]) -> None:
        step = max((int(r["server_round"]) for r in results.get("rounds", [])), default=0)
        self._metrics(final_metrics(results), step)
        if results.get("stopped_after_round") is not None:
            self.client.set_tag(self.run_id, "promptfcl.stopped_after_round", str(results["stopped_after_round"]))
        self.finished = True

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if self.finished else "FAILED")


class WandbTracker:
    """The run as one W&B run (module docstring): its config, per-round metrics against
    ``server_round``, per-task metrics against ``task``, the matrix and final metrics in the
    run's summary."""

    def __init__(self, out_dir: str | Path, config: dict[str, Any], resume: bool = False) -> None:
        try:
            # wandb is optional (promptfcl[wandb])
            import wandb
        except ImportError as exc:
            raise ConfigError("tracker = wandb needs the wandb package (pip install 'promptfcl[wandb]')") from exc
        out = Path(out_dir)
        (out / "wandb").mkdir(parents=True, exist_ok=True)
        # offline unless the environment asks for more: a run never uploads by surprise
        mode: Literal["online", "offline"] | None = (
            None if os.environ.get("WANDB_MODE") else "online" if os.environ.get("WANDB_API_KEY") else "offline")
        id_file = out / "wandb" / "promptfcl-run-id"
        run_id = _saved_id(id_file, resume)
        self.run = wandb.init(
            dir=str(out), mode=mode, project=os.environ.get("WANDB_PROJECT") or "promptfcl", name=out.name,
            config=config, id=run_id, resume="allow" if run_id else None,
            # the log's own status line and handlers stay as they are: W&B does not wrap the console
            settings=wandb.Settings(console="off"),
        )
        self.finished = False
        id_file.write_text(self.run.id + "\n")
        self.run.define_metric("server_round")
        self.run.define_metric("task")
        for key in ROUND_METRICS:
            self.run.define_metric(key, step_metric="server_round")
        for key in ("A_t", "BWT", "accuracy_matrix/*"):
            self.run.define_metric(key, step_metric="task")

    def round(self, record: dict[str, Any]) -> None:
        self.run.log({"server_round": int(record["server_round"]), **round_metrics(record)})

    def task_end(self, task: int, matrix: np.ndarray) -> None:
        self.run.log({"task": task + 1, **task_metrics(task, matrix)})
        self.run.summary["accuracy_matrix"] = matrix_rows(matrix)

    def finish(self, results: dict[str, Any]) -> None:
        self.run.summary.update(final_metrics(results))
        if results.get("accuracy_matrix") is not None:
            self.run.summary["accuracy_matrix"] = matrix_rows(results["accuracy_matrix"])
        if results.get("stopped_after_round") is not None:
            self.run.summary["stopped_after_round"] = results["stopped_after_round"]
        self.finished = True

    def close(self) -> None:
        self.run.finish(exit_code=0 if self.finished else 1)
