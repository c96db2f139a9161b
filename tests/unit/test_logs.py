"""Log lines cannot be forged or used to rewrite a terminal through the values they quote."""

from __future__ import annotations

import io
import logging

import pytest

from fabricnode.logs import ThrottledErrors, configure_logging


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


def test_throttled_errors_log_once_per_period_with_how_many_came(
    caplog: pytest.LogCaptureFixture,
) -> None:
    throttled = ThrottledErrors(logging.getLogger("fabricnode.test"), "failed (%d)", every_s=10.0)
    caplog.set_level("ERROR", logger="fabricnode.test")
    for now in (0.0, 1.0, 2.0, 9.9, 10.0, 10.5, 25.0):
        try:
            raise ValueError("boom")
        except ValueError:
            throttled.exception(now)
    assert [r.getMessage() for r in caplog.records] == ["failed (1)", "failed (4)", "failed (2)"]
    assert all(r.exc_info is not None for r in caplog.records)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("a\x85b", "a\\x85b"),  # NEL, a C1 control: a line break to many readers
        ("a\x9b2Jb", "a\\x9b2Jb"),  # CSI, the C1 form of ESC [
        ("a\u2028b", "a\\u2028b"),  # LINE SEPARATOR: str.splitlines() breaks on it
        ("a\u2029b", "a\\u2029b"),  # PARAGRAPH SEPARATOR
        ("a\u202eb", "a\\u202eb"),  # RIGHT-TO-LEFT OVERRIDE: text that reads otherwise
        ("a\x1cb", "a\\x1cb"),  # FILE SEPARATOR: splitlines() breaks on it too
        ("día ü 模型", "día ü 模型"),  # printable text stays as it is
    ],
)
def test_every_character_that_is_not_printable_by_its_category_is_escaped(
    value: str, shown: str
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    out = io.StringIO()
    configure_logging("INFO", "f" * 32, out)
    try:
        logging.getLogger("fabricnode.test").info("adapter %s loaded", value)
    finally:
        root.handlers, root.level = saved[0], saved[1]
    text = out.getvalue()
    assert len(text.splitlines()) == 1
    assert text.rstrip("\n").endswith(f"adapter {shown} loaded")
