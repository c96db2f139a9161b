"""The controller's scaler: the demand rules, and above them the forecast policy.

Rules
-----
* **The demand rules** (``demand.DemandScaler``) as before: scale from zero on
  ``fabric.wanted`` labels, idle to zero after ``idle_to_zero``, else ``min_replicas``.
* **Following demand.** A model that may run more replicas than its rules' floor
  (``max_replicas > max(min_replicas, 1)``) has one ``policy.ForecastPolicy``, kept across
  passes and rebuilt when its ``ttft_p95`` objective changes. Its target is the larger of the
  rules' and the policy's, with the reason of the one that set it (the policy's: ``forecast``,
  ``load``, ``objective``, ``low-demand`` or ``bounds``, then what it saw). The policy runs
  between ``max(min_replicas, 1)`` and ``max_replicas``: going to zero stays the idle rule's,
  and while that rule says zero the policy is not asked.
* **What the policy is told**, each pass (``signals`` gathers it):

  - arrivals (requests, prompt tokens) and completions (output tokens) from the agents'
    request logs, polled once per forecast bin (``bin_s``) at the first pass of a new bin and
    fed as the bin that just ended, so each bin of the forecaster gets one poll. Requests are
    logged when they end, so they count as arrivals then;
  - the p95 TTFT of the last ``ttft_window_s`` of polls, when the service has a ``ttft_p95``
    objective (without one the policy never scales on latency);
  - the gossiped load of the model's SERVING replicas;
  - what the controller holds (``controller.Fleet``: serving and starting units, the learned
    cold start) and the replica's capacity (``capacity``: the planner's for a catalog model
    on its first GPU type, or the GPU type its replicas run on; else ``DEFAULT_CAPACITY``).
* A model that cannot go above its floor polls nothing and behaves as the rules say.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import trio

from fabricnode.elastic.capacity import DEFAULT_CAPACITY, catalog_capacity
from fabricnode.elastic.controller import Fleet, ModelPlan
from fabricnode.elastic.demand import DemandScaler
from fabricnode.elastic.policy import (
    Decision,
    ForecastPolicy,
    PolicyConfig,
    ReplicaCapacity,
    ReplicaState,
)
from fabricnode.elastic.signals import TtftWindow, WorkloadPoller, agent_urls, load_sample
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.registry import State
from fabricnode.mesh.schema import SERVICE_LABEL

# (model or model path, GPU type, GPUs per replica) -> the planner's capacity, or None
CapacityOf = Callable[[str, str, int], ReplicaCapacity | None]


def follows_demand(plan: ModelPlan) -> bool:
    """Can the model run more replicas than the demand rules' floor?"""
    return plan.max_replicas > max(plan.min_replicas, 1)


@dataclass
class _Model:
    """One model's policy and what the scaler remembers for it."""

    objective_s: float | None
    policy: ForecastPolicy
    ttft: TtftWindow
    why: str = ""  # the reason of the policy's last change of count


