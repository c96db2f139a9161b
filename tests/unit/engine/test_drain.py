"""The drain of a leaving node under a fake clock (``engine.drain``): the engine stops only
when nothing is in flight to it, or after the deadline once what was left is handed over; the
doors close when the ingress relays nothing more."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.engine.drain import Action, Drain, Phase, deadline_s


def test_a_leave_stops_accepting_at_once_and_the_engine_only_when_nothing_is_in_flight() -> None:
    d = Drain(deadline_s=30.0)
    assert d.leave(100.0, engine=10, relayed=5) == [Action.STOP_ACCEPTING]
    assert d.phase is Phase.DRAINING and d.next_deadline() == 130.0
    for t, n in ((101.0, 9), (110.0, 4), (129.0, 1)):
        assert d.update(t, engine=n, relayed=5) == []  # requests still running: no stop
    assert d.update(129.5, engine=0, relayed=5) == [Action.STOP_ENGINE]
    assert d.statistics().handed_over == 0 and d.statistics().engine_at_start == 10


def test_an_idle_node_stops_its_engine_right_after_it_stopped_accepting() -> None:
    d = Drain(deadline_s=30.0)
    assert d.leave(0.0, engine=0, relayed=0) == [Action.STOP_ACCEPTING, Action.STOP_ENGINE]


def test_at_the_deadline_what_runs_is_handed_over_then_the_engine_stops() -> None:
    d = Drain(deadline_s=30.0, handover_s=5.0)
    d.leave(0.0, engine=3, relayed=0)
    assert d.update(30.0, engine=3, relayed=0) == [Action.HAND_OVER]
    assert d.phase is Phase.HANDING_OVER and d.next_deadline() == 35.0
    assert d.update(30.1, engine=1, relayed=2) == []  # broken off, not gone yet
    assert d.update(30.2, engine=0, relayed=3) == [Action.STOP_ENGINE]
    assert d.statistics().handed_over == 3


def test_a_hand_over_that_does_not_empty_the_engine_stops_it_after_handover_s() -> None:
    d = Drain(deadline_s=10.0, handover_s=5.0)
    d.leave(0.0, engine=1, relayed=0)
    assert d.update(10.0, engine=1, relayed=0) == [Action.HAND_OVER]
    assert d.update(14.9, engine=1, relayed=0) == []
    assert d.update(15.0, engine=1, relayed=0) == [Action.STOP_ENGINE]


def test_after_the_engine_the_doors_wait_for_the_requests_relayed_elsewhere() -> None:
    d = Drain(deadline_s=30.0)
    d.leave(0.0, engine=2, relayed=4)
    assert d.update(5.0, engine=0, relayed=4) == [Action.STOP_ENGINE]
    assert d.phase is Phase.STOPPING_ENGINE and d.next_deadline() == math.inf
    assert d.engine_stopped(6.0, relayed=4) == []
    assert d.phase is Phase.RELAYING and d.next_deadline() == 36.0
    assert d.update(20.0, engine=0, relayed=1) == []
    assert d.update(21.0, engine=0, relayed=0) == [Action.CLOSE_DOORS]
    assert d.closed and d.next_deadline() == math.inf
    assert d.update(22.0, engine=0, relayed=0) == []  # closed once


def test_relayed_requests_get_at_most_the_deadline_after_the_engine_stopped() -> None:
    d = Drain(deadline_s=30.0)
    d.leave(0.0, engine=0, relayed=1)
    d.engine_stopped(1.0, relayed=1)
    assert d.update(30.9, engine=0, relayed=1) == []
    assert d.update(31.0, engine=0, relayed=1) == [Action.CLOSE_DOORS]


def test_an_engine_that_exits_by_itself_mid_drain_ends_the_engine_phase() -> None:
    """vLLM got Slurm's SIGTERM too and finished first, or crashed: its requests broke with it
    and their ingresses resume them; the drain goes on with what the ingress relays."""
    d = Drain(deadline_s=30.0)
    d.leave(0.0, engine=5, relayed=0)
    assert d.engine_stopped(3.0, relayed=2) == []
    assert d.phase is Phase.RELAYING and d.statistics().engine_stopped_at == 3.0
    assert d.update(4.0, engine=0, relayed=0) == [Action.CLOSE_DOORS]


def test_a_node_without_engine_only_waits_for_what_it_relays() -> None:
    d = Drain(deadline_s=30.0, has_engine=False)
    assert d.leave(0.0, engine=0, relayed=2) == [Action.STOP_ACCEPTING]
    assert d.phase is Phase.RELAYING and d.next_deadline() == 30.0
    assert d.update(2.0, engine=0, relayed=0) == [Action.CLOSE_DOORS]
    idle = Drain(deadline_s=30.0, has_engine=False)
    assert idle.leave(0.0, engine=0, relayed=0) == [Action.STOP_ACCEPTING, Action.CLOSE_DOORS]


def test_a_second_leave_changes_nothing() -> None:
    d = Drain(deadline_s=30.0)
    d.leave(0.0, engine=1, relayed=0)
    assert d.leave(10.0, engine=1, relayed=0) == []
    assert d.next_deadline() == 30.0  # from the first signal, not the second


def test_the_deadline_never_runs_past_the_slurm_jobs_end() -> None:
    assert deadline_s(30.0, None, 1000.0) == 30.0  # outside Slurm, or an unknown end
    assert deadline_s(30.0, 2000.0, 1000.0) == 30.0
    assert deadline_s(30.0, 1025.0, 1000.0) == 15.0  # 10 s before the end: the engine's stop
    assert deadline_s(30.0, 1005.0, 1000.0) == 0.0  # past it: hand over at once


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        Drain(deadline_s=-1.0)


@given(
    deadline=st.floats(0.0, 100.0),
    steps=st.lists(
        st.tuples(st.floats(0.0, 20.0), st.integers(0, 5), st.integers(0, 5)), max_size=40
    ),
)
def test_the_engine_never_stops_early_and_the_doors_always_close(
    deadline: float, steps: list[tuple[float, int, int]]
) -> None:
    """Whatever the counts do, STOP_ENGINE comes only with nothing in flight or after the
    hand-over; each action comes once and in order; driven by its own deadlines it closes."""
    d = Drain(deadline_s=deadline, handover_s=5.0)
    now = 0.0
    engine = steps[0][1] if steps else 0
    seen = d.leave(now, engine=engine, relayed=0)
    for dt, engine, relayed in steps:
        now += dt
        if d.phase is Phase.STOPPING_ENGINE:
            seen += d.engine_stopped(now, relayed=relayed)
            engine = 0
        handing = d.phase is Phase.HANDING_OVER
        acts = d.update(now, engine=engine, relayed=relayed)
        if Action.STOP_ENGINE in acts:
            assert engine == 0 or (handing and now >= deadline + 5.0)
        seen += acts
    while not d.closed:  # nothing changes any more: only the deadlines move it
        if d.phase is Phase.STOPPING_ENGINE:
            seen += d.engine_stopped(now, relayed=1)
            continue
        now = max(now, d.next_deadline())
        assert now < math.inf
        seen += d.update(now, engine=1, relayed=1)
    assert seen[0] is Action.STOP_ACCEPTING and seen[-1] is Action.CLOSE_DOORS
    assert len(seen) == len(set(seen))
    order = [Action.STOP_ACCEPTING, Action.HAND_OVER, Action.STOP_ENGINE, Action.CLOSE_DOORS]
    assert seen == [a for a in order if a in seen]
