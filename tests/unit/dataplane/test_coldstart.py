"""Waiting for a replica (``fabricnode.dataplane.coldstart``): the machine under a fake clock
(plain floats), a fake route table standing for the mesh. No sockets, no trio."""

from __future__ import annotations

import math

from fabricnode.dataplane.coldstart import (
    RETRY_FAILED_AFTER_S,
    ReplicaRoom,
    ReplicaWait,
)
from fabricnode.dataplane.request import Rejection
from fabricnode.dataplane.routetable import Route
from fabricnode.dataplane.routing import NodeInfo


def route(sid: str) -> Route:
    return Route(
        NodeInfo(sid, f"http://{sid}", "p", None, None, "L4", 1, 4096, None),
        ("127.0.0.1", 1),
        math.inf,
        False,
    )


class Table:
    """The replicas of the model now; a lookup leaves out the nodes a request tried."""

    def __init__(self) -> None:
        self.sids: list[str] = []

    def lookup(self, tried: set[str]) -> list[Route] | None:
        routes = [route(s) for s in self.sids]
        return routes if any(s not in tried for s in self.sids) else None


def wait(
    hold_s: float = 10.0, *, stream: bool = False, failed: frozenset[str] = frozenset()
) -> ReplicaWait:
    return ReplicaWait("m1", 100.0, hold_s, failed, keepalive_s=2.0, holds_head=stream)


def test_a_request_waits_until_a_replica_serves_then_gets_its_routes() -> None:
    table = Table()
    w = wait()
    assert w.poll(100.0, table.lookup) is None
    assert w.poll(105.0, table.lookup) is None
    table.sids.append("n1")  # a replica joined: the shell polls on the mesh's change
    got = w.poll(105.1, table.lookup)
    assert isinstance(got, list) and [r.info.session_id for r in got] == ["n1"]


def test_past_its_hold_time_from_arrival_the_request_is_refused_with_retry_after() -> None:
    w = wait(hold_s=10.0)
    assert w.next_deadline() == 110.0
    assert w.poll(109.99, Table().lookup) is None
    got = w.poll(110.0, Table().lookup)
    assert isinstance(got, Rejection)
    assert (got.status, got.code) == (503, "replica_starting")
    assert got.message == (
        "a replica of 'm1' is starting: no replica served within 10 s; retry shortly"
    )
    assert got.headers == [(b"retry-after", b"30")]


def test_a_replica_that_comes_at_the_deadline_still_serves() -> None:
    table = Table()
    table.sids.append("n1")
    assert isinstance(wait(hold_s=1.0).poll(200.0, table.lookup), list)


def test_a_held_stream_gets_a_comment_at_once_and_every_keepalive() -> None:
    w = wait(stream=True)
    assert w.note_due(100.0) and w.note() == b": waiting for a replica of m1 to start\n\n"
    assert not w.note_due(101.9)
    assert w.next_deadline() == 102.0  # the next comment, before the wait's end
    assert w.note_due(102.0)
    assert not wait(stream=False).note_due(100.0)  # no head out: no comments


def test_nodes_that_failed_are_asked_again_only_after_a_while() -> None:
    table = Table()
    table.sids.append("n1")
    w = wait(failed=frozenset({"n1"}))
    assert w.next_deadline() == 100.0 + RETRY_FAILED_AFTER_S
    assert w.poll(101.0, table.lookup) is None
    got = w.poll(100.0 + RETRY_FAILED_AFTER_S, table.lookup)
    assert isinstance(got, list) and w.tried == set()
    assert w.next_deadline() == 110.0


def test_the_room_is_bounded_and_says_when_a_model_starts_or_stops_waiting() -> None:
    room = ReplicaRoom(max_waiting=2)
    assert room.enter("m1") is None
    assert room.add("m1", +1) is True  # m1 starts waiting
    assert room.add("m1", +1) is True  # two: the label's count changes
    full = room.enter("m2")
    assert isinstance(full, Rejection) and (full.status, full.code) == (503, "replica_starting")
    assert full.message == (
        "too many requests are waiting for replicas to start; 'm2' has none now"
    )
    assert full.headers == [(b"retry-after", b"30")]
    assert room.add("m1", -1) is True
    assert room.add("m1", -1) is True and room.snapshot() == {}


def test_the_room_says_a_growing_queue_at_two_steps_an_octave() -> None:
    """The agent relabels its entry (signed, gossiped) when the room says so: as a queue grows
    to n, about 2 log2 n times, not once per request."""
    room = ReplicaRoom(max_waiting=10_000)
    changed = [n + 1 for n in range(1000) if room.add("m", +1)]
    assert changed[:8] == [1, 2, 3, 4, 6, 8, 12, 16]
    assert len(changed) <= 20
    assert room.snapshot() == {"m": 1000}
    gone = [n for n in range(999, -1, -1) if room.add("m", -1)]
    assert len(gone) <= 20 and gone[-1] == 0 and room.snapshot() == {}
