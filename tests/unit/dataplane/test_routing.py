"""The routing core: load scores, the five policies, the prefix index, filters and parsers.

Everything is pure, so tests pass ``now`` explicitly and seed every RNG. Candidates are named by
their session id (``"a"``, ``"b"``, ...) and the helpers below build the rest.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabricnode.dataplane.request import Requirements, parse_require
from fabricnode.dataplane.routing import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    Candidate,
    LoadSnapshot,
    NodeInfo,
    Policy,
    RouteRequest,
    RoutingConfig,
    load_score,
    make_policy,
    meets,
    prompt_blocks,
    provider_allowed,
    quant_bits,
)

NOW = 1_750_000_000.0
CFG = RoutingConfig()
SYSTEM = "".join(f"rule {i}: answer briefly and cite your sources.\n" for i in range(60))  # ~2.8 KB
FP_A = "a1b2c3d4e5f60718"
FP_B = "ffeeddccbbaa9988"

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


BASE = NodeInfo(
    session_id="",
    url="http://10.0.0.5:8080",
    provider="acme",
    verified_provider=None,
    certified_name=None,
    gpu_type="H100",
    gpu_count=1,
    max_model_len=32768,
    quantization=None,
)


def node(sid: str, **changes: Any) -> NodeInfo:
    return replace(BASE, session_id=sid, **changes)


def cand(
    sid: str,
    *,
    waiting: int = 0,
    running: int = 0,
    kv: float = 0.0,
    inflight: int | None = None,
    local: int = 0,
    age: float = 0.0,
    report: bool = True,
) -> Candidate:
    load = None
    if report:
        total = waiting + running if inflight is None else inflight
        load = LoadSnapshot(waiting, running, kv, total, NOW - age)
    return Candidate(node(sid), load, local)


def request(
    text: str = "", *, model: str = "m", session: str | None = None, blocks: tuple[int, ...] = ()
) -> RouteRequest:
    return RouteRequest(model, blocks or prompt_blocks(text), session, len(text) // 4)


def pick(policy: Policy, req: RouteRequest, cands: list[Candidate], now: float = NOW) -> str:
    ranked = policy.rank(req, cands, now)
    assert ranked is not None
    return ranked[0].node.session_id


def ids(ranked: list[Candidate] | None) -> list[str]:
    assert ranked is not None
    return [c.node.session_id for c in ranked]


# -- every policy -------------------------------------------------------------------------------

loads = st.one_of(
    st.none(),
    st.builds(
        LoadSnapshot,
        waiting=st.integers(0, 6),
        running=st.integers(0, 40),
        kv_usage=st.floats(0.0, 1.0),
        inflight=st.integers(0, 50),
        at=st.floats(NOW - 10.0, NOW + 5.0),
    ),
)
candidate_sets = st.lists(
    st.builds(lambda load, local: (load, local), loads, st.integers(0, 20)),
    min_size=1,
    max_size=8,
).map(lambda rows: [Candidate(node(f"n{i}"), ld, lc) for i, (ld, lc) in enumerate(rows)])
requests = st.builds(
    request,
    st.sampled_from(["", SYSTEM, SYSTEM + "what is 2+2?", SYSTEM[:300] + "other", "x" * 700]),
    session=st.sampled_from([None, "u1", "u2"]),
)


def backlogged(c: Candidate, now: float) -> bool:
    """The documented SP-P rule, restated independently of the implementation."""
    load = c.load
    if load is None or abs(now - load.at) > CFG.load_stale_after_s:
        return False
    if load.waiting > 1 or (load.waiting > 0 and load.kv_usage >= 0.9):
        return True
    return c.local_inflight >= max(8, 2 * load.running)


@pytest.mark.parametrize("name", POLICY_NAMES)
@SETTINGS
@given(rounds=st.lists(st.tuples(candidate_sets, requests, st.integers(0, 7)), max_size=6))
def test_every_policy_ranks_each_candidate_exactly_once(
    name: str, rounds: list[tuple[list[Candidate], RouteRequest, int]]
) -> None:
    policy = make_policy(name, rng=random.Random(7))
    for cands, req, routed_to in rounds:
        before = policy.statistics()
        ranked = policy.rank(req, cands, NOW)
        after = policy.statistics()
        affinity = after.sticky_hits + after.prefix_hits > before.sticky_hits + before.prefix_hits
        if ranked is None:
            assert name == "prefix-pending"
            assert all(backlogged(c, NOW) for c in cands)
            assert not affinity
            continue
        assert sorted(map(id, ranked)) == sorted(map(id, cands))
        if name == "prefix-pending" and not affinity:
            assert not backlogged(ranked[0], NOW)
        policy.on_routed(req, cands[routed_to % len(cands)].node.session_id, NOW)
        if routed_to == 7:
            policy.on_removed(cands[0].node.session_id)
    stats = policy.statistics()
    outcomes = (
        stats.sticky_hits,
        stats.prefix_hits,
        stats.misses,
        stats.fallbacks_weak,
        stats.fallbacks_overloaded,
    )
    assert stats.ranked + stats.holds == len(rounds)
    # One affinity outcome per call, held or not.
    assert sum(outcomes) == (len(rounds) if name.startswith("prefix") else 0)


def test_policy_names_and_default() -> None:
    assert set(POLICY_NAMES) >= {"round-robin", "least-load", "p2c", "prefix", "prefix-pending"}
    assert DEFAULT_POLICY == "prefix-pending"
    for name in POLICY_NAMES:
        assert make_policy(name).name == name


def test_unknown_policy_name_is_rejected_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match="round-robin, least-load, p2c, prefix, prefix-pending"):
        make_policy("fastest")


def test_config_rejects_nonsense_values() -> None:
    with pytest.raises(ValueError, match="prefix_max_entries"):
        RoutingConfig(prefix_max_entries=0)
    with pytest.raises(ValueError, match="waiting_weight"):
        RoutingConfig(waiting_weight=-1.0)
    with pytest.raises(ValueError, match="load_stale_after_s"):
        RoutingConfig(load_stale_after_s=math.nan)


# -- load score ---------------------------------------------------------------------------------


def test_waiting_requests_weigh_more_than_running_ones() -> None:
    assert load_score(cand("a", waiting=2), NOW, CFG) > load_score(cand("b", running=6), NOW, CFG)


def test_local_inflight_adds_to_a_fresh_report() -> None:
    # Added, not max'ed: every request we send must move the score before the next report.
    assert load_score(cand("a", running=3, local=2), NOW, CFG) == 5.0
    assert load_score(cand("a", running=3, local=3), NOW, CFG) == 6.0


def test_reported_inflight_counts_only_beyond_waiting_and_running() -> None:
    assert load_score(cand("a", waiting=1, running=3, inflight=4), NOW, CFG) == 7.0
    assert load_score(cand("a", waiting=1, running=3, inflight=10), NOW, CFG) == 13.0


def test_kv_usage_raises_the_score() -> None:
    assert load_score(cand("a", kv=1.0), NOW, CFG) == CFG.kv_weight


def test_prefill_backlog_raises_the_score_with_or_without_a_report() -> None:
    busy = cand("a", running=3)
    busy.prefill_s = 0.1
    assert load_score(busy, NOW, CFG) == pytest.approx(3.0 + 0.1 * CFG.prefill_weight)
    unknown = cand("b", report=False)
    unknown.prefill_s = 0.2
    assert load_score(unknown, NOW, CFG) == pytest.approx(
        CFG.unknown_load_penalty + 0.2 * CFG.prefill_weight
    )


@pytest.mark.parametrize("name", ["least-load", "prefix", "prefix-pending"])
def test_a_node_in_the_middle_of_a_prefill_loses_to_a_busier_idle_one(name: str) -> None:
    # Thirty requests in decode cost a new prompt little; a tenth of a second of prompts this
    # ingress just sent is a tenth of a second the new one waits (bench/tiers.py).
    prefilling = cand("a", running=2, local=2)
    prefilling.prefill_s = 0.1
    decoding = cand("b", running=6, local=6)
    assert pick(make_policy(name), request(), [prefilling, decoding]) == "b"
    prefilling.prefill_s = 0.0
    assert pick(make_policy(name), request(), [prefilling, decoding]) == "a"


def test_hidden_requests_leave_our_count_and_the_reports() -> None:
    # Thirty of our batch requests on a node that schedules by priority, five of its own.
    busy = cand("a", running=35, local=30, kv=0.5)
    busy.hidden = 30
    assert load_score(busy, NOW, CFG) == pytest.approx(5 + 0.5 * CFG.kv_weight)
    # More hidden than running: the rest come out of the queue, then out of what is in transit.
    queued = cand("a", waiting=3, running=2, inflight=9, local=6)
    queued.hidden = 6
    assert load_score(queued, NOW, CFG) == pytest.approx(CFG.waiting_weight * 0 + 3)
    # Never below nothing, whatever a stale report says.
    stale = cand("a", running=1, local=40)
    stale.hidden = 40
    assert load_score(stale, NOW, CFG) == 0.0
    unknown = cand("a", local=7, report=False)
    unknown.hidden = 5
    assert load_score(unknown, NOW, CFG) == 2 + CFG.unknown_load_penalty


@pytest.mark.parametrize("name", ["least-load", "prefix", "prefix-pending"])
def test_a_node_decoding_hidden_batch_work_wins_over_one_computing_a_long_prompt(name: str) -> None:
    # bench/tiers.py's step logs: interactive prompts queued behind a 0.5 s prompt on one node
    # while the other decoded thirty batch requests, which a new prompt would have gone ahead of.
    batch = cand("a", running=32, local=30, kv=0.6)
    mid_prompt = cand("b", running=4, local=4, kv=0.2)
    mid_prompt.prefill_s = 0.3
    assert pick(make_policy(name), request(), [batch, mid_prompt]) == "b"  # counted: 62 vs 34
    batch.hidden = 30
    assert pick(make_policy(name), request(), [batch, mid_prompt]) == "a"


def test_pending_does_not_hold_for_hidden_requests() -> None:
    # Our in-flight count past SP-P's cap, but all of it batch work the request goes ahead of.
    only_batch = cand("a", running=2, local=20)
    assert make_policy("prefix-pending").rank(request(), [only_batch], NOW) is None
    only_batch.hidden = 18
    assert pick(make_policy("prefix-pending"), request(), [only_batch]) == "a"


@pytest.mark.parametrize(
    "stale",
    [
        cand("a", waiting=50, running=9, local=2, age=CFG.load_stale_after_s + 0.5),
        cand("a", waiting=50, running=9, local=2, age=-(CFG.load_stale_after_s + 0.5)),
        cand("a", local=2, report=False),
    ],
    ids=["old-report", "future-report", "no-report"],
)
def test_stale_or_missing_load_falls_back_to_local_inflight(stale: Candidate) -> None:
    assert load_score(stale, NOW, CFG) == 2 + CFG.unknown_load_penalty


def test_least_load_uses_local_inflight_when_every_report_is_stale() -> None:
    old = CFG.load_stale_after_s + 1
    cands = [
        cand("a", waiting=0, local=5, age=old),
        cand("b", waiting=40, local=1, age=old),
        cand("c", local=3, report=False),
    ]
    assert pick(make_policy("least-load"), request(), cands) == "b"


def test_garbage_report_fields_cannot_make_a_node_look_idle() -> None:
    nan = Candidate(node("a"), LoadSnapshot(-5, -5, math.nan, -5, NOW), 0)
    assert load_score(nan, NOW, CFG) == 0.0
    huge_kv = Candidate(node("a"), LoadSnapshot(0, 0, 1e9, 0, NOW), 0)
    assert load_score(huge_kv, NOW, CFG) == CFG.kv_weight
    nan_time = Candidate(node("a"), LoadSnapshot(0, 0, 0.0, 0, math.nan), 3)
    assert load_score(nan_time, NOW, CFG) == 3 + CFG.unknown_load_penalty


# -- round robin, least load, p2c ---------------------------------------------------------------


def test_round_robin_rotates_the_start_and_keeps_rotation_order() -> None:
    policy = make_policy("round-robin")
    cands = [cand("a", waiting=9), cand("b"), cand("c")]
    orders = [ids(policy.rank(request(), cands, NOW)) for _ in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_least_load_picks_the_least_loaded_then_orders_by_score() -> None:
    cands = [cand("a", running=5), cand("b", waiting=1), cand("c", running=1), cand("d", kv=0.5)]
    assert ids(make_policy("least-load").rank(request(), cands, NOW)) == ["c", "d", "b", "a"]


def test_least_load_spreads_equal_nodes() -> None:
    policy = make_policy("least-load")
    cands = [cand("a"), cand("b"), cand("c"), cand("d", running=1)]
    picks = [pick(policy, request(), cands) for _ in range(9)]
    assert sorted(picks) == ["a", "a", "a", "b", "b", "b", "c", "c", "c"]


def test_p2c_always_picks_the_better_of_two() -> None:
    policy = make_policy("p2c", rng=random.Random(3))
    cands = [cand("a", running=4), cand("b", running=2)]
    assert {pick(policy, request(), cands) for _ in range(50)} == {"b"}


@SETTINGS
@given(scores=st.lists(st.integers(0, 30), min_size=2, max_size=8, unique=True), seed=st.integers())
def test_p2c_never_picks_the_worst(scores: list[int], seed: int) -> None:
    policy = make_policy("p2c", rng=random.Random(seed))
    cands = [cand(f"n{i}", running=s) for i, s in enumerate(scores)]
    worst = f"n{scores.index(max(scores))}"
    for _ in range(20):
        ranked = ids(policy.rank(request(), cands, NOW))
        assert ranked[0] != worst
        assert ranked[-1] == worst or ranked[0] == worst


def test_p2c_is_random_not_always_the_least_loaded() -> None:
    policy = make_policy("p2c", rng=random.Random(5))
    cands = [cand(f"n{i}", running=i) for i in range(6)]
    picks = {pick(policy, request(), cands) for _ in range(200)}
    assert "n0" in picks and len(picks) >= 3 and "n5" not in picks


# -- prefix -------------------------------------------------------------------------------------


def routed(
    policy: Policy, text: str, sid: str, *, model: str = "m", session: str | None = None
) -> RouteRequest:
    req = request(text, model=model, session=session)
    policy.on_routed(req, sid, NOW)
    return req


def test_prefix_routes_a_shared_long_prefix_to_the_node_that_got_it() -> None:
    policy = make_policy("prefix")
    routed(policy, SYSTEM + "first question", "b")
    cands = [cand("a"), cand("b", running=3), cand("c")]  # b is busier, within the guard
    assert pick(policy, request(SYSTEM + "a second, different question"), cands) == "b"
    assert policy.statistics().prefix_hits == 1


@pytest.mark.parametrize("name", ["prefix", "prefix-pending"])
def test_a_prefill_backlog_does_not_break_prefix_affinity(name: str) -> None:
    # The prompts just sent to b share the new request's prefix, which b has cached: b's
    # backlog overstates what the request would wait for there, and affinity holds.
    policy = make_policy(name)
    routed(policy, SYSTEM + "first question", "b")
    b = cand("b", running=3)
    b.prefill_s = 0.5
    cands = [cand("a"), b, cand("c")]
    assert pick(policy, request(SYSTEM + "a second, different question"), cands) == "b"
    # Without affinity the backlog counts: a request with no match goes elsewhere.
    assert pick(policy, request("an unrelated prompt " * 40), cands) != "b"


def test_prefix_picks_the_least_loaded_of_the_nodes_sharing_the_prefix() -> None:
    policy = make_policy("prefix")
    routed(policy, SYSTEM + "q1", "b")
    routed(policy, SYSTEM + "q2", "c")
    cands = [cand("a"), cand("b", running=3), cand("c", running=2)]
    assert pick(policy, request(SYSTEM + "q3"), cands) == "c"


def test_prefix_prefers_the_longest_match() -> None:
    policy = make_policy("prefix")
    routed(policy, SYSTEM, "b")
    routed(policy, SYSTEM + "a long conversation history " * 20, "c")
    cands = [cand("a"), cand("b"), cand("c", running=2)]
    req = request(SYSTEM + "a long conversation history " * 20 + "and a new turn")
    assert pick(policy, req, cands) == "c"


def test_prefix_falls_back_to_least_load_when_the_match_is_weak() -> None:
    policy = make_policy("prefix")
    routed(policy, SYSTEM, "b")
    cands = [cand("a", running=1), cand("b", running=2), cand("c")]
    # Shares SYSTEM's first 3 blocks only: under prefix_min_match_blocks.
    assert pick(policy, request(SYSTEM[:200] + "zzz" * 40), cands) == "c"
    # Shares all of SYSTEM, but that is under half of this much longer prompt.
    assert pick(policy, request(SYSTEM + "q" * (3 * len(SYSTEM))), cands) == "c"
    stats = policy.statistics()
    assert (stats.fallbacks_weak, stats.prefix_hits) == (2, 0)


def test_prefix_falls_back_when_the_matched_node_is_overloaded() -> None:
    policy = make_policy("prefix")
    routed(policy, SYSTEM + "q1", "b")
    cands = [cand("a", running=1), cand("b", waiting=3, running=20), cand("c", running=2)]
    assert pick(policy, request(SYSTEM + "q2"), cands) == "a"
    assert policy.statistics().fallbacks_overloaded == 1


def test_prefix_without_any_match_is_least_load() -> None:
    policy = make_policy("prefix")
    cands = [cand("a", running=1), cand("b")]
    assert pick(policy, request(SYSTEM), cands) == "b"
    assert policy.statistics().misses == 1


def test_prefix_match_is_per_model() -> None:
    policy = make_policy("prefix")
    routed(policy, SYSTEM + "q1", "b", model="m1")
    cands = [cand("a"), cand("b", running=1)]
    assert pick(policy, request(SYSTEM + "q2", model="m2"), cands) == "a"
    assert pick(policy, request(SYSTEM + "q2", model="m1"), cands) == "b"


def test_sticky_session_prefers_the_sessions_last_node() -> None:
    policy = make_policy("prefix")
    routed(policy, "hello", "c", session="user-1")
    cands = [cand("a"), cand("b"), cand("c", running=4)]
    assert pick(policy, request("unrelated words", session="user-1"), cands) == "c"
    assert policy.statistics().sticky_hits == 1
    assert pick(policy, request("unrelated words", session="user-2"), cands) != "c"


def test_sticky_session_yields_when_its_node_is_overloaded() -> None:
    policy = make_policy("prefix")
    routed(policy, "hello", "c", session="user-1")
    cands = [cand("a"), cand("b", running=1), cand("c", waiting=4)]
    assert pick(policy, request("hello again", session="user-1"), cands) == "a"


def test_sticky_session_follows_the_latest_route() -> None:
    policy = make_policy("prefix")
    routed(policy, "hello", "c", session="user-1")
    routed(policy, "hello", "b", session="user-1")
    cands = [cand("a"), cand("b", running=1), cand("c")]
    assert pick(policy, request("more", session="user-1"), cands) == "b"


def test_on_removed_purges_prefix_and_session_affinity() -> None:
    policy = make_policy("prefix")
    routed(policy, SYSTEM + "q1", "b", session="user-1")
    assert policy.statistics().nodes == 1
    policy.on_removed("b")
    assert policy.statistics().nodes == 0
    # "b" is back (a revived session): it inherits nothing it had before removal.
    cands = [cand("a"), cand("b", running=2)]
    assert pick(policy, request(SYSTEM + "q2", session="user-1"), cands) == "a"
    stats = policy.statistics()
    assert (stats.sticky_hits, stats.prefix_hits, stats.misses) == (0, 0, 1)
    policy.on_removed("never-seen")  # harmless


def test_prefix_index_never_exceeds_its_cap_under_a_million_inserts() -> None:
    cap = 1000
    policy = make_policy("prefix", config=RoutingConfig(prefix_max_entries=cap))
    rng = random.Random(11)
    inserts = 0
    blocks: tuple[int, ...] = ()
    for i in range(4000):
        blocks = tuple(rng.getrandbits(63) for _ in range(250))
        req = RouteRequest("m", blocks, f"s{i}", 1000)
        policy.on_routed(req, f"node{i % 7}", NOW)
        inserts += len(blocks)
        assert policy.statistics().index_entries <= cap
    assert inserts >= 1_000_000
    assert policy.statistics().index_entries == cap
    # The latest prompt survived in full (shallow blocks are evicted last).
    cands = [cand(f"node{j}", running=1) for j in range(7)] + [cand("idle")]
    last = RouteRequest("m", blocks, None, 1000)
    assert pick(policy, last, cands) == "node2"  # 3999 % 7


def test_session_map_is_bounded() -> None:
    policy = make_policy("prefix", config=RoutingConfig(session_max_entries=50))
    for i in range(500):
        routed(policy, "hi", "a", session=f"user-{i}")
        assert policy.statistics().sessions <= 50


# -- prefix-pending (selective pushing) ---------------------------------------------------------


def test_pending_holds_only_when_every_candidate_is_backlogged() -> None:
    policy = make_policy("prefix-pending")
    full = [cand("a", waiting=2, running=8), cand("b", waiting=3, running=30)]
    assert policy.rank(request(SYSTEM), full, NOW) is None
    assert policy.statistics().holds == 1
    some_room = [*full, cand("c", waiting=0, running=40)]
    assert pick(policy, request(SYSTEM), some_room) == "c"


def test_pending_keeps_affinity_to_a_backlogged_node_under_the_load_guard() -> None:
    policy = make_policy("prefix-pending")
    routed(policy, SYSTEM + "q1", "b")
    # b has a short queue (score 5) but holds the prefix; the guard allows up to 2 + 8.
    cands = [cand("a", running=2), cand("b", waiting=1, running=1), cand("c", waiting=2)]
    assert ids(policy.rank(request(SYSTEM + "q2"), cands, NOW)) == ["b", "a", "c"]
    # Even when every node is backlogged: affinity is a pick, not a HOLD.
    full = [cand("a", waiting=1), cand("b", waiting=1, running=1)]
    assert pick(policy, request(SYSTEM + "q3"), full) == "b"
    assert policy.statistics().holds == 0


def test_pending_pushes_to_an_open_node_over_an_overloaded_prefix_match() -> None:
    policy = make_policy("prefix-pending")
    routed(policy, SYSTEM + "q1", "b")
    # b's queue puts it over the guard (4 * 4 + 1 > 2 + 8): the open node wins, b goes last
    # among... the backlogged ones are tried after every open one.
    cands = [cand("a", running=2), cand("b", waiting=4, running=1), cand("c", waiting=2)]
    assert ids(policy.rank(request(SYSTEM + "q2"), cands, NOW)) == ["a", "c", "b"]
    assert policy.statistics().fallbacks_overloaded == 1


def test_pending_without_hold_pushes_to_the_least_loaded() -> None:
    policy = make_policy("prefix-pending")
    full = [cand("a", waiting=3), cand("b", waiting=2, running=2)]
    assert policy.rank(request(), full, NOW) is None
    assert ids(policy.rank(request(), full, NOW, allow_hold=False)) == ["b", "a"]


def test_pending_does_not_hold_for_a_queue_of_one() -> None:
    # An engine counts a request as waiting until its next step admits it: a report showing one
    # waiting request on every node is the usual snapshot of engines with room (bench/tiers.py).
    policy = make_policy("prefix-pending")
    one_each = [cand("a", waiting=1, running=30), cand("b", waiting=1, running=20)]
    assert pick(policy, request(), one_each) == "b"
    assert policy.statistics().holds == 0
    assert policy.rank(request(), [cand("a", waiting=2), cand("b", waiting=2)], NOW) is None


def test_pending_holds_for_one_waiting_request_on_a_node_whose_kv_cache_is_full() -> None:
    # One waiting request on a node with no KV room is the head of a queue: it waits for a
    # request to end, and so would the next (bench/federation.py: long prompts on an L4).
    policy = make_policy("prefix-pending")
    full = [cand("a", waiting=1, running=20, kv=0.95), cand("b", waiting=1, running=9, kv=0.9)]
    assert policy.rank(request(), full, NOW) is None
    room = [*full, cand("c", waiting=1, running=30, kv=0.6)]
    assert pick(policy, request(), room) == "c"
    lenient = make_policy("prefix-pending", config=RoutingConfig(pending_kv_full=1.01))
    assert lenient.rank(request(), full, NOW) is not None
    with pytest.raises(ValueError, match="pending_kv_full"):
        RoutingConfig(pending_kv_full=-0.1)


def test_pending_caps_what_we_push_between_reports() -> None:
    policy = make_policy("prefix-pending")
    # No queue in the report, but we already have max(8, 2 * running) requests in flight.
    assert policy.rank(request(), [cand("a", running=2, local=8)], NOW) is None
    assert policy.rank(request(), [cand("a", running=6, local=11)], NOW) is not None
    assert policy.rank(request(), [cand("a", running=6, local=12)], NOW) is None


@pytest.mark.parametrize(
    "unknown",
    [cand("z", waiting=9, age=CFG.load_stale_after_s + 0.1), cand("z", report=False)],
    ids=["stale", "missing"],
)
def test_pending_never_holds_when_a_load_is_unknown(unknown: Candidate) -> None:
    policy = make_policy("prefix-pending")
    cands = [cand("a", waiting=2), unknown]
    assert pick(policy, request(), cands) == "z"


def test_a_hold_resolves_when_the_reports_age_out() -> None:
    policy = make_policy("prefix-pending")
    cands = [cand("a", waiting=3), cand("b", waiting=2)]
    assert policy.rank(request(), cands, NOW) is None
    later = NOW + CFG.load_stale_after_s + 0.1
    assert policy.rank(request(), cands, later) is not None


@SETTINGS
@given(cands=candidate_sets, req=requests)
def test_pending_holds_iff_every_candidate_is_backlogged(
    cands: list[Candidate], req: RouteRequest
) -> None:
    held = make_policy("prefix-pending").rank(req, cands, NOW) is None
    assert held == all(backlogged(c, NOW) for c in cands)


def test_plain_prefix_never_holds() -> None:
    full = [cand("a", waiting=5), cand("b", waiting=5)]
    assert make_policy("prefix").rank(request(), full, NOW) is not None


# -- prompt blocks ------------------------------------------------------------------------------


def common_prefix_len(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@SETTINGS
@given(
    shared=st.text("ab", max_size=40),
    a=st.text("abc", max_size=30),
    b=st.text("abc", max_size=30),
    size=st.integers(1, 6),
)
def test_prompt_blocks_share_exactly_the_common_whole_block_prefix(
    shared: str, a: str, b: str, size: int
) -> None:
    x, y = shared + a, shared + b
    bx = prompt_blocks(x, block_chars=size)
    by = prompt_blocks(y, block_chars=size)
    assert len(bx) == len(x) // size and len(by) == len(y) // size
    same = 0
    while same < min(len(bx), len(by)) and bx[same] == by[same]:
        same += 1
    assert same == min(common_prefix_len(x, y) // size, len(bx), len(by))


def test_prompt_blocks_ignore_a_trailing_partial_block_and_cap_the_count() -> None:
    assert prompt_blocks("a" * 63) == ()
    assert prompt_blocks("a" * 130) == prompt_blocks("a" * 128)
    assert len(prompt_blocks("x" * 100_000)) == 256
    assert len(prompt_blocks("x" * 100, block_chars=10, max_blocks=3)) == 3
    with pytest.raises(ValueError):
        prompt_blocks("abc", block_chars=0)


def test_prompt_blocks_are_cumulative() -> None:
    # Block 1 of "XXXXYYYY" and of "ZZZZYYYY" differ although the block text is the same.
    x, z = prompt_blocks("XXXXYYYY", block_chars=4), prompt_blocks("ZZZZYYYY", block_chars=4)
    assert x[1] != z[1]


# -- requirements -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quantization", "bits"),
    [
        (None, 16),
        ("", 16),
        ("bf16", 16),
        ("fp8", 8),
        ("FP8", 8),
        ("int8", 8),
        ("w8a8", 8),
        ("fbgemm_fp8", 8),
        ("awq", 4),
        ("gptq", 4),
        ("gptq_marlin", 4),
        ("int4", 4),
        ("w4a16", 4),
        ("bitsandbytes", 4),
        ("gguf", 4),
        ("aqlm", 2),
        ("int8_dynamic", 8),
        ("compressed-tensors", 0),
        ("mystery", 0),
    ],
)
def test_quant_bits_table(quantization: str | None, bits: int) -> None:
    assert quant_bits(quantization) == bits


def test_meets_checks_gpu_case_insensitively_and_unknown_facts_fail() -> None:
    h100 = node("a", gpu_type="H100", quantization="fp8", max_model_len=8192)
    assert meets(h100, Requirements())
    assert meets(h100, parse_require("gpu=h100|A100-80G"))
    assert meets(h100, Requirements(gpu=frozenset({"H100"})))
    assert not meets(h100, parse_require("gpu=A100-80G"))
    assert meets(h100, parse_require("quant>=8"))
    assert not meets(h100, parse_require("quant>=16"))
    assert meets(h100, parse_require("ctx>=8192"))
    assert not meets(h100, parse_require("ctx>=8193"))
    assert not meets(node("b", max_model_len=None), parse_require("ctx>=1"))
    assert not meets(node("c", quantization="mystery"), parse_require("quant>=1"))
    assert not meets(node("d", gpu_type=""), parse_require("gpu=H100"))


# -- providers ----------------------------------------------------------------------------------


def test_unverified_provider_is_rejected_even_when_the_claimed_name_matches() -> None:
    claimed = node("a", provider="acme", verified_provider=None, certified_name=None)
    assert not provider_allowed(claimed, frozenset({"acme"}))
    assert provider_allowed(claimed, frozenset())  # no allowlist: everyone


def test_verified_provider_matches_by_fingerprint_or_certified_name() -> None:
    certified = node("a", provider="acme", verified_provider=FP_A, certified_name="acme")
    assert provider_allowed(certified, frozenset({FP_A}))
    assert provider_allowed(certified, frozenset({"acme"}))
    assert provider_allowed(certified, frozenset({"other", "acme"}))
    assert not provider_allowed(certified, frozenset({"other", FP_B}))


def test_pinned_provider_name_also_requires_a_pinned_fingerprint() -> None:
    pinned = {"acme": frozenset({FP_A})}
    genuine = node("a", verified_provider=FP_A, certified_name="acme")
    impostor = node("b", verified_provider=FP_B, certified_name="acme")  # self-minted key
    assert provider_allowed(genuine, frozenset({"acme"}), pinned)
    assert not provider_allowed(impostor, frozenset({"acme"}), pinned)
    assert provider_allowed(impostor, frozenset({"acme"}))  # unpinned names trust any cert
    assert provider_allowed(impostor, frozenset({FP_B}), pinned)  # explicit fingerprint


@pytest.mark.parametrize("name", ["prefix", "prefix-pending"])
def test_held_blocks_is_the_prefix_the_index_holds_at_a_target(name: str) -> None:
    """What the cross-site cost reads (``sites`` rule 7): the leading blocks of a prompt this
    ingress last sent to a target (a node, or a peer site's gateway), per model."""
    policy = make_policy(name)
    first = routed(policy, SYSTEM + "first question", "site:B/gw.b:7950")
    assert policy.held_blocks(first, "site:B/gw.b:7950") == len(first.prefix_blocks)
    again = request(SYSTEM + "a second, different question")
    assert policy.held_blocks(again, "site:B/gw.b:7950") == len(SYSTEM) // 64
    assert policy.held_blocks(again, "site:C/gw.c:7950") == 0  # never sent there
    assert policy.held_blocks(request(SYSTEM + "q", model="m2"), "site:B/gw.b:7950") == 0
    assert policy.held_blocks(request("short"), "site:B/gw.b:7950") == 0  # no whole block
    policy.on_removed("site:B/gw.b:7950")
    assert policy.held_blocks(again, "site:B/gw.b:7950") == 0


@pytest.mark.parametrize("name", ["round-robin", "least-load", "p2c"])
def test_a_policy_without_a_prefix_index_holds_nothing(name: str) -> None:
    policy = make_policy(name)
    req = routed(policy, SYSTEM, "b")
    assert policy.held_blocks(req, "b") == 0
