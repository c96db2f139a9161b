"""What the mesh shows of demand, for the controller: requests waiting for a replica, idleness.

Rules
-----
* **Scale from zero.** An ingress holding requests for a declared model that has no replica
  labels its own entry ``fabric.wanted=<model> [<model> ...]`` (``WANTED_LABEL``; set and
  cleared as the first request starts and the last stops waiting; ``wanted_labels`` spreads
  many models over ``fabric.wanted.1`` ... so that every value fits the registry's label
  limit). A model wanted by any alive agent gets a target of at least one replica, at once.
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
takes the larger of its target and the policy's); ``Declared`` gives the ingress the declared
models and how long a request for each may wait.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
import trio

from fabricnode.elastic.controller import Fleet, ModelPlan
from fabricnode.elastic.servicefile import ServiceSpec, parse
from fabricnode.elastic.signals import WORKLOAD_PATH, agent_urls
from fabricnode.errors import FabricError
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.registry import MAX_LABEL_VALUE
from fabricnode.mesh.schema import CONTROL_COUNTS, WANTED_LABEL

log = logging.getLogger("fabricnode.elastic.demand")

# agent HTTP URL, window (s) -> requests per model over the window; raises on failure
AskWorkload = Callable[[str, float], Mapping[str, float]]


def ask_workload(url: str, window_s: float) -> dict[str, float]:
    """Request counts per model in one agent's request log over the last ``window_s``."""
    r = httpx.get(f"{url}{WORKLOAD_PATH}", params={"window": f"{window_s:g}"}, timeout=3.0)
    r.raise_for_status()
    models = r.json().get("models") or {}
    return {str(m): float(row.get("requests", 0.0)) for m, row in models.items()}


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


def wanted_models(core: MeshCore) -> set[str]:
    """Models some agent the control plane counts (``CONTROL_COUNTS``) holds requests for (its
    ``fabric.wanted*`` labels)."""
    out: set[str] = set()
    for entry in core.entries(CONTROL_COUNTS):
        values = [v for k, v in entry.body.labels if k.startswith(WANTED_LABEL)]
        for value in values:
            out.update(value.split())
    return out


@dataclass
class DemandScaler:
    """The controller's scaler without a load policy (module docstring)."""

    core: MeshCore
    ask: AskWorkload = ask_workload
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
            idle_s = plan.idle_to_zero_s
            if plan.min_replicas > 0 or idle_s is None:
                continue
            every = min(self.check_interval_s, idle_s / 2)
            if now - self.checked_at.get(plan.model, -math.inf) < every:
                continue
            self.checked_at[plan.model] = now
            urls = agent_urls(self.core)
            count = await trio.to_thread.run_sync(self._requests, urls, plan.model, idle_s)
            if count:  # None (an agent did not answer): no news, the last verdict stands
                self.active_at[plan.model] = now
        self._wanted = wanted

    def target(self, plan: ModelPlan, now: float) -> tuple[int, str]:
        if plan.model in self._wanted:
            return max(1, plan.min_replicas), "scale from zero: requests waiting"
        if plan.min_replicas > 0 or plan.idle_to_zero_s is None:
            return plan.min_replicas, "min replicas"
        idle_s = plan.idle_to_zero_s
        last = self.active_at.get(plan.model)
        if last is not None and now - last < idle_s:
            return 1, "active recently"
        return 0, f"idle for {idle_s:g} s"

    def _requests(
        self, urls: Sequence[tuple[str, str]], model: str, window_s: float
    ) -> float | None:
        total = 0.0
        for sid, url in urls:
            try:
                total += float(self.ask(url, window_s).get(model, 0.0))
            except (httpx.HTTPError, ValueError, FabricError) as exc:
                log.info("no request log from %s: %s", sid[:8], exc)
                return None
        return total


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
