"""The batch gate as a machine (``fabricnode.dataplane.gate``): no sockets, no trio, time as
plain floats. A fake world of nodes (their load reports) stands for the route table.

Each case of the socket test (``tests/system/dataplane/test_batch_gate.py``) has its
decision here: waiting for room and release in order, refusal past the gate's size and its
longest wait, a client leaving, the admitted metric's key label, failover keeping its turn,
batch work hidden from interactive scores, pacing, one prompt per walk (prefill clocks), and
yielding under pressure (and not without it). What only sockets show stays there.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.dataplane.endpoints import CHAT, EMBEDDINGS, RESPONSES
from fabricnode.dataplane.gate import (
    GATE_FULL,
    GATE_GONE,
    GATE_TIMEOUT,
    GO,
    GRANTED,
    MAX_KEY_LABELS,
    NO_NODE,
    QUEUED,
    REFUSED,
    BatchGate,
    BatchWaiter,
)
from fabricnode.dataplane.job import BatchSlot, Job
from fabricnode.dataplane.prefill import PrefillClocks
from fabricnode.dataplane.request import Routed
from fabricnode.dataplane.routetable import Route
from fabricnode.dataplane.routing import (
    Candidate,
    LoadSnapshot,
    NodeInfo,
    make_policy,
)
from fabricnode.dataplane.tiers import RoomRules

WALL = 1_750_000_000.0  # the wall clock load reports carry
RULES = RoomRules(kv_threshold=0.7, max_waiting=0, max_inflight=4, stale_after_s=3.0)


class World:
    """Nodes serving m1 and their last load reports; the gate's ``lookup`` and ``load_of``."""

    def __init__(self, nodes: int = 1) -> None:
        self.sids = [f"node{i}" for i in range(nodes)]
        self.loads: dict[str, LoadSnapshot | None] = dict.fromkeys(self.sids)
        self.gone: set[str] = set()
        self.prefill = PrefillClocks()
        self.wall = WALL
        self.routes = {
            sid: Route(
                NodeInfo(sid, f"http://{sid}", "p", None, None, "L4", 1, 4096, None),
                ("127.0.0.1", 1),
                math.inf,
                False,
            )
            for sid in self.sids
        }

    def report(self, i: int, *, kv: float = 0.1, waiting: int = 0, at: float | None = None) -> None:
        at = self.wall if at is None else at
        self.loads[self.sids[i]] = LoadSnapshot(waiting, 1, kv, 0, at)

    def lookup(
        self, w: BatchWaiter, now: float, wall: float
    ) -> tuple[list[Route], list[Candidate]] | None:
        routes = [self.routes[s] for s in self.sids if s not in self.gone]
        pinned = w.routed.pinned
        if pinned is not None:
            routes = [r for r in routes if r.info.session_id == pinned]
        if not routes:
            return None
        cands = [
            Candidate(
                r.info,
                self.loads[r.info.session_id],
                0,
                self.prefill.backlog(r.info.session_id, now),
            )
            for r in routes
            if r.info.session_id not in w.tried
        ]
        return routes, cands

    def load_of(self, sid: str) -> LoadSnapshot | None:
        return self.loads.get(sid)

    def gate(self, **overrides: object) -> BatchGate:
        settings_: dict[str, object] = {
            "max_waiting": 16,
            "max_wait_s": 30.0,
            "rules": RULES,
            "prefill_tokens_per_s": 0.0,
            "preempt_kv_threshold": 0.9,
            "preempt_per_report": 2,
        }
        settings_.update(overrides)
        return BatchGate(
            policy=make_policy("least-load"),
            prefill=self.prefill,
            lookup=self.lookup,
            load_of=self.load_of,
            **settings_,  # type: ignore[arg-type]
        )


def waiter(
    name: str = "w",
    *,
    tenant: str = "-",
    started: float = 0.0,
    tried: set[str] | None = None,
    kind: str = CHAT,
    tokens: int = 0,
    doc: dict[str, object] | None = None,
) -> BatchWaiter:
    job = Job(kind, "m1", False, b"{}", b"/v1/chat/completions", {}, None, started, doc)
    job.slot = BatchSlot(tenant)
    job.prefill_tokens = tokens
    routed = Routed(kind, "m1", False, doc or {}, None, frozenset(), None, name, tokens)
    return BatchWaiter(job, routed, tried if tried is not None else set())


def granted(gate: BatchGate) -> list[BatchWaiter]:
    return [w for w in gate.take_ended() if w.outcome == GRANTED]


