"""The controller's scaler: the demand rules, and above them the forecast policy.

Rules
-----
* **The demand rules** (``demand.DemandScaler``) as before: scale from zero on
  ``fabric.wanted`` labels, idle to zero after ``idle_to_zero``, else ``min_replicas``.
* **Following demand.** A model that may run more replicas than its rules' floor (``max_replicas
  > max(min_replicas, 1)``) has one ``policy.ForecastPolicy``, kept across passes and rebuilt
  when its ``ttft_p95`` objective or ``scale_in_hold`` changes (a new one, after a takeover too,
  counts its scale-in hold from the last scale-out Slurm shows: ``ForecastPolicy.resume``). Its
  target is the larger of the rules' and the policy's, with the reason of the one that set it
  (the policy's: ``forecast``, ``backlog``, ``load``, ``objective``, ``low-demand`` or
  ``bounds``, then what it saw). The policy runs between ``max(min_replicas, 1)`` and
  ``max_replicas``: going to zero stays the idle rule's, and while that rule says zero the
  policy is not asked.
* **What the policy is told**, each pass (``observe`` reads it; ``TtftWindow`` keeps the
  polls' TTFT histograms of the last ``window_s`` and gives their p95 once enough first tokens
  were seen, streams only: a JSON answer has no first token):

  - arrivals (requests, prompt tokens) and completions (output tokens) from the agents'
    request logs, polled once per forecast bin (``bin_s``) at the first pass of a new bin and
    fed as the bin that just ended, so each bin of the forecaster gets one poll. Requests are
    logged when they end, so they count as arrivals then;
  - the p95 TTFT of the last ``ttft_window_s`` of polls, when the service has a ``ttft_p95``
    objective (without one the policy never scales on latency);
  - the gossiped load of the model's SERVING replicas, and the requests the ingresses hold
    for it waiting for a replica (``observe.wanted_held``: the counts of their
    ``fabric.wanted`` labels), both backlog;
  - what the controller holds (``vocab.Fleet``: serving and starting units, the learned
    cold start) and the replica's capacity: the prior (``capacity``: the planner's for a
    catalog model on its first GPU type, or the GPU type its replicas run on; else
    ``DEFAULT_CAPACITY``) scaled by what the model's ``throughput.ThroughputLearner`` learned
    from its replicas seen saturated. The learner is fed the same load each pass and, per poll
    that counted every agent, the requests that ended since the previous such poll; it is kept
    when the policy is rebuilt for new knobs (a replica sustains what it did).
* A model that cannot go above its floor polls nothing and behaves as the rules say.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from fabricnode.elastic.capacity import DEFAULT_CAPACITY, catalog_capacity
from fabricnode.elastic.demand import DemandScaler
from fabricnode.elastic.observe import (
    AgentClient,
    CapacityOf,
    ModelSums,
    Poll,
    WorkloadClient,
    WorkloadPoller,
    agent_urls,
    capacity,
    load_sample,
    serving_gpu_type,
    wanted_held,
)
from fabricnode.elastic.policy import (
    Decision,
    ForecastPolicy,
    PolicyConfig,
    ReplicaCapacity,
    ReplicaState,
)
from fabricnode.elastic.throughput import LearnerConfig, ThroughputLearner
from fabricnode.elastic.vocab import Fleet, ModelPlan, Reason, Why
from fabricnode.mesh.core import MeshCore
from fabricnode.requestlog.ttft import ttft_quantile


def follows_demand(plan: ModelPlan) -> bool:
    """Can the model run more replicas than the demand rules' floor?"""
    return plan.service.max_replicas > max(plan.service.min_replicas, 1)


