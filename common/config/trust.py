"""Trust as a property of the run: whether the hostile-client defences apply.

promptfcl serves two kinds of runs with opposite needs. A simulation of this project's own
clients (the virtual population, no fault injection) has no hostile client: every method must
compute its paper's aggregation exactly, so the defences are off. Nodes of other organisations
(``population = "nodes"``) and runs that inject faults need them on. ``defences`` = "auto"
resolves to exactly that; "on" and "off" force it. The malformed-reply checks and the
``max-client-weight`` cap are not defences in this sense: they never change an honest reply and
are always on.

The resolved value and its reason are logged at start-up and written to results.json
(``defences``), so a reader knows which computation a result is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Trust:
    """The run's resolved ``defences`` setting and why."""

    defended: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"resolved": "on" if self.defended else "off", "why": self.why}

    def describe(self) -> str:
        return f"defences {'on' if self.defended else 'off'}: {self.why}"


def resolve_trust(setting: str, population: str, fault: str) -> Trust:
    """Resolve ``defences`` (``setting``: "auto", "on" or "off") for a run of ``population``
    ("virtual" or "nodes") with fault injection ``fault`` ("" for none)."""
    if setting == "on":
        return Trust(True, "defences = 'on' in the run configuration")
    if setting == "off":
        return Trust(False, "defences = 'off' in the run configuration: every client is trusted")
    if setting != "auto":
        raise ValueError(f"defences must be 'auto', 'on' or 'off', got {setting!r}")
    if population == "nodes":
        return Trust(True, "deployed nodes (population = 'nodes'): clients run other organisations' code")
    if fault:
        return Trust(True, f"fault injection (fault = {fault!r}): some simulated clients are hostile")
    return Trust(False, "a simulation of this project's own clients with no fault injection: every client is "
                        "honest, so each method is computed as its paper defines it")