# -- waiting for room, in order ---------------------------------------------------------------


def test_batch_requests_wait_while_no_node_has_room_and_go_in_order_as_slots_free() -> None:
    world = World()  # no load report: the node takes one batch request at a time
    gate = world.gate()
    first, second, third = waiter("first"), waiter("second"), waiter("third")
    assert gate.offer(first, 1.0, WALL) == GO
    assert first.ranked[0].node.session_id == "node0" and first.job.slot.node == "node0"
    assert gate.offer(second, 1.1, WALL) == QUEUED and not second.outcome
    assert gate.offer(third, 1.2, WALL) == QUEUED
    assert len(gate) == 2 and gate.inflight == {"node0": 1}
    gate.scan(2.0, WALL)  # nothing changed: nobody goes
    assert gate.take_ended() == [] and len(gate) == 2
    gate.done(first.job)  # the first ends: its slot is free
    assert gate.inflight == {}
    gate.scan(3.0, WALL)
    assert granted(gate) == [second] and len(gate) == 1
    gate.done(second.job)
    gate.scan(4.0, WALL)
    assert granted(gate) == [third] and len(gate) == 0
    gate.done(third.job)
    assert gate.inflight == {} and gate.next_deadline() == math.inf


def test_a_newcomer_does_not_pass_the_waiters_even_when_it_finds_room() -> None:
    world = World()
    gate = world.gate()
    gate.offer(holder := waiter("holder"), 0.0, WALL)
    gate.offer(waiting := waiter("waiting"), 0.1, WALL)
    gate.done(holder.job)  # room, but the gate has not walked yet
    late = waiter("late")
    assert gate.offer(late, 0.2, WALL) == QUEUED  # queued behind, and the walk lets the first go
    assert granted(gate) == [waiting] and late.outcome == "" and len(gate) == 1


def test_a_node_with_a_fresh_report_and_room_takes_up_to_its_cap() -> None:
    world = World()
    world.report(0, kv=0.1)
    gate = world.gate()
    verdicts = [gate.offer(waiter(str(i)), 0.0, WALL) for i in range(RULES.max_inflight + 1)]
    assert verdicts == [GO] * RULES.max_inflight + [QUEUED]
    assert gate.inflight == {"node0": RULES.max_inflight}


def test_no_eligible_node_is_a_refusal_not_a_wait() -> None:
    world = World()
    world.gone.add("node0")
    gate = world.gate()
    w = waiter()
    assert gate.offer(w, 0.0, WALL) == REFUSED and w.outcome == NO_NODE
    # A waiter whose nodes all go while it waits is ended the same way.
    world.gone.clear()
    gate.offer(waiter("holder"), 0.0, WALL)
    gate.offer(w2 := waiter("w2"), 0.0, WALL)
    world.gone.add("node0")
    gate.scan(1.0, WALL)
    assert gate.take_ended() == [w2] and w2.outcome == NO_NODE and len(gate) == 0


# -- refusals: size and longest wait ---------------------------------------------------------


def test_the_gate_refuses_past_its_size() -> None:
    world = World()
    gate = world.gate(max_waiting=1)
    gate.offer(waiter("holder"), 0.0, WALL)
    assert gate.offer(waiter("waiter"), 0.0, WALL) == QUEUED
    full = waiter("one too many")
    assert gate.offer(full, 0.0, WALL) == REFUSED and full.outcome == GATE_FULL
    assert len(gate) == 1


def test_a_full_gate_pushes_out_the_longest_queues_newest_for_another_tenant() -> None:
    world = World()
    gate = world.gate(max_waiting=2)
    gate.offer(waiter("holder"), 0.0, WALL)
    a1, a2 = waiter("a1", tenant="a"), waiter("a2", tenant="a")
    gate.offer(a1, 0.0, WALL)
    gate.offer(a2, 0.0, WALL)
    b1 = waiter("b1", tenant="b")
    assert gate.offer(b1, 0.0, WALL) == QUEUED
    assert gate.take_ended() == [a2] and a2.outcome == GATE_FULL
    assert {w.routed.session_key for w in gate.waiters()} == {"a1", "b1"}


def test_a_wait_ends_at_its_deadline_counted_from_the_requests_arrival() -> None:
    world = World()
    gate = world.gate(max_wait_s=0.5)
    gate.offer(waiter("holder"), 0.0, WALL)
    late = waiter("late", started=10.0)
    gate.offer(late, 10.2, WALL)
    assert late.deadline == 10.5 and gate.next_deadline() == 10.5
    gate.expire(10.49)
    assert gate.take_ended() == []
    gate.expire(10.5)
    assert gate.take_ended() == [late] and late.outcome == GATE_TIMEOUT and len(gate) == 0
    assert gate.next_deadline() == math.inf


