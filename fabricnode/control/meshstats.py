"""The mesh's rates and latencies per model over the last minutes (``GET /fabric/v1/stats``).

Each agent counts what it answered as an ingress (``dataplane.recent``); a request is counted
once, by the agent the client sent it to. So the mesh's figures are the sum over every agent:
``MeshStats.gather`` asks the other live agents for their own counts
(``/fabric/v1/stats?scope=self``), adds them to this agent's, and reads the rates and
percentiles from the sum (``recent.summarize``). That makes any agent a window on the whole mesh.

Bounds: at most ``MAX_AGENTS`` agents asked, ``peers.CONCURRENCY`` at a time, through
``peers.PeerClient`` (each answer bounded in time and size); an agent that does not answer, or
answers something else, is left out and counted (``answered`` < ``asked`` in the answer). One
gathering is reused for ``CACHE_S`` by every viewer with the same key, so ten open dashboards
cost the mesh what one does. Nothing of the page's request is passed on, its key least of all:
each agent is asked with this agent's own signed header (``peerauth``), so one gathering serves
every admin who may read it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from fabricnode.control.peerauth import STATS_PATH
from fabricnode.control.peers import CONCURRENCY, PeerClient
from fabricnode.dataplane.recent import BUCKET_S, BUCKETS, merge, summarize
from fabricnode.elastic.observe import agent_urls
from fabricnode.mesh.core import MeshCore

log = logging.getLogger("fabricnode.control.meshstats")

MAX_AGENTS = 256
CACHE_S = 2.0
MAX_CACHED = 8

Json = dict[str, Any]
LocalExport = Callable[[float, float], list[Json]]
AskAgent = Callable[[str, str, float], Awaitable[list[Json] | None]]  # (session, url, window)


def window_of(raw: str | None) -> float:
    """The ``window`` query parameter (seconds), bounded to what the ring keeps."""
    if raw is None:
        return BUCKETS * BUCKET_S
    value = float(raw)  # ValueError: the caller answers 400
    if not math.isfinite(value) or value < BUCKET_S:
        raise ValueError(f"window {raw!r}: expected seconds >= {BUCKET_S:g}")
    return min(value, BUCKETS * BUCKET_S)


class MeshStats:
    def __init__(
        self,
        core: MeshCore,
        local_export: LocalExport,
        wall_clock: Callable[[], float],
        peers: PeerClient,
        ask: AskAgent | None = None,
    ) -> None:
        self.core = core
        self.local_export = local_export
        self.wall_clock = wall_clock
        self.peers = peers
        self.ask = ask or self._ask
        self._cache: dict[float, tuple[float, Json]] = {}

    def local(self, window_s: float) -> Json:
        """This agent's own counts: what ``scope=self`` answers (mergeable rows)."""
        now = self.wall_clock()
        return {
            "scope": "self",
            "bucket_s": BUCKET_S,
            "now": now,
            "rows": self.local_export(now, window_s),
        }

    async def gather(self, window_s: float) -> Json:
        """The whole mesh's figures (see the module docstring)."""
        key = window_s
        now = self.wall_clock()
        cached = self._cache.get(key)
        if cached is not None and now - cached[0] < CACHE_S:
            return cached[1]
        agents = self.peer_agents()
        answers: list[list[Json]] = [self.local_export(now, window_s)]
        answered = 1
        limiter = trio.CapacityLimiter(CONCURRENCY)

        async def one(sid: str, url: str) -> None:
            nonlocal answered
            async with limiter:
                rows = await self.ask(sid, url, window_s)
            if rows is not None:
                answers.append(rows)
                answered += 1

        async with trio.open_nursery() as nursery:
            for sid, url in agents:
                nursery.start_soon(one, sid, url)
        doc = {
            "scope": "mesh",
            "bucket_s": BUCKET_S,
            "now": now,
            "agents": {"asked": len(agents) + 1, "answered": answered},
            "models": summarize(merge(answers), now, window_s),
        }
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[key] = (now, doc)
        return doc

    def peer_agents(self) -> list[tuple[str, str]]:
        """(session id, HTTP address) of the other agents the control plane counts
        (``agent_urls``: probed members not known down, dead or gone; a suspect one may be a
        slow answer, which the timeout bounds)."""
        own = self.core.self_entry.session_id
        agents = sorted((sid, url) for sid, url in agent_urls(self.core) if sid != own)
        return [(sid, url.rstrip("/")) for sid, url in agents[:MAX_AGENTS]]

    async def _ask(self, sid: str, url: str, window_s: float) -> list[Json] | None:
        params = {"scope": "self", "window": f"{window_s:g}"}
        doc = await self.peers.get_json(url, sid, STATS_PATH, params)
        rows = None if doc is None else doc.get("rows")
        return rows if isinstance(rows, list) else None
