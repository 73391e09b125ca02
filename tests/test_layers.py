"""The code's structure: layers, no import cycles, Flower's internals behind one door.

Every import statement is read from the source (those inside functions included), so an
import hidden in a function cannot break the layering unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: common <- strategies <- client <- server: a package may import only those at or left of it
LAYERS = ["common", "strategies", "client", "server"]


def package_of(path: Path) -> str:
    """The installed package a file's relative imports start from (``promptfcl.strategies.hgp``)."""
    parts = path.resolve().relative_to(ROOT).parts[:-1]
    return ".".join(("promptfcl", *parts))


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a file, at any depth (not those only type
    checkers run); a relative import is resolved against the file's package, as Python does."""
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and
                 isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                 for stmt in block.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom):
            base = package_of(path).split(".")
            base = base[: len(base) - node.level + 1]
            if node.module:
                out.append((node.lineno, ".".join([*base, node.module])))
            else:  # ``from . import options``: each name is a module of that package
                out += [(node.lineno, ".".join([*base, alias.name])) for alias in node.names]
    return out


def project_modules() -> dict[str, Path]:
    """Every module of the four layers by its installed name (``promptfcl.strategies.hgp.strategy``)."""
    out = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(("promptfcl", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return out


def layer_of(module: str) -> str | None:
    """The layer a module name belongs to (None: not the project's)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "promptfcl" and parts[1] in LAYERS else None


def test_no_import_goes_against_the_layers():
    bad = []
    for name, path in project_modules().items():
        own = LAYERS.index(layer_of(name))
        for line, module in imports_of(path):
            top = layer_of(module)
            if top is not None and LAYERS.index(top) > own:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "imports against common <- strategies <- client <- server:\n  " + "\n  ".join(bad)


def test_the_layers_are_imported_by_their_installed_name_only():
    """``promptfcl.common...`` (or relative, inside the package), never a bare ``common...``: the
    repository root on sys.path would make a second copy of every module (and of every class) in tests."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for folder in (*LAYERS, "tests", "deploy", "scripts") for path in sorted((ROOT / folder).rglob("*.py"))
           for line, module in imports_of(path) if module.split(".")[0] in LAYERS]
    assert not bad, "\n  ".join(bad)


def test_the_layers_import_each_other_relatively():
    """Inside the package every project import is relative, so tools that read the checkout (a type
    checker, an editor) resolve them without the installed name, which the checkout has no folder for."""
    bad = [f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}"
           for path in project_modules().values() for node in ast.walk(ast.parse(path.read_text()))
           if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "promptfcl"]
    bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}"
            for path in project_modules().values() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Import) for alias in node.names if alias.name.split(".")[0] == "promptfcl"]
    assert not bad, "use a relative import:\n  " + "\n  ".join(bad)


