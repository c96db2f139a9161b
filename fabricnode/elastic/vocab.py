"""The words every elastic module speaks: a declared model's plan, the controller's goals and
actions, its decisions and their reasons. Pure: no I/O, no clock, no trio.

This module sits at the bottom of ``fabricnode.elastic`` (above only the service file, the
policy and the leader rule; the ``elastic-layers`` contract in pyproject.toml): the records
here are what the loop (``controller``), the scalers (``demand``, ``follow``), the I/O
(``observe``, ``slurmctl``) and the pure pass (``reconcile``) hand each other, so none of them
needs to import the loop that drives them. The registry labels they read and write
(``fabric.service``, ``slurm.job_id``, ``fabric.wanted``, ``fabric.controller``) are not
elastic's words but the registry's: they are spelled once, in ``mesh.schema``, and each module
imports the key it needs from there.

Records, and why each one exists
--------------------------------
* ``ModelPlan``: a declared model (the service file's ``ModelService``, as it is) and what the
  controller derives from it once per file: the GPUs of a replica and the (Slurm GPU type,
  GPUs) options in order of preference (``plans``: ``"auto"`` asks the planner). Everything
  below reads the service's settings through ``plan.service``; nothing copies them.
* ``Goal``: a plan and what the scaler wants of it now (the target, clamped, and its ``Why``).
* ``Submit``: one decision of a pass, a job to submit: the plan it is for plus what the pass
  chose (the placement, the job it replaces, why). ``slurmctl`` turns it into an sbatch line.
* ``Cancel``: a job to cancel, gently (SIGTERM, the agent drains) or outright, and why.
* ``Decision``: what the controller did (submit, cancel, refused, invalid), for the log, the
  ``fabric services`` list and the metric.

Reasons
-------
A ``Why`` is a ``Reason`` (a small closed set) and the full sentence a person reads. The log
line and ``fabric services`` show the sentence; the metric
``fabric_controller_decisions_total{action_reason}`` is labelled ``action:reason.label``. The
labels are public (docs/services.md, "How the controller decides"; docs/operators.md) and are
the strings the controller has always reported for these reasons; ``Reason.label`` is never
read back out of a sentence.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fabricnode.elastic.servicespec import Limits as Limits  # the one Limits: the file's
from fabricnode.elastic.servicespec import ModelService


class Reason(enum.Enum):
    """Why the controller decided something; the value is the metric label (module docstring)."""

    # a job's successor ahead of its time limit, or the replacement of one that reached it
    TIME_LIMIT = "time limit"
    # a served job ended on its own: its replacement's reason says how (squeue's final state)
    PREEMPTED = "preempted"
    NODE_FAILURE = "node failure"
    FAILED = "failed"
    OUT_OF_MEMORY = "out of memory"
    CANCELLED_OUTSIDE = "cancelled outside"
    GONE = "gone from the queue"
    ENDED = "ended"  # completed, a deadline, or a final state without a reason of its own
    # the target: the demand rules (demand.py)
    MIN_REPLICAS = "min replicas"
    SCALE_FROM_ZERO = "scale from zero"
    ACTIVE = "active recently"
    IDLE = "idle"
    # the target: the scaling policy (policy.REASONS, same words), and its hold between changes
    FORECAST = "forecast"
    BACKLOG = "backlog"
    LOAD = "load"
    OBJECTIVE = "objective"
    LOW_DEMAND = "low-demand"
    LOW_LOAD = "low-load"
    STATIC = "static"
    BOUNDS = "bounds"
    DEMAND = "demand"
    # cancels
    SCALE_DOWN = "scale down"
    PENDING = "pending"  # pending too long at a placement when another is allowed
    NO_LONGER = "no longer"  # the model left the service file
    DRAIN_HUNG = "drain took over"  # a cancelled job still running: cancelled outright
    # Slurm said no
    SBATCH = "sbatch"
    SCANCEL = "scancel"
    # the mesh's service file does not parse (the label is the file's name in the message)
    INVALID = "the mesh's service file"

    @property
    def label(self) -> str:
        return self.value


@dataclass(frozen=True)
class Why:
    """A reason and the sentence that says it (``"replaces job 12 (preempted)"``)."""

    reason: Reason
    text: str

    def __str__(self) -> str:
        return self.text

    def but(self, text: str) -> Why:
        """The same reason said otherwise (``"min replicas (none running)"``)."""
        return Why(self.reason, text)


MIN_REPLICAS = Why(Reason.MIN_REPLICAS, "min replicas")

# squeue's final states -> the reason of the replacement of a served job that ended so
# (jobs.END_CAUSES says them in words); any other final state is Reason.ENDED
END_REASONS: Mapping[str, Reason] = {
    "PREEMPTED": Reason.PREEMPTED,
    "TIMEOUT": Reason.TIME_LIMIT,
    "FAILED": Reason.FAILED,
    "NODE_FAIL": Reason.NODE_FAILURE,
    "BOOT_FAIL": Reason.NODE_FAILURE,
    "OUT_OF_MEMORY": Reason.OUT_OF_MEMORY,
    "CANCELLED": Reason.CANCELLED_OUTSIDE,
}


@dataclass(frozen=True)
class Placement:
    """A partition (None: the site's default) and a Slurm GPU type ("": any) with its GPUs."""

    partition: str | None
    gres_type: str
    gpus: int

    def key(self) -> tuple[str, str]:
        return (self.partition or "", self.gres_type)

    def __str__(self) -> str:
        where = [f"partition {self.partition}"] if self.partition else []
        if self.gres_type:
            where.append(f"GPU type {self.gres_type}")
        return " and ".join(where) or "the default partition"


@dataclass(frozen=True)
class ModelPlan:
    """One declared model as the controller acts on it: the service entry and the GPU options
    derived from it (``plans.plan_of``)."""

    service: ModelService
    gpus: int  # per replica (one job) on the first option, or on any type without options
    # (Slurm GPU type, GPUs per replica) in order of preference; () = any type with ``gpus``
    gpu_options: tuple[tuple[str, int], ...] = ()

    @property
    def model(self) -> str:
        return self.service.name

    def placements(self) -> list[Placement]:
        """Where a replica may be submitted, in order of preference: every GPU type in order,
        and within each type every partition in order (reconcile, rule 3)."""
        types = self.gpu_options or (("", self.gpus),)
        parts: tuple[str | None, ...] = self.service.partitions or (None,)
        return [Placement(p, kind, gpus) for kind, gpus in types for p in parts]


@dataclass(frozen=True)
class ServicePlans:
    """The mesh's service file as plans: one per declared model, the limits, the digest."""

    models: tuple[ModelPlan, ...]
    limits: Limits | None = None  # None: no limit (the file always has them)
    digest: str = ""


@dataclass(frozen=True)
class Goal:
    """A plan and the replicas wanted of it now, already within [min, max], and why."""

    plan: ModelPlan
    target: int
    why: Why = MIN_REPLICAS
    # when the idle rule takes the model to zero unless a request comes (unix time; None: it
    # does not): a job it retires before its time limit needs no successor
    idle_at: float | None = None

    @property
    def model(self) -> str:
        return self.plan.model


@dataclass(frozen=True)
class Submit:
    """A job to submit: the plan it is for, where (the placement a pass chose among the plan's),
    the job it takes over from (a time-limit successor), and why."""

    plan: ModelPlan
    placement: Placement
    why: Why
    replaces: str = ""

    @property
    def model(self) -> str:
        return self.plan.model


@dataclass(frozen=True)
class Cancel:
    job_id: str
    model: str
    why: Why
    # scancel outright, not SIGTERM to the job's step: a job with nothing to drain (pending, or
    # its agent not serving yet: the signal would find no step, or one that serves nobody), or
    # a drain that did not end
    hard: bool = False


Action = Submit | Cancel


@dataclass(frozen=True)
class Held:
    """What the controller holds of one model, as a pass counts it (reconcile, rule 1): units
    serving, and units submitted but not serving yet (pending or starting); draining jobs not
    at all."""

    serving: int = 0
    starting: int = 0
    # when the newest job that is not a time-limit successor was submitted (unix time, Slurm's):
    # the controller started it for demand then, which a controller that takes over still sees
    newest_at: float | None = None

    @property
    def replicas(self) -> int:
        return self.serving + self.starting


@dataclass(frozen=True)
class Fleet:
    """What the controller holds of each model when it asks the scaler: the units a pass
    counts (``Held``; a model with none is absent) and each model's cold start, the learned
    time from ``sbatch`` to SERVING (``reconcile.Memory.cold_start_s``)."""

    held: Mapping[str, Held] = field(default_factory=dict)
    cold_start_s: Mapping[str, float] = field(default_factory=dict)


class Scaler(Protocol):
    async def observe(self, plans: Sequence[ModelPlan], now: float, fleet: Fleet) -> None:
        """Gather what ``target`` needs (may block in a worker thread, never the loop)."""
        ...

    def target(self, plan: ModelPlan, now: float) -> tuple[int, Why]:
        """Replicas wanted now (before clamping to the plan's min and max) and why."""
        ...

    def idle_at(self, plan: ModelPlan, now: float) -> float | None:
        """When the model goes to zero if no request comes (``Goal.idle_at``), None: never."""
        ...

    def learned(self, plan: ModelPlan) -> dict[str, object]:
        """What the scaler learned of the model, as ``fabric services --json`` shows it under
        each model's ``learned`` ({}: it learns nothing)."""
        ...


class MinReplicas:
    """The scaler without demand signals: every model at its ``min_replicas``."""

    async def observe(self, plans: Sequence[ModelPlan], now: float, fleet: Fleet) -> None:
        return None

    def target(self, plan: ModelPlan, now: float) -> tuple[int, Why]:
        return plan.service.min_replicas, MIN_REPLICAS

    def idle_at(self, plan: ModelPlan, now: float) -> float | None:
        return None

    def learned(self, plan: ModelPlan) -> dict[str, object]:
        return {}


@dataclass(frozen=True)
class Decision:
    at: float
    model: str
    action: str  # "submit", "cancel", "refused", "invalid"
    why: Why
    job_id: str = ""

    @property
    def reason(self) -> str:
        return self.why.text

    @property
    def key(self) -> tuple[str, str]:
        """The metric's (action, reason label)."""
        return (self.action, self.why.reason.label)

    def line(self) -> str:
        """The log line, after ``controller ``."""
        job = f" job {self.job_id}" if self.job_id else ""
        return f"{self.action} {self.model or '-'}{job}: {self.why.text}"

    def to_json(self) -> dict[str, object]:
        return {
            "at": self.at,
            "model": self.model,
            "action": self.action,
            "reason": self.why.text,
            "job_id": self.job_id or None,
        }
