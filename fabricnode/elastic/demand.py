"""What the mesh shows of demand, for the controller: requests waiting for a replica, idleness.

Rules
-----
* **Scale from zero.** An ingress holding requests for a declared model that has no replica
  labels its own entry ``fabric.wanted=<model> [<model> ...]`` (``WANTED_LABEL``; set and
  cleared as the first request starts and the last stops waiting; ``wanted_labels`` spreads
  many models over ``fabric.wanted.1`` ... so that every value fits the registry's label
  limit). A model wanted by any agent the control plane counts (``observe.wanted_models``:
  standing at least ``mesh.schema.CONTROL_COUNTS``) gets a target of at least one replica, at
  once.
* **Idle to zero.** A model whose service allows zero replicas (``min_replicas = 0``) stays
  at one or more while it was active within its ``idle_to_zero`` time: a request wanted it, or
  the agents' request logs (``GET /fabric/v1/workload?window=...`` on every alive agent, the
  planner's source) counted a request for it. The logs are read every ``check_interval_s``
  (at most half the idle time) per model. A check where an agent does not answer is no news
  (the replica being drained is one such agent: it has stopped answering while it leaves);
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fabricnode.elastic.observe import (
    AgentClient,
    WorkloadClient,
    agent_urls,
    requests_for,
    wanted_models,
)
from fabricnode.elastic.servicefile import ServiceSpec, parse
from fabricnode.elastic.vocab import MIN_REPLICAS, Fleet, ModelPlan, Reason, Why
from fabricnode.errors import FabricError
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.registry import MAX_LABEL_VALUE
from fabricnode.mesh.schema import WANTED_LABEL

MAX_WANTED_LABELS = 8


def wanted_labels(models: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """The ``fabric.wanted`` labels for ``models`` held: space-separated names, each value
    within the registry's limit, at most ``MAX_WANTED_LABELS`` labels (the rest wait for a
    place: they are added as the first ones stop waiting)."""
    values: list[str] = []
    for model in sorted(models):
        if values and len(values[-1]) + 1 + len(model) <= MAX_LABEL_VALUE:
            values[-1] += " " + model
        elif len(values) < MAX_WANTED_LABELS:
            values.append(model)
    keys = [WANTED_LABEL] + [f"{WANTED_LABEL}.{i}" for i in range(1, MAX_WANTED_LABELS)]
    return tuple(zip(keys, values, strict=False))


@dataclass
class DemandScaler:
    """The controller's scaler without a load policy (module docstring)."""

    core: MeshCore
    client: WorkloadClient = field(default_factory=lambda: AgentClient())
    check_interval_s: float = 30.0
    active_at: dict[str, float] = field(default_factory=dict)  # model -> last activity seen
    checked_at: dict[str, float] = field(default_factory=dict)
    _wanted: set[str] = field(default_factory=set)

    async def observe(
        self, plans: Sequence[ModelPlan], now: float, fleet: Fleet | None = None
    ) -> None:
        """Read the request logs of the models due for an idleness check, in a worker thread
        (the controller's own agent is one of those asked: its loop must stay free)."""
        wanted = wanted_models(self.core)
        for plan in plans:
            if plan.model in wanted:
                self.active_at[plan.model] = now
                continue
            idle_s = plan.service.idle_to_zero_s
            if plan.service.min_replicas > 0 or idle_s is None:
                continue
            every = min(self.check_interval_s, idle_s / 2)
            if now - self.checked_at.get(plan.model, -math.inf) < every:
                continue
            self.checked_at[plan.model] = now
            agents = agent_urls(self.core)
            count = await requests_for(self.client, agents, plan.model, idle_s)
            if count:  # None (an agent did not answer): no news, the last verdict stands
                self.active_at[plan.model] = now
        self._wanted = wanted

    def target(self, plan: ModelPlan, now: float) -> tuple[int, Why]:
        service = plan.service
        if plan.model in self._wanted:
            why = Why(Reason.SCALE_FROM_ZERO, "scale from zero: requests waiting")
            return max(1, service.min_replicas), why
        if service.min_replicas > 0 or service.idle_to_zero_s is None:
            return service.min_replicas, MIN_REPLICAS
        idle_s = service.idle_to_zero_s
        last = self.active_at.get(plan.model)
        if last is not None and now - last < idle_s:
            return 1, Why(Reason.ACTIVE, "active recently")
        return 0, Why(Reason.IDLE, f"idle for {idle_s:g} s")


@dataclass
class Declared:
    """The declared models of the mesh's service file and their hold times, for the ingress
    (parsed once per file)."""

    core: MeshCore
    _digest: bytes = b""
    _holds: dict[str, float] = field(default_factory=dict)

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
        return self._holds

    def hold_s(self, model: str) -> float | None:
        return self._current().get(model)

    def models(self) -> list[str]:
        return sorted(self._current())
