"""The pending-aware hold (``fabricnode.dataplane.hold``): when a held request goes, under a
fake clock (plain floats). No sockets, no trio."""

from __future__ import annotations

from fabricnode.dataplane.hold import STALE_MARGIN_S, Hold
from fabricnode.dataplane.routing import (
    Candidate,
    LoadSnapshot,
    NodeInfo,
    RouteRequest,
    make_policy,
)

WALL = 1_750_000_000.0
STALE_S = 3.0


def cand(sid: str, *, waiting: int, at: float = WALL) -> Candidate:
    info = NodeInfo(sid, f"http://{sid}", "p", None, None, "L4", 1, 4096, None)
    return Candidate(info, LoadSnapshot(waiting, 4, 0.5, 0, at), 0)


def hold(now: float = 10.0, hold_max_s: float = 2.0) -> Hold:
    policy = make_policy("prefix-pending")
    return Hold(
        policy, RouteRequest("m1", (), None, 10), now, hold_max_s=hold_max_s, stale_after_s=STALE_S
    )


def test_a_request_is_held_while_every_node_is_backlogged_and_goes_once_one_is_open() -> None:
    h = hold()
    busy = [cand("a", waiting=5), cand("b", waiting=5)]
    assert h.rank(busy, 10.1, WALL) is None
    ranked = h.rank([cand("a", waiting=5), cand("b", waiting=0)], 10.2, WALL)
    assert ranked is not None and ranked[0].node.session_id == "b"


def test_past_its_longest_hold_the_request_is_pushed_anyway() -> None:
    h = hold(hold_max_s=2.0)
    busy = [cand("a", waiting=5), cand("b", waiting=3)]
    assert h.rank(busy, 11.9, WALL) is None
    ranked = h.rank(busy, 12.0, WALL)
    assert ranked is not None and len(ranked) == 2


def test_its_deadline_is_when_a_report_that_holds_it_goes_stale_or_its_end() -> None:
    h = hold(now=10.0, hold_max_s=5.0)
    # b's report is a second old: stale in two seconds, when b counts as open.
    h.held([cand("a", waiting=5), cand("b", waiting=5, at=WALL - 1.0)], 10.0, WALL)
    assert h.next_deadline() == 10.0 + 2.0 + STALE_MARGIN_S
    ranked = h.rank([cand("a", waiting=5), cand("b", waiting=5, at=WALL - 1.0)], 12.0, WALL + 2.01)
    assert ranked is not None and ranked[0].node.session_id == "b"
    h2 = hold(now=10.0, hold_max_s=1.0)
    h2.held([cand("a", waiting=5)], 10.0, WALL)
    assert h2.next_deadline() == 11.0  # the hold ends before the report goes stale
