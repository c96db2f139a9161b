"""The control loop an agent runs with ``--controller``: read, decide, act, every few seconds.

Theory of operation
-------------------
Each tick (``interval_s``) the controller asks the registry who acts (``leader.acting``). A
standby only keeps its status current ("standby; acting: <id>"). The acting one:

1. reads the mesh's service file (``core.services``), parses it (``ServicePlans``; a file
   that does not parse changes nothing: the error is the status, the jobs keep serving);
2. lists the mesh's jobs from Slurm (``SlurmControl.list_jobs`` in a worker thread) and the
   replicas from the registry (entries labelled ``fabric.service``, matched to jobs by their
   ``slurm.job_id`` label; it is alive while its standing is at least ``CONTROL_COUNTS``
   (``mesh.schema``: not DOWN, LEFT or dead in this agent's view); the engine's error from the
   ``fabric.engine_error`` label);
3. tells the scaler what it holds of each model (``Fleet``: serving and starting units as the
   pass counts them, the learned cold start), asks it for each model's target
   (``Scaler.target``: the demand rules and the scaling policy, clamped to the service's min
   and max) and runs ``reconcile`` with the target's reason;
4. carries out the actions in a worker thread: ``sbatch`` for submissions (the service's
   partition, account, QoS, time limit, extra options, engine), ``scancel --signal=TERM`` for
   cancels (the agent leaves and drains). Slurm's refusals become the model's status and a
   decision with the refusal's text; the next pass tries again.

Every decision is a log line, a ``Decision`` in ``recent`` (the last ``MAX_DECISIONS``) and a
count in ``decisions`` by (action, reason kind), which the admin API serves as
``/fabric/v1/controller`` and Prometheus text. A takeover starts from Slurm's list of jobs, so
the new acting controller neither forgets its predecessor's jobs nor submits twice for them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import trio

from fabricnode.elastic.leader import Candidate, acting, candidate_since
from fabricnode.elastic.policy import REASONS as POLICY_REASONS
from fabricnode.elastic.reconcile import (
    Cancel,
    Goal,
    Held,
    Limits,
    Memory,
    ModelStatus,
    Placement,
    Replica,
    Submit,
    holdings,
    reconcile,
)
from fabricnode.elastic.slurmctl import Job, SlurmControl, SlurmRefused, Submission
from fabricnode.errors import FabricError
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.schema import (
    CONTROL_COUNTS,
    CONTROLLER_LABEL,
    ENGINE_ERROR_LABEL,
    SERVICE_LABEL,
    SLURM_JOB_LABEL,
)

log = logging.getLogger("fabricnode.elastic.controller")

MAX_DECISIONS = 200


@dataclass(frozen=True)
class ModelPlan:
    """What the controller needs of one declared model (from the service file)."""

    model: str
    min_replicas: int
    max_replicas: int
    gpus: int
    partitions: tuple[str, ...] = ()
    time_limit: str | None = None  # as sbatch takes it
    time_limit_s: int | None = None
    account: str | None = None
    qos: str | None = None
    sbatch_args: tuple[str, ...] = ()
    engine: str = "sim"  # "sim" or an engine command template (fabricnode.engine.template)
    model_path: str | None = None
    idle_to_zero_s: float | None = None  # min_replicas 0: scale to zero after this idle time
    # (Slurm GPU type, GPUs per replica) in order of preference; () = any type with ``gpus``
    gpu_options: tuple[tuple[str, int], ...] = ()
    ttft_p95_s: float | None = None  # the latency objective, if the service has one
    gpu_types: tuple[str, ...] = ()  # allowed GPU types (catalog names), in order of preference
    sleep_after_s: float | None = None  # the jobs' engines sleep after this idle time


@dataclass(frozen=True)
class ServicePlans:
    models: tuple[ModelPlan, ...]
    limits: Limits = field(default_factory=Limits)
    digest: str = ""


@dataclass(frozen=True)
class Fleet:
    """What the controller holds of each model when it asks the scaler: the units a pass
    counts (``reconcile.Held``; a model with none is absent) and each model's cold start, the
    learned time from ``sbatch`` to SERVING (``Memory.cold_start_s``)."""

    held: Mapping[str, Held] = field(default_factory=dict)
    cold_start_s: Mapping[str, float] = field(default_factory=dict)


class Scaler(Protocol):
    async def observe(self, plans: Sequence[ModelPlan], now: float, fleet: Fleet) -> None:
        """Gather what ``target`` needs (may block in a worker thread, never the loop)."""
        ...

    def target(self, plan: ModelPlan, now: float) -> tuple[int, str]:
        """Replicas wanted now (before clamping to the plan's min and max) and why."""
        ...


class MinReplicas:
    """The scaler without demand signals: every model at its ``min_replicas``."""

    async def observe(self, plans: Sequence[ModelPlan], now: float, fleet: Fleet) -> None:
        return None

    def target(self, plan: ModelPlan, now: float) -> tuple[int, str]:
        return plan.min_replicas, "min replicas"


@dataclass(frozen=True)
class Decision:
    at: float
    model: str
    action: str  # "submit", "cancel", "refused", "invalid"
    reason: str
    job_id: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "at": self.at,
            "model": self.model,
            "action": self.action,
            "reason": self.reason,
            "job_id": self.job_id or None,
        }