def test_a_client_that_leaves_is_out_of_the_gate_and_the_others_keep_their_turn() -> None:
    world = World()
    gate = world.gate()
    holder = waiter("holder")
    gate.offer(holder, 0.0, WALL)
    leaves, stays = waiter("leaves"), waiter("stays")
    gate.offer(leaves, 0.0, WALL)
    gate.offer(stays, 0.0, WALL)
    gate.leave(leaves)
    assert gate.take_ended() == [leaves] and leaves.outcome == GATE_GONE
    gate.leave(leaves)  # once only
    assert gate.take_ended() == []
    gate.done(holder.job)
    gate.scan(1.0, WALL)
    assert granted(gate) == [stays]


def test_the_key_label_is_the_keys_name_else_the_tenant_bounded() -> None:
    gate = World().gate()
    w = waiter(tenant="alice-id")
    assert gate.key_label(w.job) == "alice-id"
    for i in range(MAX_KEY_LABELS):
        gate.key_label(waiter(tenant=f"t{i}").job)
    assert gate.key_label(waiter(tenant="one more").job) == "other"
    assert gate.key_label(w.job) == "alice-id"  # already labelled: kept


def test_waiting_counts_by_label() -> None:
    world = World()
    gate = world.gate()
    gate.offer(waiter("holder"), 0.0, WALL)
    for tenant in ("a", "a", "b"):
        gate.offer(waiter(tenant=tenant), 0.0, WALL)
    assert gate.waiting_by_label() == {"a": 2, "b": 1}


# -- failover ---------------------------------------------------------------------------------


def test_a_failover_keeps_its_turn_and_is_not_sent_back_to_the_node_it_tried() -> None:
    """Node 0 (room) failed the request; node 1 has no room: it waits, from now, not from its
    arrival, and goes to node 1 when a report there shows room."""
    world = World(nodes=2)
    world.report(0, kv=0.1)
    world.report(1, kv=0.9)
    gate = world.gate(max_wait_s=5.0)
    assert gate.offer(waiter("first"), 0.0, WALL) == GO  # to node 0
    fail = waiter("fails over", tried={"node0"})
    assert gate.offer(fail, 20.0, WALL) == QUEUED and fail.deadline == 25.0
    world.report(1, kv=0.2)
    gate.scan(21.0, WALL)
    assert granted(gate) == [fail] and fail.ranked[0].node.session_id == "node1"


def test_a_failover_goes_at_once_past_waiters_when_a_node_has_room() -> None:
    """An admitted request keeps its turn: its failover does not queue behind newer waiters."""
    world = World(nodes=2)  # no reports: each node takes one
    gate = world.gate()
    first, second = waiter("first"), waiter("second")
    gate.offer(first, 0.0, WALL)
    gate.offer(second, 0.0, WALL)
    assert gate.offer(waiter("waits"), 0.0, WALL) == QUEUED
    gate.done(first.job)  # its node is free; the walk has not run yet
    failover = waiter("failover", tried={second.job.slot.node or ""})
    assert gate.offer(failover, 1.0, WALL) == GO
    assert failover.ranked[0].node.session_id == first.ranked[0].node.session_id


def test_a_request_pinned_to_a_node_waits_for_that_node_only() -> None:
    """A Responses follow-up may go only to the node that stored its response."""
    world = World(nodes=2)
    world.report(0, kv=0.1)
    world.report(1, kv=0.9)  # no room on the pinned node
    gate = world.gate()
    w = waiter(kind=RESPONSES)
    w.routed.pinned = "node1"
    assert gate.offer(w, 0.0, WALL) == QUEUED and w.outcome == ""
    world.report(1, kv=0.1)
    gate.scan(1.0, WALL)
    assert granted(gate) == [w] and [c.node.session_id for c in w.ranked] == ["node1"]


# -- batch work hidden from interactive scores --------------------------------------------------


@pytest.mark.parametrize(("kind", "hidden"), [(CHAT, 1), (RESPONSES, 1), (EMBEDDINGS, 0)])
def test_generation_kinds_count_as_hidden_batch_work_until_done(kind: str, hidden: int) -> None:
    world = World()
    gate = world.gate()
    w = waiter(kind=kind)
    gate.offer(w, 0.0, WALL)
    assert gate.hidden == ({"node0": 1} if hidden else {})
    gate.done(w.job)
    assert gate.hidden == {} and gate.inflight == {} and w.slot.node is None


