"""Waiting for a replica (scale from zero), as a sans-IO machine: the ingress's shell waits,
this decides. It returns routes or a refusal and never dispatches.

Rules
-----
1. A request for a model declared in the mesh's service file that no node serves now waits for
   a replica instead of a 404, at most ``hold_s`` from its arrival (the service's hold time).
   So does a request whose every node failed before answering (replicas leaving, preempted),
   for the hold time left: the nodes that failed (``failed``) are not asked again until
   ``RETRY_FAILED_AFTER_S`` after its arrival (the circuit breaker still ejects them).
2. ``ReplicaRoom`` bounds the waiters: past ``max_waiting`` in all, a newcomer is refused at
   once (503 ``replica_starting``, Retry-After 30). It counts waiters per model and says when a
   model starts or stops waiting, or its count crosses a step of ``mesh.schema.held_step`` (the
   agent labels its entry with the models and their counts, so that the acting controller
   starts the replicas they need).
3. ``ReplicaWait.poll(now, lookup)`` is the wait's one decision: the routes to dispatch to once
   one of them has an eligible node (``lookup``, the shell's route table and filters), the
   refusal once its deadline passed (503 ``replica_starting``: "no replica served within
   ``hold_s`` s"), else None (wait on). A stream gets its 200 SSE head at once
   (``holds_head``) and a comment line every ``keepalive_s`` (``note_due``) so that clients and
   proxies do not time out.
4. ``next_deadline()``: the wait's end, its next keep-alive comment, or the moment the failed
   nodes may be asked again. Anything else that ends a wait is an event the shell reports by
   polling again: a node joining or a report arriving (the mesh changed).

Pure: no I/O, no clock reads, no trio; ``now`` is the ingress's monotonic clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from fabricnode.dataplane.request import Rejection
from fabricnode.dataplane.routetable import Route
from fabricnode.mesh.schema import held_step

# A request waiting for a replica after every node failed tries those nodes again after this.
RETRY_FAILED_AFTER_S = 5.0
RETRY_AFTER_S = 30  # Retry-After of a request that found no replica in time
CODE = "replica_starting"
# The 200 head of a stream held for a replica: its events come when a replica answers.
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)

# The routes of the model now, if one of them has an eligible node that ``tried`` leaves out.
Lookup = Callable[[set[str]], "list[Route] | None"]


class ReplicaRoom:
    """The requests waiting for replicas, per model (rule 2)."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.waiting: dict[str, int] = {}

    def enter(self, model: str) -> Rejection | None:
        """A request for ``model`` starts waiting; its refusal if the room is full. The shell
        tells the agent when ``changed`` (a model started waiting)."""
        if sum(self.waiting.values()) >= self.max_waiting:
            return Rejection(
                503,
                f"too many requests are waiting for replicas to start; {model!r} has none now",
                CODE,
                [(b"retry-after", b"%d" % RETRY_AFTER_S)],
            )
        return None

    def add(self, model: str, delta: int) -> bool:
        """One more (or fewer) waiter for ``model``: True when what the agent's label says
        changed: a model started or stopped waiting, or its count crossed a step of
        ``held_step`` (two an octave: a queue of n changes it about 2 log2 n times)."""
        waiting = self.waiting
        before = waiting.get(model, 0)
        n = before + delta
        if n > 0:
            waiting[model] = n
        else:
            waiting.pop(model, None)
        return held_step(max(0, n)) != held_step(before)

    def snapshot(self) -> Mapping[str, int]:
        return dict(self.waiting)


class ReplicaWait:
    """One request's wait for a replica (rules 1, 3, 4)."""

    __slots__ = (
        "deadline",
        "hold_s",
        "holds_head",
        "keepalive_s",
        "model",
        "next_note",
        "retry_failed_at",
        "tried",
    )

    def __init__(
        self,
        model: str,
        started: float,
        hold_s: float,
        failed: frozenset[str],
        *,
        keepalive_s: float,
        holds_head: bool,
    ) -> None:
        self.model = model
        self.hold_s = hold_s
        self.deadline = started + hold_s
        self.tried = set(failed)  # nodes that failed it: not asked again until retry_failed_at
        self.retry_failed_at = started + RETRY_FAILED_AFTER_S
        self.keepalive_s = keepalive_s
        self.holds_head = holds_head  # a stream whose 200 head is out: it gets comments
        self.next_note = -math.inf  # the first comment goes out with the first wait

    def poll(self, now: float, lookup: Lookup) -> list[Route] | Rejection | None:
        """The routes to dispatch to, the refusal, or None: wait on (rule 3)."""
        if self.tried and now >= self.retry_failed_at:
            self.tried.clear()  # nodes that failed may answer now (the breaker still ejects)
        routes = lookup(self.tried)
        if routes:
            return routes
        if now >= self.deadline:
            return self.refusal()
        return None

    def refusal(self) -> Rejection:
        return Rejection(
            503,
            f"a replica of {self.model!r} is starting: no replica served within "
            f"{self.hold_s:g} s; retry shortly",
            CODE,
            [(b"retry-after", b"%d" % RETRY_AFTER_S)],
        )

    def note_due(self, now: float) -> bool:
        """Whether a keep-alive comment goes out now (a held stream, every ``keepalive_s``)."""
        if not self.holds_head or now < self.next_note:
            return False
        self.next_note = now + self.keepalive_s
        return True

    def note(self) -> bytes:
        """The comment line (an SSE comment: clients skip it)."""
        return b": waiting for a replica of " + self.model.encode() + b" to start\n\n"

    def next_deadline(self) -> float:
        """When the wait's answer may change by time alone (rule 4)."""
        soonest = self.deadline
        if self.holds_head:
            soonest = min(soonest, self.next_note)
        if self.tried:
            soonest = min(soonest, self.retry_failed_at)
        return soonest
