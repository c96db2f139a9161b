"""One pass of the controller: from what Slurm and the mesh show, the jobs to submit and cancel.

Pure: ``reconcile(now, goals, jobs, replicas, memory, limits)`` returns the actions and each
model's status; the controller loop (``fabricnode.elastic.controller``) gathers the inputs
(``squeue`` through ``slurmctl``, the registry) and carries out the actions. Starting every pass
from Slurm's own list of our jobs is what makes a takeover or a healed partition safe: a new
acting controller counts the jobs its predecessor submitted, never its own memory.

Rules, per model (its ``vocab.Goal``: the plan and the replicas wanted now, between the
service's min and max). Every action carries a ``vocab.Why``: the reason the metric counts and
the sentence the log shows.

1. **Units.** Each of our jobs for the model is PENDING, STARTING (running, no SERVING replica
   yet) or SERVING (its agent's entry, matched by the ``slurm.job_id`` label, is SERVING and
   alive). A time-limit successor and the job it replaces (``replaces=``) count as one unit
   until the old job is gone; jobs being drained by a cancel do not count. A job whose agent
   has left the mesh (signed LEFT: its time limit near, a SIGTERM, a preemption) still counts
   until squeue says how it ended (its replacement's reason names that), but it is the first
   a surplus retires (rule 4).
2. **Time limits, make-before-break.** A SERVING job whose end is nearer than the model's lead
   time (``Memory.lead_s``: the learned time from ``sbatch`` to SERVING on that partition, times
   ``lead_factor`` and at least ``lead_slack_s`` more, plus the agent's leave margin) gets a
   successor, unless it has one. Only a serving job: one still starting replaces nothing yet,
   and while the lead is longer than a job (before anything was learned, or for very short
   jobs) successors must not chain. Never for a job this pass's scale-down retires (rule 4 is
   decided first), nor for one the idle rule retires before it leaves (``Goal.idle_at``, when
   the model goes to zero unless a request comes, before ``Memory.leaves_at``): the successor
   would be cancelled before it served. Should a request come, the next pass submits it.
3. **Too few** units (a job ended: time limit, preemption, crash; or the goal grew): submit the
   difference (a replacement's reason names the job it replaces and how that one ended, as
   ``squeue --states=all`` shows it: "replaces job 12 (preempted)"), at the first allowed
   *placement* not penalised. A placement is a partition and
   a Slurm GPU type (``ModelPlan.placements``: every GPU type in order of preference, and within
   each type every partition in order), so a model stays on its preferred GPUs while any of its
   partitions can give them.
4. **Too many** units: cancel the newest PENDING jobs first, then STARTING, then the SERVING
   ones nearest their time limit (a handover pair is retired whole, successor and old job: it
   is the unit nearest its limit), so that what stays needs no successor soon
   (a SERVING job's cancel is SIGTERM to its step: the agent leaves and drains its requests;
   a PENDING or STARTING one is cancelled outright, having nothing to drain: SIGTERM would not
   reach a job whose step has not begun, and a pending job ignores it). Never below the goal. The
   cancel's reason carries the goal's (``scale down to 2: low-demand: ...``).
5. **Pending too long, or refused.** A job pending longer than ``patience_s`` at a placement
   when another is allowed is cancelled and resubmitted at the next placement; the one it left
   is avoided for ``penalty_s`` (when every placement is, the last is used). A placement Slurm
   refused outright (``Memory.refused``: an unknown partition or GPU type, a QoS or account
   limit) is avoided for ``refusal_retry_s``; when every placement is, the model waits, its
   status *refused* with Slurm's words, instead of calling sbatch every pass.
6. **Start failures back off.** A job that ends without ever serving is a start failure (its
   replica's error, when the agent published one, is kept). Retries wait ``backoff_s * 2^(k-1)``
   (capped); after ``max_failures`` in a row the model is *failed* and nothing more is submitted
   for it until the service file changes (``Memory.reset_model``). A replica that serves resets
   the count.
7. **Limits.** A submission that would exceed the mesh's ``max_jobs`` or ``max_gpus`` is not
   made, a time-limit successor included (the old job then ends before its replacement
   starts); the status says so. Cancels are never limited.

Learning (``Memory.observe``): the first time a job's replica is SERVING, the time from its
submission to its first SERVING (queue wait plus engine start-up: the agent's
``fabric.serving_since`` label minus ``submitted_at``; without the label, ``now`` for a job an
earlier pass saw starting) is folded into an exponentially weighted mean per (model,
partition), in the order the jobs served; until then ``default_lead_s`` is used. So a
controller that takes over learns the same figure from the jobs it inherits already serving as
their submitter did, not their age. The same learned time is the scaling
policy's cold start (``Memory.cold_start_s``), and ``holdings`` counts each model's units as a
pass does (serving, and pending or starting), for the policy before the pass runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from fabricnode.elastic.jobs import Job
from fabricnode.elastic.vocab import (
    END_REASONS,
    Action,
    Cancel,
    Goal,
    Held,
    Limits,
    Placement,
    Reason,
    Submit,
    Why,
)

PENDING, STARTING, SERVING = "pending", "starting", "serving"


@dataclass(frozen=True)
class Replica:
    """A replica as the registry shows it."""

    session_id: str
    model: str
    job_id: str
    state: str  # "join", "serving", "down", "left"
    alive: bool = True
    error: str = ""  # the engine's last error, when the agent published one
    serving_since: float | None = None  # when it first served (unix time), as its agent says


@dataclass(frozen=True)
class Tuning:
    default_lead_s: float = 180.0  # sbatch to SERVING before anything was observed
    lead_factor: float = 1.5  # safety on the learned lead time...
    lead_slack_s: float = 30.0  # ...and at least this much (queue and start-up vary)
    leave_margin_s: float = 120.0  # the agents leave this long before their time limit
    learn_weight: float = 0.3  # EWMA weight of a new observation
    patience_s: float = 300.0  # pending this long on a partition: try the next one
    penalty_s: float = 900.0  # how long a placement that kept a job pending is avoided
    refusal_retry_s: float = 60.0  # how long a placement Slurm refused is avoided
    backoff_s: float = 30.0
    max_backoff_s: float = 600.0
    max_failures: int = 5
    drain_kill_s: float = 180.0  # a cancelled job still running after this is cancelled hard
    # a serving job that ended on its own is COMPLETING for a moment before squeue shows how it
    # ended; its replacement waits this long at most for that (the resources are held anyway)
    completing_wait_s: float = 30.0


@dataclass
class Failures:
    count: int = 0
    next_try_at: float = 0.0
    last_error: str = ""
    failed: bool = False


@dataclass
class Memory:
    """What the acting controller learned and remembers between passes. A new acting
    controller starts from the defaults and rebuilds what the mesh shows: the start-up times
    of the jobs it inherits from their agents' ``fabric.serving_since`` (Learning, in the
    module docstring), the jobs themselves from Slurm."""

    tuning: Tuning = field(default_factory=Tuning)
    lead: dict[tuple[str, str], float] = field(default_factory=dict)  # (model, partition) -> s
    served: set[str] = field(default_factory=set)  # jobs whose replica was seen SERVING
    known: dict[str, tuple[str, str]] = field(default_factory=dict)  # job -> (model, partition)
    draining: dict[str, float] = field(default_factory=dict)  # job -> when we cancelled it
    failures: dict[str, Failures] = field(default_factory=dict)
    # (model, partition, GPU type) -> until when: kept a job pending too long / was refused
    penalised: dict[tuple[str, str, str], float] = field(default_factory=dict)
    refusals: dict[tuple[str, str, str], float] = field(default_factory=dict)
    refusal_notes: dict[str, str] = field(default_factory=dict)  # model -> Slurm's last words
    errors: dict[str, str] = field(default_factory=dict)  # job -> replica error seen
    # model -> served jobs that ended this pass and how ("replaces job 12 (preempted)"): the
    # reasons of their replacements
    ended: dict[str, list[Why]] = field(default_factory=dict)
    completing: dict[str, float] = field(default_factory=dict)  # served job -> first seen so
    # start-up times taken over from the controller that acted before (``inherit``): the jobs
    # serving at the next pass are not learned from again
    inherited: bool = False

    def lead_s(self, model: str, partition: str, time_limit_s: int | None = None) -> float:
        """How long before a job's end its successor is submitted: the learned time to
        SERVING with a safety factor, plus the time the job's agent leaves before its end
        (``leave_margin_s``, at most half the job, as the agent does)."""
        t = self.tuning
        learned = self.lead.get((model, partition), t.default_lead_s)
        margin = t.leave_margin_s
        if time_limit_s is not None:
            margin = min(margin, time_limit_s / 2)
        return max(learned * t.lead_factor, learned + t.lead_slack_s) + margin

    def leaves_at(self, job: Job) -> float:
        """When ``job``'s agent leaves for its time limit (``leave_margin_s`` before its end,
        at most half the job, as the agent does); never, without an end."""
        if job.ends_at is None:
            return float("inf")
        margin = self.tuning.leave_margin_s
        if job.time_limit_s is not None:
            margin = min(margin, job.time_limit_s / 2)
        return job.ends_at - margin

    def cold_start_s(self, model: str, places: Sequence[Placement], now: float) -> float:
        """The learned time from ``sbatch`` to SERVING of a job submitted now (on the partition
        a submission would take, else the longest learned on any partition of the model),
        ``default_lead_s`` before anything was learned: the scaling policy's horizon."""
        place = _placement(model, places, self, now)
        if place is not None and place.partition and (model, place.partition) in self.lead:
            return self.lead[(model, place.partition)]
        learned = [s for (m, _), s in self.lead.items() if m == model]
        return max(learned) if learned else self.tuning.default_lead_s

    def start_s(self, model: str, places: Sequence[Placement], now: float) -> float | None:
        """How long a replica of ``model`` submitted now is expected to take to serve
        (``cold_start_s``), or None when it would not start soon here: Slurm refused every
        placement, or kept a job of each pending too long, or the model failed or backs off
        (a peer site then starts it: ``dataplane.sites`` rule 8)."""
        failures = self.failures.get(model)
        if failures is not None and (failures.failed or failures.next_try_at > now):
            return None
        for p in places:
            key = (model, *p.key())
            if self.refusals.get(key, 0.0) <= now and self.penalised.get(key, 0.0) <= now:
                return self.cold_start_s(model, places, now)
        return None

    def inherit(self, lead: Mapping[tuple[str, str], float]) -> None:
        """Start from the learned start-up times of the controller that acted before
        (``elastic.startups``), as if learned here: it learned them from the jobs serving now,
        so the next pass does not learn from those again."""
        self.lead.update(lead)
        self.inherited = bool(lead)

    def observe(self, model: str, partition: str, seconds: float) -> None:
        w = self.tuning.learn_weight
        old = self.lead.get((model, partition))
        self.lead[(model, partition)] = seconds if old is None else (1 - w) * old + w * seconds

    def reset_model(self, model: str) -> None:
        self.failures.pop(model, None)
        self.refusal_notes.pop(model, None)
        for key in [k for k in self.refusals if k[0] == model]:
            del self.refusals[key]

    def refused(self, model: str, place: Placement, why: str, now: float) -> None:
        """Slurm refused a submission at ``place`` (rule 5)."""
        self.refusals[(model, *place.key())] = now + self.tuning.refusal_retry_s
        self.refusal_notes[model] = f"{place}: {why}"

    def failure(self, model: str) -> Failures:
        return self.failures.setdefault(model, Failures())


