"""When an agent counts as joined (``/ready``, the "ready:" log line): pure, clock passed in."""

from __future__ import annotations

from collections.abc import Callable

from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.membership import Liveness


class JoinTracker:
    """Decides when the agent counts as joined; once joined it stays joined.

    Joined means: some other member answered (we know one alive), or there was nobody to join
    (no seeds at start: we are the first), or ``timeout_s`` passed without an answer — every seed
    was a stale rendezvous line, so we are the founder of a new mesh and should serve anyway.
    ``reason`` says which, once joined.
    """

    def __init__(
        self,
        core: MeshCore,
        *,
        had_seeds: bool,
        started_at: float,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.core = core
        self.had_seeds = had_seeds
        self.started_at = started_at
        self.timeout_s = timeout_s
        self.clock = clock
        self.reason = ""

    def is_ready(self) -> bool:
        if self.reason:
            return True
        if not self.had_seeds:
            self.reason = "no peers to join: starting a new mesh"
        elif any(m.status == Liveness.ALIVE for m in self.core.members.members.values()):
            self.reason = "joined the mesh"
        elif self.clock() - self.started_at >= self.timeout_s:
            self.reason = f"no peer answered in {self.timeout_s:g} s: starting a new mesh"
        return bool(self.reason)
