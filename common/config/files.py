"""Reading a run configuration from where users write it: a TOML file (flat keys, or a
``[tool.flwr.app.config]`` table), ``--set key=value`` pairs, and TOML literals for Flower."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from .experiment import ConfigError, ExperimentConfig


def toml_value(value: object) -> str:
    """``value`` (bool, int, float or str) as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def read_config(
    config_file: str | None, overrides: list[str], strategy: str | None = None, out: str | None = None
) -> ExperimentConfig:
    """Defaults <- TOML file (flat keys, or a [tool.flwr.app.config] table) <- ``--set`` pairs <- flags.

    Only the configuration's own checks run here; ``strategies.platform.run_checks.load_config`` adds the run's.
    """
    raw: dict[str, Any] = {}
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            doc = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        doc = doc.get("tool", {}).get("flwr", {}).get("app", {}).get("config", doc)
        raw.update(_flatten(doc))
    raw.update(parse_overrides(overrides))
    if strategy:
        raw["strategy"] = strategy
    if out:
        raw["out-dir"] = out
    return ExperimentConfig.from_dict(raw)


def _flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["num-tasks=5", "lr=1e-3"]`` -> dict; values parsed as TOML scalars where possible."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} is not of the form key=value")
        key, raw = pair.split("=", 1)
        key, raw = key.strip(), raw.strip()
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw  # bare strings such as dataset=digits
    return out
