"""The simulated engine's priority scheduling (vLLM's ``--scheduling-policy priority``): the
waiting queue by (priority, arrival), the preemption victim, the ``priority`` request field on
the HTTP endpoints, and first come, first served left as it was."""

from __future__ import annotations

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from fabricnode.simengine.__main__ import build_parser, config_from_args
from fabricnode.simengine.model import SCHEDULING_POLICIES, Scheduler, Step, run_until_idle
from fabricnode.simengine.server import EngineDriver, SimConfig, SimEngineApp
from tests.unit.simengine.test_model import TokenLog, check_accounting, config, drive, prompt


def admission_order(steps: list[Step]) -> list[int]:
    return [rid for step in steps for rid in step.admitted]


def test_first_come_first_served_refuses_a_non_zero_priority_as_vllm_does() -> None:
    s = Scheduler(config())
    with pytest.raises(ValueError, match=r"^Got priority 3 but Priority scheduling is not enabled"):
        s.submit(prompt(32), 4, 0.0, priority=3)
    s.submit(prompt(32), 4, 0.0, priority=0)  # the default is always accepted
    assert s.statistics().requests_by_priority == ((0, 1),)


def test_unknown_scheduling_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        config(scheduling_policy="sjf")


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    # One request runs at a time: the admission order is the waiting queue's order.
    s = Scheduler(config(scheduling_policy="priority", max_num_seqs=1))
    first = s.submit(prompt(32, 0), 2, 0.0, priority=5)  # alone: admitted at the first step
    step = s.step(0.0)
    assert step is not None and step.admitted == (first,)
    late_low = s.submit(prompt(32, 100), 2, 0.1, priority=1)
    batch = s.submit(prompt(32, 200), 2, 0.2, priority=1)
    urgent = s.submit(prompt(32, 300), 2, 0.3, priority=-2)
    normal = s.submit(prompt(32, 400), 2, 0.4)
    again = s.submit(prompt(32, 500), 2, 0.5, priority=1)
    assert [r.id for r in s.waiting] == [urgent, normal, late_low, batch, again]
    _, steps = drive(s, step.ends_at)
    assert admission_order(steps) == [urgent, normal, late_low, batch, again]
    assert s.statistics().requests_by_priority == ((-2, 1), (0, 1), (1, 3), (5, 1))


def _preemption_scenario(policy: str, priorities: tuple[int, int, int]) -> tuple[list[int], ...]:
    """a (320-token prompt), b and c (64 each) admitted in that order into 40 blocks, then
    decoded until their growth no longer fits: the ids, and the requests preempted in order."""
    s = Scheduler(config(kv_tokens=640, scheduling_policy=policy))
    log = TokenLog(s)
    now = 0.0
    order = []
    for (n, base), priority in zip(((320, 0), (64, 5000), (64, 9000)), priorities, strict=True):
        rid = s.submit(prompt(n, base), 200, now, priority=priority)
        log.keys[rid], log.max_tokens[rid], log.tokens[rid] = s.requests[rid].prompt_key, 200, []
        order.append(rid)
        step = s.step(now)
        assert step is not None and step.admitted == (rid,)
        log.record(step)
        now = step.ends_at
    preempted: list[int] = []
    while (step := s.step(now)) is not None:
        log.record(step)
        preempted.extend(step.preempted)
        now = step.ends_at
        check_accounting(s)
    log.check_all_finished()
    return order, preempted


def test_the_lowest_priority_running_request_is_preempted_first() -> None:
    # Under fcfs c, the newest, goes first; with b at a lower priority (a higher value), b goes
    # first although c was admitted after it.
    (_, b, c), fcfs = _preemption_scenario("fcfs", (0, 0, 0))
    assert fcfs[:2] == [c, b]
    (_, b, c), by_priority = _preemption_scenario("priority", (0, 5, 0))
    assert by_priority == [b, c]  # a, of the highest priority and the oldest, runs on


def test_among_equal_priorities_the_most_recently_admitted_is_preempted() -> None:
    (a, b, c), preempted = _preemption_scenario("priority", (3, 0, 3))
    # a and c share the lowest priority: c, admitted last, goes first, then a, the oldest of
    # all, before b, the only one of the highest priority.
    assert preempted[:2] == [c, a]
    assert b not in preempted