def test_no_import_cycles_between_modules():
    modules = project_modules()
    graph = {name: {m for _, m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}
    cycles = set()

    def visit(node: str, stack: list[str]) -> None:
        for nxt in graph[node]:
            if nxt in stack:
                cycle = stack[stack.index(nxt):]
                start = cycle.index(min(cycle))
                cycles.add(" -> ".join(cycle[start:] + cycle[:start] + [min(cycle)]))
            elif len(stack) < 12:
                visit(nxt, stack + [nxt])

    for name in graph:
        visit(name, [name])
    assert not cycles, "import cycles (imports inside functions included):\n  " + "\n  ".join(sorted(cycles))


def test_flower_internals_are_used_only_through_one_module():
    """Names outside Flower's public API come from common/flower_internals.py only."""
    public = ("flwr.app", "flwr.serverapp", "flwr.clientapp")
    bad = []
    for folder in (*LAYERS, "tests", "deploy"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "flower_internals.py":
                continue
            for line, module in imports_of(path):
                if module.split(".")[0] == "flwr" and not module.startswith(public) and module != "flwr":
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "Flower internals imported directly; add them to common/flower_internals.py:\n  " + "\n  ".join(bad)


def test_every_flower_internal_promptfcl_uses_exists():
    """Fails with every missing name and its public replacement after a Flower upgrade."""
    from promptfcl.common.flower_internals import missing_internals

    missing = missing_internals()
    assert not missing, "the installed Flower lacks:\n  " + "\n  ".join(missing)


def test_code_cites_papers_by_title_not_by_a_path_outside_the_repository():
    """../shared is not part of this repository: a path into it means nothing to a reader."""
    import re

    offenders = []
    for path in [*ROOT.glob("*.toml"), *(p for d in [*LAYERS, "configs", "tests", "deploy", "scripts"]
                                          for p in (ROOT / d).rglob("*") if p.suffix in {".py", ".toml", ".sh"})]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"papers/\d{3}|shared/(REFERENCE|ENVIRONMENT|README)", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert not offenders, offenders


def test_strategies_never_name_client_code_even_as_strings():
    """A lazy "promptfcl.client.x:Y" string in strategies/ is an upward import in disguise."""
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "strategies").rglob("*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if '"client.' in line or "'client." in line]
    assert not offenders, offenders


def test_every_method_has_a_strategy_and_a_learner():
    import torch

    from promptfcl.common.model.trainable import ModuleShape, TrainableModule
    from promptfcl.strategies.platform.learner import LocalLearner
    from promptfcl.strategies.platform.strategy import PromptStrategy
    from promptfcl.strategies.registry import (
        learner_class,
        methods,
        options_class,
        private_records,
        prompt_class,
        statistics_of,
        strategy_class,
    )

    assert set(methods()) == {"c2prompt", "fedavg", "fedcprompt", "fppl", "hepco", "hgp", "lorm", "pilora", "powder"}
    for name, method in methods().items():
        strategy, learner = strategy_class(name), learner_class(name)
        assert issubclass(strategy, PromptStrategy) and issubclass(learner, LocalLearner)
        # both sides read what the Method declares, found by their package (no copy of their own)
        assert strategy.name == name
        assert strategy.prompt_class is prompt_class(name) is method.load("prompt")
        assert learner.options_class is strategy.options_class is options_class(name)
        assert strategy.private_records == private_records(name) and strategy.statistics == statistics_of(name)
        # every module family implements the trainable-module protocol the prompted model uses
        with torch.device("meta"):
            module = prompt_class(name).of(ModuleShape(16, (0, 1), 2, 4, 2))
        assert isinstance(module, torch.nn.Module) and isinstance(module, TrainableModule), name


#: what a method declares once, in its Method (strategies/registry.py), and its classes read from there
DECLARED = {"name", "prompt_class", "options_class", "private_records", "statistics"}


def test_a_method_folder_declares_each_thing_once():
    """A method's name, module, options, privacy bounds and statistics are its ``Method``'s (its
    package's __init__.py): no strategy or learner class of its folder states one again."""
    import importlib
    import inspect
    import pkgutil

    from promptfcl.strategies.platform.learner import LocalLearner
    from promptfcl.strategies.platform.strategy import PromptStrategy
    from promptfcl.strategies.registry import methods

    offenders, seen = [], set()
    for method in methods().values():
        package = importlib.import_module(method.package)
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{method.package}.{info.name}")
            for cls in vars(module).values():
                if (inspect.isclass(cls) and cls.__module__ == module.__name__
                        and issubclass(cls, (PromptStrategy, LocalLearner))):
                    seen.add(cls)
                    offenders += [f"{cls.__module__}.{cls.__name__}.{attr}" for attr in DECLARED & set(vars(cls))
                                  if not inspect.isfunction(vars(cls)[attr])]  # a method of that name is not one
    assert len(seen) >= 2 * len(methods()) and not offenders, offenders


def test_a_declaration_is_read_by_the_package_that_defines_the_class():
    """A class outside every method package reads the platform's defaults or its own body; a subclass
    of a method's class, wherever it is defined, reads that method's declaration."""
    from promptfcl.common.config.options import NoOptions
    from promptfcl.common.model.prompted import CodaPrompt
    from promptfcl.strategies.lorm.options import LoRMOptions
    from promptfcl.strategies.lorm.prompt import LoRMAdapters
    from promptfcl.strategies.lorm.strategy import LoRMStrategy
    from promptfcl.strategies.platform.strategy import PromptStrategy

    class Tuned(LoRMStrategy):
        pass

    class Own(PromptStrategy):
        name = "own"

    assert (Tuned.name, Tuned.prompt_class, Tuned.options_class) == ("lorm", LoRMAdapters, LoRMOptions)
    assert (Own.name, Own.prompt_class, Own.options_class, Own.statistics) == ("own", CodaPrompt, NoOptions, {})


#: what every method folder holds, by the same names (extras beside them are the method's own)
METHOD_FILES = {"__init__.py", "options.py", "prompt.py", "strategy.py", "learner.py"}


def test_every_method_is_one_folder_laid_out_alike():
    from promptfcl.strategies.registry import methods

    for name, method in methods().items():
        folder = ROOT / "strategies" / name
        assert method.package == f"promptfcl.strategies.{name}" and folder.is_dir()
        assert METHOD_FILES <= {p.name for p in folder.glob("*.py")}, name
        assert (method.strategy, method.learner, method.prompt) == (
            ".strategy:" + method.load("strategy").__name__, ".learner:" + method.load("learner").__name__,
            ".prompt:" + method.load("prompt").__name__)
        assert method.records in ("", ".records:PRIVATE_RECORDS")
    # no method code outside its folder: client/ holds the ClientApp, a message's context, the node's own
    # rules (its memory plan among them) and its executor
    assert {p.stem for p in (ROOT / "client").glob("*.py")} == {"__init__", "app", "faults", "memory",
                                                                "message_context", "node_data", "node_policy",
                                                                "warm_executor", "zygote"}


def test_no_method_reads_the_whole_configuration():
    """A method's code sees the sections the platform hands its strategy and learner (their ``of``
    reads the configuration once), never the whole ``ExperimentConfig``; a runtime carries none."""
    import dataclasses

    from promptfcl.common.model.runtime import Runtime
    from promptfcl.strategies.registry import methods

    for name in methods():
        for path in (ROOT / "strategies" / name).glob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            named = ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
                     | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
                     | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
                     | {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)})
            assert not {"ExperimentConfig", "cfg"} & named, path
    assert not {f.name for f in dataclasses.fields(Runtime)} & {"cfg", "config"}


