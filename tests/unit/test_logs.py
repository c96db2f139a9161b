"""Log lines cannot be forged or used to rewrite a terminal through the values they quote."""

from __future__ import annotations

import io
import logging

from fabricnode.logs import configure_logging


def test_control_characters_in_a_message_are_escaped_and_tracebacks_keep_their_lines() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    out = io.StringIO()
    configure_logging("INFO", "f" * 32, out)
    try:
        emit()
    finally:
        root.handlers, root.level = saved[0], saved[1]
    lines = out.getvalue().splitlines()
    assert lines[0].endswith(
        "model m\\n2026-01-01 00:00:00,000 INFO [deadbeef] forged\\r\\x1b[2J\\x00 end\tx"
    )
    assert lines[1].endswith("failed on a\\nb")
    assert lines[2] == "Traceback (most recent call last):"  # the traceback is ours: kept
    assert lines[-1] == "ValueError: boom"


def emit() -> None:
    log = logging.getLogger("fabricnode.test")
    log.info("model %s", "m\n2026-01-01 00:00:00,000 INFO [deadbeef] forged\r\x1b[2J\x00 end\tx")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed on %s", "a\nb")
