"""The cold-start wait's shell: how the ingress waits for a replica (``coldstart``). The
machines decide (``ReplicaRoom`` bounds the waiters, ``ReplicaWait`` says when the wait ends
and when a stream's next keep-alive comment is due); this sends the held stream's head and its
comments, and sleeps.

One way of waiting: a waiting request sleeps until the mesh changes (``wake``, from the
ingress's ``mesh_changed``: a replica joins, a report arrives) or the wait's
``next_deadline()``, and every ``REPLICA_PEEK_S`` to notice a client that hung up (a socket's
hang-up shows only when looked at). No task of its own: the request's task waits.

Requests for a model no node serves now only (scale from zero, or every node failed before
answering): a request for a served model never gets here, so the per-request state passed in
costs the hot path nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import trio

from fabricnode.dataplane.clientconn import ClientConn, ClientGone, client_send
from fabricnode.dataplane.coldstart import STREAM_HEAD, ReplicaRoom, ReplicaWait
from fabricnode.dataplane.http1 import frame
from fabricnode.dataplane.job import Job
from fabricnode.dataplane.request import Rejection
from fabricnode.dataplane.routetable import Route
from fabricnode.dataplane.sockio import LoopClock, client_gone

# A request waiting for a replica looks at its client for a hang-up this often.
REPLICA_PEEK_S = 0.25


class ReplicaWaits:
    """The trio side of the wait for a replica (see the module docstring)."""

    def __init__(
        self,
        room: ReplicaRoom,
        *,
        clock: LoopClock,
        keepalive_s: float,
        send_timeout_s: float,
        on_waiting: Callable[[Mapping[str, int]], None] | None,
    ) -> None:
        self.room = room
        self.waiting = room.waiting  # models -> requests waiting
        self.clock = clock
        self.keepalive_s = keepalive_s
        self.send_timeout_s = send_timeout_s  # a send to the waiting client (its stream)
        # Who is told which models have requests waiting (the agent labels its entry, so the
        # acting controller starts a replica).
        self.on_waiting = on_waiting
        self._changed = trio.Event()  # set and replaced by ``wake``

    def wake(self) -> None:
        """The mesh changed: waiting requests look again."""
        if self.waiting:
            changed, self._changed = self._changed, trio.Event()
            changed.set()

    async def wait(
        self,
        conn: ClientConn,
        job: Job,
        hold_s: float,
        failed: frozenset[str],
        lookup: Callable[[set[str]], list[Route] | None],
    ) -> list[Route] | Rejection:
        """Wait for a replica of ``job``'s model, once the room let it in (``ReplicaRoom.enter``):
        the routes to dispatch to (``lookup``: those with an eligible node), or the refusal
        once ``hold_s`` from the request's arrival passed. A stream gets its 200 SSE head at
        once (``job.held_head``) and a comment every ``keepalive_s``. ClientGone if the client
        hangs up."""
        model = job.model
        self._waiting(model, +1)
        holds_head = job.held_head or (job.stream and not job.http10)
        wait = ReplicaWait(
            model, job.started, hold_s, failed, keepalive_s=self.keepalive_s, holds_head=holds_head
        )
        try:
            if holds_head and not job.held_head:
                job.held_head = True
                job.status = 200
                await client_send(conn, STREAM_HEAD, self.send_timeout_s)
            while True:
                now = self.clock.now()
                got = wait.poll(now, lookup)
                if got is not None:
                    return got
                if client_gone(conn.sock):
                    raise ClientGone
                if wait.note_due(now):
                    await client_send(conn, frame([wait.note()], True), self.send_timeout_s)
                changed = self._changed
                with trio.move_on_at(min(wait.next_deadline(), now + REPLICA_PEEK_S)):
                    await changed.wait()
        finally:
            self._waiting(model, -1)

    def _waiting(self, model: str, delta: int) -> None:
        if self.room.add(model, delta) and self.on_waiting is not None:
            self.on_waiting(self.room.snapshot())  # a model starts or stops waiting
