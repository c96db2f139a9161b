"""The idle-sleep policy (pure, times given): when an engine has been idle long enough."""

from __future__ import annotations

from fabricnode.engine.sleep import IdleSleep


def test_an_engine_with_no_traffic_is_due_after_sleep_after() -> None:
    policy = IdleSleep(30.0, last_active=100.0)
    policy.observe(110.0, inflight=0, served=0)
    assert not policy.due(129.9)
    assert policy.due(130.0)


def test_a_request_in_flight_or_served_since_the_last_look_resets_the_idle_clock() -> None:
    policy = IdleSleep(30.0, last_active=0.0)
    policy.observe(25.0, inflight=1, served=0)  # a long request still running
    policy.observe(50.0, inflight=1, served=0)
    assert not policy.due(79.0) and policy.due(80.0)
    policy.observe(60.0, inflight=0, served=3)  # short ones came and went between two looks
    assert not policy.due(89.0) and policy.due(90.0)
    policy.observe(70.0, inflight=0, served=3)  # nothing new: the clock keeps running
    assert policy.due(90.0)


def test_a_wake_up_restarts_the_idle_clock() -> None:
    policy = IdleSleep(10.0, last_active=0.0)
    assert policy.due(50.0)
    policy.woke(50.0)
    assert not policy.due(59.0) and policy.due(60.0)
