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
    from promptfcl.common.learner import LocalLearner
    from promptfcl.common.model import CodaPrompt
    from promptfcl.strategies.platform.strategy import PromptStrategy
    from promptfcl.strategies.registry import learner_class, methods, options_class, prompt_class, strategy_class

    assert set(methods()) == {"fedavg", "fedcprompt", "fppl", "hepco", "hgp", "powder"}
    for name in methods():
        assert issubclass(strategy_class(name), PromptStrategy) and issubclass(learner_class(name), LocalLearner)
        assert issubclass(prompt_class(name), CodaPrompt)
        # strategy and learner read the same options, those the registry names (a run is checked against them)
        assert learner_class(name).options_class is strategy_class(name).options_class is options_class(name)


#: what every method folder holds, by the same names (extras beside them are the method's own)
METHOD_FILES = {"__init__.py", "options.py", "prompt.py", "strategy.py", "learner.py"}


def test_every_method_is_one_folder_laid_out_alike():
    from promptfcl.strategies.registry import methods

    for name, method in methods().items():
        folder = ROOT / "strategies" / name
        assert method.package == f"promptfcl.strategies.{name}" and folder.is_dir()
        assert METHOD_FILES <= {p.name for p in folder.glob("*.py")}, name
        assert (method.strategy, method.learner) == (".strategy:" + method.load("strategy").__name__,
                                                     ".learner:" + method.load("learner").__name__)
    # no method code outside its folder: client/ holds the ClientApp, the node's own rules (its memory
    # plan among them) and its executor
    assert {p.stem for p in (ROOT / "client").glob("*.py")} == {"__init__", "app", "faults", "memory", "node_data",
                                                                "node_policy", "warm_executor", "zygote"}


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
