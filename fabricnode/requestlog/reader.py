"""Reading a request log whole: its files (the live one and the rotated ones) and their
records, for the admin API's ``/fabric/v1/workload?window=`` (what ``fabric plan`` asks every
agent for) and for tests.

Blocking file I/O: the agent calls these from a worker thread. Reading only what the log
gained since the last time is ``cursor``'s.
"""

from __future__ import annotations

from pathlib import Path

from fabricnode.errors import ConfigError
from fabricnode.requestlog.format import TraceRecord, parse_line


def request_log_files(path: Path) -> list[Path]:
    """``path`` and its rotated predecessors that exist, oldest first."""
    rotated: list[tuple[int, Path]] = []
    for candidate in path.parent.glob(f"{path.name}.*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
            rotated.append((int(suffix), candidate))
    files = [p for _, p in sorted(rotated, reverse=True)]
    if path.exists():
        files.append(path)
    return files


def read_request_log(path: Path, *, include_rotated: bool = False) -> list[TraceRecord]:
    """The records of a request log (and, if asked, of its rotated files, oldest first).

    Lines that are not trace records (a line cut short by a crash) are skipped; a file with
    lines but no record at all is refused with one ConfigError line, since it is most likely
    not a request log.
    """
    files = request_log_files(path) if include_rotated else [path]
    if not files:
        raise ConfigError(f"request log {path} does not exist")
    records: list[TraceRecord] = []
    lines = 0
    for file in files:
        try:
            raw = file.read_bytes()
        except FileNotFoundError as exc:
            raise ConfigError(f"request log {file} does not exist") from exc
        except OSError as exc:
            raise ConfigError(f"cannot read request log {file}: {exc.strerror}") from exc
        for line in raw.splitlines():
            if not line.strip():
                continue
            lines += 1
            record = parse_line(line)
            if record is not None:
                records.append(record)
    if lines and not records:
        raise ConfigError(f"{path} is not a fabric request log (no trace record in it)")
    return records
