"""What a run shows while it goes: rounds.jsonl (flushed per round, kept across a kill and a
resume), accuracy_matrix.csv, group-readable results, the ETA, and the TensorBoard tracker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.files import write_atomic
from promptfcl.server.progress import MATRIX_FILE, ROUNDS_FILE, RoundsFile, RunTrackers, format_seconds

ROOT = Path(__file__).resolve().parents[1]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rounds_file_appends_flushed_lines_and_a_resume_keeps_only_checkpointed_rounds(tmp_path):
    first = RoundsFile(tmp_path)
    for r in (1, 2, 3):
        first.round({"server_round": r, "accuracy": float("nan") if r == 2 else 50.0 + r})
        assert len(lines(tmp_path / ROUNDS_FILE)) == r  # readable before close: flushed
    first.close()
    assert lines(tmp_path / ROUNDS_FILE)[1]["accuracy"] is None  # strict JSON: NaN as null
    with open(tmp_path / ROUNDS_FILE, "a") as fh:
        fh.write('{"server_round": 4, "accur')  # a line cut by a crash
    resumed = RoundsFile(tmp_path, keep=2)  # the checkpoint holds rounds 1-2
    resumed.round({"server_round": 3, "accuracy": 60.0})
    resumed.close()
    assert [(d["server_round"], d["accuracy"]) for d in lines(tmp_path / ROUNDS_FILE)] == [(1, 51.0), (2, None),
                                                                                          (3, 60.0)]


def test_accuracy_matrix_csv_and_shared_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        files = RoundsFile(tmp_path)
        matrix = np.full((3, 3), np.nan)
        matrix[:2, :2] = [[90.0, 80.5], [np.nan, 70.25]]
        files.task_end(1, matrix)
        files.close()
        write_atomic(tmp_path / "private.bin", lambda fh: fh.write(b"x"))
    finally:
        os.umask(old)
    assert (tmp_path / MATRIX_FILE).read_text().splitlines() == [
        "task,after_task_1,after_task_2,after_task_3", "1,90.0000,80.5000,", "2,,70.2500,", "3,,,"]
    assert (tmp_path / MATRIX_FILE).stat().st_mode & 0o777 == 0o640  # the group may read results, others not
    assert (tmp_path / ROUNDS_FILE).stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "private.bin").stat().st_mode & 0o777 == 0o600  # checkpoints and caches stay private


def test_eta_and_tracker_choice(tmp_path):
    trackers = RunTrackers(tmp_path, "none", total_rounds=10, done=4)
    trackers.started -= 6.0  # 2 rounds in 6 s -> 3 s a round, 4 rounds left
    assert trackers.progress(6) == "round 6/10, ETA 12s"
    assert trackers.progress(10) == "round 10/10"
    trackers.close()
    assert [format_seconds(s) for s in (5, 185, 7620)] == ["5s", "3m05s", "2h07m"]
    with pytest.raises(ConfigError, match="tracker must be one of"):
        RunTrackers(tmp_path, "neptune", 10)


def test_tensorboard_tracker_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = RunTrackers(tmp_path, "tensorboard", total_rounds=2)
    trackers.round({"server_round": 1, "accuracy": 40.0, "bytes_s2c": 100, "client_seconds": 0.5})
    trackers.round({"server_round": 2, "accuracy": 55.0, "bytes_s2c": 100, "client_seconds": 0.4})
    matrix = np.array([[55.0]])
    trackers.task_end(0, matrix)
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("accuracy")] == [(1, 40.0), (2, 55.0)]
    assert [(e.step, e.value) for e in events.Scalars("A_t")] == [(1, 55.0)]


@pytest.mark.e2e
def test_rounds_jsonl_survives_a_killed_run_and_the_resume_completes_it(tmp_path):
    """A real run in its own process, killed with SIGKILL after two rounds: rounds.jsonl holds whole
    lines of the rounds done; the resumed run ends with one line per round, equal to results.json's."""
    out = tmp_path / "run"
    code = ("import sys; from pathlib import Path; from tests.helpers import simulate_in_process; "
            "simulate_in_process(Path(sys.argv[1]), num_tasks=5, pool_size=10, rounds_per_task=3, local_epochs=2)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            path = out / ROUNDS_FILE
            if path.is_file() and len(path.read_text().splitlines()) >= 2:
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = lines(out / ROUNDS_FILE)  # every line whole: each is flushed before the next round starts
    assert [d["server_round"] for d in done] == list(range(1, len(done) + 1)) and len(done) >= 2
    assert all(isinstance(d["accuracy"], float) for d in done)

    from tests.helpers import simulate_in_process

    results = simulate_in_process(out, num_tasks=5, pool_size=10, rounds_per_task=3, local_epochs=2, resume=True)
    final = lines(out / ROUNDS_FILE)
    assert [d["server_round"] for d in final] == list(range(1, 16))
    for line, record in zip(final, results["rounds"]):
        assert line["accuracy"] == record["accuracy"] and line["bytes_c2s"] == record["bytes_c2s"]
    csv = (out / MATRIX_FILE).read_text().splitlines()
    assert len(csv) == 6 and csv[5].split(",")[5] != ""  # task 5's row filled after task 5


def test_a_terminal_keeps_a_status_line_below_the_log_and_other_streams_get_plain_lines(tmp_path):
    import io
    import logging

    from promptfcl.server.progress import STATUS, TerminalHandler

    logger = logging.getLogger("promptfcl.test-status")
    logger.propagate = False
    terminal = io.StringIO()
    handler = TerminalHandler(terminal)
    logger.addHandler(handler)
    try:
        trackers = RunTrackers(tmp_path, "none", total_rounds=10)
        logger.warning("round one")
        trackers.progress(5, accuracy=54.25)
        logger.warning("round five")
        trackers.close()
    finally:
        logger.removeHandler(handler)
        STATUS.stream = None
    out = terminal.getvalue()
    status = "[##########..........] round 5/10, ETA"
    assert out.startswith("round one\n")  # no status line yet: nothing to clear
    # the status line is drawn, cleared before the next log line, drawn again below it, cleared at the end
    before, after = out.split("round five\n")
    assert before.count(status) == 1 and "| last acc 54.2%" in before and before.endswith("\r\x1b[K")
    assert status in after and after.endswith("\r\x1b[K")

    plain = io.StringIO()  # not a terminal: server/app.py installs a plain StreamHandler
    handler2 = logging.StreamHandler(plain)
    logger.addHandler(handler2)
    try:
        RunTrackers(tmp_path, "none", total_rounds=10).progress(5, accuracy=54.25)
        logger.warning("round five")
    finally:
        logger.removeHandler(handler2)
    assert plain.getvalue() == "round five\n"


def test_the_table_says_how_many_nodes_were_left_after_a_drop():
    from promptfcl.server.report import _nodes_taking_part

    def results(rate):
        return {"config": {"num-clients": 3}, "rounds": [{"placement": [{}, {}], "sample_rates": [rate]}]}

    assert _nodes_taking_part(results(2 / 3)) == "3 nodes"
    assert _nodes_taking_part(results(1.0)) == "3 nodes at the start, 2 at the end"
    assert _nodes_taking_part({"config": {"num-clients": 3}, "rounds": []}) == "3 nodes"