@dataclass
class ControllerStatus:
    role: str = "starting"  # "acting", "standby", "starting"
    acting: str = ""  # session id of the acting controller
    service_digest: str = ""
    error: str = ""  # why the last pass did nothing (bad file, squeue failed)
    models: tuple[ModelStatus, ...] = ()
    last_pass_at: float = 0.0
    dry_run: bool = False
    commands: tuple[str, ...] = ()  # dry-run: what it would have run
    # model -> its TTFT p95 objective (seconds), for those the service file gives one
    objectives: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "role": self.role,
            "acting": self.acting or None,
            "service_digest": self.service_digest or None,
            "error": self.error or None,
            "last_pass_at": self.last_pass_at or None,
            "dry_run": self.dry_run,
            "models": [m.to_json() for m in self.models],
            "commands": list(self.commands),
            "objectives": dict(self.objectives),
        }


@dataclass
class Controller:
    core: MeshCore
    slurm: SlurmControl
    parse: Callable[[str], ServicePlans]  # raises FabricError with the reasons
    relabel: Callable[[tuple[tuple[str, str], ...]], object]
    scaler: Scaler = field(default_factory=MinReplicas)
    interval_s: float = 2.0
    wall_clock: Callable[[], float] = time.time
    memory: Memory = field(default_factory=Memory)
    status: ControllerStatus = field(default_factory=ControllerStatus)
    recent: deque[Decision] = field(default_factory=lambda: deque(maxlen=MAX_DECISIONS))
    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)
    _preempted: dict[str, bool] = field(default_factory=dict)  # ended served job -> preempted
    _digest: str = ""

    async def run(self) -> None:
        since = self.wall_clock()
        self.relabel(((CONTROLLER_LABEL, f"{since:.3f}"),))
        self.status.dry_run = self.slurm.dry_run
        log.info("controller candidate%s", " (dry run)" if self.slurm.dry_run else "")
        while True:
            await trio.sleep(self.interval_s)
            try:
                await self.tick()
            except FabricError as exc:  # a pass that failed changes nothing; say why
                self.status.error = str(exc)
                log.warning("controller pass skipped: %s", exc)

    async def tick(self) -> None:
        leader = acting_controller(self.core)
        me = self.core.self_id
        role = "acting" if leader is not None and leader.session_id == me else "standby"
        if role != self.status.role:
            log.info("controller: %s (acting: %s)", role, leader.session_id[:8] if leader else "-")
        self.status.role = role
        self.status.acting = leader.session_id if leader else ""
        if role == "acting":
            await self.run_pass()

    def replicas(self) -> list[Replica]:
        out = []
        for entry in self.core.registry:
            labels = dict(entry.body.labels)
            model = labels.get(SERVICE_LABEL)
            if not model:
                continue
            alive = self.core.standing_of(entry) >= CONTROL_COUNTS
            out.append(
                Replica(
                    entry.session_id,
                    model,
                    labels.get(SLURM_JOB_LABEL, ""),
                    entry.body.state.name.lower(),
                    alive,
                    labels.get(ENGINE_ERROR_LABEL, ""),
                )
            )
        return out

    async def run_pass(self) -> None:
        now = self.wall_clock()
        current = self.core.services.current
        if current is None:
            self.status.error = "no service file applied (fabric services apply FILE)"
            return
        try:
            plans = self.parse(current.body.text)
        except FabricError as exc:
            if current.digest.hex() != self._digest:
                self._digest = current.digest.hex()
                self._decide(Decision(now, "", "invalid", str(exc)))
            self.status.error = f"the service file is invalid, nothing changes: {exc}"
            return
        if plans.digest != self.status.service_digest:
            for p in plans.models:  # a new file: failed models get another chance
                self.memory.reset_model(p.model)
            self.status.service_digest = plans.digest
        self.status.objectives = {
            p.model: p.ttft_p95_s for p in plans.models if p.ttft_p95_s is not None
        }
        jobs = await trio.to_thread.run_sync(self.slurm.list_jobs)
        jobs = await trio.to_thread.run_sync(self._preemptions, jobs)
        ran = len(self.slurm.commands)
        fleet = Fleet(
            holdings(jobs, self.replicas(), self.memory),
            {
                p.model: self.memory.cold_start_s(p.model, _goal(p, 0, "").placements(), now)
                for p in plans.models
            },
        )
        await self.scaler.observe(plans.models, now, fleet)
        goals = []
        for plan in plans.models:
            want, why = self.scaler.target(plan, now)
            target = max(plan.min_replicas, min(plan.max_replicas, want))
            goals.append(_goal(plan, target, why))
        result = reconcile(now, goals, jobs, self.replicas(), self.memory, plans.limits)
        by_model = {p.model: p for p in plans.models}
        refused: dict[str, str] = {}
        for action in result.actions:
            if isinstance(action, Submit):
                plan = by_model[action.model]
                try:
                    job_id = await trio.to_thread.run_sync(
                        self.slurm.submit, _submission(plan, action)
                    )
                except SlurmRefused as exc:
                    refused[action.model] = str(exc)
                    place = Placement(action.partition, action.gres_type, action.gpus)
                    self.memory.refused(action.model, place, str(exc), now)
                    self._decide(
                        Decision(now, action.model, "refused", f"sbatch at {place}: {exc}")
                    )
                    continue
                if not self.slurm.dry_run:  # a dry run's jobs never show in squeue
                    self.memory.known[job_id] = (action.model, action.partition or "")
                self._decide(Decision(now, action.model, "submit", action.reason, job_id))
            elif isinstance(action, Cancel):
                try:
                    await trio.to_thread.run_sync(self.slurm.cancel, action.job_id, action.hard)
                except SlurmRefused as exc:
                    self._decide(Decision(now, action.model, "refused", f"scancel: {exc}"))
                    continue
                self._decide(Decision(now, action.model, "cancel", action.reason, action.job_id))
        self.status.models = tuple(
            _refused(s, refused[s.model]) if s.model in refused else s for s in result.status
        )
        self.status.error = ""
        self.status.last_pass_at = now
        self.status.commands = tuple(self.slurm.commands[ran:]) if self.slurm.dry_run else ()

    def _preemptions(self, jobs: list[Job]) -> list[Job]:
        """A served job that ended on its own, not by our cancel, may have been preempted
        though squeue says COMPLETED (it left within the grace time): ask Slurm once per job,
        so that its replacement says why."""
        listed = {j.job_id for j in jobs}
        for job_id in [k for k in self._preempted if k not in listed]:
            del self._preempted[job_id]
        out = []
        for j in jobs:
            if (
                j.state in ("COMPLETED", "COMPLETING", "CANCELLED")
                and j.job_id in self.memory.served
                and j.job_id not in self.memory.draining
            ):
                if j.job_id not in self._preempted:
                    try:
                        self._preempted[j.job_id] = self.slurm.preempted(j.job_id)
                    except SlurmRefused as exc:
                        log.info("cannot tell whether job %s was preempted: %s", j.job_id, exc)
                        self._preempted[j.job_id] = False
                if self._preempted[j.job_id]:
                    j = replace(j, state="PREEMPTED")
            out.append(j)
        return out

    def _decide(self, decision: Decision) -> None:
        self.recent.append(decision)
        self.decisions[(decision.action, _kind(decision.reason))] += 1
        job = f" job {decision.job_id}" if decision.job_id else ""
        log.info(
            "controller %s %s%s: %s", decision.action, decision.model or "-", job, decision.reason
        )