@dataclass(frozen=True)
class ModelStatus:
    model: str
    target: int
    serving: int
    starting: int
    pending: int
    draining: int
    state: str  # "ok", "scaling", "backing off", "failed", "limited"
    note: str = ""
    reason: str = ""  # why the target is what it is (the goal's reason)

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "target": self.target,
            "serving": self.serving,
            "starting": self.starting,
            "pending": self.pending,
            "draining": self.draining,
            "state": self.state,
            "note": self.note,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Pass:
    actions: tuple[Action, ...]
    status: tuple[ModelStatus, ...]


def reconcile(
    now: float,
    goals: Sequence[Goal],
    jobs: Iterable[Job],
    replicas: Iterable[Replica],
    memory: Memory,
    limits: Limits | None = None,
) -> Pass:
    """One pass (see the module docstring). Updates ``memory`` with what it learned."""
    jobs = list(jobs)
    t = memory.tuning
    replicas = list(replicas)
    by_job = _present(replicas)
    leaving = _leaving(replicas, by_job)
    for r in replicas:
        if r.job_id and r.error:
            memory.errors[r.job_id] = r.error
    _learn(now, jobs, by_job, memory)
    budget = _Budget(
        limits,
        sum(1 for j in jobs if not j.ending),
        sum(
            g.plan.gpus if j.gpus is None else j.gpus
            for g in goals
            for j in jobs
            if j.model == g.model and not j.ending
        ),
    )
    actions: list[Action] = []
    status: list[ModelStatus] = []
    for goal in goals:
        limited = ""  # which mesh limit stopped a submission of this model, if one did
        plan = goal.plan
        places = plan.placements()
        held_off = False  # every placement was refused lately: wait (rule 5)

        def submit(goal: Goal, why: Why, replaces: str = "") -> bool:
            """Submit one job of ``goal`` unless a mesh limit forbids it (rule 7)."""
            nonlocal limited, held_off
            place = _placement(goal.model, goal.plan.placements(), memory, now)
            if place is None:
                held_off = True
                return False
            refused = budget.take(place.gpus)
            if refused:
                limited = refused
                return False
            actions.append(Submit(goal.plan, place, why, replaces))
            return True

        mine = [j for j in jobs if j.model == goal.model and not j.ending]
        live = [j for j in mine if j.job_id not in memory.draining]
        phase = {j.job_id: _phase(j, by_job) for j in live}
        successors = {j.replaces for j in live if j.replaces}
        units = [j for j in live if j.job_id not in successors]  # a handover pair counts once
        # rule 5: pending too long where another placement is allowed
        for j in list(units):
            waited = now - (j.submitted_at or now)
            place = _placement_of(j, goal, places)
            if (
                phase[j.job_id] == PENDING
                and len(places) > 1
                and place is not None
                and waited > t.patience_s
            ):
                memory.penalised[(goal.model, *place.key())] = now + t.penalty_s
                actions.append(
                    Cancel(
                        j.job_id,
                        goal.model,
                        Why(Reason.PENDING, f"pending {waited:.0f} s on {place}"),
                        hard=True,
                    )
                )
                memory.draining[j.job_id] = now
                units.remove(j)
        # rule 4 first: the units a scale-down retires get no successor (rule 2)
        victims = _victims(units, live, phase, len(units) - goal.target, leaving)
        retired = {j.job_id for unit in victims for j in unit}
        # rule 2: successors ahead of time limits, for serving jobs only (a job still starting
        # replaces nothing yet, and a lead longer than a job must not chain successors), not
        # for one the idle rule retires before it leaves
        for j in units:
            if (
                phase[j.job_id] == SERVING
                and j.ends_at is not None
                and j.job_id not in retired
                and j.job_id not in {x.replaces for x in live}
                and j.ends_at - now <= memory.lead_s(goal.model, j.partition, j.time_limit_s)
                and (goal.idle_at is None or goal.idle_at > memory.leaves_at(j))
            ):
                in_s = j.ends_at - now
                why = Why(Reason.TIME_LIMIT, f"time limit of job {j.job_id} in {in_s:.0f} s")
                submit(goal, why, j.job_id)
        fail = memory.failure(goal.model)
        note = ""
        state = "ok"
        deficit = goal.target - len(units)
        if deficit > 0:
            if fail.failed:
                state, note = "failed", fail.last_error
                deficit = 0
            elif now < fail.next_try_at:
                state = "backing off"
                note = f"retry in {fail.next_try_at - now:.0f} s: {fail.last_error}"
                deficit = 0
        lost = memory.ended.pop(goal.model, [])
        # served jobs that just ended on their own, until squeue says how (Tuning)
        settling = sum(1 for j in jobs if j.model == goal.model and j.job_id in memory.completing)
        for _ in range(max(0, deficit - settling)):
            if lost:
                why = lost.pop(0)
            else:
                why = goal.why if len(units) else goal.why.but(f"{goal.why} (none running)")
            if not submit(goal, why):
                break
            state = "scaling"
        if held_off:
            state = "refused"
            note = f"Slurm refused every placement; {memory.refusal_notes.get(goal.model, '')}"
        if limited:
            state, note = "limited", f"mesh limit {limited} reached"
        for unit in victims:
            for j in unit:
                down = Why(Reason.SCALE_DOWN, f"scale down to {goal.target}: {goal.why}")
                gentle = phase[j.job_id] == SERVING  # only a serving replica has requests
                actions.append(Cancel(j.job_id, goal.model, down, hard=not gentle))
                memory.draining[j.job_id] = now
            state = "scaling"
        counts = {p: sum(1 for j in live if phase[j.job_id] == p) for p in (PENDING, STARTING)}
        status.append(
            ModelStatus(
                goal.model,
                goal.target,
                sum(1 for j in live if phase[j.job_id] == SERVING),
                counts[STARTING],
                counts[PENDING],
                sum(1 for j in mine if j.job_id in memory.draining),
                state,
                note,
                goal.why.text,
            )
        )
    # drains that hang (an agent that does not leave): cancel those jobs outright, once
    for j in jobs:
        since = memory.draining.get(j.job_id)
        if since is not None and j.running and now - since > t.drain_kill_s:
            hung = Why(Reason.DRAIN_HUNG, f"drain took over {t.drain_kill_s:g} s")
            actions.append(Cancel(j.job_id, j.model, hung, True))
            memory.draining[j.job_id] = now + 10 * t.drain_kill_s  # not again soon
    # jobs of models no longer declared: drain them
    declared = {g.model for g in goals}
    for j in jobs:
        if j.model not in declared and not j.ending and j.job_id not in memory.draining:
            hard = _phase(j, by_job) != SERVING
            gone = Why(Reason.NO_LONGER, "no longer in the service file")
            actions.append(Cancel(j.job_id, j.model, gone, hard))
            memory.draining[j.job_id] = now
    return Pass(tuple(actions), tuple(status))


