"""One log line per event, in key=value form, for the supervisor and its frontends.

``mptok serve`` runs several processes that write to the same stderr. An
operator reading it at 3 a.m. must see, on every line, when it happened,
which process said it (role, frontend id, pid) and what happened (``event=``)
with its details as ``key=value`` pairs that grep and awk can pick apart.
Lines from libraries (uvicorn, transformers) get the same prefix and their
text as ``msg="..."``; an exception is folded into the same line
(``error=`` and ``traceback=``) so that one event stays one line.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Any

_FIELDS_ATTR = "mptok_fields"
LOG_LEVEL_VARIABLE = "MPTOK_LOG_LEVEL"


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    """Log ``event`` with ``fields``; rendered as ``event=<event> k=v ...``."""
    logger.log(level, event, extra={_FIELDS_ATTR: fields})


def quote(value: Any) -> str:
    """``value`` as a logfmt value: bare when it is one plain word, else double-quoted."""
    text = value if isinstance(value, str) else str(value)
    if text and not any(c in text for c in ' "=\\\n\r\t') and text.isprintable():
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


class KeyValueFormatter(logging.Formatter):
    """``<UTC time> level=<L> role=<R> [frontend=<id>] pid=<pid> event=<E> k=v ...``."""

    def __init__(self, role: str, frontend_id: int | None = None):
        super().__init__()
        self._prefix = f"role={role}" if frontend_id is None else f"role={role} frontend={frontend_id}"

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [f"{stamp}.{int(record.msecs):03d}Z level={record.levelname} {self._prefix} pid={record.process}"]
        fields = getattr(record, _FIELDS_ATTR, None)
        if fields is None:
            parts.append(f"event=log logger={record.name} msg={quote(record.getMessage())}")
        else:
            parts.append(f"event={record.msg}")
            parts.extend(f"{key}={quote(value)}" for key, value in fields.items())
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            parts.append(f"error={quote(f'{type(error).__name__}: {error}')}")
            parts.append(f"traceback={quote(''.join(traceback.format_exception(*record.exc_info)))}")
        return " ".join(parts)


def configure_logging(role: str, frontend_id: int | None = None) -> None:
    """Send every logger of this process, as key=value lines, to stderr.

    Replaces the root logger's handlers; ``MPTOK_LOG_LEVEL`` (default INFO)
    sets the level. Raises ``ValueError`` naming the variable and its value
    when that is no level, before anything is replaced.
    """
    raw = os.environ.get(LOG_LEVEL_VARIABLE, "")
    level = raw.strip().upper() or "INFO"
    if level not in logging.getLevelNamesMapping():
        raise ValueError(f"{LOG_LEVEL_VARIABLE}={raw!r} is not a log level (DEBUG, INFO, WARNING, ERROR or CRITICAL)")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(role, frontend_id))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
