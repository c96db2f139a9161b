"""Scale by need (``elastic.need``): the replicas a replica submitted now meets a need for when
it arrives; several at once when the queue says so, none for a queue that drains first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.elastic.need import Need, at_arrival, replicas

RATE = st.floats(0, 50, allow_nan=False)
BACKLOG = st.floats(0, 1e5, allow_nan=False)
SERVING = st.integers(0, 20)
COLD = st.floats(0, 600, allow_nan=False)
UTIL = st.floats(0.1, 1.0)


def need(rate: float, backlog: float, serving: int, cold: float, rate_now: float = 0.0) -> Need:
    return at_arrival(
        rate=rate, rate_now=rate_now, backlog=backlog, serving=serving, cold_start_s=cold,
        drain_s=30.0,
    )  # fmt: skip


def test_a_jump_to_four_replicas_of_work_asks_for_them_in_one_decision() -> None:
    # one replica serving, the demand jumped to four replicas' worth 10 s ago: the queue
    # grew by three replica-seconds a second; a replica arrives in 20 s
    jumped = at_arrival(
        rate=4.0, rate_now=4.0, backlog=30.0, serving=1, cold_start_s=20.0, drain_s=30.0
    )
    # the queue grows by three replica-seconds a second until a new replica arrives
    assert jumped.backlog_left == 30.0 + 3 * 20.0
    assert replicas(jumped, 1.0) == 7  # four for the rate, three more drain the queue
    # a 10 s burst that is over (the demand is back to half a replica): the one replica
    # drains the queue in the cold start; nothing to add for it
    over = at_arrival(
        rate=0.5, rate_now=0.5, backlog=8.0, serving=1, cold_start_s=20.0, drain_s=30.0
    )
    assert over.backlog_left == 0.0 and replicas(over, 0.7) == 1


@settings(max_examples=300, deadline=None)
@given(RATE, RATE, BACKLOG, BACKLOG, SERVING, COLD, UTIL)
def test_need_is_monotone_in_rate_and_backlog(
    r1: float, r2: float, b1: float, b2: float, serving: int, cold: float, u: float
) -> None:
    lo, hi = (
        need(min(r1, r2), min(b1, b2), serving, cold),
        need(max(r1, r2), max(b1, b2), serving, cold),
    )
    assert 0 <= replicas(lo, u) <= replicas(hi, u)


@settings(max_examples=300, deadline=None)
@given(RATE, BACKLOG, SERVING, SERVING, COLD, UTIL)
def test_more_serving_replicas_never_need_more(
    rate: float, backlog: float, s1: int, s2: int, cold: float, u: float
) -> None:
    few, many = need(rate, backlog, min(s1, s2), cold), need(rate, backlog, max(s1, s2), cold)
    assert replicas(many, u) <= replicas(few, u)


@settings(max_examples=300, deadline=None)
@given(RATE, SERVING, COLD, UTIL)
def test_without_a_queue_the_need_is_the_rates(
    rate: float, serving: int, cold: float, u: float
) -> None:
    n = need(rate, 0.0, serving, cold)
    assert n.backlog_left == 0.0
    assert replicas(n, u) == replicas(Need(rate, 0.0, 30.0), u)
