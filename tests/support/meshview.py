"""Helpers for tests that watch real agents: free ports, an agent's view of an entry, its
/metrics as numbers."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import httpx

from cli.localmesh import AgentProcess, LocalMesh
from fabricnode.control.client import AdminClient
from fabricnode.engine.command import free_port as engine_free_port
from fabricnode.errors import AgentApiError

# An entry's fields in the order of docs/admin-guide.md's JSON reference, as the admin API and
# `fabric ... --json` give them.
ENTRY_KEYS = [
    "session_id",
    "provider",
    "verified_provider",
    "site",
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
    """A port on 127.0.0.1 for a process a test starts, from below the ephemeral range (see
    ``fabricnode.engine.command.free_port``)."""
    return engine_free_port("127.0.0.1")


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


METRIC = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", re.MULTILINE)


def metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    """An agent's (or engine's) /metrics: each series, with its labels as written, to its value
    (``api_key``: an admin key, needed once the agent's API keys are on)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    text = httpx.get(f"{url}/metrics", timeout=2.0, headers=headers).text
    return {name: float(value) for name, value in METRIC.findall(text)}


def fabric(
    mesh: LocalMesh, agent: AgentProcess, *args: str, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """``fabric --agent <agent> ARGS`` with the mesh's environment, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "--agent", agent.http_url, *args],
        env=mesh.env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
