"""The agent's log of the mesh as it sees it: its own readiness once, then every member that
appears, changes lifecycle state or liveness, or is forgotten (one line each, polled every
``interval_s``; a change that comes and goes between two looks is not logged)."""

from __future__ import annotations

import logging

import trio

from fabricnode.control.views import liveness_of
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.join import JoinTracker

log = logging.getLogger("fabricnode.agent")  # the name operators grep job logs for

INTERVAL_S = 1.0


async def log_member_changes(
    core: MeshCore, tracker: JoinTracker, interval_s: float = INTERVAL_S
) -> None:
    seen: dict[str, tuple[str, str]] = {}
    was_ready = False
    while True:
        if not was_ready and tracker.is_ready():
            was_ready = True
            log.info("ready: %s", tracker.reason)
        current: dict[str, tuple[str, str]] = {}
        for entry in core.registry:
            sid = entry.session_id
            if sid == core.self_id:
                continue
            current[sid] = (entry.body.state.label, liveness_of(core, entry))
            if seen.get(sid) != current[sid]:
                state, liveness = current[sid]
                log.info("member %s %s: %s, %s", sid[:8], entry.body.provider, state, liveness)
        for sid in seen.keys() - current.keys():
            log.info("member %s forgotten", sid[:8])
        seen = current
        await trio.sleep(interval_s)
