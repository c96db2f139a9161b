"""Each node's recent load, for the dashboard's node view (``GET /fabric/v1/nodes/{id}/load``).

The mesh keeps only each node's latest load report (``MeshCore.loads``). This keeps the last
``SAMPLES`` reports of every node seen, one per report (a report seen twice is kept once), read
from the core every ``INTERVAL_S`` by the agent (``run``). Bounded by the registry: a node that
left the registry is forgotten at the next sample.
"""

from __future__ import annotations

from collections import deque

import trio

from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.wire import Load

INTERVAL_S = 5.0
SAMPLES = 120  # ten minutes at one report every 5 s

Json = dict[str, object]


class LoadHistory:
    def __init__(self) -> None:
        self._samples: dict[str, deque[Load]] = {}

    def sample(self, core: MeshCore) -> None:
        """Keep each node's latest report, if it is new; forget nodes the registry dropped."""
        known = {entry.session_id for entry in core.registry}
        for sid in [s for s in self._samples if s not in known]:
            del self._samples[sid]
        for sid, load in core.loads.items():
            if sid not in known:
                continue
            ring = self._samples.get(sid)
            if ring is None:
                ring = self._samples[sid] = deque(maxlen=SAMPLES)
            if not ring or ring[-1].seq != load.seq or ring[-1].at != load.at:
                ring.append(load)

    def of(self, sid: str) -> list[Json]:
        """One node's reports, oldest first (``at``: when the node measured it, Unix s)."""
        return [
            {
                "at": load.at,
                "waiting": load.waiting,
                "running": load.running,
                "kv_usage": load.kv_usage,
                "inflight": load.inflight,
            }
            for load in self._samples.get(sid, ())
        ]

    async def run(self, core: MeshCore) -> None:
        """Sample every ``INTERVAL_S``, until cancelled (the agent's nursery)."""
        while True:
            self.sample(core)
            await trio.sleep(INTERVAL_S)
