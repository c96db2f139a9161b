"""The assignment follower: a JOIN-only agent (no engine command) waits for the operator's
assignment for it (``fabric plan --apply``) and turns it into the engine command to launch.

The outcome is published as labels on our entry (``fabric.plan``, ``fabric.plan_status``), so
the operator sees it with ``fabric nodes`` / ``fabric plan --apply`` without logging in here. An
assignment that cannot be carried out (no ``--engine-template``, more GPUs than the node has, a
template that does not render) is reported that way and the follower keeps waiting for the next
one. It acts once: the first command it returns is the engine; a later plan never replaces a
running engine.
"""

from __future__ import annotations

import logging

import trio

from fabricnode.engine.command import EngineCommand
from fabricnode.engine.template import EngineTemplate
from fabricnode.errors import ConfigError
from fabricnode.mesh.assignment import SignedAssignment
from fabricnode.mesh.registry import Hardware
from fabricnode.mesh.schema import PLAN_LABEL, PLAN_STATUS_LABEL
from fabricnode.mesh.service import GossipService

log = logging.getLogger("fabricnode.engine.follower")

POLL_S = 0.25  # how fast a JOIN-only node notices an assignment for it


class AssignmentFollower:
    """Waits for our assignment; ``labels`` are the plan labels a new session must carry too."""

    def __init__(
        self,
        gossip: GossipService,
        template: EngineTemplate | None,
        hardware: Hardware,
        *,
        poll_s: float = POLL_S,
    ) -> None:
        self.gossip = gossip
        self.template = template
        self.hardware = hardware
        self.poll_s = poll_s
        self.labels: tuple[tuple[str, str], ...] = ()

    async def next_engine(self) -> EngineCommand:
        """Return the engine command of the first assignment for us that can be carried out."""
        core = self.gossip.core
        seen: SignedAssignment | None = None
        while True:
            await trio.sleep(self.poll_s)
            item = core.assignments.get(core.self_id)
            if item is None or item is seen or core.left:
                continue
            seen = item
            command = self._command_for(item)
            if command is not None:
                return command

    def _command_for(self, item: SignedAssignment) -> EngineCommand | None:
        a = item.body
        where = f"plan {a.plan_id}: {a.model} tp={a.tp} dp={a.dp}"
        if self.template is None:
            log.warning("%s assigned to us, but this agent has no --engine-template", where)
            self._publish(a.plan_id, "no engine template")
            return None
        gpus = self.hardware.gpu_count
        if a.gpus > max(1, gpus):
            log.warning("%s needs %d GPUs; this node has %d", where, a.gpus, gpus)
            self._publish(a.plan_id, f"needs {a.gpus} GPUs")
            return None
        try:
            command = self.template.render(a.model, a.tp, a.dp, self.hardware.gpu_type)
        except ConfigError as exc:
            log.warning("%s: cannot render the engine template: %s", where, exc)
            self._publish(a.plan_id, f"error: {exc}"[:200])
            return None
        log.info("%s from operator %s: starting %s", where, item.operator, command.argv)
        self._publish(a.plan_id, "launching")
        return command

    def _publish(self, plan_id: str, status: str) -> None:
        self.labels = ((PLAN_LABEL, plan_id), (PLAN_STATUS_LABEL, status))
        self.gossip.relabel(PLAN_LABEL, self.labels)  # the prefix of both
