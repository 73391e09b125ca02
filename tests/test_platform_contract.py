"""The server platform exchanges values: what methods and the server loop may touch of it.

* a method's strategy module (every registered one, and the toy method of test_toy_method.py)
  fills hooks: it never calls the statistics bound, the update screen or the platform's averaging
  helper, and never reaches the platform's private names (the platform applies the run's policies,
  strategies/platform/policies.py);
* the server loop receives each round as a value (``aggregate_round`` -> ``RoundOutcome``): no
  server module reads the strategy's round state or private names, or assigns its attributes.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import fields
from pathlib import Path

from flwr.serverapp.strategy import FedAvg

from promptfcl.strategies.platform.outcome import RoundOutcome
from promptfcl.strategies.platform.sampling import Sampling
from promptfcl.strategies.platform.strategy import SEALED, PromptStrategy

ROOT = Path(__file__).resolve().parents[1]
#: what only the platform applies: the run's policies and its averaging
PLATFORM_ONLY = {"StatisticsBound", "stats_bound", "UpdateScreen", "screen", "weighting", "average", "average_replies",
                 "RunPolicies", "aggregation_policies", "update_screen"}


def platform_private() -> set[str]:
    """The platform's private names: its classes' (not dunders) and those its constructor sets."""
    names = {n for klass in (PromptStrategy, Sampling) for n in vars(klass) if n.startswith("_")
             and not n.startswith("__")}
    for path in (ROOT / "strategies/platform/strategy.py", ROOT / "strategies/platform/sampling.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
    return names


def method_sources() -> dict[str, str]:
    """Every method's strategy module (source), the toy's included."""
    from tests.test_toy_method import FILES

    out = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "strategies").glob("*/strategy.py"))
           if p.parent.name != "platform"}
    out["tests/test_toy_method.py:strategy.py"] = textwrap.dedent(FILES["strategy.py"])
    return out


def own_names(tree: ast.AST) -> set[str]:
    """Names a method module defines itself (its own private helpers may share a spelling)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                        target.value.id == "self":
                    out.add(target.attr)
    return out


def test_methods_never_apply_the_platforms_policies_or_reach_its_private_names():
    private = platform_private()
    assert {"_accept", "_sent_round", "_update_start"} <= private  # the scan sees the platform
    bad = []
    for name, source in method_sources().items():
        tree = ast.parse(source)
        mine = own_names(tree)
        for node in ast.walk(tree):
            used = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
                node.name if isinstance(node, ast.alias) else None
            if used is None:
                continue
            used = used.rsplit(".", 1)[-1]
            if used in PLATFORM_ONLY or (used in private and used not in mine):
                bad.append(f"{name}:{getattr(node, 'lineno', '?')} uses {used}")
    assert not bad, "methods fill hooks; the platform applies the policies:\n  " + "\n  ".join(bad)


def test_the_platforms_helpers_are_private_and_its_contract_sealed():
    public = {n for n in set(dir(PromptStrategy)) - set(dir(FedAvg)) if not n.startswith("_")}
    assert not public & {"average", "accept", "update_start", "accepted", "rejected", "reply_shares", "reply_nodes",
                         "update_norms", "update_cosines", "placement_of", "defence_counts", "stats_ratios"}
    assert {"__init__", "aggregate_train", "aggregate_round", "configure_train"} <= SEALED  # a method's state: setup
    assert len(public) <= 53, sorted(public)  # 59 before issue 41


def strategy_expression(node: ast.AST) -> bool:
    """``strategy`` or ``<anything>.strategy``: the server's names for the run's strategy."""
    return (isinstance(node, ast.Name) and node.id == "strategy") or \
        (isinstance(node, ast.Attribute) and node.attr == "strategy")


def test_the_server_loop_receives_a_rounds_outcome_instead_of_reading_the_strategy():
    round_state = {f.name for f in fields(RoundOutcome)} - {"arrays", "metrics", "sample_rate"}
    round_state |= {"reply_shares", "reply_nodes", "defence_counts", "last_sample_rate", "policies",
                    "placement_of", "aggregate_train"} | PLATFORM_ONLY
    private = platform_private()
    bad, calls = [], []
    for path in sorted((ROOT / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and strategy_expression(node.value):
                if node.attr in round_state or node.attr in private:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads strategy.{node.attr}")
                if node.attr == "aggregate_round":
                    calls.append(path.name)
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute) and strategy_expression(target.value):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} sets strategy.{target.attr}")
    assert not bad, "the loop reads a round from its RoundOutcome:\n  " + "\n  ".join(bad)
    assert calls == ["rounds.py"]  # train_round, once per attempt
