"""Writing the request log: ``RequestLog``, a bounded buffer the ingress appends to and a flush
that appends its lines to the file from a worker thread, rotating it by size.

``append`` is the only call on the request path (the ingress's settler, once per answered
request): a length check and a deque append. ``flush`` serializes the buffer (``format``) and
writes it, meant to run periodically in a worker thread (the agent's ``_flush_request_log``).
The file is rotated by size (``log.jsonl`` -> ``log.jsonl.1`` -> ...). A full disk costs log
lines, never the ingress: when the buffer is full, records are dropped and counted rather than
growing without limit, and a failed write is counted, not raised.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from fabricnode.requestlog.format import RawTrace, TraceRecord, raw_line, record_line


@dataclass(frozen=True)
class RequestLogStats:
    buffered: int
    written: int
    dropped: int
    rotations: int
    write_errors: int
    last_error: str


class RequestLog:
    """Append-only JSON-lines request log: ``append`` on the hot path, ``flush`` in a thread.

    ``append`` only puts the record in a bounded in-memory buffer (``max_buffer`` records);
    ``flush`` serializes and appends the buffer to ``path`` (mode 0600), rotating first when
    the file would pass ``rotate_bytes``: ``path`` -> ``path.1`` -> ... -> ``path.<keep>``.

    The buffer is a deque, whose ``append`` and ``popleft`` are atomic: the event loop adds
    records without taking a lock, and the flushing thread takes them from the other end.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_buffer: int = 10_000,
        rotate_bytes: int = 64 * 1024 * 1024,
        keep: int = 1,
    ) -> None:
        if max_buffer < 1 or rotate_bytes < 1 or keep < 1:
            raise ValueError("max_buffer, rotate_bytes and keep must be >= 1")
        self.path = path
        self.max_buffer = max_buffer
        self.rotate_bytes = rotate_bytes
        self.keep = keep
        self._buffer: deque[TraceRecord | RawTrace] = deque()
        self._lock = threading.Lock()  # the counters below (event loop vs flush thread)
        self._flush_lock = threading.Lock()  # one flush at a time
        self._written = 0
        self._dropped = 0
        self._rotations = 0
        self._write_errors = 0
        self._last_error = ""

    def append(self, record: TraceRecord | RawTrace) -> bool:
        """Buffer one record; False (and counted) if the buffer is full."""
        buffer = self._buffer
        if len(buffer) >= self.max_buffer:
            with self._lock:
                self._dropped += 1
            return False
        buffer.append(record)
        return True

    def flush(self) -> int:
        """Write what is buffered; returns how many records were written.

        Blocking file I/O: call it from a worker thread. An OSError (disk full, directory
        gone) loses this batch, is counted in ``write_errors``/``dropped`` and is not raised.
        """
        with self._flush_lock:
            buffer = self._buffer
            batch = [buffer.popleft() for _ in range(len(buffer))]
            if not batch:
                return 0
            lines = []
            for record in batch:
                try:
                    if isinstance(record, tuple):
                        lines.append(raw_line(record))
                    else:
                        lines.append(record_line(record))
                except (TypeError, ValueError, OverflowError):  # never fatal
                    with self._lock:
                        self._dropped += 1
            data = b"".join(lines)
            try:
                self._write(data)
            except OSError as exc:
                with self._lock:
                    self._write_errors += 1
                    self._dropped += len(batch)
                    self._last_error = f"{exc.filename or self.path}: {exc.strerror or exc}"
                return 0
            with self._lock:
                self._written += len(batch)
            return len(batch)

    def _write(self, data: bytes) -> None:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(data) > self.rotate_bytes:
            self._rotate()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            written = 0
            while written < len(data):  # os.write may write less than asked
                written += os.write(fd, data[written:])
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        for n in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._rotations += 1

    def statistics(self) -> RequestLogStats:
        with self._lock:
            return RequestLogStats(
                buffered=len(self._buffer),
                written=self._written,
                dropped=self._dropped,
                rotations=self._rotations,
                write_errors=self._write_errors,
                last_error=self._last_error,
            )
