"""Checkpoints: the whole server state after every round, in one file, written atomically.

A checkpoint holds the global parameters, the schedule position (task, round, server
round), the strategy's state, the results so far and the random states. Clients are
stateless given (seed, client id, task, round) and the global parameters, so a resumed run
replays exactly what the uninterrupted run would.

Format: one safetensors file (``checkpoint.safetensors``). Every array (the global
parameters, the strategy's arrays, the random generators' states) is a tensor; everything
else is JSON in the file's metadata, with arrays referred to by name. Loading it runs no
code from the file (deserialising Python objects would), and nothing in it names a Python class. Files are
written to a temporary name, flushed, fsynced and renamed, so a crash while writing leaves
the previous checkpoint intact.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..common.config.experiment import RESULT_NEUTRAL_KEYS, ConfigError, ExperimentConfig
from ..common.files import write_atomic

FILENAME = "checkpoint.safetensors"
LEGACY_FILENAME = "checkpoint.pkl"  # written by promptfcl before this format; never read
FORMAT_VERSION = 2


@dataclass
class Checkpoint:
    config: dict[str, Any]
    task: int  # task of the last completed round
    round: int  # round (within the task) of the last completed round
    server_round: int
    task_finished: bool  # on_task_end has run for ``task``
    arrays: dict[str, np.ndarray]
    strategy_state: dict[str, Any]
    accuracy_matrix: np.ndarray
    rounds: list[dict[str, Any]]
    rng: dict[str, Any]
    elapsed_seconds: float
    platform_state: dict[str, Any] = field(default_factory=dict)  # e.g. the nodes' declared data sizes


def capture_rng() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.random.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["torch"])


# ----------------------------------------------------------------------------- encoding
def _split(value: Any, path: str, tensors: dict[str, np.ndarray]) -> Any:
    """``value`` as JSON, its arrays moved into ``tensors`` under ``path`` and referred to by name."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        tensors[path] = np.ascontiguousarray(value)
        return {"__array__": path}
    if isinstance(value, dict):
        return {"__dict__": [[str(k), _split(v, f"{path}/{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _join(value: Any, tensors: dict[str, np.ndarray]) -> Any:
    if isinstance(value, dict):
        if "__array__" in value:
            return tensors[value["__array__"]].copy()
        return {k: _join(v, tensors) for k, v in value["__dict__"]}
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    return value


#: numpy dtype -> safetensors dtype name (what checkpoints hold: parameters, states, counters, flags)
SAFETENSORS_DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
                      "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64",
                      "uint64": "U64"}


def encode(ckpt: Checkpoint) -> bytes:
    """The checkpoint as the bytes of a safetensors file."""
    buffer = io.BytesIO()
    write(ckpt, buffer)
    return buffer.getvalue()


def write(ckpt: Checkpoint, fh: BinaryIO) -> None:
    """Write the checkpoint to ``fh`` as a safetensors file, each array's bytes straight from the
    array: no copy of the server's state is made to write it (safetensors' own ``save`` builds the
    whole file in memory, twice)."""
    tensors: dict[str, np.ndarray] = {}
    python_rng = ckpt.rng["python"]
    numpy_rng = ckpt.rng["numpy"]
    doc = {
        "version": FORMAT_VERSION,
        "config": ckpt.config, "task": ckpt.task, "round": ckpt.round, "server_round": ckpt.server_round,
        "task_finished": ckpt.task_finished, "elapsed_seconds": ckpt.elapsed_seconds,
        "arrays": _split(ckpt.arrays, "arrays", tensors),
        "strategy_state": _split(ckpt.strategy_state, "strategy", tensors),
        "platform_state": _split(ckpt.platform_state, "platform", tensors),
        "accuracy_matrix": _split(np.asarray(ckpt.accuracy_matrix, dtype=np.float64), "accuracy-matrix", tensors),
        "rounds": _split(ckpt.rounds, "rounds", tensors),
        "rng": {
            "python": [python_rng[0], list(python_rng[1]), python_rng[2]],
            "numpy": [numpy_rng[0], _split(np.asarray(numpy_rng[1]), "rng/numpy", tensors), *numpy_rng[2:]],
            "torch": _split(ckpt.rng["torch"], "rng/torch", tensors),
        },
    }
    # NaN stays NaN (Python's JSON reads its own NaN back): the records resume exactly as they were
    header: dict[str, Any] = {"__metadata__": {"promptfcl": json.dumps(doc, allow_nan=True)}}
    offset, ordered = 0, []
    for name, value in tensors.items():
        value = np.ascontiguousarray(value.astype(value.dtype.newbyteorder("<"), copy=False))  # little-endian
        if value.dtype.name not in SAFETENSORS_DTYPES:
            raise ValueError(f"checkpoint array {name!r} has dtype {value.dtype}, which a checkpoint cannot hold")
        header[name] = {"dtype": SAFETENSORS_DTYPES[value.dtype.name], "shape": list(value.shape),
                        "data_offsets": [offset, offset + value.nbytes]}
        offset += value.nbytes
        ordered.append(value)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned, as safetensors writes them
    fh.write(len(text).to_bytes(8, "little"))
    fh.write(text)
    for value in ordered:
        fh.write(value.reshape(-1).data.cast("B"))


def decode(data: bytes) -> Checkpoint:
    """The checkpoint in the bytes of a safetensors file (ValueError if it is not one)."""
    # safetensors: only when a checkpoint is read
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        tensors = load(data)
    except SafetensorError as exc:
        raise ValueError(f"not a safetensors file ({exc})") from exc
    header_len = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    if "promptfcl" not in metadata:
        raise ValueError("a safetensors file, but not a promptfcl checkpoint")
    doc = json.loads(metadata["promptfcl"])
    if doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"format version {doc.get('version')} (expected {FORMAT_VERSION})")
    python_rng, numpy_rng = doc["rng"]["python"], doc["rng"]["numpy"]
    return Checkpoint(
        config=doc["config"], task=int(doc["task"]), round=int(doc["round"]), server_round=int(doc["server_round"]),
        task_finished=bool(doc["task_finished"]), arrays=_join(doc["arrays"], tensors),
        strategy_state=_join(doc["strategy_state"], tensors), accuracy_matrix=_join(doc["accuracy_matrix"], tensors),
        rounds=_join(doc["rounds"], tensors), elapsed_seconds=float(doc["elapsed_seconds"]),
        platform_state=_join(doc.get("platform_state", {"__dict__": []}), tensors),
        rng={"python": (python_rng[0], tuple(python_rng[1]), python_rng[2]),
             "numpy": (numpy_rng[0], _join(numpy_rng[1], tensors), *numpy_rng[2:]),
             "torch": torch.from_numpy(_join(doc["rng"]["torch"], tensors))},
    )


# ----------------------------------------------------------------------------- files
def save(ckpt: Checkpoint, out_dir: str | Path) -> Path:
    """Atomically replace ``out_dir/checkpoint.safetensors``."""
    path = Path(out_dir) / FILENAME
    write_atomic(path, lambda fh: write(ckpt, fh))
    return path


def load(out_dir: str | Path) -> Checkpoint | None:
    """The checkpoint in ``out_dir``, None if there is none; a clear error if it is unreadable.

    A checkpoint of the earlier format (``checkpoint.pkl``, serialised Python objects) is refused
    without being opened: loading it would run code from the file.
    """
    out = Path(out_dir)
    if (out / LEGACY_FILENAME).is_file():
        raise ConfigError(
            f"{out / LEGACY_FILENAME} is a checkpoint in the serialised-object format of earlier promptfcl "
            "versions; it is not opened, since loading that format runs code from the file. Finish that run with "
            "the version that wrote it, or move the file away to start afresh")
    path = out / FILENAME
    if not path.is_file():
        return None
    try:
        return decode(path.read_bytes())
    except Exception as exc:
        raise ConfigError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc}); "
                          "move it away to start afresh") from exc


def check_compatible(ckpt: Checkpoint, config: Mapping[str, Any]) -> None:
    """Refuse to resume under a configuration (``config``: the run's, ``ExperimentConfig.to_dict``)
    that would change the results."""
    try:  # keys added since the checkpoint was written take their defaults, as then
        filled = ExperimentConfig.from_dict(ckpt.config).to_dict()
    except ConfigError:
        filled = ckpt.config
    saved = {k: v for k, v in filled.items() if k not in RESULT_NEUTRAL_KEYS}
    now = {k: v for k, v in config.items() if k not in RESULT_NEUTRAL_KEYS}
    if saved != now:
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff[:6])
        raise ConfigError(f"cannot resume: the checkpoint was made with a different configuration ({details})")
