"""Writing the request log: a private file, rotation by size, a bounded buffer, failures
counted, appends from the event loop while another thread flushes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from fabricnode.requestlog.reader import read_request_log
from fabricnode.requestlog.writer import RequestLog
from tests.unit.requestlog.test_format import record


def test_request_log_file_is_private_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "log.jsonl"
    log = RequestLog(path)
    records = [record(t=float(i)) for i in range(5)]
    for r in records:
        assert log.append(r)
    log.flush()
    assert log.flush() == 0
    assert read_request_log(path) == records
    assert path.stat().st_mode & 0o077 == 0


def test_request_log_rotates_by_size(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    line_bytes = len(json.dumps(record().as_dict(), separators=(",", ":"))) + 1
    log = RequestLog(path, rotate_bytes=3 * line_bytes, keep=2)
    written = []
    for i in range(8):
        r = record(t=float(i))
        written.append(r)
        log.append(r)
        log.flush()
    assert path.with_name("log.jsonl.1").exists() and path.with_name("log.jsonl.2").exists()
    assert not path.with_name("log.jsonl.3").exists()
    assert path.stat().st_size <= 3 * line_bytes
    assert log.statistics().rotations == 2
    assert read_request_log(path, include_rotated=True) == written


def test_request_log_buffer_is_bounded_and_counts_drops(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "log.jsonl", max_buffer=3)
    accepted = [log.append(record(t=float(i))) for i in range(5)]
    assert accepted == [True, True, True, False, False]
    stats = log.statistics()
    assert (stats.buffered, stats.dropped) == (3, 2)
    assert log.flush() == 3
    assert log.append(record())


def test_a_failing_write_is_counted_not_raised(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_text("")
    log = RequestLog(tmp_path / "not-a-dir" / "log.jsonl")
    log.append(record())
    assert log.flush() == 0
    stats = log.statistics()
    assert stats.write_errors == 1 and stats.dropped == 1 and "not-a-dir" in stats.last_error


def test_appends_during_flushes_from_another_thread_are_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path, max_buffer=100_000)
    stop = threading.Event()

    def flusher() -> None:
        while not stop.is_set():
            log.flush()

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for i in range(5000):
            log.append(record(t=float(i)))
    finally:
        stop.set()
        thread.join()
    log.flush()
    assert [r.t for r in read_request_log(path)] == [float(i) for i in range(5000)]
