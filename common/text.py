"""Text that came from someone else, made safe to log and to send.

Two uses:

* **Logs.** A string a node or the server chose (an error reason, a refused URL path, a run
  config value) may hold a newline or another control character; printed as it is, it forges
  log lines. :func:`printable` escapes them as ``repr`` does, and :class:`EscapeArgs` does it
  for every argument of the ``promptfcl`` logger's records (the format string is the code's,
  the arguments are data), so a call site that forgets cannot forge a line.
* **Error replies.** What a node tells the server of an error must not carry the node's local
  paths: :func:`without_paths` replaces the node's known folders by their names and any other
  absolute path by ``<path>``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

#: an absolute POSIX path (not the tail of a URL or of a longer word), a home-relative one, or a
#: Windows one; ``*`` and ``<`` end it, so help texts such as ``<class>/*.png`` stay readable
_PATH = re.compile(r"(?<![\w.~:/<>*-])/[^\s'\"`,;()\[\]{}<>|*]+|~/[^\s'\"`,;()\[\]{}<>|*]*|"
                   r"\b[A-Za-z]:\\[^\s'\"`,;()\[\]{}<>|*]+")


def printable(text: str, limit: int | None = None) -> str:
    """``text`` with every non-printable character escaped as ``repr`` escapes it (``\\n``,
    ``\\x1b``, ``\\u2028``), cut to ``limit`` characters (with a note saying so)."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if limit is not None and len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text


def without_paths(text: str, known: Mapping[str, str] | None = None) -> str:
    """``text`` without file-system paths.

    Parameters
    ----------
    text : str
        An error message.
    known : mapping, optional
        A path -> the name it is replaced by (``{"/srv/images": "<data-dir>"}``), longest first,
        so a known folder keeps its meaning in the message; relative paths are replaced only here.
        Any other absolute path becomes ``<path>``.
    """
    for path, name in sorted((known or {}).items(), key=lambda item: -len(item[0])):
        if len(path.strip(os.sep)) > 0:  # never "/" or "": that would replace every separator
            text = re.sub(re.escape(path) + r"(?![\w.-])", name.replace("\\", "\\\\"), text)
    return _PATH.sub("<path>", text)


class _Escaped:
    """A log argument whose ``str`` and ``repr`` are :func:`printable`."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return printable(str(self.value))

    def __repr__(self) -> str:
        return printable(repr(self.value))


def _escaped(arg: Any) -> Any:
    # strings, exceptions and paths carry text from elsewhere (wrapped, so %s and %r both come out
    # escaped once); numbers stay numbers (%d, %.3f)
    if isinstance(arg, (str, BaseException, os.PathLike)):
        return _Escaped(arg)
    return arg


class EscapeArgs(logging.Filter):
    """Escapes control characters in a record's arguments (:func:`printable`), never dropping it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, Mapping):
            record.args = {k: _escaped(v) for k, v in record.args.items()}
        elif record.args:
            record.args = tuple(_escaped(a) for a in record.args)
        return True


def escape_log_args(logger: logging.Logger | None = None) -> logging.Logger:
    """Install :class:`EscapeArgs` on ``logger`` (default: ``promptfcl``) once; return the logger.

    A logger's filters see only the records made on that logger, and every module of the
    project logs on ``promptfcl`` itself."""
    logger = logger or logging.getLogger("promptfcl")
    if not any(isinstance(f, EscapeArgs) for f in logger.filters):
        logger.addFilter(EscapeArgs())
    return logger