def test_no_method_overrides_the_platforms_contract():
    """The platform owns configure/aggregate and the reply checks; a method that tries is refused."""
    import pytest

    from promptfcl.strategies.platform.strategy import SEALED, PromptStrategy
    from promptfcl.strategies.registry import methods, strategy_class

    for name in methods():
        cls = strategy_class(name)
        for klass in cls.__mro__[: cls.__mro__.index(PromptStrategy)]:
            assert not SEALED & set(vars(klass)), (name, klass)
    with pytest.raises(TypeError, match="overrides \\['aggregate_train'\\]"):
        type("Rogue", (PromptStrategy,), {"aggregate_train": lambda self, *a: None})


def test_no_learner_overrides_the_platforms_loop():
    """The platform owns local training (fit and its pieces); a method fills hooks, and a learner
    that overrides a sealed name is refused."""
    import pytest

    from promptfcl.strategies.platform.learner import SEALED, LocalLearner
    from promptfcl.strategies.registry import learner_class, methods

    assert "fit" in SEALED
    for name in methods():
        cls = learner_class(name)
        for klass in cls.__mro__[: cls.__mro__.index(LocalLearner)]:
            assert not SEALED & set(vars(klass)), (name, klass)
    with pytest.raises(TypeError, match="overrides \\['fit'\\]"):
        type("Rogue", (LocalLearner,), {"fit": lambda self, *a: None})


