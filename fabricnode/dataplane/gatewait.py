"""The batch gate's shell: how the ingress waits for its ``gate.BatchGate``. The machine
decides; this holds the waiting tasks, the cancel scopes of the attempts it may take back, and
the one loop that looks again.

One way of waiting: a waiting request sleeps on its own event until the machine ends its wait
(``BatchGate.take_ended``); the loop sleeps until an event (a batch request queued, an attempt
that may be taken back starting, the mesh changing: ``wake``) or the machine's
``next_deadline()``, and every ``GATE_PEEK_S`` while requests wait, to notice clients that hung
up (a socket's hang-up shows only when looked at), or when a node's ejection by the circuit
breaker ends (a waiter may see that node then). A batch request ending scans at once
(``done``). No fixed period otherwise: asleep while the gate is idle.

Batch requests only: an interactive request never gets here, so the per-request state passed
in (its connection, record and filters) costs the hot path nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import trio

from fabricnode.dataplane.clientconn import ClientConn, ClientGone
from fabricnode.dataplane.failure import TAKEN_BACK, Failed
from fabricnode.dataplane.gate import (
    GATE_GONE,
    GRANTED,
    NO_NODE,
    QUEUED,
    BatchGate,
    BatchWaiter,
)
from fabricnode.dataplane.job import Job
from fabricnode.dataplane.metrics import IngressMetrics
from fabricnode.dataplane.request import Routed
from fabricnode.dataplane.routetable import CircuitBreaker, Route
from fabricnode.dataplane.routing import Candidate
from fabricnode.dataplane.sockio import LoopClock, client_gone

# While batch requests wait in the gate, their clients are checked for a hang-up this often.
GATE_PEEK_S = 0.5


class GateWaits:
    """The trio side of one ``BatchGate`` (see the module docstring)."""

    def __init__(
        self,
        gate: BatchGate,
        *,
        clock: LoopClock,
        wall_clock: Callable[[], float],
        breaker: CircuitBreaker,
        metrics: IngressMetrics,
    ) -> None:
        self.gate = gate
        self.clock = clock
        self.wall_clock = wall_clock
        self.breaker = breaker
        self.metrics = metrics
        self._waits: dict[BatchWaiter, tuple[ClientConn, trio.Event]] = {}
        self._scopes: dict[Job, trio.CancelScope] = {}
        self._wake = trio.Event()  # the loop looks again (``run``)

    def wake(self) -> None:
        """Something the gate reads may have changed (a load report, a node): look again."""
        if self.gate.busy():
            self._wake.set()

    async def admit(
        self,
        conn: ClientConn,
        job: Job,
        routed: Routed,
        tried: set[str],
    ) -> tuple[list[Candidate], list[Route]] | str | None:
        """A batch request's way to a node with room for batch work (``gate.BatchGate``): the
        candidates to try (the first holds a batch slot on its node, ``job.slot.node``) with
        their routes; ``GATE_FULL`` or ``GATE_TIMEOUT`` when the gate sends it away; None when
        no node is eligible any more. ClientGone if its client hangs up while it waits."""
        w = BatchWaiter(job, routed, tried)
        gate = self.gate
        if gate.offer(w, self.clock.now(), self.wall_clock()) == QUEUED and not w.outcome:
            event = trio.Event()
            self._waits[w] = (conn, event)
            self._wake.set()  # the gate's loop watches its deadline and its client
            try:
                await event.wait()
            finally:
                del self._waits[w]
                gate.leave(w, "")  # a no-op once its wait ended (else: shutdown)
        self._ended()
        outcome = w.outcome
        if outcome == GRANTED:
            if w.first:  # metrics of a batch request sent on (not of its failovers)
                self.metrics.batch_wait.observe((), self.clock.now() - job.started)
                self.metrics.batch_admitted.labels(w.label or gate.key_label(job)).inc()
            return w.ranked, w.routes
        if outcome == GATE_GONE:
            self.metrics.client_disconnects.labels("gate").inc()
            raise ClientGone
        if outcome == NO_NODE:
            return None
        return outcome

    def _ended(self) -> None:
        """Wake the waiters whose wait in the gate ended."""
        waits = self._waits
        for w in self.gate.take_ended():
            waiting = waits.get(w)
            if waiting is not None:
                waiting[1].set()

    def done(self, job: Job) -> None:
        """The attempt that held a batch slot ended: free the slot, and let a waiter have it."""
        gate = self.gate
        gate.done(job)
        if len(gate):
            gate.scan(self.clock.now(), self.wall_clock())
            self._ended()

    async def preemptible(
        self, job: Job, sid: str, attempt: Coroutine[Any, Any, Failed | None]
    ) -> Failed | None:
        """A batch attempt the gate may take back until its answer's head is in (``Relay.exchange``
        calls ``answered`` then): the attempt's outcome, or ``failure.TAKEN_BACK`` (the request
        waits again)."""
        self.gate.running(job, sid, self.clock.now())
        with trio.CancelScope() as scope:
            self._scopes[job] = scope
            self._wake.set()  # the gate's loop watches for pressure while batch work runs
            try:
                return await attempt
            finally:
                self.answered(job, sid)
        if job.slot is not None:
            job.slot.preemptions += 1
        self.metrics.batch_preempted.inc()
        return TAKEN_BACK

    def answered(self, job: Job, sid: str) -> None:
        self.gate.answered(job, sid)
        self._scopes.pop(job, None)

    async def run(self) -> None:
        """The gate's one way of waiting: until an event (a batch request queued or sent, a
        mesh change: ``wake``) or the gate's deadline (``BatchGate.next_deadline``: a
        wait's end, a pacing or prefill clock running out, a load report going stale), and
        every ``GATE_PEEK_S`` while requests wait, for clients that hung up (``client_gone``),
        and when a node's ejection by the circuit breaker ends.
        Then: end the waits past their deadline, take back batch work from nodes under
        pressure, and release the waiters that have room. Asleep while the gate is idle."""
        gate = self.gate
        next_peek = 0.0
        while True:
            wake = self._wake = trio.Event()
            if not gate.busy():
                await wake.wait()
                continue
            deadline = gate.next_deadline()
            if len(gate):
                # Its clients, and a node back from ejection (a waiter may see it then).
                now = self.clock.now()
                deadline = min(deadline, next_peek, self.breaker.next_readmission(now))
            if deadline > self.clock.now():
                with trio.move_on_at(deadline):
                    await wake.wait()
            else:
                await trio.lowlevel.checkpoint()
            now, wall = self.clock.now(), self.wall_clock()
            if len(gate) and now >= next_peek:
                next_peek = now + GATE_PEEK_S
                for w, (conn, _) in list(self._waits.items()):
                    if client_gone(conn.sock):
                        gate.leave(w, GATE_GONE)
            gate.expire(now)
            for job in gate.pressure(wall):
                scope = self._scopes.get(job)
                if scope is not None:
                    scope.cancel()
            gate.scan(now, wall)
            self._ended()
