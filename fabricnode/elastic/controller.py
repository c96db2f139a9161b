"""The control loop an agent runs with ``--controller``: read, decide, act, every few seconds.

Theory of operation
-------------------
Each tick (``interval_s``) the controller asks the registry who acts (``leader.acting``). A
standby only keeps its status current ("standby; acting: <id>"). The acting one:

1. reads the mesh's service file (``core.services``), parses it (``vocab.ServicePlans``; a
   file that does not parse changes nothing: the error is the status, the jobs keep serving);
2. lists the mesh's jobs from Slurm and the replicas from the registry (``observe``:
   ``SlurmCalls.jobs``, ``replicas``: entries labelled ``fabric.service``, alive while their
   standing is at least ``mesh.schema.CONTROL_COUNTS``);
3. tells the scaler what it holds of each model (``vocab.Fleet``: serving and starting units
   as the pass counts them, the learned cold start), asks it for each model's target
   (``Scaler.target``: the demand rules and the scaling policy, clamped to the service's min
   and max) and runs ``reconcile`` with the target's reason (``vocab.Goal``);
4. carries out the actions (``observe.SlurmCalls``): ``sbatch`` for submissions,
   ``scancel --signal=TERM`` for cancels (the agent leaves and drains). Slurm's refusals
   become the model's status and a decision with the refusal's text; the next pass tries
   again.

This is the top of ``fabricnode.elastic``: it imports the rest, and nothing in the package
imports it (the ``elastic-layers`` contract). Every decision (``vocab.Decision``) is a log
line, an entry in ``recent`` (the last ``MAX_DECISIONS``) and a count in ``decisions`` by
(action, reason label: ``vocab.Reason``), which the admin API serves as
``/fabric/v1/controller`` and Prometheus text. A takeover starts from Slurm's list of jobs, so
the new acting controller neither forgets its predecessor's jobs nor submits twice for them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import trio

from fabricnode.elastic.leader import candidate_since
from fabricnode.elastic.observe import SlurmCalls, acting_controller, replicas
from fabricnode.elastic.reconcile import Memory, ModelStatus, holdings, reconcile
from fabricnode.elastic.sitespread import ServingElsewhere, site_plan, starts_of
from fabricnode.elastic.slurmctl import SlurmControl, SlurmRefused
from fabricnode.elastic.startups import inherited_start_ups, start_up_labels
from fabricnode.elastic.vocab import (
    Cancel,
    Decision,
    Fleet,
    Goal,
    MinReplicas,
    Reason,
    Scaler,
    ServicePlans,
    Submit,
    Why,
)
from fabricnode.errors import FabricError
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.schema import CONTROLLER_LABEL
from fabricnode.mesh.sites import DEFAULT_SITE

log = logging.getLogger("fabricnode.elastic.controller")

MAX_DECISIONS = 200


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
    # model -> what this controller learned of it (the scaler's, and the start-up time)
    learned: dict[str, dict[str, object]] = field(default_factory=dict)
    # model -> our site's share of it, for models counted across sites (``sitespread``)
    site_shares: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "role": self.role,
            "acting": self.acting or None,
            "service_digest": self.service_digest or None,
            "error": self.error or None,
            "last_pass_at": self.last_pass_at or None,
            "dry_run": self.dry_run,
            "models": [
                {**m.to_json(), "learned": self.learned.get(m.model, {})} for m in self.models
            ],
            "commands": list(self.commands),
            "objectives": dict(self.objectives),
            "site_shares": dict(self.site_shares),
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
    _digest: str = ""
    _calls: SlurmCalls = field(init=False)
    _acted: bool = False  # has acted since it started (the first pass inherits start-ups)
    _published: tuple[tuple[str, str], ...] = ()  # the start-up labels on our entry
    # Capacity across sites (``sitespread``): our site, and what the other sites serve of a
    # model (set by the agent of a gateway, from its view of the peer sites; None elsewhere).
    site: str = DEFAULT_SITE
    serving_elsewhere: ServingElsewhere | None = None
    # model -> seconds a replica started now would take to serve, for the models we would
    # start now (``may_start``); kept while acting, for our site's summary (``start_here``)
    starts: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._calls = SlurmCalls(self.slurm)

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
        if role != "acting":
            self.starts = {}
        if role == "acting":
            if not self._acted:
                self._acted = True
                self._inherit()
            await self.run_pass()
            self._publish()

    def _inherit(self) -> None:
        """Begin to act from the start-up times the controller that acted before learned
        (``elastic.startups``), read from its entry (dead ones stay in the registry a while)."""
        since = candidate_since(self.core.self_entry.body.labels)
        if since is None:
            return
        entries = ((e.session_id, e.body.labels) for e in self.core.registry)
        lead = inherited_start_ups(entries, self.core.self_id, since)
        if lead:
            said = ", ".join(f"{m}@{p or '-'} {s:.1f} s" for (m, p), s in sorted(lead.items()))
            log.info("controller: start-up times taken over: %s", said)
            self.memory.inherit(lead)

    def _publish(self) -> None:
        """Our learned start-up times on our entry, when they changed (``elastic.startups``)."""
        labels = start_up_labels(self.memory.lead)
        if labels == self._published:
            return
        own = self.core.self_entry.body.labels
        candidate = next(((k, v) for k, v in own if k == CONTROLLER_LABEL), None)
        if candidate is None:
            return
        self._published = labels
        self.relabel((candidate, *labels))

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
                self._decide(Decision(now, "", "invalid", Why(Reason.INVALID, str(exc))))
            self.status.error = f"the service file is invalid, nothing changes: {exc}"
            return
        plans = self._site_plans(plans)
        if plans.digest != self.status.service_digest:
            for p in plans.models:  # a new file: failed models get another chance
                self.memory.reset_model(p.model)
            self.status.service_digest = plans.digest
        self.status.objectives = {
            p.model: p.service.ttft_p95_s for p in plans.models if p.service.ttft_p95_s is not None
        }
        jobs = await self._calls.jobs(self.memory.served, self.memory.draining)
        ran = len(self.slurm.commands)
        fleet = Fleet(
            holdings(jobs, replicas(self.core), self.memory),
            {p.model: self.memory.cold_start_s(p.model, p.placements(), now) for p in plans.models},
        )
        await self.scaler.observe(plans.models, now, fleet)
        goals = []
        for plan in plans.models:
            want, why = self.scaler.target(plan, now)
            service = plan.service
            target = max(service.min_replicas, min(service.max_replicas, want))
            goals.append(Goal(plan, target, why, self.scaler.idle_at(plan, now)))
        result = reconcile(now, goals, jobs, replicas(self.core), self.memory, plans.limits)
        # after the pass: what it learned includes the jobs it saw serving now
        self.status.learned = {
            p.model: {
                "cold_start_s": round(self.memory.cold_start_s(p.model, p.placements(), now), 1),
                "cold_start_learned": any(m == p.model for m, _ in self.memory.lead),
                **self.scaler.learned(p),
            }
            for p in plans.models
        }
        refused: dict[str, str] = {}
        for action in result.actions:
            if isinstance(action, Submit):
                place = action.placement
                try:
                    job_id = await self._calls.submit(action)
                except SlurmRefused as exc:
                    refused[action.model] = str(exc)
                    self.memory.refused(action.model, place, str(exc), now)
                    why = Why(Reason.SBATCH, f"sbatch at {place}: {exc}")
                    self._decide(Decision(now, action.model, "refused", why))
                    continue
                if not self.slurm.dry_run:  # a dry run's jobs never show in squeue
                    self.memory.known[job_id] = (action.model, place.partition or "")
                self._decide(Decision(now, action.model, "submit", action.why, job_id))
            elif isinstance(action, Cancel):
                try:
                    await self._calls.cancel(action.job_id, action.hard)
                except SlurmRefused as exc:
                    why = Why(Reason.SCANCEL, f"scancel: {exc}")
                    self._decide(Decision(now, action.model, "refused", why))
                    continue
                self._decide(Decision(now, action.model, "cancel", action.why, action.job_id))
        self.status.models = tuple(
            _refused(s, refused[s.model]) if s.model in refused else s for s in result.status
        )
        memory = self.memory  # after this pass's refusals: a start refused here is none
        self.starts = starts_of(
            plans.models, self.site, lambda p: memory.start_s(p.model, p.placements(), now)
        )
        self.status.error = ""
        self.status.last_pass_at = now
        self.status.commands = tuple(self.slurm.commands[ran:]) if self.slurm.dry_run else ()

    def start_here(self, model: str) -> float | None:
        """Seconds until a replica of ``model`` started now would serve at our site (inf: we
        would start none now); None while we do not act (the acting controller knows)."""
        if self.status.role != "acting":
            return None
        return self.starts.get(model, math.inf)

    def _site_plans(self, plans: ServicePlans) -> ServicePlans:
        """The plans with our site's share of every model counted across sites
        (``sitespread``); the shares in the status."""
        shares: dict[str, str] = {}
        models = []
        for plan in plans.models:
            bounded, got = site_plan(plan, self.site, self.serving_elsewhere)
            if got is not None:
                shares[plan.model] = got.describe(self.site, plan.service.prefer_sites)
            models.append(bounded)
        if shares != self.status.site_shares:
            for model, said in sorted(shares.items()):
                if self.status.site_shares.get(model) != said:
                    log.info("controller: %s: %s", model, said)
            self.status.site_shares = shares
        return replace(plans, models=tuple(models)) if shares else plans

    def _decide(self, decision: Decision) -> None:
        self.recent.append(decision)
        self.decisions[decision.key] += 1
        log.info("controller %s", decision.line())


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


def summarise(controller: Controller, limit: int = 50) -> dict[str, object]:
    """``/fabric/v1/controller``'s body."""
    recent: Sequence[Decision] = list(controller.recent)[-limit:]
    return {**controller.status.to_json(), "decisions": [d.to_json() for d in recent]}
