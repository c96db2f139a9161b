"""The pending-aware hold as a sans-IO machine: an interactive request the policy holds at the
ingress (``routing``: SkyLB's selective pushing, every node backlogged) and when it goes.

Rules
-----
1. A request is held when the policy ranks its candidates as ``None`` (only the pending-aware
   policy does, and only with ``allow_hold``). ``rank(candidates, now, wall)`` asks it again:
   the ranked candidates once some node is open, else None (hold on).
2. At most ``hold_max_s``: from then on the policy is asked with ``allow_hold=False`` and
   pushes the request to its least-loaded pick (affinity kept) rather than wait on.
3. A node is backlogged only on a fresh load report (``routing._backlogged``), so a hold ends
   by a fresh report showing room, one of our requests finishing (both events the shell
   waits for: a request ending, the mesh changing), or a report ageing out. ``next_deadline``
   is the soonest of the hold's end and the moment the first candidate's fresh report goes
   stale: the policy's answer does not change by time alone before then.

Pure: no I/O, no clock reads, no trio; ``now`` is the ingress's monotonic clock, ``wall`` the
wall clock load reports carry.
"""

from __future__ import annotations

from collections.abc import Sequence

from fabricnode.dataplane.routing import Candidate, Policy, RouteRequest

# A report is fresh while ``|wall - at| <= stale_after_s``: look just after it stops being.
STALE_MARGIN_S = 0.001


class Hold:
    """One held request (see the module docstring)."""

    __slots__ = ("deadline", "give_up", "policy", "rreq", "stale_after_s")

    def __init__(
        self,
        policy: Policy,
        rreq: RouteRequest,
        now: float,
        *,
        hold_max_s: float,
        stale_after_s: float,
    ) -> None:
        self.policy = policy
        self.rreq = rreq
        self.give_up = now + hold_max_s
        self.stale_after_s = stale_after_s
        self.deadline = self.give_up

    def held(self, candidates: Sequence[Candidate], now: float, wall: float) -> None:
        """The policy held the request over ``candidates``: when to ask it again by time."""
        soonest = self.give_up
        stale_s = self.stale_after_s
        for c in candidates:
            load = c.load
            if load is not None and abs(wall - load.at) <= stale_s:
                soonest = min(soonest, now + (load.at + stale_s - wall) + STALE_MARGIN_S)
        self.deadline = soonest

    def rank(
        self, candidates: Sequence[Candidate], now: float, wall: float
    ) -> list[Candidate] | None:
        """The candidates in the order to try them, or None: hold on (rules 1 and 2)."""
        ranked = self.policy.rank(self.rreq, candidates, wall, allow_hold=now < self.give_up)
        if ranked is None:
            self.held(candidates, now, wall)
        return ranked

    def next_deadline(self) -> float:
        return self.deadline