# -- pacing and prefill clocks: deadlines instead of a tick ---------------------------------------


def test_pacing_holds_the_next_request_until_the_nodes_pacing_time() -> None:
    world = World()
    world.report(0, kv=0.0)
    gate = world.gate(prefill_tokens_per_s=1000.0)
    assert gate.offer(waiter("a", tokens=1000), 0.0, WALL) == GO
    b = waiter("b", tokens=1000)
    assert gate.offer(b, 0.0, WALL) == QUEUED and b.outcome == ""
    assert gate.next_deadline() == pytest.approx(1.0)  # not a tick: when pacing allows
    gate.scan(0.99, WALL)
    assert gate.take_ended() == []
    gate.scan(1.0, WALL)
    assert granted(gate) == [b]


def test_one_walk_sends_a_node_one_batch_prompt_and_waits_for_its_prefill_clock() -> None:
    world = World()
    gate = world.gate()
    holder = waiter("holder", tokens=4000)
    gate.offer(holder, 0.0, WALL)  # no report: room for one
    waiting = [waiter(str(i), tokens=4000) for i in range(3)]
    for w in waiting:
        gate.offer(w, 0.0, WALL)
    world.report(0, kv=0.0)  # room for many now
    gate.done(holder.job)
    now = 1.0  # the holder's prompt is computed by now (default rate 10,000 tokens/s)
    gate.scan(now, WALL)
    assert granted(gate) == [waiting[0]] and len(gate) == 2
    end = now + world.prefill.backlog("node0", now)
    assert end == pytest.approx(1.4)  # ~4,000 tokens at the default rate
    assert gate.next_deadline() == pytest.approx(end)
    gate.scan(end, WALL)
    assert granted(gate) == [waiting[1]]


def test_a_fresh_report_without_room_ends_by_going_stale_then_one_may_go() -> None:
    world = World()
    world.report(0, kv=0.95)  # fresh, no room
    gate = world.gate()
    w = waiter()
    assert gate.offer(w, 10.0, WALL) == QUEUED
    assert gate.next_deadline() == pytest.approx(10.0 + RULES.stale_after_s)
    gate.scan(13.1, WALL + 3.1)  # stale now: a node without a fresh report takes one
    assert granted(gate) == [w]


def test_a_queue_on_the_node_is_left_to_events_not_polled() -> None:
    """Room that only a new report or a request ending gives has no deadline: the waiter's own
    deadline is the gate's next."""
    world = World()
    world.report(0, kv=0.1)
    gate = world.gate(max_wait_s=30.0)
    for i in range(RULES.max_inflight):
        gate.offer(waiter(str(i)), 0.0, WALL)
    w = waiter("waits")
    gate.offer(w, 0.0, WALL)
    assert gate.next_deadline() == 30.0


# -- yielding under pressure --------------------------------------------------------------------


def running_gate(world: World, n: int, **overrides: object) -> tuple[BatchGate, list[Job]]:
    gate = world.gate(**overrides)
    jobs = []
    for i in range(n):
        w = waiter(str(i))
        assert gate.offer(w, float(i), WALL) == GO
        gate.running(w.job, "node0", float(i))
        jobs.append(w.job)
    return gate, jobs


def test_pressure_takes_back_the_newest_batch_work_one_per_queued_request_once_per_report() -> None:
    world = World()
    world.report(0, kv=0.1)
    gate, jobs = running_gate(world, 3)
    assert gate.pressure(WALL) == []
    world.report(0, kv=0.95, waiting=1)
    assert gate.pressure(WALL) == [jobs[2]]
    gate.answered(jobs[2], "node0")  # the shell cancelled it
    gate.done(jobs[2])
    assert gate.pressure(WALL) == []  # the same report: no second one
    world.report(0, kv=0.95, waiting=5, at=WALL + 1)  # a newer report: at most the cap
    assert gate.pressure(WALL + 1) == [jobs[1], jobs[0]]
    assert gate.inflight == {"node0": 2}


def test_an_answered_attempt_is_never_taken_back() -> None:
    world = World()
    world.report(0, kv=0.1)
    gate, jobs = running_gate(world, 2)
    gate.answered(jobs[1], "node0")
    world.report(0, kv=0.95, waiting=1)
    assert gate.pressure(WALL) == [jobs[0]]
    gate.answered(jobs[0], "node0")
    assert gate.preemptible == {} and not gate.busy()


