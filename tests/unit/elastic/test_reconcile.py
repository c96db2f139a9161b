"""One controller pass, without Slurm or sockets: keep-alive across time limits, replacing what
ended, scaling both ways, partitions that keep jobs pending, start failures backing off, limits,
and the memory a pass learns from (Hypothesis checks the counting laws)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.elastic.jobs import Job
from fabricnode.elastic.reconcile import Memory, Replica, Tuning, holdings, reconcile
from fabricnode.elastic.vocab import (
    MIN_REPLICAS,
    Cancel,
    Goal,
    Held,
    Limits,
    Placement,
    Reason,
    Submit,
    Why,
)
from tests.unit.elastic.plans import plan

NOW = 1_800_000_000.0
M = "llama-3.1-8b"


def job(
    job_id: str,
    state: str = "RUNNING",
    *,
    model: str = M,
    partition: str = "gpu",
    submitted: float = NOW - 600,
    ends: float | None = NOW + 3600,
    replaces: str = "",
    gres_type: str = "",
    gpus: int | None = None,
) -> Job:
    started = None if state == "PENDING" else submitted + 5
    return Job(
        job_id, model, state, partition, submitted, started, ends, 7200, "", replaces, gres_type,
        gpus,
    )  # fmt: skip


def serving(job_id: str, model: str = M) -> Replica:
    return Replica(f"s{job_id:>031}", model, job_id, "serving")


def goal(target: int = 2, partitions: tuple[str, ...] = ("gpu",), model: str = M) -> Goal:
    return Goal(plan(model, partitions=partitions, time_limit_s=7200), target, MIN_REPLICAS)


def typed_goal(
    target: int, partitions: tuple[str, ...], options: tuple[tuple[str, int], ...]
) -> Goal:
    entry = plan(M, gpu_options=options, partitions=partitions, time_limit_s=7200)
    return Goal(entry, target, MIN_REPLICAS)


def reasons(actions: object) -> list[str]:
    return [a.why.text for a in actions]  # type: ignore[attr-defined]


def submits(actions: object) -> list[Submit]:
    return [a for a in actions if isinstance(a, Submit)]  # type: ignore[attr-defined]


def cancels(actions: object) -> list[Cancel]:
    return [a for a in actions if isinstance(a, Cancel)]  # type: ignore[attr-defined]


def test_steady_state_does_nothing() -> None:
    p = reconcile(NOW, [goal()], [job("1"), job("2")], [serving("1"), serving("2")], Memory())
    assert p.actions == ()
    (s,) = p.status
    assert (s.serving, s.starting, s.pending, s.state) == (2, 0, 0, "ok")


def test_missing_replicas_are_submitted_on_the_preferred_partition() -> None:
    p = reconcile(NOW, [goal(3, ("preempt", "gpu"))], [job("1")], [serving("1")], Memory())
    new = submits(p.actions)
    assert len(new) == 2 and {s.placement.partition for s in new} == {"preempt"}
    assert p.status[0].state == "scaling"


def test_a_job_near_its_time_limit_gets_one_successor_ahead_of_the_learned_lead() -> None:
    memory = Memory(Tuning(default_lead_s=60, lead_factor=1.5, lead_slack_s=10, leave_margin_s=30))
    lead = memory.lead_s(M, "gpu")
    assert lead == 120  # max(60 * 1.5, 60 + 10) + 30
    # (both were seen SERVING 60 s after submission: what the lead assumed)
    far = [job("1", ends=NOW + lead + 5, submitted=NOW - 60), job("2", submitted=NOW - 60)]
    assert reconcile(NOW, [goal()], far, [serving("1"), serving("2")], memory).actions == ()
    near = [job("1", ends=NOW + lead - 5, submitted=NOW - 60), job("2", submitted=NOW - 60)]
    p = reconcile(NOW, [goal()], near, [serving("1"), serving("2")], memory)
    (succ,) = submits(p.actions)
    assert succ.replaces == "1" and "time limit of job 1" in succ.why.text
    # next pass: the successor is pending; the pair counts as one unit, nothing more is done
    jobs = [*near, job("3", "PENDING", submitted=NOW, replaces="1")]
    p = reconcile(NOW + 1, [goal()], jobs, [serving("1"), serving("2")], memory)
    assert p.actions == ()
    assert p.status[0].serving == 2 and p.status[0].pending == 1


def test_the_lead_is_learned_from_submission_to_serving() -> None:
    memory = Memory(Tuning(default_lead_s=500, lead_factor=1.0, lead_slack_s=0, leave_margin_s=0))
    started = job("7", submitted=NOW - 40)
    reconcile(NOW, [goal(1)], [started], [Replica("a" * 32, M, "7", "join")], memory)
    assert memory.lead_s(M, "gpu") == 500  # not serving yet
    reconcile(NOW, [goal(1)], [started], [serving("7")], memory)
    assert memory.lead_s(M, "gpu") == 40
    reconcile(NOW + 99, [goal(1)], [started], [serving("7")], memory)  # observed once per job
    assert memory.lead_s(M, "gpu") == 40


def test_a_preempted_or_crashed_replica_is_replaced_without_backoff() -> None:
    memory = Memory()
    jobs = [job("1"), job("2")]
    reconcile(NOW, [goal()], jobs, [serving("1"), serving("2")], memory)
    p = reconcile(NOW + 5, [goal()], jobs[:1], [serving("1")], memory)  # job 2 vanished
    assert len(submits(p.actions)) == 1 and memory.failure(M).count == 0
    assert submits(p.actions)[0].why == Why(Reason.GONE, "replaces job 2 (gone from the queue)")
    # squeue --states=all says how a job ended: the replacement's reason says it too
    jobs = [job("1"), job("3")]
    reconcile(NOW + 10, [goal()], jobs, [serving("1"), serving("3")], memory)
    ended = [job("1", "NODE_FAIL"), job("3", "PREEMPTED")]
    p = reconcile(NOW + 15, [goal()], ended, [], memory)
    assert sorted(reasons(submits(p.actions))) == [
        "replaces job 1 (node failure)", "replaces job 3 (preempted)",
    ]  # fmt: skip
    # a cause is told once: a later scale-up is not called a replacement
    p = reconcile(NOW + 20, [goal(3)], [job("4"), job("5")], [serving("4"), serving("5")], memory)
    assert reasons(submits(p.actions)) == ["min replicas"]
    # a job COMPLETING has not said how it ended yet: its replacement waits for that, briefly
    memory = Memory(Tuning(completing_wait_s=30))
    reconcile(NOW, [goal(1)], [job("6")], [serving("6")], memory)
    assert reconcile(NOW + 2, [goal(1)], [job("6", "COMPLETING")], [], memory).actions == ()
    p = reconcile(NOW + 4, [goal(1)], [job("6", "PREEMPTED")], [], memory)
    assert [s.why for s in submits(p.actions)] == [
        Why(Reason.PREEMPTED, "replaces job 6 (preempted)")
    ]
    reconcile(NOW, [goal(1)], [job("7")], [serving("7")], memory)
    assert reconcile(NOW + 2, [goal(1)], [job("7", "COMPLETING")], [], memory).actions == ()
    p = reconcile(NOW + 33, [goal(1)], [job("7", "COMPLETING")], [], memory)
    assert [s.why for s in submits(p.actions)] == [Why(Reason.ENDED, "replaces job 7 (ended)")]


def test_start_failures_back_off_then_the_model_is_failed_with_the_engine_error() -> None:
    memory = Memory(Tuning(backoff_s=10, max_failures=3))
    t = NOW
    for attempt in range(1, 4):
        j = job(f"j{attempt}", submitted=t)
        broken = Replica("b" * 32, M, j.job_id, "down", error="model path /x: no such file")
        reconcile(t, [goal(1)], [j], [broken], memory)
        t += 1
        p = reconcile(t, [goal(1)], [], [], memory)  # the job ended without serving
        fail = memory.failure(M)
        assert fail.count == attempt and fail.last_error == "model path /x: no such file"
        if attempt < 3:
            assert submits(p.actions) == [] and p.status[0].state == "backing off"
            assert fail.next_try_at == t + 10 * 2 ** (attempt - 1)
            t = fail.next_try_at
            assert len(submits(reconcile(t, [goal(1)], [], [], memory).actions)) == 1
    assert p.status[0].state == "failed" and "no such file" in p.status[0].note
    assert reconcile(t + 10_000, [goal(1)], [], [], memory).actions == ()
    memory.reset_model(M)  # a new service file
    assert len(submits(reconcile(t + 10_000, [goal(1)], [], [], memory).actions)) == 1


def test_scale_down_cancels_pending_then_starting_then_serving_and_never_below_target() -> None:
    jobs = [
        job("1", submitted=NOW - 900),
        job("2", submitted=NOW - 800),
        job("3", submitted=NOW - 100),  # running, not serving yet
        job("4", "PENDING", submitted=NOW - 50),
    ]
    memory = Memory()
    p = reconcile(NOW, [goal(1)], jobs, [serving("1"), serving("2")], memory)
    assert [c.job_id for c in cancels(p.actions)] == ["4", "3", "2"]
    # only the serving one has requests to drain (SIGTERM to its step); the pending and the
    # starting one are cancelled outright (a pending job ignores a signal, a starting job's step
    # may not exist yet)
    assert [c.hard for c in cancels(p.actions)] == [True, True, False]
    # cancelled jobs drain: they no longer count, and are not cancelled twice
    p = reconcile(NOW + 1, [goal(1)], jobs, [serving("1"), serving("2")], memory)
    assert p.actions == () and p.status[0].draining == 3
    # once they are gone they were not start failures
    p = reconcile(NOW + 60, [goal(1)], jobs[:1], [serving("1")], memory)
    assert p.actions == () and memory.failure(M).count == 0


def test_a_partition_that_keeps_a_job_pending_is_left_for_the_next() -> None:
    memory = Memory(Tuning(patience_s=120, penalty_s=600))
    stuck = job("9", "PENDING", partition="preempt", submitted=NOW - 121)
    p = reconcile(NOW, [goal(1, ("preempt", "gpu"))], [stuck], [], memory)
    assert [c.job_id for c in cancels(p.actions)] == ["9"]
    assert [s.placement.partition for s in submits(p.actions)] == ["gpu"]
    # with a single allowed partition it just waits
    p = reconcile(NOW, [goal(1, ("preempt",))], [stuck], [], Memory(Tuning(patience_s=120)))
    assert p.actions == ()


def test_gpu_types_are_tried_in_order_each_on_every_partition_with_its_own_gpus() -> None:
    typed = typed_goal(1, ("preempt", "gpu"), (("a100", 2), ("h100", 1)))
    assert [(p.partition, p.gres_type, p.gpus) for p in typed.plan.placements()] == [
        ("preempt", "a100", 2), ("gpu", "a100", 2), ("preempt", "h100", 1), ("gpu", "h100", 1),
    ]  # fmt: skip
    memory = Memory(Tuning(patience_s=120, penalty_s=600))
    (first,) = submits(reconcile(NOW, [typed], [], [], memory).actions)
    assert first.placement == Placement("preempt", "a100", 2)
    # A100s pend too long on both partitions: the H100s are tried, with their own count
    jobs = [job("7", "PENDING", partition="preempt", gres_type="a100", gpus=2, submitted=NOW - 121)]
    p = reconcile(NOW, [typed], jobs, [], memory)
    assert [c.job_id for c in cancels(p.actions)] == ["7"]
    assert "pending 121 s on partition preempt and GPU type a100" in cancels(p.actions)[0].why.text
    (second,) = submits(p.actions)
    assert (second.placement.partition, second.placement.gres_type) == ("gpu", "a100")
    jobs = [job("8", "PENDING", partition="gpu", gres_type="a100", gpus=2, submitted=NOW - 121)]
    (third,) = submits(reconcile(NOW + 1, [typed], jobs, [], memory).actions)
    assert third.placement == Placement("preempt", "h100", 1)
    # GPUs held are counted from the jobs' own tags against max_gpus
    held = [job("9", gres_type="a100", gpus=2)]
    p = reconcile(
        NOW,
        [replace(typed, target=2)],
        held,
        [serving("9")],
        Memory(),
        Limits(max_jobs=10_000, max_gpus=3),
    )
    assert submits(p.actions) == []
    assert p.status[0].state == "limited"  # 2 held + 2 more > 3


def test_a_placement_slurm_refused_is_skipped_and_with_none_left_the_model_waits() -> None:
    memory = Memory(Tuning(refusal_retry_s=60))
    two = goal(1, ("nope", "gpu"))
    memory.refused(M, Placement("nope", "", 1), "invalid partition specified: nope", NOW)
    (sub,) = submits(reconcile(NOW, [two], [], [], memory).actions)
    assert sub.placement.partition == "gpu"
    memory.refused(M, Placement("gpu", "", 1), "Invalid qos specification", NOW)
    p = reconcile(NOW + 1, [two], [], [], memory)
    assert p.actions == ()  # no sbatch every pass while Slurm says no
    (s,) = p.status
    assert s.state == "refused" and "partition gpu: Invalid qos specification" in s.note
    # the refusals expire: tried again, in order; a new service file forgets them at once
    (again,) = submits(reconcile(NOW + 61, [two], [], [], memory).actions)
    assert again.placement.partition == "nope"
    memory.refused(M, Placement("nope", "", 1), "no", NOW + 61)
    memory.refused(M, Placement("gpu", "", 1), "no", NOW + 61)
    memory.reset_model(M)
    assert len(submits(reconcile(NOW + 62, [two], [], [], memory).actions)) == 1


def test_a_replica_that_starts_serving_resets_start_failures_but_not_slurms_refusal() -> None:
    """Over a QoS's submit limit Slurm admits one job and refuses the next: the admitted one
    serving says nothing about the limit, so no sbatch until the refusal expires."""
    memory = Memory(Tuning(refusal_retry_s=60))
    memory.failure(M).count = 2
    reconcile(NOW, [goal(2)], [job("1", submitted=NOW)], [], memory)
    memory.refused(M, Placement("gpu", "", 1), "QOSMaxSubmitJobPerUserLimit", NOW)
    p = reconcile(NOW + 5, [goal(2)], [job("1", submitted=NOW)], [serving("1")], memory)
    assert memory.failure(M).count == 0
    assert p.actions == ()
    assert p.status[0].state == "refused" and p.status[0].serving == 1
    assert (
        len(submits(reconcile(NOW + 61, [goal(2)], [job("1")], [serving("1")], memory).actions))
        == 1
    )


def test_mesh_limits_are_never_exceeded() -> None:
    goals = [goal(3), goal(3, model="other")]
    p = reconcile(
        NOW, goals, [job("1")], [serving("1")], Memory(), Limits(max_jobs=4, max_gpus=100_000)
    )
    assert len(submits(p.actions)) == 3  # 1 running + 3 = 4
    assert p.status[1].state == "limited" and "max_jobs" in p.status[1].note
    gpus = [replace(g, plan=replace(g.plan, gpus=4)) for g in goals]
    p = reconcile(NOW, gpus, [], [], Memory(), Limits(max_jobs=10_000, max_gpus=10))
    assert len(submits(p.actions)) == 2


def test_jobs_of_a_model_no_longer_declared_are_drained() -> None:
    jobs = [job("1"), job("5", model="old"), job("6", "PENDING", model="old")]
    p = reconcile(NOW, [goal(1)], jobs, [serving("1"), serving("5", "old")], Memory())
    assert [(c.job_id, c.why.text, c.hard) for c in cancels(p.actions)] == [
        ("5", "no longer in the service file", False),
        ("6", "no longer in the service file", True),
    ]


@given(
    target=st.integers(0, 6),
    states=st.lists(st.sampled_from(["PENDING", "RUNNING", "SERVING"]), max_size=8),
)
@settings(max_examples=200, deadline=None)
def test_after_a_pass_the_jobs_that_count_equal_the_target(target: int, states: list[str]) -> None:
    jobs = [job(str(i), "PENDING" if s == "PENDING" else "RUNNING") for i, s in enumerate(states)]
    replicas = [serving(str(i)) for i, s in enumerate(states) if s == "SERVING"]
    p = reconcile(NOW, [goal(target)], jobs, replicas, Memory())
    assert len(jobs) + len(submits(p.actions)) - len(cancels(p.actions)) == target
    assert not (submits(p.actions) and cancels(p.actions))


def test_only_serving_jobs_get_successors_so_a_long_lead_never_chains_them() -> None:
    memory = Memory(Tuning(default_lead_s=600))  # longer than the jobs themselves
    short = [job("1", ends=NOW + 100), job("2", ends=NOW + 100)]
    starting = [Replica("a" * 32, M, "1", "join"), Replica("b" * 32, M, "2", "join")]
    assert reconcile(NOW, [goal()], short, starting, memory).actions == ()
    p = reconcile(NOW, [goal()], short, [serving("1"), serving("2")], memory)
    assert sorted(s.replaces for s in submits(p.actions)) == ["1", "2"]
    # the successors start: none of them gets a successor of its own
    jobs = [*short, job("3", ends=NOW + 120, replaces="1"), job("4", ends=NOW + 120, replaces="2")]
    p = reconcile(NOW + 5, [goal()], jobs, [serving("1"), serving("2")], memory)
    assert p.actions == ()


def test_a_drain_that_hangs_is_cancelled_outright_once() -> None:
    memory = Memory(Tuning(drain_kill_s=100))
    jobs = [job("1"), job("2")]
    p = reconcile(NOW, [goal(1)], jobs, [serving("1"), serving("2")], memory)
    (victim,) = cancels(p.actions)
    assert not victim.hard
    p = reconcile(NOW + 50, [goal(1)], jobs, [serving("1"), serving("2")], memory)
    assert p.actions == ()
    p = reconcile(NOW + 101, [goal(1)], jobs, [serving("1"), serving("2")], memory)
    (hard,) = cancels(p.actions)
    assert hard.hard and hard.job_id == victim.job_id and "drain took over" in hard.why.text
    assert reconcile(NOW + 102, [goal(1)], jobs, [serving("1")], memory).actions == ()


def test_time_limit_successors_count_against_the_mesh_limits_too() -> None:
    memory = Memory(Tuning(default_lead_s=600))
    near = [job("1", ends=NOW + 100), job("2", ends=NOW + 100)]
    p = reconcile(
        NOW,
        [goal()],
        near,
        [serving("1"), serving("2")],
        memory,
        Limits(max_jobs=3, max_gpus=100_000),
    )
    (succ,) = submits(p.actions)  # room for one successor, not two
    assert succ.replaces in ("1", "2")
    assert p.status[0].state == "limited" and "max_jobs" in p.status[0].note


def test_holdings_count_units_as_a_pass_does_and_the_cold_start_is_the_learned_lead() -> None:
    """What the scaling policy is told before a pass: a handover pair is one unit, a draining
    job none, a pending or still starting job a starting unit; its cold start the learned time
    from sbatch to SERVING on the partition a submission would take."""
    memory = Memory()
    jobs = [
        job("1"),
        job("2", ends=NOW + 60),
        job("3", "PENDING", replaces="2"),  # 2's successor: one unit with it
        job("4"),  # running, its replica not serving yet
        job("5", "PENDING", submitted=NOW - 30),  # the newest that is not a successor
        job("6", submitted=NOW - 10),  # being drained
        job("7", "COMPLETED", submitted=NOW - 5),
        job("8", model="other", partition="cpu"),
    ]
    memory.draining["6"] = NOW - 5
    held = holdings(jobs, [serving("1"), serving("2"), serving("6"), serving("8", "other")], memory)
    assert held == {
        M: Held(serving=2, starting=2, newest_at=NOW - 30),
        "other": Held(serving=1, starting=0, newest_at=NOW - 600),
    }
    assert held[M].replicas == 4
    places = goal(partitions=("gpu", "big")).plan.placements()
    assert memory.cold_start_s(M, places, NOW) == memory.tuning.default_lead_s
    memory.observe(M, "gpu", 90.0)
    memory.observe(M, "big", 400.0)
    assert memory.cold_start_s(M, places, NOW) == 90.0
    memory.penalised[(M, "gpu", "")] = NOW + 60  # submissions go to "big" for now
    assert memory.cold_start_s(M, places, NOW) == 400.0
    default = goal(partitions=()).plan.placements()
    assert memory.cold_start_s(M, default, NOW) == 400.0  # the site's default: the longest


def test_a_controller_that_takes_over_learns_start_up_times_from_the_agents_not_job_ages() -> None:
    tuning = Tuning(default_lead_s=500, lead_factor=1.0, lead_slack_s=0, leave_margin_s=0)
    first, successor = Memory(tuning), Memory(tuning)
    started = job("7", submitted=NOW - 40)
    reconcile(NOW, [goal(1)], [started], [Replica("a" * 32, M, "7", "join")], first)
    since = Replica("a" * 32, M, "7", "serving", serving_since=NOW - 1)
    reconcile(NOW, [goal(1)], [started], [since], first)
    assert first.lead_s(M, "gpu") == 39  # as the agent says: it served a second ago
    # an hour later a new acting controller inherits the job already serving
    later = NOW + 3600
    reconcile(later, [goal(1)], [started], [since], successor)
    assert successor.lead_s(M, "gpu") == first.lead_s(M, "gpu")
    # an agent that does not say: the job's age is not its start-up time, nothing is learned
    blind = Memory(tuning)
    reconcile(later, [goal(1)], [started], [serving("7")], blind)
    assert blind.lead_s(M, "gpu") == 500 and "7" in blind.served
    # a label that cannot be (before the submission, or in the future) is not believed
    odd = Memory(tuning)
    wrong = Replica("a" * 32, M, "7", "serving", serving_since=later + 50)
    reconcile(later, [goal(1)], [started], [wrong], odd)
    assert odd.lead_s(M, "gpu") == 500


def test_scale_down_retires_the_serving_jobs_nearest_their_time_limit_without_successors() -> None:
    memory = Memory(Tuning(default_lead_s=60, lead_factor=1.5, lead_slack_s=10, leave_margin_s=30))
    lead = memory.lead_s(M, "gpu")
    jobs = [
        job("1", ends=NOW + 3000),
        job("2", ends=NOW + lead - 5),  # due for a successor
        job("3", ends=NOW + 2000),
    ]
    replicas = [serving("1"), serving("2"), serving("3")]
    p = reconcile(NOW, [goal(1)], jobs, replicas, memory)
    assert submits(p.actions) == []
    assert sorted(c.job_id for c in cancels(p.actions)) == ["2", "3"]
    assert all(not c.hard for c in cancels(p.actions))  # serving: drained


def test_a_handover_pair_is_retired_whole_when_scaling_in() -> None:
    memory = Memory()
    jobs = [
        job("1", ends=NOW + 60),
        job("3", "PENDING", submitted=NOW - 30, replaces="1"),
        job("2", ends=NOW + 3000),
    ]
    p = reconcile(NOW, [goal(1)], jobs, [serving("1"), serving("2")], memory)
    assert submits(p.actions) == []
    assert {(c.job_id, c.hard) for c in cancels(p.actions)} == {("3", True), ("1", False)}


def test_scale_to_zero_and_a_time_limit_together_submit_no_successor_that_is_cancelled() -> None:
    memory = Memory(Tuning(default_lead_s=60, lead_factor=1.5, lead_slack_s=10, leave_margin_s=30))
    lead = memory.lead_s(M, "gpu")
    jobs = [job("1", ends=NOW + lead - 5, submitted=NOW - 600)]
    replicas = [serving("1")]
    cold = Goal(plan(M, partitions=("gpu",), time_limit_s=7200, min_replicas=0), 1, MIN_REPLICAS)
    # the idle rule takes the model to zero in 20 s, before the job leaves (its end minus 30 s)
    soon = replace(cold, idle_at=NOW + 20)
    p = reconcile(NOW, [soon], jobs, replicas, memory)
    assert p.actions == ()
    # the idle time runs out: the job is drained, and no successor was ever submitted
    p = reconcile(NOW + 20, [replace(soon, target=0)], jobs, replicas, memory)
    assert submits(p.actions) == [] and [c.job_id for c in cancels(p.actions)] == ["1"]
    # a request came meanwhile: the idle time moves past the job's leave, the successor goes in
    fresh = Memory(memory.tuning)
    p = reconcile(NOW, [replace(cold, idle_at=NOW + 600)], jobs, replicas, fresh)
    assert [s.replaces for s in submits(p.actions)] == ["1"]


@given(
    target=st.integers(0, 5),
    ends=st.lists(st.integers(-50, 4000), min_size=1, max_size=6),
    pending=st.integers(0, 3),
    idle_in=st.none() | st.integers(0, 4000),
)
@settings(max_examples=300, deadline=None)
def test_no_pass_submits_a_successor_for_a_job_it_or_the_idle_rule_retires_first(
    target: int, ends: list[int], pending: int, idle_in: int | None
) -> None:
    memory = Memory(Tuning(default_lead_s=300))
    jobs = [job(str(i), ends=NOW + e) for i, e in enumerate(ends)]
    jobs += [job(f"p{i}", "PENDING", submitted=NOW - i) for i in range(pending)]
    replicas = [serving(str(i)) for i in range(len(ends))]
    idle_at = None if idle_in is None else NOW + idle_in
    g = replace(goal(target), idle_at=idle_at)
    p = reconcile(NOW, [g], jobs, replicas, memory)
    cancelled = {c.job_id for c in cancels(p.actions)}
    replaced = {s.replaces for s in submits(p.actions) if s.replaces}
    assert not replaced & cancelled
    if idle_at is not None:
        by_id = {j.job_id: j for j in jobs}
        assert all(memory.leaves_at(by_id[r]) < idle_at for r in replaced)
    # what stays after a scale-down ends no sooner than what was retired
    kept = [j for j in jobs if j.job_id not in cancelled and j.state == "RUNNING"]
    gone = [j for j in jobs if j.job_id in cancelled and j.state == "RUNNING"]
    if gone and kept:
        assert max(j.ends_at or 0 for j in gone) <= min(j.ends_at or 0 for j in kept)


def test_a_job_whose_agent_left_is_the_first_a_surplus_retires() -> None:
    # The agent of job 6 left at its time limit and drains slowly; its successor 8 ended
    # first, so 6 is a unit again beside 10 (8's successor, still starting), which carries
    # that replica on: the surplus retires 6, never 10, and nothing more is submitted.
    jobs = [
        job("6", submitted=NOW - 90, ends=NOW + 30, replaces="4"),
        job("9", submitted=NOW - 60, ends=NOW + 60, replaces="7"),
        job("10", submitted=NOW - 40, ends=NOW + 80, replaces="8"),
        job("11", "PENDING", submitted=NOW - 20, replaces="9"),
    ]
    left = Replica("a" * 32, M, "6", "left")
    replicas = [left, serving("9"), Replica("b" * 32, M, "10", "join")]
    p = reconcile(NOW, [goal()], jobs, replicas, Memory())
    assert [c.job_id for c in cancels(p.actions)] == ["6"] and submits(p.actions) == []
    # a lone job whose agent left still counts until squeue says how it ended (its
    # replacement's reason names that), and a restarted engine's new session keeps it a unit
    assert reconcile(NOW, [goal(1)], [job("6")], [left], Memory()).actions == ()
    back = [left, Replica("c" * 32, M, "6", "serving")]
    assert reconcile(NOW, [goal(1)], [job("6")], back, Memory()).actions == ()


def test_the_expected_start_is_the_learned_time_and_none_where_slurm_will_not_start_soon() -> None:
    """``Memory.start_s`` (``dataplane.sites`` rule 8): the learned start-up time on a
    placement Slurm neither refused nor kept pending too long; None when every placement is
    refused or penalised, or the model backs off after failures."""
    memory = Memory()
    places = (Placement("gpu", "", 1), Placement("big", "", 1))
    assert memory.start_s(M, places, NOW) == memory.tuning.default_lead_s
    memory.lead[(M, "gpu")] = 25.0
    assert memory.start_s(M, places, NOW) == 25.0
    memory.refused(M, places[0], "invalid partition", NOW)
    assert memory.start_s(M, places, NOW) is not None  # "big" may still take it
    memory.penalised[(M, *places[1].key())] = NOW + 300
    assert memory.start_s(M, places, NOW) is None
    assert memory.start_s(M, places, NOW + 10_000) == 25.0  # both expired
    memory.failure(M).next_try_at = NOW + 10_100
    assert memory.start_s(M, places, NOW + 10_000) is None
