"""The log's tail, for the elastic controller: what the request log gained after a cursor.

The controller asks every agent every few seconds what its log gained since the last time
(``/fabric/v1/workload?after=<cursor>``, summed by ``sums.recent_sums``). A cursor names a
place in the log: ``<inode>:<byte offset>`` of the file the place is in, so rotation (``path``
renamed to ``path.1``) does not lose it; only the bytes after it are read, and only whole lines
(a line being written is read next time, whole). ``end`` (``CURSOR_END``) asks for a cursor at
the log's end: nothing before it counts.

Blocking file I/O: the agent calls ``read_request_log_after`` from a worker thread.
"""

from __future__ import annotations

import os
from pathlib import Path

from fabricnode.errors import ConfigError
from fabricnode.requestlog.format import TraceRecord, parse_line
from fabricnode.requestlog.reader import request_log_files

CURSOR_END = "end"  # ask for a cursor at the log's end (nothing before it counts)
# How far back from a file's end the last whole line is looked for: far longer than any line
# the writer writes (every field is bounded, format.MAX_MODEL_CHARS).
MAX_LOOKBACK_BYTES = 1 << 20


def parse_cursor(cursor: str) -> tuple[int, int] | None:
    """``(inode, offset)`` of a cursor, None for ``CURSOR_END``; ValueError if malformed."""
    if cursor == CURSOR_END:
        return None
    ino, sep, offset = cursor.partition(":")
    if not sep or not ino.isdigit() or not offset.isdigit() or len(cursor) > 64:
        raise ValueError(f"not a request log cursor: {cursor[:64]!r}")
    return int(ino), int(offset)


def read_request_log_after(path: Path, cursor: str) -> tuple[list[TraceRecord], str]:
    """The records appended to the request log at ``path`` after ``cursor``, and the cursor
    after them (module docstring). Blocking file I/O: call it from a worker thread.

    ``CURSOR_END`` gives no record and the cursor at the end. A cursor whose file is gone
    (rotated out of the kept files) or was cut shorter reads what the current files hold. Lines
    that are not trace records are skipped; ValueError for a malformed cursor, ConfigError
    when a file cannot be read.
    """
    place = parse_cursor(cursor)
    files = request_log_files(path)
    if not files:
        return [], "0:0"  # nothing logged yet: whatever is written first is new
    stats = []
    for file in files:
        try:
            stats.append((file, os.stat(file)))
        except FileNotFoundError:  # rotated away between the listing and now
            continue
        except OSError as exc:
            raise ConfigError(f"cannot read request log {file}: {exc.strerror}") from exc
    if not stats:
        return [], "0:0"
    if place is None:
        file, st = stats[-1]
        return [], _cursor_at_end(file, st.st_ino, st.st_size)
    ino, offset = place
    start = next((i for i, (_, st) in enumerate(stats) if st.st_ino == ino), None)
    if start is None or stats[start][1].st_size < offset:
        start, offset = len(stats) - 1, 0  # its file is gone or was cut: the current one
    records: list[TraceRecord] = []
    new_cursor = cursor
    for i in range(start, len(stats)):
        file, st = stats[i]
        at = offset if i == start else 0
        data = _read_from(file, at)
        whole = data.rfind(b"\n") + 1
        for line in data[:whole].splitlines():
            if not line.strip():
                continue
            record = parse_line(line)
            if record is not None:
                records.append(record)
        new_cursor = f"{st.st_ino}:{at + whole}"
    return records, new_cursor


def _read_from(file: Path, offset: int) -> bytes:
    try:
        with open(file, "rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise ConfigError(f"cannot read request log {file}: {exc.strerror}") from exc


def _cursor_at_end(file: Path, ino: int, size: int) -> str:
    """The cursor after the last whole line of ``file`` (a line being written is not yet)."""
    at = max(0, size - MAX_LOOKBACK_BYTES)
    try:
        with open(file, "rb") as f:
            f.seek(at)
            data = f.read(size - at)
    except OSError as exc:
        raise ConfigError(f"cannot read request log {file}: {exc.strerror}") from exc
    end = at + data.rfind(b"\n") + 1
    return f"{ino}:{end}"


def read_request_log_since(path: Path, since: float) -> tuple[list[TraceRecord], str, float | None]:
    """The records of the request log at ``path`` and its rotated files that ended at or after
    ``since`` (unix time), the cursor after the last of them (so that asking after it next
    counts nothing twice and loses nothing), and the time from which the kept files hold every
    record: the first record's when a rotated file is kept (older files may have been dropped),
    else None (the current file is the log's first: it holds everything this log ever had).
    Blocking file I/O: call it from a worker thread."""
    files = request_log_files(path)
    if not files:
        return [], "0:0", None
    records: list[TraceRecord] = []
    cursor = "0:0"
    first: float | None = None
    for file in files:
        try:
            ino = os.stat(file).st_ino
        except FileNotFoundError:  # rotated away between the listing and now
            continue
        except OSError as exc:
            raise ConfigError(f"cannot read request log {file}: {exc.strerror}") from exc
        data = _read_from(file, 0)
        whole = data.rfind(b"\n") + 1
        for line in data[:whole].splitlines():
            record = parse_line(line) if line.strip() else None
            if record is None:
                continue
            first = record.t if first is None else min(first, record.t)
            if record.t >= since:
                records.append(record)
        cursor = f"{ino}:{whole}"
    return records, cursor, first if len(files) > 1 else None
