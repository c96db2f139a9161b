"""Processes, ports and /proc readings shared by the benches (bench/router.py, bench/routing.py
and the load generator bench/_loadgen.py).

Standard library only: bench/_loadgen.py imports it too, from whichever venv it runs in. Linux
only: process trees and CPU time come from /proc.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- process trees --------------------------------------------------------------------------------


def process_tree() -> dict[int, list[int]]:
    """Children of every process, from /proc (ppid is field 4 of /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(*roots: int, skip: Callable[[int], bool] = lambda _pid: False) -> list[int]:
    """``roots`` and every process below them, leaving out the subtrees of pids where ``skip``.
    With one root, that root comes first."""
    tree = process_tree()
    out: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if skip(pid):
            continue
        out.append(pid)
        todo.extend(tree.get(pid, ()))
    return out


def argv_of(pid: int) -> list[str]:
    """The command line of ``pid``; empty when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


# -- CPU and memory -------------------------------------------------------------------------------


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime of these processes (clock ticks); a process that is gone counts 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def host_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs from /proc/stat (idle and iowait are not busy)."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    total = sum(fields[:8])  # guest time is already inside user/nice
    return total - fields[3] - fields[4], total


def cpu_steal() -> tuple[int, int]:
    """(steal, total) jiffies from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def rss_mb(pids: list[int]) -> float:
    """Resident memory of these processes together, MiB; a process that is gone counts 0."""
    total_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
                        break
        except (OSError, ValueError):
            continue
    return total_kb / 1024
