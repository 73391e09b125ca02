"""The ServerApp: reads the run config, runs the task stream, writes the results."""

from __future__ import annotations

import logging
import sys

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..common.config.experiment import ExperimentConfig
from ..common.files import results_umask
from ..common.text import escape_log_args
from ..strategies.platform.run_checks import check_run
from .progress import TerminalHandler
from .report import table, write_outputs
from .run import finish, run_experiment

log = logging.getLogger("promptfcl")

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for `flwr run` (simulation or deployment) and `promptfcl simulate`."""
    setup_logging()
    cfg = ExperimentConfig.from_run_config(context.run_config)
    check_run(cfg)  # before any dataset or backbone is loaded
    with results_umask():  # results, plots and the run's logs: the group may read them, nobody else
        results = run_experiment(grid, cfg)
        path = write_outputs(results, cfg.output.out_dir)
        finish(cfg.output.out_dir, cfg.output.keep_checkpoint, results)
    print("\n" + table(results) + "\n")
    log.info("results written to %s", path)


def setup_logging(level: int = logging.INFO) -> None:
    """The ``promptfcl`` logger's handler and level, its arguments escaped (a node's error
    reason or a run-config value cannot forge log lines: common/text.py)."""
    logger = escape_log_args()
    if not logger.handlers:
        # on a terminal the log keeps a status line (round, ETA, accuracy) at its foot
        handler = TerminalHandler() if sys.stderr.isatty() else logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s promptfcl %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