def test_a_preempted_request_waits_at_its_priority_place_not_at_the_head() -> None:
    # 32 blocks: a and b (11 blocks each at admission) outgrow the cache at 96 tokens, and b is
    # preempted; meanwhile a more urgent request arrived, and stays ahead of b in the queue.
    s = Scheduler(config(kv_tokens=512, scheduling_policy="priority", max_num_seqs=2))
    a = s.submit(prompt(160, 0), 200, 0.0, priority=1)
    b = s.submit(prompt(160, 5000), 200, 0.0, priority=1)
    now = 0.0
    urgent = -1
    while True:
        step = s.step(now)
        assert step is not None
        now = step.ends_at
        if urgent < 0:  # waits: two run already (max_num_seqs)
            urgent = s.submit(prompt(16, 7000), 4, now, priority=0)
        if step.preempted:
            break
    assert step.preempted == (b,)
    assert [r.id for r in s.waiting] == [urgent, b]
    assert list(s.running) == [a]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 200), st.floats(0, 2)),
        min_size=1,
        max_size=25,
    ),
    st.integers(400, 2000),
)
def test_with_every_priority_zero_both_policies_schedule_identically(
    shape: list[tuple[int, int, float]], kv_tokens: int
) -> None:
    """Priority scheduling generalises first come, first served: with equal priorities the two
    policies take the same steps (the same admissions, preemptions, tokens and times)."""
    steps: dict[str, list[Step]] = {}
    for policy in SCHEDULING_POLICIES:
        s = Scheduler(config(kv_tokens=kv_tokens, max_batched_tokens=512, scheduling_policy=policy))
        arrivals = sorted(
            ((at, prompt(n, i * 311), m) for i, (n, m, at) in enumerate(shape)),
            key=lambda a: a[0],
        )
        now, taken = 0.0, []
        for at, tokens, max_tokens in arrivals:
            while now < at and (step := s.step(now)) is not None:
                taken.append(step)
                now = step.ends_at
            now = max(now, at)
            try:
                s.submit(tokens, max_tokens, at)
            except ValueError:
                continue  # can never fit: refused alike
        _, rest = drive(s, now)
        steps[policy] = taken + rest
    assert steps["priority"] == steps["fcfs"]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 200), st.floats(0, 2), st.integers(-2, 2)),
        min_size=1,
        max_size=25,
    ),
    st.integers(400, 2000),
)
def test_under_priority_every_request_still_finishes_with_exactly_max_tokens(
    shape: list[tuple[int, int, float, int]], kv_tokens: int
) -> None:
    s = Scheduler(config(kv_tokens=kv_tokens, max_batched_tokens=512, scheduling_policy="priority"))
    submitted = 0
    now = 0.0
    for i, (n, max_tokens, _, priority) in enumerate(sorted(shape, key=lambda x: x[2])):
        try:
            s.submit(prompt(n, i * 311), max_tokens, now, priority=priority)
            submitted += 1
        except ValueError:
            continue
        step = s.step(now)
        if step is not None:
            now = step.ends_at
    run_until_idle(s, now)
    done = list(s.requests.values())
    assert len(done) == submitted
    for r in done:
        assert len(r.output) == r.max_tokens and r.finish_reason == "length"
    stats = s.statistics()
    assert stats.waiting == stats.running == stats.kv_tokens_reserved == 0


def test_the_command_line_sets_the_scheduling_policy() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--model", "m"])).engine.scheduling_policy == "fcfs"
    args = parser.parse_args(["--model", "m", "--scheduling-policy", "priority"])
    assert config_from_args(args).engine.scheduling_policy == "priority"


async def _post_all(
    policy: str, requests: list[tuple[str, dict[str, object]]]
) -> tuple[list[httpx.Response], str]:
    cfg = config(scheduling_policy=policy)
    driver = EngineDriver(cfg)
    app = SimEngineApp(SimConfig(cfg), driver, wall_clock=lambda: 1_750_000_000.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(driver.run)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            answers = [await client.post(path, json=body) for path, body in requests]
            metrics = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    return answers, metrics


GENERATION = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ("/v1/completions", {"prompt": "once upon", "max_tokens": 3}),
    ("/v1/responses", {"input": "hello", "max_output_tokens": 3}),
]


async def test_under_fcfs_a_priority_field_is_a_400_as_vllm_answers(
    autojump_clock: MockClock,
) -> None:
    requests = [(path, {**body, "priority": 1}) for path, body in GENERATION]
    requests.append(("/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": 0}))
    answers, _ = await _post_all("fcfs", requests)
    assert [a.status_code for a in answers] == [400, 400, 400, 200]
    assert "Priority scheduling is not enabled" in answers[0].json()["error"]["message"]


async def test_under_priority_scheduling_the_field_is_taken_and_counted(
    autojump_clock: MockClock,
) -> None:
    requests = [(path, {**body, "priority": 1}) for path, body in GENERATION]
    requests.append(("/v1/completions", {"prompt": "x", "max_tokens": 1}))
    requests.append(("/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": "high"}))
    answers, metrics = await _post_all("priority", requests)
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 400]
    assert answers[-1].json()["error"]["param"] == "priority"
    line = 'fabric_simengine_requests_by_priority_total{model_name="llama-3-8b",priority="%d"}'
    assert f"{line % 1} 3.0" in metrics
    assert f"{line % 0} 1.0" in metrics
