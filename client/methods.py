"""Each method's local learning, found by the same name as its strategy (``strategies.METHODS``).

A method whose clients train like FedAvg-Prompt's uses ``LocalLearner``; the others
subclass it and override its hooks (``client/learner.py``).
"""

from __future__ import annotations

from typing import Any

from strategies import METHODS, check_method, load_by_path

# name -> learner "module:Class" (imported on first use: a client process loads only its own)
LEARNERS: dict[str, str] = {
    "fedavg": "client.learner:LocalLearner",
    "fppl": "client.fppl:FPPLLearner",
    "hgp": "client.hgp:HGPLearner",
    "hepco": "client.learner:LocalLearner",
    "fedcprompt": "client.fedcprompt:FedCPromptLearner",
    "powder": "client.powder:PowderLearner",
}
assert LEARNERS.keys() == METHODS.keys(), "every method needs a learner and a strategy"


def learner_class(name: str) -> Any:
    """The ``LocalLearner`` subclass that trains method ``name`` on a client."""
    check_method(name)
    return load_by_path(LEARNERS[name])
