"""Typed options: run-config values converted strictly, and the base of every method's options.

A method's options are the run-config keys ``<method>.<key>`` (``hgp.cov-type``); the method
declares them as a dataclass subclass of :class:`MethodOptions`, with what of a run it supports
(``COMPATIBILITY``) and its own checks against the run (``check_run``); the platform checks and
parses them once (strategies/platform/run_checks.py) into the object the strategy and the
learner receive.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigError

if TYPE_CHECKING:  # config parses its values through this module; no import back at run time
    from ..privacy import PrivacyOptions
    from .sections import DataSection, EvaluationSection, FederationSection, ModelSection

# What a run may ask of a method (a method's ``COMPATIBILITY`` lists those it supports, as in
# Mammoth's ``COMPATIBILITY``); strategies/platform/run_checks.py refuses a run that asks for more.
#: clients on different tasks in one round (``switch-fraction`` < 1 or ``switch-every`` > 0)
ASYNCHRONOUS_TASKS = "asynchronous-tasks"
#: Powder's random tasks (``task-generator = "random"``); they are asynchronous too
RANDOM_TASKS = "random-tasks"
#: differential privacy (``dp.*``, common/privacy.py): the method's uploads can be bounded
DIFFERENTIAL_PRIVACY = "differential-privacy"
CAPABILITIES = frozenset({ASYNCHRONOUS_TASKS, RANDOM_TASKS, DIFFERENTIAL_PRIVACY})


def coerce_value(key: str, value: Any, type_name: Any) -> Any:
    """Convert a run-config value (TOML or CLI string) to the field's type, strictly.

    Shared by the run config and every method's options dataclass."""
    t = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", str(type_name))
    try:
        if t == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError
        if t == "int":
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if t == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if t == "str":
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} = {value!r} is not a valid {t}") from None
    raise ConfigError(f"{key}: unsupported field type {t}")


class MethodOptions:
    """Base of every method's options dataclass (run-config keys ``<prefix>.<key>``, kebab-case).

    A method declares a dataclass subclass with its fields (a trailing underscore keeps a
    Python keyword usable: ``lambda_`` is the key ``lambda``), sets ``prefix`` and
    overrides ``validate``; parsing, coercion and unknown-key errors live here once.
    """

    prefix: ClassVar[str] = ""
    #: what of a run the method supports (names from ``CAPABILITIES``): a run that needs one it
    #: lacks is refused before anything is loaded (strategies/platform/run_checks.py)
    COMPATIBILITY: ClassVar[frozenset[str]] = CAPABILITIES
    #: why the method lacks a capability, where the refusal should say more than that it does
    WHY_NOT: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def key_of(cls, name: str) -> str:
        """The run-config key of field ``name`` (without the prefix)."""
        return name.rstrip("_").replace("_", "-")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> Any:
        """Parse ``<prefix>.*`` options (prefix removed); unknown keys and bad values raise ConfigError."""
        known = {cls.key_of(f.name): f for f in fields(cls)}  # type: ignore[arg-type]
        values: dict[str, Any] = {}
        for key, raw in (options or {}).items():
            f = known.get(str(key)) or known.get(str(key).replace("_", "-"))
            if f is None and not known:
                raise ConfigError(f"{cls.prefix!r} takes no options, got {cls.prefix}.{key}")
            if f is None:
                raise ConfigError(f"unknown option {cls.prefix}.{key}; known: "
                                  f"{', '.join(f'{cls.prefix}.{k}' for k in sorted(known))}")
            values[f.name] = coerce_value(f"{cls.prefix}.{key}", raw, f.type)
        opts = cls(**values)
        opts.validate()
        return opts

    def validate(self) -> None:
        """Raise ConfigError for values that cannot work."""

    def check_run(self, *, data: DataSection, federation: FederationSection, model: ModelSection,
                  evaluation: EvaluationSection, privacy: PrivacyOptions) -> None:
        """Raise ConfigError where these options cannot work with a run of these sections and
        ``privacy`` (its ``dp.*``) (beyond ``COMPATIBILITY``); called once before anything is loaded.
        An override names the inputs it reads and takes the others as ``**_``. Default: no such check."""

    def to_dict(self) -> dict[str, Any]:
        """The options as run-config keys (prefix removed)."""
        return {self.key_of(f.name): getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class NoOptions(MethodOptions):
    """A method without options of its own (FedAvg-Prompt)."""