def _goal(plan: ModelPlan, target: int, why: str) -> Goal:
    return Goal(
        plan.model,
        target,
        plan.gpus,
        plan.partitions,
        plan.time_limit_s,
        why,
        plan.gpu_options,
    )


# The jobs' agents take any free ports (they announce them in the registry): several jobs
# starting at once on one node must not race for the wrapper's preferred 8080/7946.
JOB_AGENT_ARGS = ("--http", "0.0.0.0:0", "--gossip", "0.0.0.0:0")
MAX_SIGNAL_LEAD_S = 120  # the wrapper's --signal=TERM@120


def _submission(plan: ModelPlan, action: Submit) -> Submission:
    extra: tuple[str, ...] = ()
    if plan.time_limit_s is not None and plan.time_limit_s < 4 * MAX_SIGNAL_LEAD_S:
        # Slurm's warning signal (the agent leaves on it) at most a quarter of a short job
        # before its end, not the wrapper's 120 s that would end a 2-minute job at once.
        extra = (f"--signal=TERM@{max(10, plan.time_limit_s // 4)}",)
    return Submission(
        model=plan.model,
        gpus=action.gpus,
        partition=action.partition,
        time_limit=plan.time_limit,
        account=plan.account,
        qos=plan.qos,
        sbatch_args=(*extra, *plan.sbatch_args),
        agent_args=_agent_args(plan),
        engine=plan.engine,
        model_path=plan.model_path,
        replaces=action.replaces,
        gres_type=action.gres_type,
    )


