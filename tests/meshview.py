"""Helpers for tests that watch real agents: free ports and an agent's view of an entry."""

from __future__ import annotations

import socket
from typing import Any

from fabricnode.client import AdminClient
from fabricnode.errors import AgentApiError
from fabricnode.localmesh import AgentProcess

# An entry's fields in SPEC.md's order, as the admin API and `fabric ... --json` give them.
ENTRY_KEYS = [
    "session_id",
    "provider",
    "verified_provider",
    "state",
    "version",
    "liveness",
    "addresses",
    "hardware",
    "engine",
    "models",
    "labels",
    "load",
    "started_at",
    "updated_at",
    "expires_at",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def entry(watcher: AgentProcess, sid: str) -> dict[str, Any] | None:
    """``sid``'s entry as ``watcher`` shows it (None if unknown or the agent does not answer)."""
    try:
        with AdminClient(watcher.http_url, timeout_s=2.0) as client:
            return {n["session_id"]: n for n in client.nodes()}.get(sid)
    except AgentApiError:
        return None


def state_is(watcher: AgentProcess, sid: str, state: str) -> bool:
    e = entry(watcher, sid)
    return e is not None and e["state"] == state
