"""Methods, found by name from the run configuration (``strategy = "<name>"``): the one registry.

A method is one folder: a package whose ``__init__.py`` defines ``METHOD``, a :class:`Method`
naming its strategy (the server's side, a ``PromptStrategy`` subclass that fills the platform's
hooks), its learner (the client's side, a ``LocalLearner`` subclass), its prompt module, its
options (what both sides read, and what a run is checked against), and the privacy bounds and
the statistics declarations of the records its clients upload, each relative to the package;
the folder holds everything else of the method (records, losses). The ``Method`` is the one
declaration of these: the strategy and the learner read their ``name``, ``prompt_class``,
``options_class``, ``private_records`` and ``statistics`` from it (``Declared``: the method is
found by the package that defines the class), so no class body repeats them. Every folder of
``promptfcl/strategies`` that defines ``METHOD`` is a method; so is every package another
distribution registers under the entry-point group ``promptfcl.methods`` (``name = "package"``),
so a method can live outside this repository. Each part is imported on first use: a client
process loads only its own method's client side (learner, prompt, options, records), never its
strategy module; checking a run loads only the options.

Each method names the paper to cite for it (``Method.citation``, one BibTeX entry: the one place
the project keeps it; docs/methods.md repeats it and a test keeps the two equal).

A run is checked against its method's options by strategies/platform/run_checks.py.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
import re
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from ..common.config.experiment import ConfigError, ExperimentConfig
from ..common.config.files import toml_value
from ..common.config.options import MethodOptions, NoOptions
from ..common.privacy import NAMESPACE as DP_NAMESPACE
from ..common.privacy import PrivacyOptions, PrivateRecord

ENTRY_POINTS = "promptfcl.methods"


@dataclass(frozen=True)
class Method:
    """A method by name, and where its two halves live (``".module:Class"``, relative to ``package``)."""

    name: str
    strategy: str  # a PromptStrategy subclass: the server's side
    learner: str  # a LocalLearner subclass: local learning
    #: the trainable module both sides build (common/model/trainable.py's protocol: a CodaPrompt or a
    #: LowRankAdapters subclass; the strategy's ``prompt_class``)
    prompt: str
    #: the privacy bounds of what a client uploads besides its arrays (``record name -> PrivateRecord``,
    #: the strategy's ``private_records``); "": no extra upload is bounded
    records: str = ""
    #: a MethodOptions subclass, what both sides read and a run is checked against ("": no options)
    options: str = ""
    #: what each uploaded record of statistics holds (``record name -> Statistics``, the strategy's
    #: ``statistics``, read by the client's fault injection); "": none
    statistics: str = ""
    package: str = ""  # the method's package (set by discovery)
    #: named settings of the method's options a paper compares against (``bench compare``
    #: runs ``<name>/<variant>``), e.g. HePCo's FedAvg-Prompt baseline
    variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    #: the paper to cite for the method, one BibTeX entry (venue, year and authors as the paper's
    #: text prints them); "" for a method without one
    citation: str = ""
    #: what :meth:`declared` loaded, by field (each Method its own: a re-imported package is a new Method)
    _loaded: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @property
    def citation_key(self) -> str | None:
        """The BibTeX key of :attr:`citation` (None without one)."""
        found = re.match(r"\s*@\w+\s*\{\s*([^,\s]+)\s*,", self.citation)
        return found.group(1) if found else None

    @property
    def citation_title(self) -> str | None:
        """The title of :attr:`citation`, without BibTeX's case-protecting braces (None without one)."""
        found = re.search(r"^\s*title\s*=\s*\{(.*)\},?\s*$", self.citation, re.MULTILINE | re.IGNORECASE)
        return found.group(1).replace("{", "").replace("}", "") if found else None

    def variant(self, name: str) -> dict[str, Any]:
        """The options (kebab-case keys, no namespace) of variant ``name``."""
        named = dict(self.variants)
        if name not in named:
            raise ConfigError(f"{self.name} has no variant {name!r}; its variants: {', '.join(named) or 'none'}")
        return dict(named[name])

    def load(self, which: str) -> Any:
        """The strategy, learner, prompt or options class or the records' bounds (``which``), imported on first use."""
        module, attr = getattr(self, which).split(":")
        return getattr(importlib.import_module(module, self.package or None), attr)

    def declared(self, which: str) -> Any:
        """What the method declares under ``which``: its ``name``, its ``prompt`` module class, its
        ``options`` class (``NoOptions`` where it names none), its ``records`` or ``statistics``
        mapping (empty where it names none); imported on first use, once."""
        if which not in self._loaded:
            if which == "name":
                value: Any = self.name
            elif not getattr(self, which):
                value = NoOptions if which == "options" else {}
            else:
                value = self.load(which)
            self._loaded[which] = value
        return self._loaded[which]


