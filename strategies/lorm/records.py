"""What LoRM adds to the wire.

Client -> server, every round, the record ``GRAMS`` beside the arrays:

* ``blocks`` (L,) int64: the adapted blocks, in the run's order (each row of the arrays below);
* ``diag-<target>`` (L, in) float32 per adapted projection (``qkv``, ``proj``, ``fc1``, ``fc2``): the
  diagonal of the Gram of its input, ``sum_tokens x x^T`` over every token (CLS included) of the
  client's Gram pass, per sample: divided by ``samples`` (and by the passes), so honest clients'
  rows are alike whatever their data's size (the statistics bound compares them) and the server
  recovers the sum as ``samples x row``;
* ``head-gram`` (1, D (D + 1) / 2) float32: the head's input Gram (the pre-logit features'
  ``sum f f^T``), packed upper triangle, per sample likewise;
* ``samples`` (1,) int64: the samples of the pass (the reply's ``num-examples``);
* ``tokens`` (1,) int64: the tokens summed into each row (samples x tokens per image x passes).

Nothing of it is bounded under differential privacy: LoRM refuses ``dp.*`` (options.py, WHY_NOT).
"""

from __future__ import annotations

from ..platform.statistics import DIAGONAL, PACKED_TRIU, Statistics
from .prompt import LoRMAdapters

#: name of the record of a client's Gram statistics
GRAMS = "lorm-grams"
#: its arrays besides the per-projection diagonals
BLOCKS, SAMPLES, TOKENS, HEAD_GRAM = "blocks", "samples", "tokens", "head-gram"


def diagonal_name(target: str) -> str:
    """The array of projection ``target``'s Gram diagonals."""
    return f"diag-{target}"


def factor_of(name: str) -> str | None:
    """``"a"`` or ``"b"`` for an adapter factor's array (``prompt.lora_qkv0_a``), else None."""
    if name.startswith("prompt.lora_") and name[-2:] in ("_a", "_b"):
        return name[-1]
    return None


#: where the run is defended, each projection's per-sample Gram diagonal is bounded against the same
#: block's rows of the round's other replies, the head's Gram likewise, and the samples by num-examples
STATISTICS = {GRAMS: Statistics(second_moments={**{diagonal_name(t): DIAGONAL for t in LoRMAdapters.targets},
                                                HEAD_GRAM: PACKED_TRIU},
                                counts=(SAMPLES,), keys=BLOCKS)}
