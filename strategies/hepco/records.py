"""What HePCo adds to the wire with ``hepco.client-weights = "class-counts"`` (nothing otherwise).

Client -> server, every round, the record ``CLASS_COUNTS`` beside the arrays: ``classes`` (K,)
int64, the classes of the samples the client trained on, and ``counts`` (K,) int64, how many of
each. The server weighs each client's losses on a latent of class y by its share of y
(strategy.py, ``client_weights``), as the paper's "weighted sum ... similar to Zhang et al.
(2022b)" (sec. 5.2; that work weighs client k on class y by n_k^y / n^y) and the authors' code
(its trainer weighs client j by its count of y) do.

Both arrays are the client's label histogram, sent in the clear (as C2Prompt's class counts):
under differential privacy nothing of it is noised (records below), which the privacy docs say.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord

from ...common.privacy import PrivateRecord
from ...common.records import to_array_record
from ..platform.statistics import Statistics

#: name of the record of a client's label counts
CLASS_COUNTS = "hepco-counts"

#: public metadata only: the label histogram travels in the clear
PRIVATE_RECORDS = {CLASS_COUNTS: PrivateRecord(public=("classes", "counts"))}

#: where the run is defended, the platform checks the counts against the reply's num-examples
STATISTICS = {CLASS_COUNTS: Statistics(counts=("counts",), keys="classes")}


def class_counts(labels: np.ndarray) -> ArrayRecord:
    """The record of one client's label histogram over ``labels`` (the classes it trained on)."""
    classes, counts = np.unique(np.asarray(labels, np.int64), return_counts=True)
    return to_array_record({"classes": classes.astype(np.int64), "counts": counts.astype(np.int64)})


def count_matrix(records: list[dict[str, np.ndarray]], num_classes: int) -> np.ndarray:
    """(C, num_classes) float64: client c's count of each class (0 where it reported none).

    Classes outside the head are ignored (the platform's reply checks refuse such records where
    they check the keys; this keeps the server step total whatever it is given).
    """
    out = np.zeros((len(records), num_classes), np.float64)
    for c, record in enumerate(records):
        classes = np.asarray(record.get("classes", np.zeros(0)), np.int64).reshape(-1)
        counts = np.asarray(record.get("counts", np.zeros(0)), np.float64).reshape(-1)
        inside = (classes >= 0) & (classes < num_classes) & np.isfinite(counts) & (counts > 0)
        np.add.at(out[c], classes[inside[: len(classes)]], counts[inside[: len(classes)]])
    return out
