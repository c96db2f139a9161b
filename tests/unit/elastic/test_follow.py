"""The controller's scaler above the minimum, on the pure mesh core with fake request logs: a
rising demand scales out on the forecast, a falling one scales in only after the hold, an agent
that does not answer changes nothing, an idle model still goes to zero; and through the
controller, the policy's reason is the decision's."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import pytest
import trio

from fabricnode.elastic.controller import Controller
from fabricnode.elastic.demand import DemandScaler
from fabricnode.elastic.follow import ForecastScaler, TtftWindow, follows_demand
from fabricnode.elastic.observe import History, ModelSums
from fabricnode.elastic.policy import REASONS, ReplicaCapacity
from fabricnode.elastic.slurmctl import SlurmControl
from fabricnode.elastic.vocab import Fleet, Held, ModelPlan, Reason, ServicePlans
from fabricnode.mesh.core import MeshConfig
from fabricnode.mesh.identity import Identity, OperatorKey
from fabricnode.mesh.registry import State
from fabricnode.mesh.schema import WANTED_LABEL
from fabricnode.mesh.wire import Load
from fabricnode.testing.simnet import SimNetwork
from tests.unit.elastic.plans import plan as model_plan
from tests.unit.elastic.test_controller import MESH, FakeSlurm, announce, apply

OPERATOR = OperatorKey(Identity.from_seed(b"o" * 32))
CAPACITY = ReplicaCapacity(prefill_tokens_per_s=2000.0, decode_tokens_per_s=200.0)
PROMPT, OUTPUT = 1000, 20  # tokens of every request of the fake traffic
COLD_START_S = 30.0
STEP_S = 2.0  # the controller's pass
HOT = model_plan("hot", 1, 4, ttft_p95_s=2.0, gpu_types=("A100-80G",))


def mesh(n: int = 3) -> SimNetwork:
    net = SimNetwork(config=MeshConfig(trusted_operators=(OPERATOR.fingerprint,)), seed=9)
    first = net.add_node(0)
    for i in range(1, n):
        net.add_node(i, seeds=[first.addr])
    net.run_for(10)
    for i, node in enumerate(net.nodes.values()):  # simulated nodes have no HTTP address
        body = node.core.self_entry.body
        addresses = dataclasses.replace(body.addresses, http=f"http://10.0.0.{i}:8080")
        node.core.update_self(net.wall, addresses=addresses)
        net.poke(node)
    net.run_for(3)
    return net


class Logs:
    """Every agent's request log as lists of requests; a cursor is a position in one (the
    agents' workload endpoint, ``observe.WorkloadClient``)."""

    def __init__(self, urls: Sequence[str], created: float = 0.0) -> None:
        self.created = created  # the logs hold every request from here on
        # per agent: (ended at, model, prompt tokens, output tokens)
        self.logged: dict[str, list[tuple[float, str, int, int]]] = {u: [] for u in urls}
        self.down: set[str] = set()
        self.asked = 0
        self.now = 0.0

    def requests(self, model: str, per_agent: int, now: float) -> None:
        self.now = now
        for entries in self.logged.values():
            entries.extend([(now, model, PROMPT, OUTPUT)] * per_agent)

    def after(self, url: str, cursor: str) -> tuple[str, Mapping[str, ModelSums]]:
        self.asked += 1
        if url in self.down:
            raise httpx.ConnectError("refused")
        entries = self.logged[url]
        start = len(entries) if cursor == "end" else int(cursor.split(":")[1])
        sums: dict[str, ModelSums] = {}
        for _, model, prompt, output in entries[start:]:
            sums[model] = sums.get(model, ModelSums()) + ModelSums(1, prompt, 1, output, 1)
        return f"0:{len(entries)}", sums

    def history(self, url: str, history_s: float, bin_s: float) -> History:
        """``GET /fabric/v1/workload?history=&bin=``: the sums by bin, aligned as the agent
        aligns them; each log complete from when it was created."""
        self.asked += 1
        if url in self.down:
            raise httpx.ConnectError("refused")
        entries = self.logged[url]
        start = math.floor((self.now - history_s) / bin_s) * bin_s
        bins: dict[float, dict[str, ModelSums]] = {}
        for t, model, prompt, output in entries:
            if t >= start:
                row = bins.setdefault(start + (t - start) // bin_s * bin_s, {})
                row[model] = row.get(model, ModelSums()) + ModelSums(1, prompt, 1, output, 1)
        return History(f"0:{len(entries)}", self.created, sorted(bins.items()))

    def requests_in(self, url: str, window_s: float) -> Mapping[str, float]:
        """The demand rules' idleness check (``GET /fabric/v1/workload?window=``)."""
        if url in self.down:
            raise httpx.ConnectError("refused")
        return {}


class Replicas:
    """The controller's side: it holds what the scaler asks for, replicas starting for
    ``COLD_START_S`` before they serve."""

    def __init__(self, serving: int) -> None:
        self.ready_at = [0.0] * serving

    def fleet(self, model: str, now: float) -> Fleet:
        serving = sum(1 for t in self.ready_at if t <= now)
        held = Held(serving, len(self.ready_at) - serving)
        return Fleet({model: held}, {model: COLD_START_S})

    def apply(self, target: int, now: float) -> None:
        while len(self.ready_at) < target:
            self.ready_at.append(now + COLD_START_S)
        self.ready_at = sorted(self.ready_at)[:target]  # the newest (starting) ones go first


def scaler_for(net: SimNetwork, logs: Logs) -> ForecastScaler:
    core = next(iter(net.nodes.values())).core
    return ForecastScaler(
        core,
        client=logs,
        rules=DemandScaler(core, logs, check_interval_s=10.0),
        capacity_of=lambda model, gpu, gpus: CAPACITY,
    )


class Run:
    def __init__(self, plan: ModelPlan, serving: int, n: int = 3) -> None:
        self.net = mesh(n)
        self.urls = [node.core.self_entry.body.addresses.http for node in self.net.nodes.values()]
        self.now = 1000.0
        self.logs = Logs(self.urls, created=self.now)  # the traffic starts with the run
        self.scaler = scaler_for(self.net, self.logs)
        self.plan = plan
        self.replicas = Replicas(serving)
        self.history: list[tuple[float, int, str]] = []

    def step(self, per_agent: int) -> tuple[int, str]:
        """One pass: the traffic of the last ``STEP_S`` is logged, then the scaler decides and
        the controller applies the target (clamped, as the controller does)."""
        self.now += STEP_S
        self.logs.requests(self.plan.model, per_agent, self.now)
        fleet = self.replicas.fleet(self.plan.model, self.now)
        trio.run(self.scaler.observe, [self.plan], self.now, fleet)
        want, why = self.scaler.target(self.plan, self.now)
        service = self.plan.service
        target = max(service.min_replicas, min(service.max_replicas, want))
        self.replicas.apply(target, self.now)
        self.history.append((self.now, target, why.text))
        return target, why.text

    def run(self, seconds: float, per_agent: int) -> list[tuple[float, int, str]]:
        start = len(self.history)
        for _ in range(round(seconds / STEP_S)):
            self.step(per_agent)
        return self.history[start:]


# 3 agents x 1 request of 1000 prompt / 20 output tokens per 2 s: 1,500 prompt and 30 output
# tokens/s, 0.9 of a replica's work: 2 replicas at 70%. Two per agent: 3 replicas; none: 1.


def test_rising_demand_scales_out_on_the_forecast() -> None:
    run = Run(HOT, serving=1)
    quiet = run.run(60, per_agent=0)
    assert {target for _, target, _ in quiet} == {1}
    assert quiet[-1][2] == "min replicas"
    ramp = run.run(120, per_agent=1) + run.run(120, per_agent=2)
    outs = [(at, t, why) for (at, t, why), (_, before, _) in zip(ramp[1:], ramp, strict=False)
            if t > before]  # fmt: skip
    assert outs, "the demand tripled and nothing scaled out"
    assert all(why.startswith("forecast: ") for _, _, why in outs)
    assert ramp[-1][1] >= 3  # (the trend and the headroom may ask for one more)
    assert "in 30 s" in outs[0][2]  # the horizon is the controller's cold start


def test_falling_demand_scales_in_only_after_the_hold() -> None:
    run = Run(HOT, serving=3)
    busy = run.run(240, per_agent=2)
    assert busy[-1][1] == 3
    drop = run.now
    hold = run.scaler.config.scale_in_hold_s
    quiet = run.run(hold + 60, per_agent=0)
    first_in = next((at, t, why) for at, t, why in quiet if t < 3)
    assert first_in[0] >= drop + hold  # no scale-in within the hold of the last busy bin
    assert first_in[2].startswith("low-demand: ")
    assert quiet[-1][1] == 1


def test_an_agent_that_does_not_answer_changes_nothing() -> None:
    run = Run(HOT, serving=2)
    steady = run.run(240, per_agent=1)
    assert {t for _, t, _ in steady[-30:]} == {2}
    run.logs.down.add(run.urls[1])
    missing = run.run(30, per_agent=1)  # its share is not seen for three polls...
    run.logs.down.clear()
    back = run.run(60, per_agent=1)  # ...then counted at once, none lost or twice
    assert {t for _, t, _ in missing + back} == {2}
    demand = run.scaler.models["hot"].policy.forecaster.forecast(run.now, 0.0).now
    assert demand.prefill_tokens_per_s == pytest.approx(1500, rel=0.05)  # what was logged


def test_an_idle_model_allowed_zero_still_goes_to_zero() -> None:
    cold = model_plan("cold", 0, 3, idle_to_zero_s=60.0)
    assert follows_demand(cold) and not follows_demand(model_plan("one", 0, 1))
    run = Run(cold, serving=0)
    node = list(run.net.nodes.values())[2]
    node.core.update_self(run.net.wall, labels=((WANTED_LABEL, "cold"),))
    run.net.poke(node)
    run.net.run_for(3)
    assert run.step(0) == (1, "scale from zero: requests waiting")
    node.core.update_self(run.net.wall, labels=())
    run.net.poke(node)
    run.net.run_for(3)
    after = run.run(120, per_agent=0)
    assert after[0][1:] == (1, "active recently")
    assert after[-1][1:] == (0, "idle for 60 s")
    gone = next(at for at, t, _ in after if t == 0)
    assert gone - after[0][0] < 70  # at its idle time, not held up by the policy's hold


def test_a_model_without_room_above_its_floor_polls_nothing() -> None:
    plan = model_plan("fixed", 2, 2)
    run = Run(plan, serving=2)
    assert run.run(30, per_agent=3)[-1][1:] == (2, "min replicas")
    assert run.logs.asked == 0 and run.scaler.models == {}


def test_load_and_ttft_reach_the_policy() -> None:
    """The gossiped load of the model's serving replicas and the logs' p95 TTFT are what
    the policy confirms a scale-out with (``load``, ``objective``)."""
    run = Run(HOT, serving=1)
    run.run(40, per_agent=0)
    core = run.scaler.core
    for node in run.net.nodes.values():  # each agent serves the model, its KV cache full
        sid = node.core.self_id
        labels = (("fabric.service", "hot"), ("slurm.job_id", sid[:6]))
        node.core.update_self(run.net.wall, state=State.SERVING, labels=labels)
        run.net.poke(node)
        core.loads[sid] = Load(sid, 1, 3, 8, 0.97, 11, run.now + STEP_S)
    run.net.run_for(3)
    target, why = run.step(0)
    assert (target, why.split(":")[0]) == (2, "load")
    assert "97% used" in why
    window = TtftWindow(60.0, min_samples=3)
    window.add(0.0, {100: 2})
    assert window.p95(1.0) is None  # too few first tokens
    window.add(10.0, {10: 1})
    p95 = window.p95(11.0)
    assert p95 is not None and p95 > 2.0
    assert window.p95(65.0) is None  # the slow ones left the window


def test_saturated_replicas_teach_the_scaler_what_a_replica_sustains() -> None:
    """The planner's capacity is ten times what the replica does (a slowed engine): the one
    replica always has a queue and ends 1.5 requests/s (0.09 of the prior's work). The learner
    takes its throughput for the capacity, and the policy sizes by it, where the prior said one
    is plenty."""
    run = Run(HOT, serving=1)
    prior = ReplicaCapacity(prefill_tokens_per_s=20_000.0, decode_tokens_per_s=2_000.0)
    run.scaler.capacity_of = lambda model, gpu, gpus: prior
    assert run.scaler.learned(run.plan) == {}  # nothing polled yet
    core = run.scaler.core
    node = next(iter(run.net.nodes.values()))
    labels = (("fabric.service", "hot"), ("slurm.job_id", "job1"))
    node.core.update_self(run.net.wall, state=State.SERVING, labels=labels)
    run.net.poke(node)
    run.net.run_for(3)
    sid = node.core.self_id
    queue = 4
    for i in range(40):  # 80 s: the queue at the replica grows by one request every 2 s
        core.loads[sid] = Load(sid, i, queue + i, 8, 0.5, 12, run.now + STEP_S)
        run.step(per_agent=1)
    state = run.scaler.models["hot"]
    factor = state.learner.factor(prior)
    assert factor == pytest.approx((1500 / 20_000 + 30 / 2_000), rel=0.1)
    assert state.learner.statistics().windows >= 5
    learned = state.learner.capacity(prior)
    assert learned.decode_tokens_per_s == pytest.approx(2_000 * factor)
    assert run.history[-1][1] == 4  # the need at what a replica does: the maximum
    shown = run.scaler.learned(run.plan)["replica_capacity"]  # as `fabric services --json` shows
    assert isinstance(shown, dict) and shown["source"] == "saturated"
    assert shown["decode_tokens_per_s"] == pytest.approx(2_000 * factor, abs=0.1)
    assert shown["saturated_windows"] == state.learner.statistics().windows


def test_malformed_workload_answers_are_refused() -> None:
    ok = {"requests": 2, "prompt_tokens": 10, "prompt_known": 1, "ttft": {"3": 2}}
    assert ModelSums.from_json(ok) == ModelSums(2, 10, 1, 0, 0, {3: 2})
    bad: list[object] = [
        [],
        {"requests": -1},
        {"requests": True},
        {"requests": 1.5},
        {"ttft": {"x": 1}},
        {"ttft": {"999": 1}},
        {"ttft": {"1": -2}},
    ]
    for row in bad:
        with pytest.raises(ValueError):
            ModelSums.from_json(row)
    sums = ModelSums(4, 300, 3, 0, 0)
    assert sums.prompt_tokens_estimate == 400  # the unknown prompt counted at the known mean


PLANS = {
    "follow": ServicePlans(
        (model_plan("m", 1, 3, partitions=("gpu",), time_limit_s=120, gpu_types=("A100-80G",)),),
        digest="follow",
    )
}


def parse(text: str) -> ServicePlans:
    return PLANS[text]


def test_the_controller_logs_and_counts_the_policys_reason() -> None:
    run = Run(HOT, serving=1)
    node = next(iter(run.net.nodes.values()))
    slurm = FakeSlurm()
    clock = [run.net.wall]
    ctl = Controller(
        node.core,
        SlurmControl(MESH, Path("/x.sbatch"), "me", slurm, False),
        parse,
        lambda labels: None,
        scaler=run.scaler,
        wall_clock=lambda: clock[0],
    )
    announce(run.net, ctl, node, 1.0)
    apply(run.net, node, "follow")
    clock[0] = run.logs.created = run.net.wall  # the traffic starts with the controller

    async def passes(n: int, per_agent: int) -> None:
        for _ in range(n):
            clock[0] += STEP_S
            run.logs.requests("m", per_agent, clock[0])
            await ctl.tick()

    trio.run(passes, 60, 2)
    reasons = [d.reason for d in ctl.recent if d.action == "submit"]
    assert reasons[0].startswith("min replicas")
    assert any(r.startswith("forecast: ") for r in reasons), reasons
    assert ctl.decisions[("submit", "forecast")] >= 1
    (status,) = ctl.status.models
    assert status.target > 1 and status.reason.startswith("forecast: ")
    assert status.to_json()["reason"] == status.reason


def test_every_reason_of_the_policy_is_a_reason_of_the_controller() -> None:
    """The scaler turns the policy's reason into ``Reason(decision.reason)``: every one the
    policy may give must be there, with the same words (they are the metric's labels)."""
    assert {Reason(r).label for r in REASONS} == set(REASONS)


def takeover(run: Run, last_scale_out_s: float) -> None:
    """The acting controller dies: a new scaler on the same mesh and logs, the fleet showing
    the model's last scale-out ``last_scale_out_s`` ago (Slurm's submit time)."""
    held_by = run.replicas.fleet

    def fleet(model: str, now: float) -> Fleet:
        f = held_by(model, now)
        h = f.held[model]
        newest = Held(h.serving, h.starting, newest_at=now - last_scale_out_s)
        return Fleet({model: newest}, f.cold_start_s)

    run.replicas.fleet = fleet  # type: ignore[method-assign]
    run.scaler = scaler_for(run.net, run.logs)


def test_a_takeover_under_steady_load_keeps_the_replicas_the_load_needs() -> None:
    """Steady load that needs three replicas for 15 min; the last scale-out 20 min ago. The new
    controller replays the request logs' last ten minutes: it neither scales in on a demand it
    has not seen (before the replay it went to one at its first pass, then back up to four)
    nor asks for more."""
    run = Run(HOT, serving=1)
    run.run(900, per_agent=2)
    assert run.history[-1][1] == 3
    takeover(run, last_scale_out_s=1200)
    after = run.run(120, per_agent=2)
    assert {target for _, target, _ in after} == {3}, after[:5]


def test_a_takeover_keeps_the_scale_in_hold_it_has_evidence_for() -> None:
    """The load falls 200 s before the takeover: the new controller scales in 100 s after it,
    when the first controller would have (the hold's 300 s of low needs, seen in the replayed
    logs), not 300 s after it (a restarted hold) nor at once."""
    run = Run(HOT, serving=1)
    run.run(900, per_agent=2)
    run.run(200, per_agent=0)
    assert run.history[-1][1] == 3
    takeover(run, last_scale_out_s=1200)
    took_over = run.now
    after = run.run(240, per_agent=0)
    first_in = next(at for at, target, _ in after if target < 3)
    assert 90 <= first_in - took_over <= 120, after


def test_without_every_agents_history_a_takeover_restarts_the_hold() -> None:
    """One agent's log does not answer the history: no replay (its requests would read as no
    demand), and the hold runs from the new controller's first decision."""
    run = Run(HOT, serving=1)
    run.run(900, per_agent=2)
    takeover(run, last_scale_out_s=1200)
    run.logs.down.add(run.urls[0])
    after = run.run(60, per_agent=2)
    assert {target for _, target, _ in after} == {3}, after[:5]
