"""Experiment configuration: one frozen, validated object of sections built from Flower's run config.

Flower hands every ServerApp and ClientApp the same flat ``context.run_config``
(``[tool.flwr.app.config]`` in pyproject.toml plus ``--run-config`` overrides).
Keys are kebab-case (``num-tasks``); method-specific keys are namespaced by the
strategy name (``hepco.lambda-kl``) and are validated by the strategy itself. Each key is a
field of one section (common/config/sections.py); the flat keys exist only at the edges
(``from_run_config``, ``from_dict``, ``to_dict``, ``replace``, the digest).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ConfigError  # re-exported: the error of configurations
from .checks import (  # noqa: F401
    AGGREGATIONS,
    AUGMENTATIONS,
    CENTRALISED_MODES,
    DEFENCES,
    DEVICES,
    EVALUATIONS,
    FAULTS,
    HEADS,
    PARTITIONS,
    POPULATIONS,
    PRECISIONS,
    PROMPT_MODES,
    TASK_GENERATORS,
    valid_ray_address,
    validate_config,
)
from .options import coerce_value
from .sections import (  # noqa: F401
    IDENTITIES,
    SECTION_CLASSES,
    SECTIONS,
    CachingSection,
    DataSection,
    EvaluationSection,
    FederationSection,
    ModelSection,
    OutputSection,
    PlacementSection,
    RobustnessSection,
    RunSection,
    TrainingSection,
)

DP_NAMESPACE = "dp"  # differential privacy's run-config keys, dp.* (common/privacy.py)

#: the flat keys in the order ``to_dict`` (results.json, checkpoints, splits.npz) has always listed
#: them; tests/test_config.py checks it names every key of every section once
FLAT_ORDER = (
    "strategy", "seed", "out-dir", "device", "threads", "precision", "dataset", "data-dir", "hf-revision",
    "num-tasks", "task-generator", "num-rounds", "classes-per-task", "min-overlap", "task-data-fraction",
    "task-data-sharing", "head", "test-fraction", "max-train-per-class", "max-test-per-class", "splits",
    "num-clients", "clients-per-round", "client-fraction", "rounds-per-task", "switch-every", "switch-fraction",
    "partition", "dirichlet-beta", "classes-per-client", "min-partition-size", "dirichlet-balance",
    "partition-scope", "partition-class-order", "category-ratio", "split-ratio", "imbalance-ratio", "centralised",
    "centralised-mode", "round-timeout", "min-replies", "round-retries", "max-reply-bytes", "defences",
    "update-norm-factor", "update-clip", "update-clip-by-count", "update-strike-norm", "update-min-cosine",
    "update-reversed-norm", "update-strikes", "update-mean-cosine", "update-mean-cosine-after", "update-norm-rounds",
    "stats-bound", "max-update-norm", "max-client-weight", "aggregation", "trim-fraction", "resume", "max-rounds",
    "keep-checkpoint", "tracker", "fault", "fault-rate", "fault-clients", "fault-hang-seconds", "fault-z",
    "fault-epsilon", "fault-knowledge", "byzantine-clients", "ray-address",
    "client-cpus", "client-gpus", "population", "evaluation", "evaluate-every", "evaluate-with-train", "num-classes",
    "class-names", "local-epochs", "batch-size", "lr", "lr-schedule", "lr-schedule-epochs", "augment",
    "augment-crop-scale", "input-norm", "resize-interpolation", "eval-crop", "query-cache", "data-cache",
    "query-cache-disk", "backbone", "weights", "image-size", "patch-size", "embed-dim", "depth", "num-heads",
    "backbone-cache-disk", "prompt-mode", "prompt-tokens", "prompt-layers", "pool-size", "prompt-length",
    "ortho-init",
)


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything that defines one run, as its sections. Defaults are the offline default experiment.

    Code reads a section (``cfg.data.num_tasks``) and passes on the sections a part needs; the
    flat kebab-case keys of Flower's run config exist only at the edges (:meth:`from_run_config`,
    :meth:`from_dict`, :meth:`to_dict`, :meth:`replace`). The paper-scale settings live in
    ``configs/*.toml``; see README.
    """

    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    federation: FederationSection = field(default_factory=FederationSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    model: ModelSection = field(default_factory=ModelSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    robustness: RobustnessSection = field(default_factory=RobustnessSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    output: OutputSection = field(default_factory=OutputSection)
    caching: CachingSection = field(default_factory=CachingSection)
    # method-specific options, "<strategy>.<key>" -> value (and dp.*)
    method: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_config(self)  # each section has checked its own values when it was made

    # ------------------------------------------------------------------ derived
    @property
    def per_task_head(self) -> bool:
        """Whether the head has a block of rows per task (``head``; "auto": with random tasks)."""
        return self.model.per_task_head(self.data)

    def method_options(self, name: str) -> dict[str, Any]:
        """Options namespaced ``name.*`` with the prefix removed (keys kebab-case)."""
        prefix = name + "."
        return {k[len(prefix) :]: v for k, v in self.method.items() if k.startswith(prefix)}

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        """Flat kebab-case dict, the same shape as Flower's run config."""
        out = {k: getattr(getattr(self, section), name) for k, (section, name) in _FLAT.items()}
        out.update(self.method)
        return out

    def fingerprint(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def digest(self) -> str:
        """Short hash of the full configuration; server and clients must agree on it."""

        relevant = {k: v for k, v in self.to_dict().items() if k not in RESULT_NEUTRAL_KEYS}
        return hashlib.sha1(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:12]

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> ExperimentConfig:
        """From Flower's ``context.run_config``; an empty one is an error, not the defaults.

        Flower fuses the overrides into every key pyproject.toml declares, so the run config
        holds every method's options (``[tool.flwr.app.config.<method>]``); only the run's
        method's and ``dp.*`` are kept (Flower has already refused keys it does not declare).
        """
        if not run_config:
            raise ConfigError(
                "the run config is empty: Flower did not pass the app's configuration "
                "(run with `flwr run .` or `promptfcl simulate`)"
            )
        strategy = str(run_config.get("strategy", RunSection.strategy))
        kept = (f"{strategy}.", f"{DP_NAMESPACE}.")
        return cls.from_dict({k: v for k, v in run_config.items() if "." not in k or k.startswith(kept)})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ExperimentConfig:
        """Build from a flat kebab-case mapping; unknown keys are an error, not ignored."""
        return cls().replace(**{k.replace("-", "_"): v for k, v in raw.items() if "." not in k},
                             method={k: v for k, v in raw.items() if "." in k})

    def replace(self, method: Mapping[str, Any] | None = None, **changes: Any) -> ExperimentConfig:
        """This configuration with flat keys changed (``lr=0.5``, ``num_tasks=10``; kebab or snake
        case) or whole sections replaced (``training=TrainingSection(...)``); checked again."""
        sections: dict[str, dict[str, Any]] = {}
        whole: dict[str, Any] = {}
        for name, value in changes.items():
            if name in SECTION_CLASSES and isinstance(value, SECTION_CLASSES[name]):
                whole[name] = value
                continue
            kebab = name.replace("_", "-")
            where = _FLAT.get(kebab)
            if where is None:
                raise ConfigError(f"unknown configuration key {kebab!r}; known keys: {', '.join(sorted(_FLAT))}")
            section, attr = where
            sections.setdefault(section, {})[attr] = coerce_value(kebab, value, _TYPES[kebab])
        for section, values in sections.items():
            whole[section] = dataclasses.replace(whole.get(section, getattr(self, section)), **values)
        if method is not None:
            whole["method"] = dict(method)
        return dataclasses.replace(self, **whole)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ConfigError for values that cannot work together; checked before any training
        (common/config/checks.py)."""
        validate_config(self)


#: flat key -> (section, field), in ``FLAT_ORDER``
_FLAT: dict[str, tuple[str, str]] = {
    k: where for k in FLAT_ORDER
    for where in [next((s, f.name) for s in SECTIONS for f in fields(SECTION_CLASSES[s])
                       if f.name.replace("_", "-") == k)]
}
#: flat key -> its declared type (for coercing run-config values)
_TYPES: dict[str, Any] = {
    f.name.replace("_", "-"): f.type for s in SECTIONS for f in fields(SECTION_CLASSES[s])
}


def keys_of(identity: str) -> tuple[str, ...]:
    """The run-config keys (kebab-case) that enter ``identity`` (one of ``IDENTITIES``)."""
    return tuple(k for k, (s, name) in _FLAT.items()
                 if identity in {f.name: f for f in fields(SECTION_CLASSES[s])}[name].metadata["identities"])


def keys_in(section: str) -> tuple[str, ...]:
    """The run-config keys (kebab-case) of ``section`` (one of ``SECTIONS``)."""
    return tuple(f.name.replace("_", "-") for f in fields(SECTION_CLASSES[section]))


#: keys that do not change what a run computes (excluded from the digest clients check)
RESULT_NEUTRAL_KEYS = frozenset(k for s in SECTIONS for k in keys_in(s)) - frozenset(keys_of("results"))