T = TypeVar("T")


@functools.cache
def method_of(cls: type) -> Method | None:
    """The method whose package defines ``cls`` or the nearest of its bases; None where none does
    (the platform's base classes, or a class a test defines outside any method package)."""
    packages = {method.package: method for method in methods().values()}
    for klass in cls.__mro__:
        module = klass.__module__
        while module:
            if module in packages:
                return packages[module]
            module = module.rpartition(".")[0]
    return None


class Declared(Generic[T]):
    """A class attribute of a method's strategy or learner that the method declares once, in its
    ``Method`` (its package's ``METHOD``), read from there: ``which`` names the ``Method`` field
    (:meth:`Method.declared`). A class outside every method package (the platform's base, a
    test's) gets ``default``; its own class body may set the attribute, which then hides this."""

    def __init__(self, which: str, default: T) -> None:
        self.which, self.default = which, default

    def __get__(self, obj: object, owner: type) -> T:
        method = method_of(owner)
        return self.default if method is None else method.declared(self.which)  # type: ignore[no-any-return]


@functools.cache
def methods() -> dict[str, Method]:
    """Every method: this package's folders, then entry points of other installed distributions."""
    here = importlib.import_module(__name__.rpartition(".")[0])  # this package: promptfcl.strategies

    found: dict[str, Method] = {}
    packages = [f"{here.__name__}.{info.name}" for info in pkgutil.iter_modules(here.__path__) if info.ispkg]
    packages += [ep.value.split(":")[0] for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)]
    for package in packages:
        spec = getattr(importlib.import_module(package), "METHOD", None)
        if spec is None:
            continue
        if spec.name in found:
            raise ConfigError(f"two methods are named {spec.name!r}: {found[spec.name].package} and {package}")
        found[spec.name] = replace(spec, package=package)
    return found


def cite(name: str) -> str:
    """``name`` with its paper, for a report's method line: ``hgp (cite hgp: "Reducing ...")``;
    the bare name for a method without a citation, or one not installed here (``promptfcl show``
    of a run made elsewhere)."""
    try:
        method = methods().get(name)
    except (ConfigError, ImportError):  # a broken plug-in must not cost a finished run its table
        method = None
    if method is None or method.citation_key is None:
        return name
    return f'{name} (cite {method.citation_key}: "{method.citation_title}")'


def check_method(name: str) -> None:
    if name not in methods():
        raise ConfigError(f"unknown strategy {name!r}; available: {', '.join(sorted(methods()))}")


def strategy_class(name: str) -> Any:
    """The ``PromptStrategy`` subclass of method ``name``."""
    check_method(name)
    return methods()[name].load("strategy")


def learner_class(name: str) -> Any:
    """The ``LocalLearner`` subclass that trains method ``name`` on a client."""
    check_method(name)
    return methods()[name].load("learner")


def options_class(name: str) -> type[MethodOptions]:
    """The options of method ``name`` (without importing either of its sides)."""
    check_method(name)
    return methods()[name].declared("options")  # type: ignore[no-any-return]


def prompt_class(name: str) -> Any:
    """The prompt module a method's clients and server use (its strategy's ``prompt_class``),
    without importing the strategy."""
    check_method(name)
    return methods()[name].load("prompt")


