"""The log's tail after a cursor (the elastic controller's signals)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabricnode.requestlog.cursor import read_request_log_after, read_request_log_since
from fabricnode.requestlog.format import TraceRecord
from fabricnode.requestlog.writer import RequestLog
from tests.unit.requestlog.test_format import record


def three_lines_a_file(path: Path, keep: int) -> RequestLog:
    """A request log rotated every three records, ``keep`` rotated files kept."""
    line_bytes = len(json.dumps(record().as_dict(), separators=(",", ":"))) + 1
    return RequestLog(path, rotate_bytes=3 * line_bytes, keep=keep)


def logged(log: RequestLog, *ts: float) -> list[TraceRecord]:
    """Records ending at ``ts``, each written at once."""
    out = [record(t=t) for t in ts]
    for r in out:
        log.append(r)
        log.flush()
    return out


def test_the_tail_after_a_cursor_is_read_once_whole_lines_only_across_rotations(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.jsonl"
    assert read_request_log_after(path, "end") == ([], "0:0")  # nothing logged yet
    log = three_lines_a_file(path, keep=2)

    def write(*ts: float) -> list[TraceRecord]:
        return logged(log, *ts)

    write(1.0, 2.0)
    records, cursor = read_request_log_after(path, "end")
    assert records == []  # end: what was there before does not count
    new = write(3.0)
    records, cursor = read_request_log_after(path, cursor)
    assert records == new
    assert read_request_log_after(path, cursor) == ([], cursor)  # nothing twice
    with path.open("ab") as f:  # a line being written is left for the next read
        f.write(b'{"v": 1, "T": 9.0, "M": "m", "I"')
    records, torn = read_request_log_after(path, cursor)
    assert records == [] and torn == cursor
    with path.open("ab") as f:
        f.write(b': 1, "O": 2, "latency_s": 0.5}\n')
    records, cursor = read_request_log_after(path, cursor)
    assert [(r.t, r.input_tokens) for r in records] == [(9.0, 1)]
    new = write(4.0, 5.0, 6.0, 7.0)  # rotates past the cursor's file: nothing lost
    assert path.with_name("log.jsonl.1").exists()
    records, cursor = read_request_log_after(path, cursor)
    assert records == new
    with pytest.raises(ValueError):
        read_request_log_after(path, "12:x")


def test_the_past_since_a_time_comes_with_a_cursor_after_it_and_how_far_back_it_is_whole(
    tmp_path: Path,
) -> None:
    """``read_request_log_since``: the records since a time across the kept files, the cursor
    after the last (asking after it gives only what came next), and while no file was rotated
    ``None`` (the log holds all it ever had), after a rotation the first kept record's time."""
    path = tmp_path / "log.jsonl"
    assert read_request_log_since(path, 0.0) == ([], "0:0", None)
    log = three_lines_a_file(path, keep=1)

    def write(*ts: float) -> list[TraceRecord]:
        return logged(log, *ts)

    write(1.0, 2.0)
    records, cursor, covers = read_request_log_since(path, 2.0)
    assert [r.t for r in records] == [2.0] and covers is None
    new = write(3.0)
    assert read_request_log_after(path, cursor)[0] == new
    write(4.0, 5.0, 6.0, 7.0)  # rotated past what one kept file holds: 1 to 3 dropped
    records, cursor, covers = read_request_log_since(path, 0.0)
    assert covers == records[0].t and covers > 1.0
    assert [r.t for r in records] == sorted(r.t for r in records)
    assert read_request_log_after(path, cursor)[0] == []
