"""One check of a run (strategies/platform/run_checks.py), called by every entry point before
any dataset or backbone is loaded; what a method supports is data on its options."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.config.options import CAPABILITIES, MethodOptions
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]
#: a HePCo option that conflicts with the run: diagnostics read the server's data of virtual clients
CONFLICT = {"strategy": "hepco", "population": "nodes", "hepco.diagnostics": True}
CONFLICT_MESSAGE = "hepco.diagnostics measures against the server's central data"
#: the same as ``--set`` pairs, with a backbone that needs no file
SETS = ["--set", "dataset='digits'", "--set", "weights='random'", "--set", "population='nodes'",
        "--set", "hepco.diagnostics=true"]


class Loaded(Exception):
    """What a dataset or backbone loader raises here: the run got past its check."""


@pytest.fixture
def no_loading(monkeypatch):
    """Every dataset and backbone loader raises :class:`Loaded`."""
    import promptfcl.common.data.cache as data_cache
    import promptfcl.common.data.sources as data
    import promptfcl.common.model.runtime as runtime
    import promptfcl.server.run as server_run

    def load(*args, **kwargs):
        raise Loaded

    for module, name in ((data, "load_dataset"), (data_cache, "load_dataset"), (data_cache, "load_dataset_cached"),
                         (runtime, "load_dataset_cached"), (runtime, "build_model"), (runtime, "get_runtime"),
                         (server_run, "get_runtime"), (server_run, "initial_trainable_state")):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, load)


def test_promptfcl_simulate_refuses_a_conflicting_option_before_loading(no_loading, tmp_path, capsys):
    from promptfcl.server.cli import main

    assert main(["simulate", "--strategy", "hepco", *SETS, "--out", str(tmp_path / "out")]) == 2
    assert CONFLICT_MESSAGE in capsys.readouterr().err


def test_the_serverapp_refuses_a_conflicting_option_before_loading(no_loading, tmp_path):
    from promptfcl.server.app import main

    cfg = tiny_config(**CONFLICT, **{"out-dir": str(tmp_path / "out")})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg.to_dict())
    with pytest.raises(ConfigError, match=CONFLICT_MESSAGE):
        main(None, context)
    # the same run without the conflict gets as far as loading
    fine = tiny_config(**{**CONFLICT, "hepco.diagnostics": False}, **{"out-dir": str(tmp_path / "fine")})
    with pytest.raises(Loaded):
        main(None, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=fine.to_dict()))


def test_bench_checks_every_method_before_any_run(no_loading, tmp_path, capsys):
    from promptfcl.server.cli import main

    code = main(["bench", "robustness", "--methods", "fedavg,hepco", "--attacks", "poison", "--defences", "off",
                 "--out", str(tmp_path), *SETS])
    assert code == 2 and CONFLICT_MESSAGE in capsys.readouterr().err


def test_a_client_checks_privacy_without_the_methods_strategy():
    """The client's subset refuses what the server's check refuses, and imports no strategy."""
    code = """
import sys
from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.strategies.platform.run_checks import check_client_run, check_run
cfg = ExperimentConfig.from_dict({"strategy": "hgp", "dp.clip": 1.0, "hgp.cov-type": "lowrank"})
for check in (check_run, check_client_run):
    try:
        check(cfg)
        raise SystemExit("accepted")
    except ConfigError as exc:
        assert "strategy 'hgp' does not support differential privacy" in str(exc), exc
check_run(ExperimentConfig.from_dict({"strategy": "hepco"}))
loaded = sorted(m for m in sys.modules if m.endswith((".strategy", ".learner")) and m.startswith("promptfcl."))
assert not loaded, loaded
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    assert done.returncode == 0, done.stderr[-2000:]


CHECKS = {"check_schedule", "check_privacy", "privacy_refusal"}


def test_runs_are_checked_in_one_module():
    """check_schedule / check_privacy are called from run_checks alone; no strategy declares checks."""
    callers = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] not in ("common", "strategies", "client", "server"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                if name in CHECKS and path.relative_to(ROOT) != Path("strategies/platform/run_checks.py"):
                    callers.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not callers, callers
    from promptfcl.strategies.platform.strategy import PromptStrategy
    from promptfcl.strategies.registry import methods, strategy_class

    for name in methods():
        declared = {n for klass in strategy_class(name).__mro__ for n in vars(klass)}
        assert not declared & (CHECKS | {"random_tasks", "asynchronous_tasks"}), name
    assert not {"check_schedule", "privacy_refusal", "check_privacy"} & set(dir(PromptStrategy))


def test_what_a_method_supports_is_data_on_its_options():
    from promptfcl.strategies.registry import learner_class, methods, options_class, strategy_class

    for name in methods():
        options = options_class(name)
        assert issubclass(options, MethodOptions) and options.prefix == name
        assert "COMPATIBILITY" in vars(options), f"{name} declares no COMPATIBILITY"
        assert isinstance(options.COMPATIBILITY, frozenset) and options.COMPATIBILITY <= CAPABILITIES
        assert set(options.WHY_NOT) <= CAPABILITIES - options.COMPATIBILITY
        # the strategy and the learner read the options the registry names
        assert strategy_class(name).options_class is options is learner_class(name).options_class
    assert "differential-privacy" not in options_class("powder").COMPATIBILITY
    assert {n for n in methods() if "random-tasks" not in options_class(n).COMPATIBILITY} == {"fppl", "hepco", "hgp",
                                                                                                "lorm", "pilora"}
    assert options_class("lorm").COMPATIBILITY == frozenset()  # synchronous stream, no DP (its Grams)
