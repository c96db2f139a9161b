"""Log lines of ``fabric start``: stdlib ``logging`` to stderr, each line tagged with the short
session id, so the lines of several agents (and of one agent's successive sessions) in one job
log can be told apart. stdout is kept for the ready lines alone."""

from __future__ import annotations

import logging
import sys
from typing import TextIO


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
        logging.Formatter("%(asctime)s %(levelname)s [%(session)s] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.getLogger("hypercorn.error").setLevel(max(root.level, logging.WARNING))
    # httpx logs every engine health/metrics poll at INFO: twice a second of noise.
    logging.getLogger("httpx").setLevel(max(root.level, logging.WARNING))
