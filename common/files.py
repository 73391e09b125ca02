"""Files: written so that a crash never leaves half of one (checkpoints, results, caches), and
read only where they should be (class folders named by the server)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import DataError

#: the most a results file gives beyond its owner: the group may read it, others nothing
RESULTS_MODE = 0o640
#: the bits a process writing results always masks (group write, everything for others)
RESULTS_UMASK = 0o027


def write_atomic(path: Path, write: Callable[[BinaryIO], object], shared: bool = False) -> None:
    """Write to a temporary file beside ``path``, sync, then rename over ``path``.

    The file is the owner's alone (0600, as the temporary file is made), or with ``shared``
    readable by the group at most (:data:`RESULTS_MODE`, less where the umask says so: 0640
    under the usual 022): results are for the group, checkpoints and caches are not.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if shared:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, RESULTS_MODE & ~umask)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def results_umask() -> Iterator[None]:
    """Within: this process's umask masks at least :data:`RESULTS_UMASK`, so every file it
    creates (results, plots, logs of the run, folders) is at most group-readable, whatever
    writes it; the umask before is restored after. The umask is the whole process's: use it
    around a run, not around one file of a busy multi-threaded process."""
    previous = os.umask(RESULTS_UMASK)
    os.umask(previous | RESULTS_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


def class_folder(root: Path, name: str) -> Path:
    """``root/name`` for a class name that is one path component, else DataError.

    Class names reach a node in the run config, so they are untrusted: an absolute path,
    ``..``, a separator or a NUL would make the node read outside its data directory. The
    joined path is also checked lexically to sit directly in ``root`` (a symlinked class
    folder that the node's own operator placed there is followed).
    """
    reason = class_name_problem(name)
    if reason is None:
        joined = Path(os.path.normpath(root / name))
        if joined.parent != Path(os.path.normpath(root)):
            reason = "resolves outside the data directory"
    if reason is not None:
        raise DataError(f"class name {name!r} refused: {reason} (a class name is one folder inside the data directory)")
    return root / name


def class_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a class folder's name (None: it can)."""
    if not name or name in (".", ".."):
        return "empty, '.' or '..'"
    if "/" in name or "\\" in name or "\x00" in name:
        return "contains a path separator or NUL"
    if os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    if len(name) > 255:
        return "longer than 255 characters"
    return None
