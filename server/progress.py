"""What a run shows while it goes: ``rounds.jsonl``, the accuracy matrix as CSV, an optional
tracker (TensorBoard), and the remaining time.

A long GPU run must not be a black box until it ends, and a crashed run's finished rounds
must be readable without unpickling its checkpoint. Every round's record is appended to
``<out-dir>/rounds.jsonl`` (one JSON object per line, flushed) as soon as it is final (a round
whose evaluation rides on the next round is written when its accuracies arrive); after every
task the accuracy matrix is rewritten as ``accuracy_matrix.csv``. A resumed run keeps the lines
of the rounds its checkpoint holds and drops any written after it.

Trackers implement :class:`Tracker` (``round``, ``task_end``, ``finish``, ``close``); ``tracker =
"tensorboard"`` adds :class:`TensorBoardTracker` (needs the ``tensorboard`` package), ``"mlflow"``
and ``"wandb"`` the trackers of server/trackers.py (their packages: the extras of the same names).

On a terminal the log keeps a status line at its foot (:data:`STATUS`, drawn by
:class:`TerminalHandler`): a bar, round x of y, ETA and the last accuracy. Anywhere else (a
file, a pipe, a cluster's log collector) only the plain log lines are written, each round's
with the same figures.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..common.config.checks import TRACKERS
from ..common.config.experiment import ConfigError
from ..common.files import write_atomic
from .report import json_safe
from .trackers import MLflowTracker, WandbTracker, final_metrics, round_metrics, task_metrics

log = logging.getLogger("promptfcl")

ROUNDS_FILE = "rounds.jsonl"
MATRIX_FILE = "accuracy_matrix.csv"


class Tracker(Protocol):
    """Where a run reports while it goes (one object per run)."""

    def round(self, record: dict[str, Any]) -> None:
        """A round's final record (the fields of results.json's ``rounds``)."""

    def task_end(self, task: int, matrix: np.ndarray) -> None:
        """Task ``task`` ended; ``matrix`` is the accuracy matrix so far (NaN: not yet)."""

    def finish(self, results: dict[str, Any]) -> None:
        """The run ended (finished or stopped early by ``max-rounds``) with these results
        (results.json's contents); not called when it failed."""

    def close(self) -> None:
        """The run stops (finished, stopped early or failed)."""


class RoundsFile:
    """``rounds.jsonl`` and ``accuracy_matrix.csv`` in ``out_dir``; ``keep`` rounds of an earlier
    process (resume) stay, later lines are dropped."""

    def __init__(self, out_dir: str | Path, keep: int = 0) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / ROUNDS_FILE
        kept: list[str] = []
        if keep and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    if 0 < int(json.loads(line)["server_round"]) <= keep:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash
        write_atomic(path, lambda fh: fh.write("".join(f"{line}\n" for line in kept).encode()), shared=True)
        self.fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run

    def round(self, record: dict[str, Any]) -> None:
        self.fh.write(json.dumps(json_safe(record)[0], allow_nan=False) + "\n")
        self.fh.flush()

    def task_end(self, task: int, matrix: np.ndarray) -> None:
        rows = ["task," + ",".join(f"after_task_{t + 1}" for t in range(matrix.shape[1]))]
        rows += [f"{i + 1}," + ",".join("" if np.isnan(v) else f"{v:.4f}" for v in row) for i, row in enumerate(matrix)]
        text = ("\n".join(rows) + "\n").encode()
        write_atomic(self.dir / MATRIX_FILE, lambda fh: fh.write(text), shared=True)

    def finish(self, results: dict[str, Any]) -> None:
        """Nothing: results.json holds the final figures."""

    def close(self) -> None:
        self.fh.close()


class TensorBoardTracker:
    """Accuracy, bytes and seconds per round, A_t, backward transfer and the accuracy matrix's
    column per task, and the final metrics (under ``final/``), under ``<out-dir>/tensorboard``:
    server/trackers.py's figures."""

    def __init__(self, out_dir: str | Path) -> None:
        try:
            # tensorboard is optional (tracker = "tensorboard")
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("tracker = tensorboard needs the tensorboard package "
                              "(pip install 'promptfcl[tensorboard]')") from exc
        self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))

    def round(self, record: dict[str, Any]) -> None:
        step = int(record["server_round"])
        for key, value in round_metrics(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def task_end(self, task: int, matrix: np.ndarray) -> None:
        # A_t, BWT from the second task on (undefined before), the matrix's column as accuracy_matrix/T<i>
        for key, value in task_metrics(task, matrix).items():
            self.writer.add_scalar(key, value, task + 1)
        self.writer.flush()

    def finish(self, results: dict[str, Any]) -> None:
        # one point each, at the last round, so they sit beside the curves they summarise
        step = max((int(r["server_round"]) for r in results.get("rounds", [])), default=0)
        for key, value in final_metrics(results).items():
            self.writer.add_scalar(f"final/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class RunTrackers:
    """The run's trackers together (rounds.jsonl always, ``tracker`` if set) and its ETA.

    Parameters
    ----------
    out_dir : str or Path
        The run's output directory.
    tracker : str
        One of :data:`TRACKERS`.
    total_rounds : int
        Rounds this run will have done when it stops.
    done : int
        Rounds an earlier process did (a resumed run: its trackers continue).
    config : dict, optional
        The run configuration, which MLflow and W&B record with the run.
    """

    def __init__(self, out_dir: str | Path, tracker: str, total_rounds: int, done: int = 0,
                 config: dict[str, Any] | None = None) -> None:
        if tracker not in TRACKERS:
            raise ConfigError(f"tracker must be one of {TRACKERS}, got {tracker!r}")
        self.trackers: list[Tracker] = [RoundsFile(out_dir, keep=done)]
        if tracker == "tensorboard":
            self.trackers.append(TensorBoardTracker(out_dir))
        elif tracker in ("mlflow", "wandb"):
            kind = MLflowTracker if tracker == "mlflow" else WandbTracker
            try:
                self.trackers.append(kind(out_dir, dict(config or {}), resume=done > 0))
            except BaseException:  # its package is missing or its store refused: rounds.jsonl is closed too
                self.trackers[0].close()
                raise
        self.total, self.done, self.started = total_rounds, done, time.perf_counter()
        self.first = done  # rounds done before this process: not in its timing

    def round(self, record: dict[str, Any]) -> None:
        for t in self.trackers:
            t.round(record)

    def task_end(self, task: int, matrix: np.ndarray) -> None:
        for t in self.trackers:
            t.task_end(task, matrix)

    def finish(self, results: dict[str, Any]) -> None:
        for t in self.trackers:
            t.finish(results)

    def close(self) -> None:
        STATUS.clear()
        for t in self.trackers:
            t.close()

    def progress(self, server_round: int, accuracy: float | None = None) -> str:
        """``round r/N, ETA ...`` from this process's mean round time (and the terminal's status line)."""
        self.done = server_round
        ran = self.done - self.first
        if ran <= 0 or self.done >= self.total:
            text = f"round {self.done}/{self.total}"
        else:
            left = (time.perf_counter() - self.started) / ran * (self.total - self.done)
            text = f"round {self.done}/{self.total}, ETA {format_seconds(left)}"
        if accuracy is not None:
            self.accuracy = accuracy
        STATUS.show(status_text(self.done, self.total, text, getattr(self, "accuracy", None)))
        return text


def status_text(done: int, total: int, progress: str, accuracy: float | None, width: int = 20) -> str:
    """``[#######.............] round 7/20, ETA 3m10s | last acc 54.2%``"""
    filled = int(width * done / max(total, 1))
    last = "" if accuracy is None else f" | last acc {accuracy:.1f}%"
    return f"[{'#' * filled}{'.' * (width - filled)}] {progress}{last}"


class StatusLine:
    """One line kept at the foot of a terminal's log, redrawn below every log line."""

    def __init__(self) -> None:
        self.text = ""
        self.stream: Any = None  # set by TerminalHandler when the log goes to a terminal

    def show(self, text: str) -> None:
        self.text = text
        if self.stream is not None:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()

    def clear(self) -> None:
        if self.stream is not None and self.text:
            self.stream.write("\r\033[K")
            self.stream.flush()
        self.text = ""


STATUS = StatusLine()


class TerminalHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A log handler for terminals: each log line is written above the status line, which is
    drawn again below it."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        STATUS.stream = self.stream

    def emit(self, record: logging.LogRecord) -> None:
        if STATUS.text:
            self.stream.write("\r\033[K")
        super().emit(record)
        if STATUS.text:
            self.stream.write(STATUS.text)
            self.stream.flush()


def format_seconds(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