def _agent_args(plan: ModelPlan) -> tuple[str, ...]:
    if plan.sleep_after_s is None:
        return JOB_AGENT_ARGS
    return (*JOB_AGENT_ARGS, "--sleep-after", f"{plan.sleep_after_s:g}")


def _refused(status: ModelStatus, why: str) -> ModelStatus:
    return ModelStatus(
        status.model,
        status.target,
        status.serving,
        status.starting,
        status.pending,
        status.draining,
        "refused",
        f"Slurm refused the last submission: {why}",
        status.reason,
    )


KINDS = (
    "preempted",
    "node failure",
    "failed",
    "out of memory",
    "cancelled outside",
    "gone from the queue",
    "time limit",
    "pending",
    "scale down",
    "no longer",
    "min replicas",
    "demand",
    "forecast",
    "sbatch",
    "scancel",
)


def _kind(reason: str) -> str:
    """A small set of reason kinds for metric labels (the full reason is in the log): the
    scaling policy's reason when the text starts with it (``forecast: ...``), else the first
    of ``KINDS`` in it."""
    head = reason.split(":", 1)[0]
    if head in POLICY_REASONS:
        return head
    for kind in KINDS:
        if kind in reason:
            return kind
    return reason.split(":", 1)[0][:32] if reason else "other"


def acting_controller(core: MeshCore) -> Candidate | None:
    """The acting controller by ``core``'s registry and liveness view (``leader.acting``)."""
    out = []
    for entry in core.registry:
        since = candidate_since(entry.body.labels)
        if since is None:
            continue
        dead = core.standing_of(entry) < CONTROL_COUNTS
        out.append(Candidate(entry.session_id, since, dead, entry.body.addresses.http))
    return acting(out)


def summarise(controller: Controller, limit: int = 50) -> dict[str, object]:
    """``/fabric/v1/controller``'s body."""
    recent: Sequence[Decision] = list(controller.recent)[-limit:]
    return {**controller.status.to_json(), "decisions": [d.to_json() for d in recent]}