@dataclass
class TtftWindow:
    """The TTFT histograms of the polls of the last ``window_s``, and their p95."""

    window_s: float = 60.0
    min_samples: int = 20  # fewer first tokens than this: no p95 (one slow stream is no trend)
    _polls: deque[tuple[float, Mapping[int, int]]] = field(default_factory=deque)

    def add(self, now: float, histogram: Mapping[int, int]) -> None:
        if histogram:
            self._polls.append((now, histogram))
        while self._polls and self._polls[0][0] <= now - self.window_s:
            self._polls.popleft()

    def p95(self, now: float) -> float | None:
        merged: dict[int, int] = {}
        for at, histogram in self._polls:
            if at > now - self.window_s:
                for bucket, count in histogram.items():
                    merged[bucket] = merged.get(bucket, 0) + count
        if sum(merged.values()) < self.min_samples:
            return None
        return ttft_quantile(merged, 0.95)


@dataclass
class _Model:
    """One model's policy and what the scaler remembers for it."""

    knobs: tuple[float | None, float | None]  # the service's objective and scale-in hold
    policy: ForecastPolicy
    ttft: TtftWindow
    learner: ThroughputLearner  # what one replica sustains, from its saturated windows
    why: Why | None = None  # the reason of the policy's last change of count


@dataclass
class ForecastScaler:
    """The controller's ``Scaler`` (module docstring)."""

    core: MeshCore
    client: WorkloadClient = field(default_factory=lambda: AgentClient())
    rules: DemandScaler | None = None  # default: DemandScaler(core, client)
    poller: WorkloadPoller | None = None  # default: WorkloadPoller(client)
    config: PolicyConfig = field(default_factory=PolicyConfig)  # ttft objective per model
    ttft_window_s: float = 60.0
    ttft_min_samples: int = 20
    load_max_age_s: float = 30.0  # three of the agents' load refreshes
    history_s: float = 600.0  # the least of the logs' past a new controller replays
    capacity_of: CapacityOf = catalog_capacity
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    models: dict[str, _Model] = field(default_factory=dict)
    _fleet: Fleet = field(default_factory=Fleet)
    _capacities: dict[tuple[str, str, int], ReplicaCapacity | None] = field(default_factory=dict)
    _polled_bin: int | None = None
    _polled_at: float | None = None  # the last poll that counted every agent

    def __post_init__(self) -> None:
        if self.rules is None:
            self.rules = DemandScaler(self.core, self.client)
        if self.poller is None:
            self.poller = WorkloadPoller(self.client)

    @property
    def bin_s(self) -> float:
        return self.config.forecast.bin_s

    async def observe(self, plans: Sequence[ModelPlan], now: float, fleet: Fleet) -> None:
        assert self.rules is not None and self.poller is not None
        await self.rules.observe(plans, now, fleet)
        self._fleet = fleet
        following = [p for p in plans if follows_demand(p)]
        names = {p.model for p in following}
        for model in list(self.models):
            if model not in names:
                del self.models[model]
        fresh: list[ModelPlan] = []
        for plan in following:
            current = self.models.get(plan.model)
            if current is None:
                fresh.append(plan)
            if current is None or current.knobs != _knobs(plan):
                # what a replica sustains does not change with the knobs: the learner stays
                self.models[plan.model] = self._new_model(plan, current)
                held = fleet.held.get(plan.model)
                if held is not None and held.newest_at is not None:
                    # after a takeover the scale-in hold runs from the last scale-out
                    self.models[plan.model].policy.resume(min(now, held.newest_at))
        if not following:
            self._polled_bin = None
            self._polled_at = None
            return
        await self._capacities_of(following)
        b = math.floor(now / self.bin_s)
        if b != self._polled_bin:
            self._polled_bin = b
            # a controller that has just begun to act replays the logs' past (``_replay``):
            # the longest scale-in hold, and enough for the forecast, at most an hour
            holds = [self.models[p.model].policy.config.scale_in_hold_s for p in fresh]
            history_s = min(3600.0, max([self.history_s, *holds])) if fresh else 0.0
            poll = await self.poller.poll(agent_urls(self.core), now, (history_s, self.bin_s))
            if poll.history_from is not None:
                for plan in fresh:
                    self._replay(plan, poll, now)
            fed_at = b * self.bin_s - 1e-3  # in the bin that just ended
            since, self._polled_at = self._polled_at, now if poll.complete else None
            for plan in following:
                sums = poll.sums.get(plan.model)
                state = self.models[plan.model]
                state.ttft.add(now, sums.ttft if sums is not None else {})
                if since is not None and poll.complete:
                    # what ended since the last poll, for the replicas' throughput
                    served = sums or ModelSums()
                    state.learner.observe_served(
                        now, since, served.requests, served.prompt_tokens, served.output_tokens
                    )
                if sums is None:
                    continue
                state.policy.observe_arrivals(fed_at, sums.requests, sums.prompt_tokens_estimate)
                state.policy.observe_completions(fed_at, sums.output_known, sums.output_tokens)
        waiting = wanted_held(self.core)  # at the ingresses, for a replica
        for plan in following:
            state = self.models[plan.model]
            state.policy.observe_held(now, waiting.get(plan.model, 0))
            p95 = state.ttft.p95(now)
            if p95 is not None and plan.service.ttft_p95_s is not None:
                state.policy.observe_ttft(now, p95)
            load = load_sample(self.core, plan.model, now, self.load_max_age_s)
            if load is not None:
                state.policy.observe_load(now, load)
                state.learner.observe_load(now, load)

    def _replica_state(self, plan: ModelPlan, state: _Model) -> ReplicaState:
        held = self._fleet.held.get(plan.model)
        serving, starting = (held.serving, held.starting) if held is not None else (0, 0)
        return ReplicaState(
            replicas=serving + starting,
            starting=starting,
            min_replicas=max(plan.service.min_replicas, 1),
            max_replicas=plan.service.max_replicas,
            cold_start_s=self._fleet.cold_start_s.get(plan.model, 0.0),
            capacity=state.learner.capacity(self._capacity(plan)),
        )

    def _replay(self, plan: ModelPlan, poll: Poll, now: float) -> None:
        """A new policy (this controller has just begun to act) lives through the agents'
        request logs' recent past, bin by bin, as if it had been acting: its forecast starts
        from the demand the mesh saw, and the scale-in hold from needs it can show (the
        decisions are not acted on; the fleet is the one held now)."""
        assert poll.history_from is not None
        state = self.models[plan.model]
        replica_state = self._replica_state(plan, state)
        bins = dict(poll.history.get(plan.model, ()))
        t = math.ceil(poll.history_from / self.bin_s) * self.bin_s
        while t < now:
            sums = bins.get(t)
            if sums is not None:  # the bin now is in is fed too: the cursor is after it
                at = min(t + self.bin_s - 1e-3, now)
                state.policy.observe_arrivals(at, sums.requests, sums.prompt_tokens_estimate)
                state.policy.observe_completions(at, sums.output_known, sums.output_tokens)
            if t + self.bin_s <= now:
                state.policy.desired_replicas(t + self.bin_s, replica_state)
            t += self.bin_s

    def target(self, plan: ModelPlan, now: float) -> tuple[int, Why]:
        assert self.rules is not None
        floor, floor_why = self.rules.target(plan, now)
        state = self.models.get(plan.model)
        if state is None or floor == 0 or not follows_demand(plan):
            return floor, floor_why
        replica_state = self._replica_state(plan, state)
        decision = state.policy.desired_replicas(now, replica_state)
        if decision.reason:
            state.why = self._why(plan.model, state, decision, now, replica_state)
        if decision.replicas > floor or (
            decision.replicas == floor and decision.reason == "low-demand"
        ):
            why = state.why or Why(
                Reason.DEMAND,
                f"demand: {_replicas(decision.replicas)} held (the policy scales in after "
                f"{state.policy.config.scale_in_hold_s:g} s of low demand)",
            )
            return decision.replicas, why
        return floor, floor_why

    def idle_at(self, plan: ModelPlan, now: float) -> float | None:
        assert self.rules is not None
        return self.rules.idle_at(plan, now)

    def learned(self, plan: ModelPlan) -> dict[str, object]:
        """What one replica sustains: the planner's estimate for its GPU (``catalog``) until
        the learner has seen replicas saturated, then that scaled by what they did
        (``saturated``), with the evidence behind it."""
        state = self.models.get(plan.model)
        if state is None:
            return {}
        prior = self._capacity(plan)
        capacity = state.learner.capacity(prior)
        stats = state.learner.statistics()
        return {
            "replica_capacity": {
                "prefill_tokens_per_s": round(capacity.prefill_tokens_per_s, 1),
                "decode_tokens_per_s": round(capacity.decode_tokens_per_s, 1),
                "source": "catalog" if capacity == prior else "saturated",
                "saturated_windows": stats.windows,
                "saturated_replica_s": round(stats.replica_s, 1),
            }
        }

    def _new_model(self, plan: ModelPlan, current: _Model | None = None) -> _Model:
        config = self.config
        objective_s = plan.service.ttft_p95_s
        if objective_s is not None:
            config = replace(config, ttft_objective_s=objective_s)
        if plan.service.scale_in_hold_s is not None:
            config = replace(config, scale_in_hold_s=plan.service.scale_in_hold_s)
        return _Model(
            _knobs(plan),
            ForecastPolicy(config),
            TtftWindow(self.ttft_window_s, self.ttft_min_samples),
            current.learner if current is not None else ThroughputLearner(self.learner),
        )

    def _capacity_key(self, plan: ModelPlan) -> tuple[str, str, int]:
        service = plan.service
        gpu = service.gpu_types[0] if service.gpu_types else serving_gpu_type(self.core, plan.model)
        return (service.model_path or plan.model, gpu, plan.gpus)

    async def _capacities_of(self, plans: Sequence[ModelPlan]) -> None:
        """The planner's capacities not yet known (in a worker thread: a model path's
        config.json is read from disk)."""
        keys = {self._capacity_key(p) for p in plans} - set(self._capacities)
        for key in keys:
            if not key[1]:
                self._capacities[key] = None  # no GPU type yet: the default until one serves
                continue
            self._capacities[key] = await capacity(self.capacity_of, key)

    def _capacity(self, plan: ModelPlan) -> ReplicaCapacity:
        return self._capacities.get(self._capacity_key(plan)) or DEFAULT_CAPACITY

    def _why(
        self, model: str, state: _Model, decision: Decision, now: float, rs: ReplicaState
    ) -> Why:
        """The decision's reason and what the policy saw, for the decision log."""
        reason = Reason(decision.reason)  # the policy's REASONS are Reason's values
        return Why(reason, self._saw(reason, model, state, decision, now, rs))

    def _saw(
        self,
        reason: Reason,
        model: str,
        state: _Model,
        decision: Decision,
        now: float,
        rs: ReplicaState,
    ) -> str:
        n = _replicas(decision.replicas)
        cfg = state.policy.config
        if reason is Reason.FORECAST:
            return f"forecast: {n} for the demand expected in {rs.cold_start_s:.0f} s"
        if reason is Reason.BACKLOG:
            load = load_sample(self.core, model, now, self.load_max_age_s)
            waiting = sum(load.waiting) if load is not None else 0
            return (
                f"backlog: {n}, {waiting} requests waiting, more than the serving replicas "
                f"drain before a new one arrives in {rs.cold_start_s:.0f} s"
            )
        if reason is Reason.OBJECTIVE:
            p95 = state.ttft.p95(now)
            seen = f"{p95:.2f} s" if p95 is not None else "measured"
            return f"objective: {n}, p95 TTFT {seen} over {cfg.ttft_objective_s:g} s"
        if reason is Reason.LOAD:
            load = load_sample(self.core, model, now, self.load_max_age_s)
            if load is None:
                return f"load: {n}"
            return (
                f"load: {n}, KV caches {load.mean_kv_usage:.0%} used, "
                f"{load.waiting_per_replica:.1f} requests waiting per replica"
            )
        if reason is Reason.LOW_DEMAND:
            return f"low-demand: {n}, demand low for {cfg.scale_in_hold_s:g} s"
        return f"{decision.reason}: {n}"


def _knobs(plan: ModelPlan) -> tuple[float | None, float | None]:
    """What of the service a model's policy is built with (a change rebuilds it)."""
    return (plan.service.ttft_p95_s, plan.service.scale_in_hold_s)


def _replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"
