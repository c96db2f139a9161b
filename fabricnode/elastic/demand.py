"""What the mesh shows of demand, for the controller: requests waiting for a replica, idleness.

Rules
-----
* **Scale from zero.** An ingress holding requests for a declared model that has no replica
  labels its own entry ``fabric.wanted=<model>=<held> [...]`` (``WANTED_LABEL``; set as the
  first request starts waiting, updated as the count held crosses a step of
  ``mesh.schema.held_step``, cleared as the last stops waiting; ``wanted_labels`` spreads many
  models over ``fabric.wanted.1`` ... so that every value fits the registry's label limit).
  The counts are the backlog the scaling policy adds (``follow``). A model wanted by any
  agent the control plane counts (``observe.wanted_models``: standing at least
  ``mesh.schema.CONTROL_COUNTS``) gets a target of at least one replica, at once.
* **Idle to zero.** A model whose service allows zero replicas (``min_replicas = 0``) stays at
  one or more while it was active within its ``idle_to_zero`` time (``activity``): a request
  wanted it, a replica of it had requests in flight or waiting (the gossiped load), a unit of
  it was submitted (Slurm's submit time: what the acting controller started for demand, which a
  controller that takes over still sees), or the agents' request logs (``GET
  /fabric/v1/workload?window=...`` on every alive agent, the planner's source) counted a
  request for it. So a controller that takes over during a ramp from zero finds the model
  active from what the mesh and Slurm show now, though it saw none of the ramp. The logs are
  read every ``check_interval_s`` (at most half the idle time) per model. A check where an
  agent does not answer is no news (the replica being drained is one such agent: it has stopped
  answering while it leaves);
  if that agent had requests waiting, they wait for a replica and want it back.
* Otherwise the target is ``min_replicas``. (Scaling above it with load and forecasts is the
  policy's: ``fabricnode.elastic.follow``.)

``DemandScaler`` is these rules as a ``Scaler`` (``follow.ForecastScaler``, the controller's,
takes the larger of its target and the policy's; what it reads of the mesh and the logs,
``observe``); ``wanted_labels`` is what an ingress labels itself with; ``Declared`` gives the
ingress the declared models and how long a request for each may wait.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fabricnode.elastic.activity import Activity, Evidence
from fabricnode.elastic.observe import (
    AgentClient,
    WorkloadClient,
    agent_urls,
    busy_models,
    requests_for,
    wanted_models,
)
from fabricnode.elastic.servicefile import ServiceSpec, parse
from fabricnode.elastic.vocab import MIN_REPLICAS, Fleet, ModelPlan, Reason, Why
from fabricnode.errors import FabricError
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.registry import MAX_LABEL_VALUE
from fabricnode.mesh.schema import WANTED_LABEL, wanted_items

MAX_WANTED_LABELS = 8


def wanted_labels(held: Mapping[str, int]) -> tuple[tuple[str, str], ...]:
    """The ``fabric.wanted`` labels for the requests ``held`` per model: space-separated
    ``<model>=<count>`` items (``mesh.schema.wanted_items``: the count rounded down to two
    steps an octave), each value within the registry's limit, at most ``MAX_WANTED_LABELS``
    labels (the rest wait for a place: they are added as the first ones stop waiting)."""
    values: list[str] = []
    for item in wanted_items(held):
        if len(item) > MAX_LABEL_VALUE:
            continue
        if values and len(values[-1]) + 1 + len(item) <= MAX_LABEL_VALUE:
            values[-1] += " " + item
        elif len(values) < MAX_WANTED_LABELS:
            values.append(item)
    keys = [WANTED_LABEL] + [f"{WANTED_LABEL}.{i}" for i in range(1, MAX_WANTED_LABELS)]
    return tuple(zip(keys, values, strict=False))


@dataclass
class DemandScaler:
    """The controller's scaler without a load policy (module docstring)."""

    core: MeshCore
    client: WorkloadClient = field(default_factory=lambda: AgentClient())
    check_interval_s: float = 30.0
    load_max_age_s: float = 30.0  # three of the agents' load refreshes
    activity: Activity = field(default_factory=Activity)  # when each model was last in demand
    checked_at: dict[str, float] = field(default_factory=dict)
    _wanted: set[str] = field(default_factory=set)

    async def observe(
        self, plans: Sequence[ModelPlan], now: float, fleet: Fleet | None = None
    ) -> None:
        """Note every evidence of demand (``activity``), reading the request logs of the
        models due for an idleness check in a worker thread (the controller's own agent is one
        of those asked: its loop must stay free)."""
        wanted = wanted_models(self.core)
        busy = busy_models(self.core, now, self.load_max_age_s)
        self.activity.keep(p.model for p in plans)
        for plan in plans:
            model = plan.model
            held = fleet.held.get(model) if fleet is not None else None
            if held is not None and held.newest_at is not None:
                self.activity.saw(model, Evidence.STARTED, min(now, held.newest_at))
            if model in busy:
                self.activity.saw(model, Evidence.BUSY, now)
            if model in wanted:
                self.activity.saw(model, Evidence.WANTED, now)
                continue
            idle_s = plan.service.idle_to_zero_s
            if plan.service.min_replicas > 0 or idle_s is None:
                continue
            every = min(self.check_interval_s, idle_s / 2)
            if now - self.checked_at.get(model, -math.inf) < every:
                continue
            self.checked_at[model] = now
            agents = agent_urls(self.core)
            count = await requests_for(self.client, agents, model, idle_s)
            if count:  # None (an agent did not answer): no news, the last verdict stands
                self.activity.saw(model, Evidence.LOGGED, now)
        self._wanted = wanted

    def target(self, plan: ModelPlan, now: float) -> tuple[int, Why]:
        service = plan.service
        if plan.model in self._wanted:
            why = Why(Reason.SCALE_FROM_ZERO, "scale from zero: requests waiting")
            return max(1, service.min_replicas), why
        if service.min_replicas > 0 or service.idle_to_zero_s is None:
            return service.min_replicas, MIN_REPLICAS
        idle_s = service.idle_to_zero_s
        if not self.activity.idle(plan.model, idle_s, now):
            evidence = self.activity.why(plan.model)
            said = _ACTIVE.get(evidence, "active recently") if evidence else "active recently"
            return 1, Why(Reason.ACTIVE, said)
        return 0, Why(Reason.IDLE, f"idle for {idle_s:g} s")

    def learned(self, plan: ModelPlan) -> dict[str, object]:
        return {}

    def idle_at(self, plan: ModelPlan, now: float) -> float | None:
        """When the idle rule takes the model to zero unless a request comes (None: it never
        does, or it is wanted now)."""
        service = plan.service
        if service.min_replicas > 0 or service.idle_to_zero_s is None:
            return None
        if plan.model in self._wanted:
            return None
        return self.activity.idle_at(plan.model, service.idle_to_zero_s)


