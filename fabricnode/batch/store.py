"""Batch files and batch state on the filesystem every job of the mesh sees.

The Batch API has no server of its own: its files and its batches live under ``$FABRIC_HOME/
batches`` (the directory the rendezvous file already shares between jobs), and any agent can
answer for any batch or work it. Everything is written so that a process killed at any
instruction leaves the directory readable and the work resumable:

* whole files (a file's content and metadata, a batch's record, its plan, a shard's ``done``
  marker, a lease) are written to a temporary name, flushed, ``fsync``-ed and renamed over the
  target: readers see the old or the new version, never half of one;
* results are *appended*, one JSON line per request in one ``write``, to a segment file named
  after the shard and the worker that ran it. A worker killed mid-write leaves at most one
  truncated last line, which readers skip (``read_results``);
* exactly once: every result names its ``custom_id``. The lines of a shard already answered are
  the ``custom_id``s found in its segments, whoever wrote them; a worker taking over a shard runs
  only the others, and the merge into the output and error files keeps the first result of each
  ``custom_id``. A request may run twice (its worker died after the engine answered and before
  the line was written, or two workers briefly held the same shard), but it is *reported* once.

Layout::

    batches/files/<file id>.json        a file's metadata (OpenAI's file object + its owner)
    batches/files/<file id>.jsonl       its content
    batches/<batch id>/batch.json       the batch's record (OpenAI's batch object + its owner)
    batches/<batch id>/plan.json        written once validated: line offsets, shard size
    batches/<batch id>/cancel           the owner asked to cancel (any agent writes it)
    batches/<batch id>/<name>.lease     who works a unit (``validate``, ``finalize``, ``shard-K``)
    batches/<batch id>/shard-K.<worker>.jsonl   results appended by one worker
    batches/<batch id>/shard-K.<worker>.progress  that worker's counts of the shard so far
    batches/<batch id>/shard-K.done     the shard is answered: its counts

Leases (``take_lease``): a unit of work is held by one worker, named in its lease file with a
wall-clock expiry that the holder renews. Another worker takes the unit over when the lease has
expired or its holder is gone from the mesh (the ``is_gone`` the caller passes); creation is
``O_EXCL``, a takeover replaces the file and reads it back. Two workers that race a takeover
may both believe they hold a shard for one renewal period, which the exactly-once rule above
makes harmless.

Bounded memory: nothing here reads a whole file. Input lines are read by byte range (the plan's
offsets: ``shard_input``, one shard's lines), files and segments line by line in chunks of
``CHUNK_BYTES`` (``iter_lines``), a shard's results are indexed by position (``ShardResults``:
its ``custom_id``s, not its lines) and read one at a time, output files are written as a stream
to a temporary name and renamed (``FileWriter``), and a batch's counts come from the ``done``
markers and the ``progress`` files, never from its results. What one call holds is one chunk,
one line, or one shard's ``custom_id``s.

Sync and blocking: the callers run these functions in a worker thread (``trio.to_thread``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson

Json = dict[str, Any]

CHUNK_BYTES = 1024 * 1024  # what one read of a file or segment takes

_ID = re.compile(r"^(file|batch)[-_][0-9a-zA-Z]{8,64}$")
_WORKER = re.compile(r"^[0-9a-zA-Z_-]{1,128}$")


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def valid_id(text: str) -> bool:
    """Ids are checked before they become paths: only ``file-…`` and ``batch_…`` of letters
    and digits, so no id names a path outside the store."""
    return bool(_ID.match(text))


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new content, never part."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class FileWriter:
    """A file written as a stream: to a temporary name beside ``path``, then ``commit`` flushes,
    ``fsync``-s and renames it over ``path`` (readers see the old file or the whole new one);
    ``abort`` (or leaving the ``with`` block on an exception) removes the temporary file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self.size = 0
        self.lines = 0
        self._buf: list[bytes] = []
        self._buffered = 0

    def write_line(self, line: bytes) -> None:
        """Append ``line`` and a newline (buffered up to ``CHUNK_BYTES``)."""
        self._buf.append(line)
        self._buf.append(b"\n")
        self._buffered += len(line) + 1
        self.lines += 1
        if self._buffered >= CHUNK_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        view = memoryview(b"".join(self._buf))
        self._buf.clear()
        self._buffered = 0
        self.size += len(view)
        while view:
            view = view[os.write(self.fd, view) :]

    def commit(self) -> None:
        try:
            self._flush()
            os.fsync(self.fd)
        finally:
            self._close()
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        self._close()
        self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.fd >= 0:
            self.abort()


