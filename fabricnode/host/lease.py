"""Keeping an agent on its Slurm job's clock: its registry lease and its own leave time both
follow the job's end, whichever way an admin moves the time limit.

Two things depend on the job's end (``SlurmJob.end_time``):

* the registry lease: our entry carries ``fabric.job_end`` (``lease_label``) and ``MeshCore``
  never renews it past that, so peers drop us at the end even if the job dies silently;
* the leave: ``margin_s`` before the end the agent leaves by the graceful path (``plan_leave``),
  because Slurm's own warning (``#SBATCH --signal``) arrives only at slurmctld's periodic check
  and the SIGTERM at the limit leaves only ``KillWait`` to drain.

``follow_job`` keeps both right. It asks ``scontrol`` (``end_time_now``) for the end at half the
time left (at least ``min_poll_s`` and at most ``max_poll_s`` apart: a few queries per job, more
only near its end) and once more at the leave moment. An end that moved, later or earlier, moves
the lease label and the leave time together, with the same margin; a leave time already past
then means leave now. An unanswered query changes nothing. The wall clock is re-read at least
every ``max_sleep_s``, so a suspended VM or a stepped clock is noticed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from fabricnode.host.slurm import LeavePlan, move_leave, plan_leave
from fabricnode.mesh.schema import JOB_END_LABEL

log = logging.getLogger("fabricnode.host.lease")


def lease_label(end_time: float) -> tuple[str, str]:
    """The entry label that caps our registry lease at the job's end."""
    return (JOB_END_LABEL, f"{end_time:.0f}")


def next_poll(end_time: float, now: float, min_poll_s: float, max_poll_s: float) -> float:
    """When to ask for the end again: at half the time left, within the poll bounds, and never
    after the end itself."""
    left = max(0.0, end_time - now)
    return now + min(max(left / 2, min_poll_s), max_poll_s, left)


async def follow_job(
    job_id: str,
    end_time: float,
    *,
    margin_s: float,
    wall_clock: Callable[[], float],
    end_time_now: Callable[[], Awaitable[float | None]],
    on_end_moved: Callable[[float], None],
    on_leave: Callable[[LeavePlan], None],
    min_poll_s: float = 30.0,
    max_poll_s: float = 1800.0,
    max_sleep_s: float = 30.0,
) -> LeavePlan | None:
    """Follow the job's end until we leave (``on_leave``, returns the plan acted on) or, with
    no leave planned (``margin_s`` 0), until the known end passes (returns None)."""
    now = wall_clock()
    plan = plan_leave(end_time, margin_s, now)
    _log_plan(job_id, plan, margin_s, now)
    poll_at = next_poll(end_time, now, min_poll_s, max_poll_s)
    while True:
        now = wall_clock()
        if now >= poll_at or (plan is not None and now >= plan.leave_at):
            found = await end_time_now()
            now = wall_clock()
            if found is not None and abs(found - end_time) >= 1.0:
                log.info(
                    "Slurm job %s: its end moved by %+.0f s; the lease%s follows",
                    job_id,
                    found - end_time,
                    " and the leave time" if plan is not None else "",
                )
                end_time = found
                on_end_moved(found)
                if plan is not None:
                    plan = move_leave(plan, found)
            if plan is not None and now >= plan.leave_at:
                log.info(
                    "Slurm job %s ends in %.0f s: leaving the mesh before it is killed",
                    job_id,
                    plan.end_time - now,
                )
                on_leave(plan)
                return plan
            if plan is None and now >= end_time:
                return None
            poll_at = next_poll(end_time, now, min_poll_s, max_poll_s)
        wake_at = poll_at if plan is None else min(poll_at, plan.leave_at)
        await trio.sleep(min(max(0.0, wake_at - now), max_sleep_s))


def _log_plan(job_id: str, plan: LeavePlan | None, margin_s: float, now: float) -> None:
    if plan is None:
        log.info("Slurm job %s: leave margin off; leaving on SIGTERM only", job_id)
        return
    note = ", half the time it has left" if plan.shortened else ""
    log.info(
        "Slurm job %s ends in %.0f s: leaving %.0f s before its end%s (--leave-before-end %g)",
        job_id,
        plan.end_time - now,
        plan.margin_s,
        note,
        margin_s,
    )
