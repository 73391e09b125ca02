"""Encoding between torch/NumPy state and Flower records, and exact payload sizes.

Record names used in every message (methods may add their own):

* ``arrays``  (ArrayRecord)  trainable parameters: prompt components, keys, attention, head
* ``config``  (ConfigRecord) task, round and client assignment for this message (evaluate
  messages may add ``pool-<task>``: the prompt slices that task is scored with)
* ``metrics`` (MetricRecord) client replies: ``num-examples``, ``train-loss``, ``train-seconds``
* ``placement`` (ConfigRecord) client replies, optional: where the client trained (``node``: the
  Ray node id in simulation, the Flower node id in deployment; ``device``: the torch device;
  ``cuda-visible-devices``: the environment value the client saw, absent if unset)
* ``evaluation`` (MetricRecord) train replies, when the message's config asks for it
  (``evaluate-task``): the node's per-task ``correct`` / ``total`` counts of the model it
  received, as an evaluate reply's ``metrics`` (``evaluate-with-train``)
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from .flower_internals import internal

ARRAYS, CONFIG, METRICS, PLACEMENT, EVALUATION = "arrays", "config", "metrics", "placement", "evaluation"
#: a train message's config key asking the node to evaluate the received arrays on tasks 0..value
EVALUATE_TASK = "evaluate-task"
PLACEMENT_FIELDS = ("node", "device", "cuda-visible-devices", "config-digest")
# evaluate messages: ``pool-<task>`` = the prompt slices task <task> is scored with (methods with
# per-task local pools, ``PromptStrategy.evaluation_pools``)
POOL_PREFIX = "pool-"


R = TypeVar("R", ArrayRecord, MetricRecord, ConfigRecord)
#: the serialisation type of an Array holding an .npy payload (Flower's ``SType.NUMPY``)
NUMPY_STYPE = "numpy.ndarray"


# A RecordDict's values, and a metric or config record's values, are unions (an ArrayRecord,
# MetricRecord or ConfigRecord; an int, float, string or list): every reply's types are checked when
# it arrives (strategies/platform/checks.py), a message's by its reader. These take a value out as
# the type it must be, and say which record or key is wrong when it is not.
def arrays_of(content: RecordDict, name: str = ARRAYS) -> ArrayRecord:
    """``content[name]``, an ArrayRecord (KeyError when absent, TypeError when another kind)."""
    return _record(content, name, ArrayRecord)


def metrics_of(content: RecordDict, name: str = METRICS) -> MetricRecord:
    """``content[name]``, a MetricRecord (KeyError when absent, TypeError when another kind)."""
    return _record(content, name, MetricRecord)


def config_of(content: RecordDict, name: str = CONFIG) -> ConfigRecord:
    """``content[name]``, a ConfigRecord (KeyError when absent, TypeError when another kind)."""
    return _record(content, name, ConfigRecord)


def _record(content: RecordDict, name: str, kind: type[R]) -> R:
    record = content[name]
    if not isinstance(record, kind):
        raise TypeError(f"record {name!r} is a {type(record).__name__}, not a {kind.__name__}")
    return record


def as_int(value: object) -> int:
    """A record's value as an int, as ``int()`` takes it (TypeError for a list or bytes)."""
    if isinstance(value, (int, float, str, np.integer, np.floating)):
        return int(value)
    raise TypeError(f"expected a number, got {type(value).__name__}")


def as_list(value: object) -> list:
    """A record's value that must be a list (TypeError otherwise)."""
    if isinstance(value, list):
        return value
    raise TypeError(f"expected a list, got {type(value).__name__}")


def as_float(value: object) -> float:
    """A record's value as a float, as ``float()`` takes it (TypeError for a list or bytes)."""
    if isinstance(value, (int, float, str, np.integer, np.floating)):
        return float(value)
    raise TypeError(f"expected a number, got {type(value).__name__}")


def to_array_record(state: Mapping[str, torch.Tensor | np.ndarray]) -> ArrayRecord:
    """Named tensors -> ArrayRecord (CPU, contiguous NumPy, names preserved)."""
    out = {}
    for name, value in state.items():
        arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        out[name] = to_array(np.ascontiguousarray(arr))
    return ArrayRecord(out)


def to_array(arr: np.ndarray) -> Array:
    """An Array of ``arr`` with the bytes ``Array(arr)`` holds (an .npy payload), copied once:
    Flower's ``np.save`` into a buffer and ``getvalue()`` copy every array twice."""
    if arr.dtype.hasobject or not arr.flags.c_contiguous:
        return Array(arr)
    header = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(arr))
    except ValueError:  # a header too long for format 1.0 (numpy then writes 2.0): numpy's own path
        return Array(arr)
    data = b"".join([header.getvalue(), arr.reshape(-1).data.cast("B")])
    return Array(dtype=str(arr.dtype), shape=tuple(arr.shape), stype=NUMPY_STYPE, data=data)


def from_array_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: record[name].numpy() for name in record.keys()}


def array_view(array: Array) -> np.ndarray:
    """An Array's values without a copy: a read-only view of its serialised bytes, where
    ``Array.numpy()`` decodes a fresh copy at every call. A server that reads each reply's
    arrays several times (checks, norms, cosines, the average) holds them once this way."""
    data = array.data
    if array.stype != NUMPY_STYPE or not isinstance(data, bytes):
        return array.numpy()
    stream = io.BytesIO(data)  # shares the bytes (nothing is written to it)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    else:  # rare header versions: numpy's own reader
        return array.numpy()
    if dtype.hasobject:
        return array.numpy()  # refuses it, as every decoding of a message does (no pickles)
    count = int(np.prod(shape, dtype=np.int64))
    view = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
    if fortran:  # our records are C-ordered; another sender's Fortran order is copied once, here
        view = np.ascontiguousarray(view.reshape(shape, order="F"))
        view.flags.writeable = False  # read-only as every view this gives
        return view
    return view.reshape(shape)


def array_views(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Every array of ``record`` as :func:`array_view` gives it (read-only, no copy)."""
    return {name: array_view(record[name]) for name in record.keys()}


def to_torch(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Writable tensors of ``record``'s arrays (one copy each: ``Array.numpy()`` decodes a fresh one)."""
    return {name: torch.from_numpy(arr) for name, arr in from_array_record(record).items()}


def payload_bytes(content: RecordDict) -> int:
    """Bytes of a message's content as Flower transmits it (its deflated object tree)."""

    return sum(len(obj.deflate()) for obj in internal("nested_objects")(content).values())