def iter_lines(fd: int, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
    """Every line of the open file ``fd`` from byte ``start`` (to ``stop``, else its end), blank
    ones included, as ``(offset, line without its newline)``; read in ``CHUNK_BYTES`` pieces,
    so what is held is one piece and the longest line. A last line without a newline is
    yielded too (a reader of results skips it if it is torn: it does not parse)."""
    pos = start  # where the next chunk starts
    parts: list[bytes] = []  # the pieces of a line not ended yet
    line_at = start
    while stop is None or pos < stop:
        want = CHUNK_BYTES if stop is None else min(CHUNK_BYTES, stop - pos)
        chunk = os.pread(fd, want, pos)
        if not chunk:
            break
        at = 0
        nl = chunk.find(b"\n")
        while nl >= 0:
            if parts:
                parts.append(chunk[at:nl])
                yield line_at, b"".join(parts)
                parts = []
            else:
                yield pos + at, chunk[at:nl]
            at = nl + 1
            line_at = pos + at
            nl = chunk.find(b"\n", at)
        if at < len(chunk):
            if not parts:
                line_at = pos + at
            parts.append(chunk[at:])
        pos += len(chunk)
    if parts:
        yield line_at, b"".join(parts)


def _read_json(path: Path) -> Json | None:
    try:
        doc = json.loads(path.read_bytes())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return None  # being replaced, or damaged: treated as absent, the writer retries
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class Lease:
    holder: str
    until: float  # wall clock


@dataclass(frozen=True)
class Plan:
    """What validation found: where each request line starts (and where the last ends), and
    how the lines are cut into shards (the unit a worker takes)."""

    offsets: tuple[int, ...]  # len = lines + 1
    shard_size: int

    @property
    def lines(self) -> int:
        return len(self.offsets) - 1

    @property
    def shards(self) -> int:
        return -(-self.lines // self.shard_size)

    def shard_lines(self, shard: int) -> range:
        start = shard * self.shard_size
        return range(start, min(start + self.shard_size, self.lines))

    def byte_range(self, lines: range) -> tuple[int, int]:
        """Where the input bytes of ``lines`` (consecutive, not empty) start and end."""
        return self.offsets[lines.start], self.offsets[lines.stop]


def split_lines(data: bytes, base: int, plan: Plan, lines: range) -> list[bytes]:
    """The raw request lines ``lines`` out of ``data``, the input's bytes from offset ``base``
    (``Plan.byte_range``)."""
    out = []
    end = len(data)
    for i in lines:
        rel = plan.offsets[i] - base
        nl = data.find(b"\n", rel)
        out.append(data[rel : nl if nl >= 0 else end])
    return out


def read_lines(fd: int, plan: Plan, lines: range) -> list[bytes]:
    """The raw request lines ``lines`` of the input file open as ``fd``: one ranged read of
    their bytes, never the whole file."""
    if not lines:
        return []
    start, stop = plan.byte_range(lines)
    parts = []
    pos = start
    while pos < stop:
        chunk = os.pread(fd, stop - pos, pos)
        if not chunk:
            break
        parts.append(chunk)
        pos += len(chunk)
    return split_lines(b"".join(parts), start, plan, lines)


@dataclass(frozen=True)
class ShardCounts:
    completed: int
    failed: int


@dataclass(frozen=True)
class ResultRef:
    """Where a result line is: segment ``segment`` of the shard, ``length`` bytes at
    ``offset``; and whether it goes to the error file."""

    segment: int
    offset: int
    length: int
    failed: bool


class ShardResults:
    """A shard's results by ``custom_id``, the first of each in any segment (the exactly-once
    rule), indexed by position: what is held is the ``custom_id``s and where their lines are,
    never the lines (``read`` fetches one). A truncated or unreadable line (a worker killed
    mid-write) is skipped. Use as a context manager: it keeps the segments open."""

    def __init__(self, paths: list[Path]) -> None:
        self.refs: dict[str, ResultRef] = {}
        self._fds: list[int] = []
        try:
            for path in paths:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                self._fds.append(fd)
                self._index(len(self._fds) - 1, fd)
        except BaseException:
            self.close()
            raise

    def _index(self, segment: int, fd: int) -> None:
        refs = self.refs
        for offset, line in iter_lines(fd):
            if not line.strip():
                continue
            try:
                doc = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            cid = doc.get("custom_id") if isinstance(doc, dict) else None
            if isinstance(cid, str) and cid not in refs:
                refs[cid] = ResultRef(segment, offset, len(line), result_failed(doc))

    def counts(self) -> ShardCounts:
        failed = sum(1 for ref in self.refs.values() if ref.failed)
        return ShardCounts(len(self.refs) - failed, failed)

    def read(self, ref: ResultRef) -> bytes:
        return os.pread(self._fds[ref.segment], ref.length, ref.offset)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ShardResults:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def result_failed(doc: Json) -> bool:
    """A result line goes to the error file when its request got no answer or an error one."""
    if doc.get("error") is not None:
        return True
    response = doc.get("response")
    if not isinstance(response, dict):
        return True
    status = response.get("status_code")
    return not isinstance(status, int) or not 200 <= status < 300


class BatchStore:
    """The Batch API's files and batches under ``root`` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files_dir = root / "files"

    def ensure(self) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)

    # -- files ------------------------------------------------------------------------------

    def put_file(self, meta: Json, content: bytes) -> None:
        """Store a file: its content first, then its metadata (a file exists once both do)."""
        self.ensure()
        file_id = meta["id"]
        write_atomic(self.files_dir / f"{file_id}.jsonl", content)
        write_atomic(self.files_dir / f"{file_id}.json", json.dumps(meta).encode())

    def file_meta(self, file_id: str) -> Json | None:
        if not valid_id(file_id):
            return None
        return _read_json(self.files_dir / f"{file_id}.json")

    def file_path(self, file_id: str) -> Path:
        if not valid_id(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.files_dir / f"{file_id}.jsonl"

    def read_file(self, file_id: str) -> bytes | None:
        """A file's whole content: for small files and tests only (the worker and the API read
        by range: ``open_file``)."""
        try:
            return self.file_path(file_id).read_bytes()
        except (OSError, ValueError):
            return None

    def open_file(self, file_id: str) -> int | None:
        """A file's content open for reading (an ``fd`` the caller closes), None if it is gone.
        Open, it stays readable whole even if the file is deleted or replaced meanwhile."""
        try:
            return os.open(self.file_path(file_id), os.O_RDONLY)
        except (OSError, ValueError):
            return None

    def file_writer(self, file_id: str) -> FileWriter:
        """A writer of a file's content as a stream; ``put_meta`` once it is committed."""
        self.ensure()
        return FileWriter(self.file_path(file_id))

    def put_meta(self, meta: Json) -> None:
        write_atomic(self.files_dir / f"{meta['id']}.json", json.dumps(meta).encode())

    def list_files(self) -> list[Json]:
        out = []
        try:
            names = os.listdir(self.files_dir)
        except FileNotFoundError:
            return []
        for name in names:
            if name.endswith(".json") and not name.startswith("."):
                meta = _read_json(self.files_dir / name)
                if meta is not None:
                    out.append(meta)
        return out

    def delete_file(self, file_id: str) -> bool:
        if not valid_id(file_id):
            return False
        existed = (self.files_dir / f"{file_id}.json").exists()
        (self.files_dir / f"{file_id}.json").unlink(missing_ok=True)
        (self.files_dir / f"{file_id}.jsonl").unlink(missing_ok=True)
        return existed

    # -- batches ----------------------------------------------------------------------------

    def batch_dir(self, batch_id: str) -> Path:
        if not valid_id(batch_id):
            raise ValueError(f"not a batch id: {batch_id!r}")
        return self.root / batch_id

    def create_batch(self, record: Json) -> None:
        self.ensure()
        d = self.batch_dir(record["id"])
        d.mkdir()
        write_atomic(d / "batch.json", json.dumps(record).encode())

    def read_batch(self, batch_id: str) -> Json | None:
        if not valid_id(batch_id):
            return None
        return _read_json(self.root / batch_id / "batch.json")

    def write_batch(self, record: Json) -> None:
        write_atomic(self.batch_dir(record["id"]) / "batch.json", json.dumps(record).encode())

    def batch_ids(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [n for n in names if n.startswith("batch_") and valid_id(n)]

    def request_cancel(self, batch_id: str, now: float) -> float:
        """Ask for the batch to be cancelled (idempotent); the time it was first asked."""
        path = self.batch_dir(batch_id) / "cancel"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            asked = self.cancel_requested(batch_id)
            return asked if asked is not None else now
        try:
            os.write(fd, json.dumps({"at": now}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return now

    def cancel_requested(self, batch_id: str) -> float | None:
        path = self.batch_dir(batch_id) / "cancel"
        if not path.exists():
            return None
        doc = _read_json(path)
        at = doc.get("at") if doc is not None else None
        return float(at) if isinstance(at, int | float) else os.stat(path).st_mtime

    # -- plan -------------------------------------------------------------------------------

    def write_plan(self, batch_id: str, plan: Plan) -> None:
        doc = {"offsets": list(plan.offsets), "shard_size": plan.shard_size}
        write_atomic(self.batch_dir(batch_id) / "plan.json", json.dumps(doc).encode())

    def read_plan(self, batch_id: str) -> Plan | None:
        doc = _read_json(self.batch_dir(batch_id) / "plan.json")
        if doc is None:
            return None
        offsets, size = doc.get("offsets"), doc.get("shard_size")
        if not isinstance(offsets, list) or not isinstance(size, int) or size < 1:
            return None
        return Plan(tuple(int(o) for o in offsets), size)

    # -- leases -----------------------------------------------------------------------------

    def lease(self, batch_id: str, name: str) -> Lease | None:
        doc = _read_json(self.batch_dir(batch_id) / f"{name}.lease")
        if doc is None:
            return None
        holder, until = doc.get("holder"), doc.get("until")
        if not isinstance(holder, str) or not isinstance(until, int | float):
            return None
        return Lease(holder, float(until))

    def take_lease(
        self,
        batch_id: str,
        name: str,
        holder: str,
        *,
        now: float,
        ttl_s: float,
        is_gone: Callable[[str], bool],
    ) -> bool:
        """Hold unit ``name`` of a batch: True if it was free (no lease), expired, its holder is
        gone, or already ours."""
        if not _WORKER.match(holder):
            raise ValueError(f"not a worker id: {holder!r}")
        path = self.batch_dir(batch_id) / f"{name}.lease"
        doc = json.dumps({"holder": holder, "until": now + ttl_s}).encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            current = self.lease(batch_id, name)
            if (
                current is not None
                and current.holder != holder
                and current.until > now
                and not is_gone(current.holder)
            ):
                return False
            write_atomic(path, doc)
            mine = self.lease(batch_id, name)
            return mine is not None and mine.holder == holder
        try:
            os.write(fd, doc)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def renew_lease(
        self, batch_id: str, name: str, holder: str, *, now: float, ttl_s: float
    ) -> bool:
        """Push our lease's expiry on; False if it is no longer ours (taken over)."""
        current = self.lease(batch_id, name)
        if current is None or current.holder != holder:
            return False
        path = self.batch_dir(batch_id) / f"{name}.lease"
        write_atomic(path, json.dumps({"holder": holder, "until": now + ttl_s}).encode())
        return True

    def release_lease(self, batch_id: str, name: str, holder: str) -> None:
        current = self.lease(batch_id, name)
        if current is not None and current.holder == holder:
            (self.batch_dir(batch_id) / f"{name}.lease").unlink(missing_ok=True)

    def live_leases(
        self, batch_id: str, prefix: str, *, now: float, is_gone: Callable[[str], bool]
    ) -> int:
        """Units named ``prefix…`` some live worker holds."""
        n = 0
        for path in self.batch_dir(batch_id).glob(f"{prefix}*.lease"):
            lease = self.lease(batch_id, path.name[: -len(".lease")])
            if lease is not None and lease.until > now and not is_gone(lease.holder):
                n += 1
        return n

    # -- results ----------------------------------------------------------------------------

    def segment_path(self, batch_id: str, shard: int, worker: str) -> Path:
        if not _WORKER.match(worker):
            raise ValueError(f"not a worker id: {worker!r}")
        return self.batch_dir(batch_id) / f"shard-{shard}.{worker}.jsonl"

    def segments(self, batch_id: str, shard: int) -> list[Path]:
        return sorted(self.batch_dir(batch_id).glob(f"shard-{shard}.*.jsonl"))

    def shard_results(self, batch_id: str, shard: int) -> ShardResults:
        """The results of a shard so far, indexed (``ShardResults``; close it)."""
        return ShardResults(self.segments(batch_id, shard))

    def read_results(self, batch_id: str, shard: int) -> dict[str, bytes]:
        """The results of a shard so far, by ``custom_id``, lines and all: for tests (the
        worker indexes them: ``shard_results``)."""
        with self.shard_results(batch_id, shard) as results:
            return {cid: results.read(ref) for cid, ref in results.refs.items()}

    def write_progress(self, batch_id: str, shard: int, worker: str, counts: ShardCounts) -> None:
        """What ``worker`` has answered of a shard it works (earlier workers' results
        included): the status polls read these, not the results."""
        if not _WORKER.match(worker):
            raise ValueError(f"not a worker id: {worker!r}")
        doc = {"completed": counts.completed, "failed": counts.failed}
        path = self.batch_dir(batch_id) / f"shard-{shard}.{worker}.progress"
        write_atomic(path, json.dumps(doc).encode())

    def mark_done(self, batch_id: str, shard: int, counts: ShardCounts) -> None:
        doc = {"completed": counts.completed, "failed": counts.failed}
        write_atomic(self.batch_dir(batch_id) / f"shard-{shard}.done", json.dumps(doc).encode())

    def done_shard_ids(self, batch_id: str) -> set[int]:
        """The shards marked done (one directory listing, no file read)."""
        out = set()
        for name in os.listdir(self.batch_dir(batch_id)):
            if name.startswith("shard-") and name.endswith(".done"):
                shard = name[len("shard-") : -len(".done")]
                if shard.isdigit():
                    out.add(int(shard))
        return out

    def done_shards(self, batch_id: str) -> dict[int, ShardCounts]:
        out: dict[int, ShardCounts] = {}
        for shard in self.done_shard_ids(batch_id):
            doc = _read_json(self.batch_dir(batch_id) / f"shard-{shard}.done")
            if doc is not None:
                out[shard] = ShardCounts(int(doc.get("completed", 0)), int(doc.get("failed", 0)))
        return out

    def counts(self, batch_id: str, plan: Plan | None) -> ShardCounts:
        """Requests answered so far: the done shards' counts plus, for each shard still being
        worked, the most advanced of its workers' ``progress`` files (one directory listing and
        small files; no result is read, so a poll costs the same for a batch of any size). A
        shard's progress lags its results by up to a worker's scan interval."""
        if plan is None:
            return ShardCounts(0, 0)
        d = self.batch_dir(batch_id)
        done: set[int] = set()
        progress: dict[int, list[str]] = {}
        for name in os.listdir(d):
            if not name.startswith("shard-"):
                continue
            number, _, rest = name[len("shard-") :].partition(".")
            if not number.isdigit():
                continue
            if rest == "done":
                done.add(int(number))
            elif rest.endswith(".progress"):
                progress.setdefault(int(number), []).append(name)
        completed = failed = 0
        for shard in done:
            doc = _read_json(d / f"shard-{shard}.done")
            if doc is not None:
                completed += int(doc.get("completed", 0))
                failed += int(doc.get("failed", 0))
        for shard, names in progress.items():
            if shard in done:
                continue
            best = ShardCounts(0, 0)
            for name in names:
                doc = _read_json(d / name)
                if doc is None:
                    continue
                seen = ShardCounts(int(doc.get("completed", 0)), int(doc.get("failed", 0)))
                if seen.completed + seen.failed > best.completed + best.failed:
                    best = seen
            completed += best.completed
            failed += best.failed
        return ShardCounts(completed, failed)
