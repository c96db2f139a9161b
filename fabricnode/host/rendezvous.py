"""Rendezvous file on a shared filesystem: how agents in different Slurm jobs find each other.

Each agent appends one line ``<gossip addr> <session id> <unix time>`` when it starts. Readers
take the most recent distinct addresses, skipping their own and anything malformed; stale lines
(agents long gone) only cost a failed first contact, because any one live member is enough to
join. Appends of one short line with O_APPEND are atomic on local filesystems and, in practice,
on NFS/Lustre/GPFS for lines this short; a torn or interleaved line is simply skipped.

The file is compacted (atomically replaced by its newest lines) when it grows past
``MAX_BYTES``, so it never needs an operator's care.

The agent's side: ``announce_and_read`` appends our line *before* reading, so of any two agents
starting together the later one always sees the earlier one and they cannot form two separate
meshes; ``watch`` re-reads the file while we know no reachable member (agents that started after
us). File access runs in a worker thread: a shared filesystem can stall.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import trio

from fabricnode.addr import split_hostport
from fabricnode.errors import ConfigError
from fabricnode.mesh.service import GossipService

log = logging.getLogger("fabricnode.host.rendezvous")

MAX_BYTES = 256 * 1024
KEEP_LINES = 512


def announce(path: Path, gossip_addr: str, session_id: str, now: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    line = f"{gossip_addr} {session_id} {int(now if now is not None else time.time())}\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    try:
        if path.stat().st_size > MAX_BYTES:
            _compact(path)
    except OSError:
        pass  # compaction is an optimisation; a reader copes with a long file


def read_peers(path: Path, *, exclude: str = "", limit: int = 64) -> list[str]:
    """Newest first, distinct gossip addresses found in the file (empty if it does not exist)."""
    try:
        text = path.read_bytes()[-MAX_BYTES * 2 :].decode("utf-8", errors="replace")
    except OSError:
        return []
    seen: list[str] = []
    for line in reversed(text.splitlines()):
        parts = line.split()
        if len(parts) != 3 or not parts[2].isdigit():
            continue
        addr = parts[0]
        try:
            split_hostport(addr)
        except ConfigError:
            continue
        if addr != exclude and addr not in seen:
            seen.append(addr)
            if len(seen) >= limit:
                break
    return seen


async def announce_and_read(path: Path, gossip_addr: str, session_id: str) -> list[str]:
    """Announce ourselves, then return the peers announced so far (our seeds)."""
    try:
        await trio.to_thread.run_sync(announce, path, gossip_addr, session_id)
    except OSError as exc:
        log.warning("cannot announce in rendezvous file %s: %s", path, exc)
    return await _read_others(path, gossip_addr)


async def watch(path: Path, gossip: GossipService, poll_s: float) -> None:
    """While isolated, bootstrap from peers newly announced in the file."""
    own = gossip.core.gossip_addr
    while True:
        await trio.sleep(poll_s)
        if gossip.core.left or gossip.core.members.reachable():
            continue
        peers = await _read_others(path, own)
        if peers:
            gossip.bootstrap(peers)


async def _read_others(path: Path, own: str) -> list[str]:
    return await trio.to_thread.run_sync(lambda: read_peers(path, exclude=own))


def _compact(path: Path) -> None:
    lines = path.read_text(errors="replace").splitlines()[-KEEP_LINES:]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
