"""The drain of a leaving node: when its engine may stop, and what becomes of the requests it
still has.

Theory of operation
-------------------
A node leaves on SIGTERM (``scancel``, preemption, the elastic controller's scale-in) or on its
own before the job's time limit. Slurm signals every process of the job step, so the engine
usually got SIGTERM at the same moment and is shutting down by its own rules (vLLM's
``--shutdown-timeout``, the simulated engine's ``--shutdown-grace-s``): it refuses new requests
and stops answering probes while it finishes those it has. The drain decides, from the signal
on, what the node does:

1. ``STOP_ACCEPTING`` at once: the shell signs LEFT (routing takes SERVING nodes only, so every
   ingress, this node's own included, routes elsewhere) and its ingress refuses forwards (503:
   the sending ingress fails over, invisibly to the client).
2. Requests in flight to the engine (this node's clients' and those other ingresses forwarded
   to it: ``engine``) run on. ``STOP_ENGINE`` once none is left. Nothing else stops the engine
   while it drains: an engine that stopped answering its health checks is shutting down, not
   hung (``EngineService.begin_drain``).
3. At the deadline (``deadline_s`` after the signal) those still running are handed over
   (``HAND_OVER``): the shell breaks them, and the ingress that holds each client continues its
   stream on another node (``dataplane.resume``), or sends a request with no answer yet to
   another node. ``STOP_ENGINE`` follows when they are gone, at the latest ``handover_s`` later.
4. Once the engine stopped (or exited by itself), the requests this node's ingress relays to
   other nodes (``relayed``: its clients' requests served elsewhere, the handed-over streams
   among them) run on; ``CLOSE_DOORS`` (stop the HTTP servers) when none is left, at the latest
   ``deadline_s`` after the engine stopped (after the signal, on a node without engine).

The machine takes the time and the counts (``update``) and returns what to do; it reads no
clock and does no I/O. ``next_deadline`` says when to call ``update`` again if no count changes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

HANDOVER_S = 5.0  # from HAND_OVER to STOP_ENGINE at the latest
JOB_END_MARGIN_S = 10.0  # a drain ends this long before the Slurm job's end: the engine's stop


def deadline_s(drain_timeout_s: float, job_end: float | None, now: float) -> float:
    """How long the engine's requests may run from a leave beginning at ``now`` (Unix time):
    ``drain_timeout_s``, and never past the Slurm job's end (``job_end``, None: unknown) less
    ``JOB_END_MARGIN_S``, after which Slurm kills the step."""
    if job_end is None:
        return drain_timeout_s
    return min(drain_timeout_s, max(0.0, job_end - now - JOB_END_MARGIN_S))


class Action(enum.Enum):
    STOP_ACCEPTING = "stop accepting"
    HAND_OVER = "hand over"
    STOP_ENGINE = "stop engine"
    CLOSE_DOORS = "close doors"


class Phase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # the engine finishes what it has
    HANDING_OVER = "handing over"  # past the deadline: the rest is being broken off
    STOPPING_ENGINE = "stopping engine"  # STOP_ENGINE said; waiting for engine_stopped
    RELAYING = "relaying"  # the engine is gone; the ingress's requests to others run on
    CLOSED = "closed"


@dataclass(frozen=True)
class DrainStatistics:
    phase: str
    began_at: float | None  # when the leave began (None: serving)
    deadline: float | None  # when the engine's requests are handed over
    engine_at_start: int  # requests in flight to the engine when the leave began
    handed_over: int  # ... still in flight at the deadline
    engine_stopped_at: float | None


class Drain:
    """One node's drain (module docstring). ``has_engine``: False on a node with no engine
    (an ingress only, or JOIN-only): it goes from STOP_ACCEPTING to relaying."""

    def __init__(
        self, *, deadline_s: float, handover_s: float = HANDOVER_S, has_engine: bool = True
    ) -> None:
        if deadline_s < 0 or handover_s < 0:
            raise ValueError("the drain's bounds are durations: >= 0")
        self.deadline_s = deadline_s
        self.handover_s = handover_s
        self.has_engine = has_engine
        self.phase = Phase.SERVING
        self.began_at: float | None = None
        self.deadline: float | None = None
        self.engine_at_start = 0
        self.handed_over = 0
        self.handover_at: float | None = None
        self.engine_stopped_at: float | None = None
        self.doors_deadline: float | None = None

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    def statistics(self) -> DrainStatistics:
        return DrainStatistics(
            self.phase.value,
            self.began_at,
            self.deadline,
            self.engine_at_start,
            self.handed_over,
            self.engine_stopped_at,
        )

    def leave(self, now: float, *, engine: int, relayed: int) -> list[Action]:
        """The leave begins (a signal, the time limit's own leave); a second call is nothing."""
        if self.phase is not Phase.SERVING:
            return []
        self.began_at = now
        self.deadline = now + self.deadline_s
        self.engine_at_start = engine
        if self.has_engine:
            self.phase = Phase.DRAINING
        else:
            self._relaying(now)
        return [Action.STOP_ACCEPTING, *self.update(now, engine=engine, relayed=relayed)]

    def engine_stopped(self, now: float, *, relayed: int) -> list[Action]:
        """The engine is gone: stopped on STOP_ENGINE, or exited by itself meanwhile (its
        requests broke with it; their ingresses resume them)."""
        if self.phase in (Phase.SERVING, Phase.RELAYING, Phase.CLOSED):
            return []
        self._relaying(now)
        return self.update(now, engine=0, relayed=relayed)

    def update(self, now: float, *, engine: int, relayed: int) -> list[Action]:
        """The counts as they are at ``now``: requests in flight to the engine, and those the
        ingress relays to other nodes."""
        phase = self.phase
        if phase is Phase.DRAINING:
            if engine == 0:
                return self._stop_engine()
            assert self.deadline is not None
            if now >= self.deadline:
                self.phase = Phase.HANDING_OVER
                self.handed_over = engine
                self.handover_at = now
                return [Action.HAND_OVER]
        elif phase is Phase.HANDING_OVER:
            assert self.handover_at is not None
            if engine == 0 or now >= self.handover_at + self.handover_s:
                return self._stop_engine()
        elif phase is Phase.RELAYING:
            assert self.doors_deadline is not None
            if relayed == 0 or now >= self.doors_deadline:
                self.phase = Phase.CLOSED
                return [Action.CLOSE_DOORS]
        return []

    def next_deadline(self) -> float:
        """When ``update`` must be called even if no count changed (inf: not before one does)."""
        phase = self.phase
        if phase is Phase.DRAINING and self.deadline is not None:
            return self.deadline
        if phase is Phase.HANDING_OVER and self.handover_at is not None:
            return self.handover_at + self.handover_s
        if phase is Phase.RELAYING and self.doors_deadline is not None:
            return self.doors_deadline
        return math.inf

    def _stop_engine(self) -> list[Action]:
        self.phase = Phase.STOPPING_ENGINE
        return [Action.STOP_ENGINE]

    def _relaying(self, now: float) -> None:
        self.phase = Phase.RELAYING
        if self.has_engine:
            self.engine_stopped_at = now
        self.doors_deadline = now + self.deadline_s
