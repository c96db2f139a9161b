"""The account of a request's attempts (``dataplane.failover``) under a fake clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fabricnode.dataplane import failure
from fabricnode.dataplane.failover import MAX_REFUSED_SKIPS, Failover
from fabricnode.dataplane.failure import Failed

BROKEN = Failed(failure.BROKEN, "connection closed before the response head")
REFUSED = Failed(failure.REFUSED, "cannot connect: Connection refused")
BUSY = failure.answered(503)
NO_RESPONSE = Failed(failure.NO_RESPONSE, "no response")


def account() -> Failover:
    return Failover(started=100.0, max_attempts=3, retry_budget_s=60.0, max_engine_failures=2)


def test_three_nodes_within_the_budget() -> None:
    fo = account()
    for sid in "abc":
        assert fo.may_try(100.0)
        fo.picked(sid)
        assert not fo.failed(BUSY)
    assert not fo.may_try(101.0) and fo.last_error == "node answered 503"
    late = account()
    late.picked("a")
    late.failed(BUSY)
    assert late.may_try(159.9) and not late.may_try(160.0)


def test_a_refused_connect_costs_no_attempt_a_few_times() -> None:
    fo = account()
    for i in range(MAX_REFUSED_SKIPS + 3):
        assert fo.may_try(100.0), i
        fo.picked(f"n{i}")
        fo.failed(REFUSED)
    assert len(fo.tried) == MAX_REFUSED_SKIPS + 3 and not fo.may_try(100.0)


def test_two_engines_failing_on_the_request_poison_it() -> None:
    fo = account()
    fo.picked("a")
    assert not fo.failed(BROKEN)
    assert fo.may_try(100.0)
    fo.picked("b")
    assert fo.failed(failure.answered(502))
    assert fo.poisoned and not fo.may_try(100.0)
    assert "failed on 2 nodes (last: node answered 502)" in fo.poison_message()
    other = account()  # 503s and refused connects are not engine failures
    for sid, failed in (("a", BUSY), ("b", REFUSED), ("c", BUSY)):
        other.picked(sid)
        assert not other.failed(failed)
    assert not other.poisoned


def test_a_resumed_stream_gets_attempts_and_time_of_its_own() -> None:
    fo = account()
    for sid in "ab":
        fo.picked(sid)
        fo.failed(BUSY)
    fo.picked("c")
    fo.resumed(150.0)
    assert fo.may_try(209.0) and not fo.may_try(210.0)
    assert fo.limit == 6 and fo.last_error == "no node left to try"


def test_waiting_in_the_gate_is_not_failover_time_and_preemption_costs_nothing() -> None:
    fo = account()
    fo.restart_clock(500.0)
    assert fo.may_try(559.0)
    fo.picked("a")
    fo.preempted("a")
    assert fo.tried == set()
    fo.restart_clock(900.0)  # only before the first attempt... which this still is
    assert fo.deadline == 960.0
    fo.picked("b")
    fo.restart_clock(2000.0)
    assert fo.deadline == 960.0


def test_what_each_kind_of_failure_says() -> None:
    sent = {k for k in KINDS if Failed(k, "").sent}
    assert sent == KINDS - {failure.REFUSED, failure.CONNECT_TIMEOUT, failure.UNUSABLE}
    engine = {k for k in KINDS if Failed(k, "").engine_failure}
    assert engine == {failure.BROKEN, failure.MALFORMED, failure.NO_RESPONSE, failure.DOWN}
    assert [failure.answered(s).engine_failure for s in (502, 503, 504)] == [True, False, True]
    assert [failure.answered(s).retry_reason for s in (502, 503)] == ["status", "status"]
    assert NO_RESPONSE.retry_reason == "timeout" and REFUSED.retry_reason == "connect"
    assert str(BROKEN) == "connection closed before the response head"


KINDS = {
    failure.REFUSED,
    failure.CONNECT_TIMEOUT,
    failure.UNUSABLE,
    failure.BROKEN,
    failure.MALFORMED,
    failure.NO_RESPONSE,
    failure.DOWN,
    failure.HEAD_OUT,
    failure.LEAVING,  # handed over by a draining node: sent, and not the engine's fault
}


@given(st.lists(st.sampled_from([BROKEN, REFUSED, BUSY, NO_RESPONSE]), max_size=20))
def test_laws(outcomes: list[Failed]) -> None:
    """Never more than max_engine_failures engine failures; never past the limit."""
    fo = account()
    for i, failed in enumerate(outcomes):
        if not fo.may_try(100.0):
            break
        fo.picked(str(i))
        fo.failed(failed)
        assert fo.engine_failures <= 2
        assert len(fo.tried) <= 3 + MAX_REFUSED_SKIPS
    assert fo.poisoned == (fo.engine_failures >= 2)
