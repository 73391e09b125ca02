"""The project's two user-facing errors, in a module that imports nothing else of the project."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class DataError(RuntimeError):
    """A dataset is missing, unreadable, or does not fit the run (its message names the source and the fix)."""