@dataclass
class _Budget:
    """Jobs and GPUs the mesh's jobs hold, against its limits (rule 7)."""

    limits: Limits | None
    jobs: int
    gpus: int

    def take(self, gpus: int) -> str:
        """Count one more job of ``gpus`` GPUs, or name the limit that forbids it."""
        if self.limits is not None and self.jobs >= self.limits.max_jobs:
            return "max_jobs"
        if self.limits is not None and self.gpus + gpus > self.limits.max_gpus:
            return "max_gpus"
        self.jobs += 1
        self.gpus += gpus
        return ""


def _victims(
    units: Sequence[Job],
    live: Sequence[Job],
    phase: Mapping[str, str],
    surplus: int,
    leaving: Set[str] = frozenset(),
) -> list[tuple[Job, ...]]:
    """The ``surplus`` units a scale-down retires (rule 4), each with the job its successor
    replaces when it is a handover pair: first those whose agent has left (``leaving``: they
    are ending anyway), then those that serve nobody yet, pending then starting (newest
    first), then the serving ones nearest their time limit (a pair's is its old job's: it is
    the one a successor was needed for), so that what stays needs none. Leaving first: a job
    whose agent left while the successor paired with it had ended first (a drain slower than
    the successor's whole life) is a unit again, beside the successor's own successor; the
    newest-first rule would cancel that one, the replica's future, instead of the leaver."""
    if surplus <= 0:
        return []
    by_id = {j.job_id: j for j in live}
    order = {PENDING: 0, STARTING: 1, SERVING: 2}

    def key(unit: tuple[Job, ...]) -> tuple[int, float, float]:
        if any(j.job_id in leaving for j in unit):
            return (-1, 0.0, 0.0)
        rank = max(order[phase[j.job_id]] for j in unit)
        newest = -max(j.submitted_at or 0.0 for j in unit)
        if rank < 2:
            return (rank, newest, 0.0)
        ends = min((j.ends_at for j in unit if j.ends_at is not None), default=float("inf"))
        return (rank, ends, newest)

    paired: list[tuple[Job, ...]] = [
        (j, by_id[j.replaces]) if j.replaces in by_id else (j,) for j in units
    ]
    return sorted(paired, key=key)[:surplus]