@pytest.mark.parametrize(
    ("threshold", "reports"),
    [
        (1.0, [(0.99, 3)]),  # off: nothing is taken back
        (0.9, [(0.99, 0), (0.5, 2)]),  # a full cache without a queue; a queue with room in it
    ],
    ids=["off", "no-pressure"],
)
def test_no_preemption_when_it_is_off_or_the_queue_is_not_under_pressure(
    threshold: float, reports: list[tuple[float, int]]
) -> None:
    world = World()
    world.report(0, kv=0.1)
    gate, _ = running_gate(world, 1, preempt_kv_threshold=threshold)
    for i, (kv, waiting) in enumerate(reports):
        world.report(0, kv=kv, waiting=waiting, at=WALL + i)
        assert gate.pressure(WALL + i) == []


def test_a_stale_report_puts_no_pressure() -> None:
    world = World()
    world.report(0, kv=0.99, waiting=3, at=WALL - 10)
    gate, _ = running_gate(world, 1)
    assert gate.pressure(WALL) == []


# -- laws ---------------------------------------------------------------------------------------

events = st.lists(
    st.tuples(
        st.sampled_from(["offer", "done", "report", "scan", "expire", "leave", "stale"]),
        st.integers(0, 2),  # node or tenant
        st.floats(0.0, 1.0),  # kv usage
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(events, st.integers(1, 4), st.integers(1, 6))
def test_the_gate_never_grants_past_a_nodes_cap(
    steps: list[tuple[str, int, float]], cap: int, max_waiting: int
) -> None:
    """Whatever happens, a node with a fresh report never holds more than ``max_inflight`` of
    our batch requests and one without holds at most one beyond what it held when its report
    went stale; every waiter's wait ends once; the gate's counts stay consistent."""
    world = World(nodes=3)
    rules = RoomRules(kv_threshold=0.7, max_waiting=0, max_inflight=cap, stale_after_s=3.0)
    gate = world.gate(rules=rules, max_waiting=max_waiting, max_wait_s=5.0)
    now, wall = 0.0, WALL
    running: list[Job] = []
    waiting: list[BatchWaiter] = []
    ended: Counter[int] = Counter()

    def collect() -> None:
        for w in gate.take_ended():
            ended[id(w)] += 1
            if w.outcome == GRANTED:
                running.append(w.job)

    for what, i, kv in steps:
        now += 0.25
        wall += 0.25
        if what == "offer":
            w = waiter(tenant=f"t{i}", started=now)
            verdict = gate.offer(w, now, wall)
            if verdict == GO:
                running.append(w.job)
            elif verdict == QUEUED:
                waiting.append(w)
        elif what == "done" and running:
            gate.done(running.pop(i % len(running)))
        elif what == "report":
            world.report(i, kv=kv, at=wall)
        elif what == "stale":
            world.loads[world.sids[i]] = None
        elif what == "scan":
            gate.scan(now, wall)
        elif what == "expire":
            gate.expire(now)
        elif what == "leave" and waiting:
            gate.leave(waiting[i % len(waiting)])
        collect()
        for sid, n in gate.inflight.items():
            load = world.loads[sid]
            if load is not None and abs(wall - load.at) <= rules.stale_after_s:
                assert n <= cap
        assert sum(gate.inflight.values()) == sum(1 for j in running if j.slot and j.slot.node)
        assert len(gate) <= max_waiting
    assert all(n == 1 for n in ended.values())


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8))
def test_backlogged_tenants_are_released_alternately_whatever_they_offer(a: int, b: int) -> None:
    """Two tenants at equal weights, one slot: while both wait, releases alternate."""
    world = World()
    gate = world.gate(max_waiting=64)
    holder = waiter("holder")
    gate.offer(holder, 0.0, WALL)
    for i in range(a):
        gate.offer(waiter(f"a{i}", tenant="a"), 0.0, WALL)
    for i in range(b):
        gate.offer(waiter(f"b{i}", tenant="b"), 0.0, WALL)
    order: list[str] = []
    job = holder.job
    now = 1.0
    while len(gate):
        gate.done(job)
        gate.scan(now, WALL)
        (w,) = granted(gate)
        order.append(w.slot.tenant)
        job = w.job
        now += 1.0
    both = 2 * min(a, b)
    assert all(order[k] != order[k + 1] for k in range(both - 1))
    assert Counter(order) == {"a": a, "b": b}
