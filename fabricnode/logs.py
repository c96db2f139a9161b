"""Log lines of ``fabric start``: stdlib ``logging`` to stderr, each line tagged with the short
session id, so the lines of several agents (and of one agent's successive sessions) in one job
log can be told apart. stdout is kept for the ready lines alone.

Messages carry values from clients and peers (model names, ids, addresses): every character
that is not printable by its Unicode category (``str.isprintable``: the C0 and C1 controls
such as NEL and CSI, DEL, format characters such as bidirectional overrides, the line and
paragraph separators U+2028 and U+2029, spaces other than ASCII's) is escaped as ``repr``
writes it (``\\n`` stays two characters, NEL is ``\\x85``), tab excepted, so nobody can forge a
log line, for a reader or for a tool that splits on Unicode line breaks, or rewrite the
terminal of whoever reads the log. Tracebacks are the agent's own and keep their
lines."""

from __future__ import annotations

import logging
import math
import sys
from typing import TextIO


def printable(text: str) -> str:
    """``text`` with every character that is not printable (module docstring) but tab
    escaped as ``repr`` writes it."""
    if text.isprintable():  # the common case, in C
        return text
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in text)


class SafeFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose messages cannot contain line breaks or terminal escapes."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


class ThrottledErrors:
    """Logs the exception being handled at most once per ``every_s``, with how many came
    since the last line: an error that a request or a packet can trigger must not let its
    sender flood the log. The caller passes the time (any monotonic clock)."""

    def __init__(self, logger: logging.Logger, message: str, every_s: float = 10.0) -> None:
        self.logger = logger
        self.message = message  # one %d: the errors since the last line
        self.every_s = every_s
        self._logged_at = -math.inf
        self._unlogged = 0

    def exception(self, now: float) -> None:
        self._unlogged += 1
        if now < self._logged_at + self.every_s:
            return
        self._logged_at = now
        count, self._unlogged = self._unlogged, 0
        self.logger.exception(self.message, count)


class _SessionFilter(logging.Filter):
    def __init__(self, session: str) -> None:
        super().__init__()
        self.session = session

    def filter(self, record: logging.LogRecord) -> bool:
        record.session = self.session
        return True


def configure_logging(level: str, session_id: str, stream: TextIO | None = None) -> None:
    """Log lines to ``stream`` (stderr), each tagged with the short session id."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_SessionFilter(session_id[:8]))
    handler.setFormatter(
        SafeFormatter("%(asctime)s %(levelname)s [%(session)s] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.getLogger("hypercorn.error").setLevel(max(root.level, logging.WARNING))
    # httpx logs every engine health/metrics poll at INFO: twice a second of noise.
    logging.getLogger("httpx").setLevel(max(root.level, logging.WARNING))
