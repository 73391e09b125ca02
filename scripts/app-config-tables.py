"""Rewrite pyproject.toml's namespaced run-config tables ([tool.flwr.app.config.<namespace>])
from the code's defaults (promptfcl.strategies.registry.app_config_tables). Run after adding or
changing a method option; tests/test_config.py fails until the two agree.

    .venv/bin/python scripts/app-config-tables.py
"""

from __future__ import annotations

from pathlib import Path

from promptfcl.strategies.registry import app_config_tables

MARK = "[tool.flwr.app.config.dp]"

path = Path(__file__).resolve().parents[1] / "pyproject.toml"
text = path.read_text()
start = text.index(MARK)
rest = text[start:]
# the namespaced tables run to the next table that is not one of them (or the end of the file)
ends = [i for i in range(len(rest)) if rest.startswith("\n[", i) and not rest.startswith("\n[tool.flwr.app.config.", i)]
end = start + (ends[0] + 1 if ends else len(rest))
path.write_text(text[:start] + app_config_tables() + ("\n" if ends else "") + text[end:])
print(f"{path}: namespaced run-config tables rewritten")