def _present(replicas: Iterable[Replica]) -> dict[str, Replica]:
    """Per job, its agent's replica while the agent is in the mesh (alive, not LEFT)."""
    return {r.job_id: r for r in replicas if r.job_id and r.alive and r.state != "left"}


def _leaving(replicas: Iterable[Replica], present: Mapping[str, Replica]) -> set[str]:
    """Jobs whose agent has left the mesh (signed LEFT: its time limit near, a SIGTERM, a
    preemption) and is not back as a new session: still RUNNING in squeue while it drains,
    serving nobody and never again (rules 1 and 4)."""
    return {r.job_id for r in replicas if r.job_id and r.state == "left"} - set(present)


def _phase(job: Job, by_job: Mapping[str, Replica]) -> str:
    if job.pending:
        return PENDING
    replica = by_job.get(job.job_id)
    return SERVING if replica is not None and replica.state == "serving" else STARTING


def _learn(now: float, jobs: Sequence[Job], by_job: Mapping[str, Replica], memory: Memory) -> None:
    t = memory.tuning
    listed = {j.job_id: j for j in jobs}
    learned: list[tuple[float, Job]] = []
    for j in jobs:
        seen_before = j.job_id in memory.known
        if not j.ending:
            memory.known.setdefault(j.job_id, (j.model, j.partition))
        replica = by_job.get(j.job_id)
        if replica is not None and replica.state == "serving" and j.job_id not in memory.served:
            memory.served.add(j.job_id)
            served_at = _served_at(now, j, replica, seen_before)
            if served_at is not None and not memory.inherited:
                learned.append((served_at, j))
            memory.failures.pop(j.model, None)  # rule 6; Slurm's refusals still hold (rule 5)
    memory.inherited = False
    for served_at, j in sorted(learned, key=lambda x: x[0]):  # in the order they served
        assert j.submitted_at is not None
        memory.observe(j.model, j.partition, served_at - j.submitted_at)
    for job_id, (model, _partition) in list(memory.known.items()):
        job = listed.get(job_id)
        gone = job is None or job.ending
        if not gone:
            continue
        if (
            job is not None
            and job.state == "COMPLETING"
            and job_id in memory.served
            and job_id not in memory.draining
            and now - memory.completing.setdefault(job_id, now) < t.completing_wait_s
        ):
            continue  # how it ended shows once it has: its replacement waits for that
        memory.completing.pop(job_id, None)
        del memory.known[job_id]
        cancelled = memory.draining.pop(job_id, None) is not None
        if job_id in memory.served or cancelled:
            if not cancelled:
                if job is None:
                    cause, reason = "gone from the queue", Reason.GONE
                else:
                    cause, reason = job.end_cause, END_REASONS.get(job.state, Reason.ENDED)
                why = Why(reason, f"replaces job {job_id} ({cause})")
                memory.ended.setdefault(model, []).append(why)
            memory.served.discard(job_id)
            continue
        fail = memory.failure(model)  # ended without ever serving: a start failure
        fail.count += 1
        fail.last_error = memory.errors.pop(job_id, "") or f"job {job_id} ended before serving"
        fail.next_try_at = now + min(t.max_backoff_s, t.backoff_s * 2 ** (fail.count - 1))
        fail.failed = fail.count >= t.max_failures


