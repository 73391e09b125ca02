"""promptfcl's server side: the ServerApp, the task loop, checkpoints, reports, the simulation
launcher, benchmarks and the command line.

promptfcl installs its four layers under their own top-level names (``common``,
``strategies``, ``client``, ``server``) because Flower loads an app's components by module
path from the app directory (``serverapp = "server.app:app"``) and ships that directory
as it is to the nodes; nesting them under one ``promptfcl`` package would need another
folder layout. What that risks, another installed package with one of these names shadowing
ours, is caught here with a clear error rather than a confusing import failure later.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _name in ("common", "strategies", "client"):
    _spec = importlib.util.find_spec(_name)
    _where = Path(_spec.origin).resolve().parent.parent if _spec is not None and _spec.origin else None
    if _where != _ROOT:
        raise ImportError(
            f"promptfcl's `{_name}` package should come from {_ROOT}, but "
            f"{_spec.origin if _spec is not None else 'nothing'} was found: another installed package uses the "
            f"top-level name `{_name}`; uninstall it or use a separate virtual environment for promptfcl")