_ACTIVE = {
    Evidence.WANTED: "active recently",
    Evidence.LOGGED: "active recently",
    Evidence.BUSY: "active: requests in flight",
    Evidence.STARTED: "active: a replica started for its demand",
}


@dataclass
class Declared:
    """The declared models of the mesh's service file, their hold times and the sites each may
    be served at (data residency), for the ingress (parsed once per file).

    A file that does not parse declares nothing and holds nothing, but does not widen where a
    model may be served: the sites of the last file that parsed stay (a model declared in a
    file that is then replaced by a broken one keeps its limits until a valid file says
    otherwise)."""

    core: MeshCore
    _digest: bytes = b""
    _holds: dict[str, float] = field(default_factory=dict)
    _sites: dict[str, frozenset[str]] = field(default_factory=dict)

    def _current(self) -> dict[str, float]:
        current = self.core.services.current
        if current is None:
            return {}
        if current.digest != self._digest:
            self._digest = current.digest
            try:
                spec: ServiceSpec = parse(current.body.text, "the mesh's service file")
            except FabricError:
                self._holds = {}
            else:
                self._holds = {m.name: m.hold_requests_s for m in spec.models}
                self._sites = {m.name: frozenset(m.sites) for m in spec.models if m.sites}
        return self._holds

    def hold_s(self, model: str) -> float | None:
        return self._current().get(model)

    def models(self) -> list[str]:
        return sorted(self._current())

    def sites(self, model: str) -> frozenset[str] | None:
        """The only sites whose nodes may serve ``model`` (None: any)."""
        self._current()
        return self._sites.get(model)