@dataclass
class ForecastScaler:
    """The controller's ``Scaler`` (module docstring)."""

    core: MeshCore
    rules: DemandScaler | None = None  # default: DemandScaler(core)
    poller: WorkloadPoller = field(default_factory=WorkloadPoller)
    config: PolicyConfig = field(default_factory=PolicyConfig)  # ttft objective per model
    ttft_window_s: float = 60.0
    ttft_min_samples: int = 20
    load_max_age_s: float = 30.0  # three of the agents' load refreshes
    capacity_of: CapacityOf = catalog_capacity
    models: dict[str, _Model] = field(default_factory=dict)
    _fleet: Fleet = field(default_factory=Fleet)
    _capacities: dict[tuple[str, str, int], ReplicaCapacity | None] = field(default_factory=dict)
    _polled_bin: int | None = None

    def __post_init__(self) -> None:
        if self.rules is None:
            self.rules = DemandScaler(self.core)

    @property
    def bin_s(self) -> float:
        return self.config.forecast.bin_s

    async def observe(self, plans: Sequence[ModelPlan], now: float, fleet: Fleet) -> None:
        assert self.rules is not None
        await self.rules.observe(plans, now, fleet)
        self._fleet = fleet
        following = [p for p in plans if follows_demand(p)]
        names = {p.model for p in following}
        for model in list(self.models):
            if model not in names:
                del self.models[model]
        for plan in following:
            current = self.models.get(plan.model)
            if current is None or current.objective_s != plan.ttft_p95_s:
                self.models[plan.model] = self._new_model(plan)
        if not following:
            self._polled_bin = None
            return
        await self._capacities_of(following)
        b = math.floor(now / self.bin_s)
        if b != self._polled_bin:
            self._polled_bin = b
            poll = await self.poller.poll(agent_urls(self.core), now)
            fed_at = b * self.bin_s - 1e-3  # in the bin that just ended
            for plan in following:
                sums = poll.sums.get(plan.model)
                state = self.models[plan.model]
                state.ttft.add(now, sums.ttft if sums is not None else {})
                if sums is None:
                    continue
                state.policy.observe_arrivals(fed_at, sums.requests, sums.prompt_tokens_estimate)
                state.policy.observe_completions(fed_at, sums.output_known, sums.output_tokens)
        for plan in following:
            state = self.models[plan.model]
            p95 = state.ttft.p95(now)
            if p95 is not None and plan.ttft_p95_s is not None:
                state.policy.observe_ttft(now, p95)
            load = load_sample(self.core, plan.model, now, self.load_max_age_s)
            if load is not None:
                state.policy.observe_load(now, load)

    def target(self, plan: ModelPlan, now: float) -> tuple[int, str]:
        assert self.rules is not None
        floor, floor_why = self.rules.target(plan, now)
        state = self.models.get(plan.model)
        if state is None or floor == 0 or not follows_demand(plan):
            return floor, floor_why
        held = self._fleet.held.get(plan.model)
        serving, starting = (held.serving, held.starting) if held is not None else (0, 0)
        cold_start_s = self._fleet.cold_start_s.get(plan.model, 0.0)
        replica_state = ReplicaState(
            replicas=serving + starting,
            starting=starting,
            min_replicas=max(plan.min_replicas, 1),
            max_replicas=plan.max_replicas,
            cold_start_s=cold_start_s,
            capacity=self._capacity(plan),
        )
        decision = state.policy.desired_replicas(now, replica_state)
        if decision.reason:
            state.why = self._why(plan.model, state, decision, now, replica_state)
        if decision.replicas > floor or (
            decision.replicas == floor and decision.reason == "low-demand"
        ):
            why = state.why or (
                f"demand: {_replicas(decision.replicas)} held (the policy scales in after "
                f"{state.policy.config.scale_in_hold_s:g} s of low demand)"
            )
            return decision.replicas, why
        return floor, floor_why

    def _new_model(self, plan: ModelPlan) -> _Model:
        config = self.config
        if plan.ttft_p95_s is not None:
            config = replace(config, ttft_objective_s=plan.ttft_p95_s)
        return _Model(
            plan.ttft_p95_s,
            ForecastPolicy(config),
            TtftWindow(self.ttft_window_s, self.ttft_min_samples),
        )

    def _capacity_key(self, plan: ModelPlan) -> tuple[str, str, int]:
        gpu = plan.gpu_types[0] if plan.gpu_types else self._serving_gpu_type(plan.model)
        return (plan.model_path or plan.model, gpu, plan.gpus)

    def _serving_gpu_type(self, model: str) -> str:
        for entry in self.core.registry:
            body = entry.body
            if body.state == State.SERVING and (SERVICE_LABEL, model) in body.labels:
                return body.hardware.gpu_type or ""
        return ""

    async def _capacities_of(self, plans: Sequence[ModelPlan]) -> None:
        """The planner's capacities not yet known (in a worker thread: a model path's
        config.json is read from disk)."""
        keys = {self._capacity_key(p) for p in plans} - set(self._capacities)
        for key in keys:
            if not key[1]:
                self._capacities[key] = None  # no GPU type yet: the default until one serves
                continue
            self._capacities[key] = await trio.to_thread.run_sync(self.capacity_of, *key)

    def _capacity(self, plan: ModelPlan) -> ReplicaCapacity:
        return self._capacities.get(self._capacity_key(plan)) or DEFAULT_CAPACITY

    def _why(
        self, model: str, state: _Model, decision: Decision, now: float, rs: ReplicaState
    ) -> str:
        """The decision's reason and what the policy saw, for the decision log."""
        n = _replicas(decision.replicas)
        cfg = state.policy.config
        if decision.reason == "forecast":
            return f"forecast: {n} for the demand expected in {rs.cold_start_s:.0f} s"
        if decision.reason == "objective":
            p95 = state.ttft.p95(now)
            seen = f"{p95:.2f} s" if p95 is not None else "measured"
            return f"objective: {n}, p95 TTFT {seen} over {cfg.ttft_objective_s:g} s"
        if decision.reason == "load":
            load = load_sample(self.core, model, now, self.load_max_age_s)
            if load is None:
                return f"load: {n}"
            return (
                f"load: {n}, KV caches {load.mean_kv_usage:.0%} used, "
                f"{load.waiting_per_replica:.1f} requests waiting per replica"
            )
        if decision.reason == "low-demand":
            return f"low-demand: {n}, demand low for {cfg.scale_in_hold_s:g} s"
        return f"{decision.reason}: {n}"


def _replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"