def private_records(name: str) -> dict[str, PrivateRecord]:
    """How differential privacy bounds each record method ``name``'s clients upload besides their
    arrays (its strategy's ``private_records``), without importing the strategy."""
    return _declared(name, "records")


def statistics_of(name: str) -> dict[str, Any]:
    """What each record of statistics method ``name``'s clients upload holds (its strategy's
    ``statistics``: record name -> ``Statistics``), without importing the strategy."""
    return _declared(name, "statistics")


def _declared(name: str, which: str) -> dict[str, Any]:
    """Method ``name``'s mapping ``which`` (``records`` or ``statistics``), loaded from its
    package without the strategy; empty where the method names none."""
    check_method(name)
    return dict(methods()[name].declared(which))


def method_options(strategy: str, options: dict[str, Any]) -> Any:
    """Method ``strategy``'s options (its ``<strategy>.*`` keys, prefix removed: the run config's
    ``method_options(strategy)``), parsed once (ConfigError on unknown keys or bad values)."""
    return options_class(strategy).from_options(options)


def build_strategy(cfg: ExperimentConfig, num_classes: int, runtime: Any = None, held: Any = None) -> Any:
    """The run's server strategy, with its options parsed once (``runtime``: the server's own data
    and backbone, where it has them; ``held``: what each virtual client holds, HeldSamples)."""
    options = method_options(cfg.run.strategy, cfg.method_options(cfg.run.strategy))
    return strategy_class(cfg.run.strategy).of(cfg, num_classes, options, runtime, held)


def build_learner(cfg: ExperimentConfig, runtime: Any) -> Any:
    """The run's local learner on ``runtime``, with the method's options parsed once (by the
    method's declared options class: a client imports no strategy module)."""
    learner = learner_class(cfg.run.strategy)
    return learner.of(cfg, runtime, learner.options_class.from_options(cfg.method_options(cfg.run.strategy)))


def check_namespaces(method_keys: dict[str, Any]) -> None:
    """Every dotted run-config key (``<method>.<option>``) names a method and one of its options.

    Options of methods other than the run's are checked too (a comparison may switch methods,
    and a typo must not pass silently because the method is not the one running). One
    namespace is not a method: ``dp.*``, differential privacy (common/privacy.py).
    """
    namespaces: dict[str, dict[str, Any]] = {}
    for key, value in method_keys.items():
        namespace, _, option = key.partition(".")
        if not option:
            raise ConfigError(f"configuration key {key!r} has an empty option name")
        namespaces.setdefault(namespace, {})[option] = value
    for namespace, options in namespaces.items():
        if namespace == DP_NAMESPACE:
            PrivacyOptions.from_options(options)
            continue
        if namespace not in methods():
            example = next(iter(options))
            raise ConfigError(f"unknown configuration namespace {namespace!r} (in {namespace}.{example}); "
                              f"options are namespaced by method ({', '.join(sorted(methods()))}) or "
                              f"{DP_NAMESPACE!r} (differential privacy)")
        options_class(namespace).from_options(options)


def namespaced_defaults() -> dict[str, dict[str, Any]]:
    """Every namespaced run-config key with its default, by namespace: ``dp`` and each method's
    options. pyproject.toml declares them as ``[tool.flwr.app.config.<namespace>]`` tables
    (:func:`app_config_tables`): Flower's run-config check refuses any key it does not declare."""
    out: dict[str, dict[str, Any]] = {DP_NAMESPACE: PrivacyOptions().to_dict()}
    for name in sorted(methods()):
        defaults = options_class(name)().to_dict()
        if defaults:
            out[name] = defaults
    return out


def app_config_tables() -> str:
    """The ``[tool.flwr.app.config.<namespace>]`` tables of pyproject.toml, as TOML text."""

    blocks = []
    for namespace, options in namespaced_defaults().items():
        lines = [f"[tool.flwr.app.config.{namespace}]"] + [f"{k} = {toml_value(v)}" for k, v in options.items()]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"

