"""``follow_job``: the lease label and the leave time follow the Slurm job's end, whichever way
the time limit moves, under trio's MockClock (a wall clock of T0 + trio time; scontrol is a
function of that clock)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

from fabricnode.host.lease import follow_job, lease_label, next_poll
from fabricnode.host.slurm import LeavePlan

T0 = 1_800_000_000.0


def wall() -> float:
    return T0 + trio.current_time()


class Job:
    """What scontrol answers (``end(now)``) and what the follower did."""

    def __init__(self, end: Callable[[float], float | None]) -> None:
        self.end = end
        self.asked: list[float] = []
        self.moves: list[tuple[float, float]] = []  # (when, new end)
        self.left: list[tuple[float, LeavePlan]] = []

    async def end_now(self) -> float | None:
        self.asked.append(wall())
        return self.end(wall())

    async def follow(
        self, end_time: float, margin_s: float = 120, max_sleep_s: float = 30
    ) -> LeavePlan | None:
        return await follow_job(
            "4242",
            end_time,
            margin_s=margin_s,
            wall_clock=wall,
            end_time_now=self.end_now,
            on_end_moved=lambda end: self.moves.append((wall(), end)),
            on_leave=lambda plan: self.left.append((wall(), plan)),
            max_sleep_s=max_sleep_s,
        )


def test_lease_label_is_whole_seconds() -> None:
    assert lease_label(T0 + 0.6) == ("fabric.job_end", f"{T0 + 1:.0f}")


def test_polls_halve_the_time_left_within_their_bounds() -> None:
    assert next_poll(T0 + 3600, T0, 30, 1800) == T0 + 1800
    assert next_poll(T0 + 36000, T0, 30, 1800) == T0 + 1800  # at most max_poll_s apart
    assert next_poll(T0 + 40, T0, 30, 1800) == T0 + 30  # at least min_poll_s apart
    assert next_poll(T0 + 10, T0, 30, 1800) == T0 + 10  # never past the end
    assert next_poll(T0 - 5, T0, 30, 1800) == T0


async def test_unchanged_end_leaves_at_the_margin_and_asks_at_that_moment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    job = Job(lambda now: T0 + 3600)
    plan = await job.follow(T0 + 3600)
    assert plan == LeavePlan(T0 + 3600, T0 + 3480, 120, 120)
    assert job.left == [(pytest.approx(T0 + 3480), plan)]
    assert job.asked[-1] == pytest.approx(T0 + 3480), "the end is checked once more at leave"
    assert job.moves == []
    assert len(job.asked) <= 10, "a few queries per job, not one a minute"


async def test_an_extended_limit_moves_the_lease_and_the_leave_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    job = Job(lambda now: T0 + 3600 if now < T0 + 1200 else T0 + 7200)
    plan = await job.follow(T0 + 3600)
    assert job.moves and job.moves[0][1] == T0 + 7200
    assert job.moves[0][0] < T0 + 3600 - 600, "found long before the old end"
    assert len(job.moves) == 1
    assert plan is not None and plan.leave_at == T0 + 7080
    assert job.left[0][0] == pytest.approx(T0 + 7080)


async def test_an_extension_found_only_at_the_leave_moment_still_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    job = Job(lambda now: T0 + 3600 if now < T0 + 3470 else T0 + 7200)
    await job.follow(T0 + 3600)
    assert [end for _, end in job.moves] == [T0 + 7200]
    assert job.left[0][0] == pytest.approx(T0 + 7080)


async def test_a_shortened_limit_moves_the_leave_earlier_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # An admin cuts the job to end at T0+2400 twenty minutes in: the agent must leave 120 s
    # before the new end, not at the old plan's T0+3480 (long after Slurm killed it).
    job = Job(lambda now: T0 + 3600 if now < T0 + 1200 else T0 + 2400)
    plan = await job.follow(T0 + 3600)
    assert [end for _, end in job.moves] == [T0 + 2400]
    assert plan == LeavePlan(T0 + 2400, T0 + 2280, 120, 120)
    assert job.left[0][0] == pytest.approx(T0 + 2280)


async def test_a_limit_cut_to_within_the_margin_leaves_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    job = Job(lambda now: T0 + 3600 if now < T0 + 1000 else T0 + 1850)
    await job.follow(T0 + 3600)
    ((found_at, _),) = job.moves
    assert job.left[0][0] == pytest.approx(found_at), "the new leave time had already passed"
    assert found_at < T0 + 1850


async def test_failed_queries_keep_the_plan(autojump_clock: trio.testing.MockClock) -> None:
    job = Job(lambda now: None)
    plan = await job.follow(T0 + 3600)
    assert job.moves == []
    assert plan is not None and job.left[0][0] == pytest.approx(T0 + 3480)


async def test_without_a_margin_only_the_lease_follows_until_the_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    job = Job(lambda now: T0 + 600 if now < T0 + 100 else T0 + 900)
    assert await job.follow(T0 + 600, margin_s=0) is None
    assert [end for _, end in job.moves] == [T0 + 900]
    assert job.left == []
    assert wall() == pytest.approx(T0 + 900), "followed up to the new end"


async def test_a_short_job_serves_for_half_its_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    job = Job(lambda now: T0 + 100)
    plan = await job.follow(T0 + 100, margin_s=120)
    assert plan is not None and plan.shortened and plan.leave_at == T0 + 50


async def test_a_wall_clock_step_is_noticed_within_max_sleep(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The wall clock jumps 50 min ahead (a suspended VM, an NTP step): the leave still happens
    # within ``max_sleep_s`` of the wall clock's leave moment, not 50 min later.
    jump = [0.0]

    def stepped() -> float:
        return T0 + trio.current_time() + jump[0]

    left: list[float] = []

    async def end_now() -> float | None:
        return T0 + 3600

    async def follow() -> None:
        await follow_job(
            "4242",
            T0 + 3600,
            margin_s=120,
            wall_clock=stepped,
            end_time_now=end_now,
            on_end_moved=lambda end: None,
            on_leave=lambda plan: left.append(stepped()),
            max_sleep_s=30,
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow)
        await trio.sleep(60)
        jump[0] = 3000.0
    assert len(left) == 1 and T0 + 3480 <= left[0] <= T0 + 3480 + 30