def test_every_learner_hook_is_documented():
    """Each public method of LocalLearner is sealed, a hook or a helper hooks use; every hook is
    listed in the learner's module docstring and in docs/extending.md's client-hook table."""
    import inspect

    from promptfcl.strategies.platform import learner
    from promptfcl.strategies.platform.learner import HOOKS, SEALED, LocalLearner

    # validation helpers (Fed-CPrompt's early stopping); the labels a fit sees (a label-flipping client's flipped)
    helpers = {"accuracy", "correct", "validation_loss", "labels_of"}
    public = {name for name, value in vars(LocalLearner).items() if inspect.isfunction(value) and name[0] != "_"}
    assert public <= SEALED | set(HOOKS) | helpers, sorted(public - SEALED - set(HOOKS) - helpers)
    guide = (ROOT / "docs" / "extending.md").read_text()
    for hook in HOOKS:
        assert f"``{hook}(" in (learner.__doc__ or ""), hook
        assert f"| `{hook}(" in guide, hook


#: a train message of each method named in argv (with its run-config settings, JSON) through the
#: ClientApp's handler, in one fresh interpreter; prints the modules it loaded
CLIENT_ONLY = """
import json, sys
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import MessageType
from promptfcl.client.app import train
from promptfcl.common.records import to_array_record
from promptfcl.common.model.runtime import get_runtime, layout_of
from promptfcl.strategies.registry import prompt_class
from tests.conftest import flower_task_identity, tiny_config

for method, settings in json.loads(sys.argv[1]).items():
    cfg = tiny_config(strategy=method, **settings)
    runtime = get_runtime(cfg, prompt_class(method))
    classes = runtime.data.num_classes
    state = {k: v.numpy().copy() for k, v in runtime.model.trainable_state().items()}
    config = {"task": 0, "round": 0, "client-id": 0, "config-digest": cfg.digest(), "num-classes": classes}
    if method == "powder":  # what Powder's server sends: the local pool's slices and the task's head rows
        rows = {k: layout_of(cfg, classes).task_rows(k, v, 0) for k, v in state.items()}
        state = {k: v if rows[k] is None else v[rows[k]] for k, v in state.items()}
        config["powder-tasks"] = [0]
    node = {"data-from-run": True, "weights-from-run": True}
    ctx = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=cfg.to_dict())
    with flower_task_identity():
        msg = Message(content=RecordDict({"arrays": to_array_record(state), "config": ConfigRecord(config)}),
                      dst_node_id=1, message_type=MessageType.TRAIN)
        reply = train(msg, ctx)
    assert reply.content["metrics"]["num-examples"] > 0, method
print(json.dumps(sorted(sys.modules)))
"""


def test_a_client_imports_only_its_methods_client_side():
    """The registry's promise: a ClientApp that trains a method loads its learner, prompt, options
    and records, never a strategy module (HePCo's latent generator and distillation among them),
    checked in a fresh interpreter that trains HePCo, Powder and FPPL (under DP: its records' bounds)."""
    import json
    import os
    import subprocess
    import sys

    methods = {"hepco": {}, "powder": {}, "fppl": {"dp.clip": 1.0}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CLIENT_ONLY, json.dumps(methods)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert {f"promptfcl.strategies.{m}.learner" for m in methods} <= loaded
    server_side = {m for m in loaded if m.startswith("promptfcl.strategies.") and m.endswith(".strategy")}
    server_side |= {m for m in loaded if m.startswith("promptfcl.server")}
    server_side |= {"promptfcl.strategies.hepco.latents", "promptfcl.strategies.hepco.distill"} & loaded
    assert not server_side, sorted(server_side)
