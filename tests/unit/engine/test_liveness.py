"""The liveness verdict under a fake clock: a missed health check is weighed against the
engine's progress (``engine.liveness``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from fabricnode.engine.liveness import EngineLiveness, Health
from fabricnode.engine.process import group_cpu_seconds


def machine() -> EngineLiveness:
    return EngineLiveness(unhealthy_after=3, busy_limit_s=60.0, progress_window_s=3.5)


def test_answers_keep_it_healthy_and_two_misses_are_not_yet_anything() -> None:
    m = machine()
    m.answered(1.0)
    m.unanswered(2.0, "ReadTimeout")
    m.unanswered(3.0, "ReadTimeout")
    assert m.verdict(3.0).health is Health.HEALTHY
    m.answered(4.0)
    m.unanswered(5.0, "ReadTimeout")
    assert m.verdict(5.0).health is Health.HEALTHY  # the count starts again


def test_an_engine_that_keeps_using_cpu_is_busy_not_dead_until_the_busy_limit() -> None:
    """The 15 MiB count_tokens case: the event loop is held, /health times out, and the
    process spins. It stays busy (and SERVING) for up to busy_limit_s, then is hung."""
    m = machine()
    cpu = 10.0
    t = 0.0
    for _ in range(60):
        t += 1.0
        m.unanswered(t, "ReadTimeout")
        cpu += 0.9  # a core, nearly all of it
        m.cpu(t, cpu)
        if t >= 3.0:
            v = m.verdict(t)
            assert v.health is Health.BUSY, (t, v)
            assert "busy, not dead" in v.reason and "CPU" in v.reason
    for _ in range(2):
        t += 1.0
        m.unanswered(t, "ReadTimeout")
        cpu += 0.9
        m.cpu(t, cpu)
    v = m.verdict(t)
    assert v.health is Health.HUNG and "over the 60 s" in v.reason
    m.answered(t + 1)
    assert m.verdict(t + 1).health is Health.HEALTHY


def test_an_engine_that_neither_answers_nor_progresses_is_hung_after_the_misses() -> None:
    """A deadlock or a stopped process: no CPU, no counters: hung after unhealthy_after."""
    m = machine()
    for t in (1.0, 2.0, 3.0):
        m.unanswered(t, "ConnectError")
        m.cpu(t, 5.0)
        m.counters(t, 100.0)
    v = m.verdict(3.0)
    assert v.health is Health.HUNG
    assert "made no progress for 2 s" in v.reason and "ConnectError" in v.reason


def test_moving_token_counters_are_progress_too_and_progress_must_be_recent() -> None:
    m = machine()
    m.counters(0.5, 100.0)
    for t in (1.0, 2.0, 3.0):
        m.unanswered(t, "answered 503")
    m.counters(3.0, 140.0)
    assert m.verdict(3.0).health is Health.BUSY
    assert "token counters move" in m.verdict(3.0).reason
    for t in (4.0, 5.0, 6.0, 7.0):
        m.unanswered(t, "answered 503")
        m.counters(t, 140.0)  # stopped moving
    assert m.verdict(6.5).health is Health.BUSY  # within the window of the last progress
    assert m.verdict(7.0).health is Health.HUNG


def test_cpu_used_before_an_answer_is_no_evidence_for_the_next_episode() -> None:
    m = machine()
    m.unanswered(1.0, "x")
    m.cpu(1.0, 1.0)
    m.answered(2.0)
    for t in (100.0, 101.0, 102.0):  # a deadlock an hour later, at 0 CPU
        m.unanswered(t, "x")
        m.cpu(t, 50.0)
    assert m.verdict(102.0).health is Health.HUNG


@given(
    st.lists(
        st.tuples(st.sampled_from(["ok", "miss", "cpu", "idle"]), st.floats(0.01, 5.0)),
        max_size=60,
    )
)
def test_laws(events: list[tuple[str, float]]) -> None:
    """Healthy within unhealthy_after misses; never busy without recent progress; never busy
    past the busy limit; hung only after unhealthy_after misses in a row."""
    m = machine()
    t, cpu = 0.0, 0.0
    for kind, dt in events:
        t += dt
        if kind == "ok":
            m.answered(t)
        elif kind == "miss":
            m.unanswered(t, "x")
        elif kind == "cpu":
            cpu += 1.0
            m.cpu(t, cpu)
        else:
            m.cpu(t, cpu)
        v = m.verdict(t)
        if m.failures < 3:
            assert v.health is Health.HEALTHY
        if v.health is Health.BUSY:
            assert m.last_progress is not None and t - m.last_progress <= 3.5
            assert m.unanswered_since is not None and t - m.unanswered_since <= 60.0


def test_the_cpu_time_of_a_process_group_is_read_from_proc() -> None:
    """What the supervisor feeds ``cpu``: a group of its own (a child in a new session) that
    spins 0.3 s of CPU when told. Not this test's own group: under pytest it holds whatever
    else the run started, and a member that exits takes its CPU time out of the sum."""
    spin = (
        "import sys, time\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        "print('spun', flush=True); sys.stdin.readline()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", spin],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        group = child.pid  # the session's (and group's) leader
        before = group_cpu_seconds(group)
        assert before is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "spun"
        after = group_cpu_seconds(group)
        assert after is not None and after - before >= 0.25, (before, after)
    finally:
        child.stdin.close()
        child.wait(10)
    assert group_cpu_seconds(2**22 + 7) == 0.0  # no such group: nothing used
    assert group_cpu_seconds(group, Path("/nonexistent")) is None