def _served_at(now: float, job: Job, replica: Replica, seen_before: bool) -> float | None:
    """When ``job`` first served, for learning its start-up time: as its agent says
    (``Replica.serving_since``), else now if an earlier pass saw it not serving yet; None when
    neither is known (a job inherited already serving from an agent that does not say: its age
    is not its start-up time)."""
    if job.submitted_at is None:
        return None
    since = replica.serving_since
    if since is not None and job.submitted_at <= since <= now:
        return since
    return now if seen_before else None


def _placement(
    model: str, places: Sequence[Placement], memory: Memory, now: float
) -> Placement | None:
    """The first placement neither penalised nor refused; if all are, the last one not
    refused (pending somewhere beats not trying); None when Slurm refused every one."""
    open_ = [p for p in places if memory.refusals.get((model, *p.key()), 0.0) <= now]
    for p in open_:
        if memory.penalised.get((model, *p.key()), 0.0) <= now:
            return p
    return open_[-1] if open_ else None


def _placement_of(job: Job, goal: Goal, places: Sequence[Placement]) -> Placement | None:
    """The placement a job of ``goal`` was submitted at (None: not one allowed now)."""
    partition = job.partition if goal.plan.service.partitions else None
    for p in places:
        if p.partition == partition and p.gres_type == job.gres_type:
            return p
    return None


def holdings(jobs: Iterable[Job], replicas: Iterable[Replica], memory: Memory) -> dict[str, Held]:
    """Per model, the units the next pass starts from (``Held``), for the scaling policy."""
    by_job = _present(replicas)
    live = [j for j in jobs if not j.ending and j.job_id not in memory.draining]
    ids = {j.job_id for j in live}
    counts: dict[str, list[int]] = {}
    newest: dict[str, float] = {}
    for j in live:
        if not j.replaces and j.submitted_at is not None:  # not a time-limit successor
            newest[j.model] = max(newest.get(j.model, j.submitted_at), j.submitted_at)
        if j.replaces in ids:
            continue  # a handover pair counts once, as its old job (serving: it had to be)
        row = counts.setdefault(j.model, [0, 0])
        row[0 if _phase(j, by_job) == SERVING else 1] += 1
    return {
        model: Held(serving, starting, newest.get(model))
        for model, (serving, starting) in counts.items()
    }
