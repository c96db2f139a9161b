"""Priority tiers (``fabricnode.dataplane.tiers``): the headers, when a node has room for batch
work, and fair queueing between tenants in the batch gate."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.dataplane.apikeys import ApiKeyStore, RateLimiter
from fabricnode.dataplane.request import Rejection, Routed, decode, decode_as
from fabricnode.dataplane.routing import LoadSnapshot
from fabricnode.dataplane.tiers import (
    BATCH,
    INTERACTIVE,
    FairQueue,
    RoomRules,
    has_room,
    next_paced,
    owner_of,
    tier_of,
)

NOW = 1_750_000_000.0
RULES = RoomRules(kv_threshold=0.6, max_waiting=0, max_inflight=8, stale_after_s=3.0)


def load(waiting: int = 0, kv: float = 0.1, at: float = NOW) -> LoadSnapshot:
    return LoadSnapshot(waiting=waiting, running=4, kv_usage=kv, inflight=4, at=at)


# -- the headers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "tier"),
    [(b"batch", BATCH), (b"Batch", BATCH), (b" BATCH ", BATCH), (b"interactive", INTERACTIVE)],
)
def test_the_priority_header_names_a_tier_in_any_case(raw: bytes, tier: str) -> None:
    assert tier_of(raw) == tier


@pytest.mark.parametrize("raw", [b"", b"low", b"batch,interactive", b"\xff" * 100])
def test_any_other_priority_value_is_one_clear_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="X-Fabric-Priority") as info:
        tier_of(raw)
    assert "\n" not in str(info.value) and len(str(info.value)) < 120


TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def keys(tmp_path: Path) -> tuple[ApiKeyStore, dict[str, str]]:
    store = ApiKeyStore.load(tmp_path / "keys.json")
    token, alice = store.new_key("alice", rate_per_s=0.2, burst=1)
    _, gone = store.new_key("gone")
    store.revoke(gone.key_id)
    return store, {"alice": alice.key_id, "gone": gone.key_id, "alice-token": token}


def test_the_owner_header_speaks_for_an_active_key(
    keys: tuple[ApiKeyStore, dict[str, str]],
) -> None:
    store, ids = keys
    owned = owner_of(f"{TOKEN} {ids['alice']}".encode(), TOKEN, store)
    assert not isinstance(owned, Rejection)
    key, tenant = owned
    assert key is not None and key.name == "alice" and tenant == ids["alice"]


@pytest.mark.parametrize(
    "header",
    [
        "wrong-token {alice}",
        "{token}",  # no tenant
        "{token} ",
        "{token}x {alice}",
        "{token} {alice} extra",  # a tenant has no space
        "{alice}",
    ],
)
def test_a_wrong_or_malformed_owner_header_is_a_401(
    keys: tuple[ApiKeyStore, dict[str, str]], header: str
) -> None:
    store, ids = keys
    raw = header.format(token=TOKEN, alice=ids["alice"]).encode()
    refused = owner_of(raw, TOKEN, store)
    assert isinstance(refused, Rejection) and refused.status == 401
    assert refused.code == "invalid_batch_owner"


def test_without_a_token_no_owner_header_verifies(keys: tuple[ApiKeyStore, dict[str, str]]) -> None:
    store, ids = keys
    for token in (None, ""):
        refused = owner_of(f" {ids['alice']}".encode(), token, store)
        assert isinstance(refused, Rejection) and refused.status == 401


@pytest.mark.parametrize("who", ["gone", "unknown", "-"])
def test_an_owner_header_naming_no_active_key_is_a_401(
    keys: tuple[ApiKeyStore, dict[str, str]], who: str
) -> None:
    store, ids = keys
    tenant = ids.get(who, "0badc0de" if who == "unknown" else who)
    refused = owner_of(f"{TOKEN} {tenant}".encode(), TOKEN, store)
    assert isinstance(refused, Rejection) and refused.status == 401
    assert refused.code == "invalid_api_key"


def test_with_keys_off_the_owner_header_names_the_fair_share_tenant(tmp_path: Path) -> None:
    open_store = ApiKeyStore.load(tmp_path / "none.json")
    for store in (None, open_store):
        assert owner_of(f"{TOKEN} -".encode(), TOKEN, store) == (None, "-")
        assert owner_of(f"{TOKEN} team-7".encode(), TOKEN, store) == (None, "team-7")
        assert isinstance(owner_of(f"{TOKEN} {'x' * 65}".encode(), TOKEN, store), Rejection)


def test_the_owner_header_skips_the_keys_rate_limit(
    keys: tuple[ApiKeyStore, dict[str, str]],
) -> None:
    """alice may send one request per 5 s; her batch worker's requests are not limited (the
    gate governs batch work), while her own second request is a 429."""
    store, ids = keys
    limiter = RateLimiter()
    body = b'{"model": "m", "messages": []}'
    bearer = {b"authorization": b"Bearer " + ids["alice-token"].encode()}
    assert isinstance(decode("chat", bearer, body, store, limiter, 0.0), Routed)
    limited = decode("chat", bearer, body, store, limiter, 0.1)
    assert isinstance(limited, Rejection) and limited.status == 429
    for _ in range(20):
        owned = owner_of(f"{TOKEN} {ids['alice']}".encode(), TOKEN, store)
        assert not isinstance(owned, Rejection)
        decoded = decode_as("chat", {}, body, owned[0])
        assert isinstance(decoded, Routed) and decoded.key is not None
    assert limiter.statistics().allowed == 1


# -- room for batch work ------------------------------------------------------------------------


def test_a_fresh_report_with_no_queue_and_kv_below_the_threshold_has_room() -> None:
    assert has_room(load(), 0, NOW, RULES)
    assert has_room(load(), 7, NOW, RULES)


@pytest.mark.parametrize(
    ("report", "inflight", "why"),
    [
        (load(waiting=1), 0, "a queue"),
        (load(kv=0.6), 0, "KV at the threshold"),
        (load(kv=0.95), 0, "KV above it"),
        (load(kv=math.nan), 0, "KV unknown"),
        (load(), 8, "our cap reached"),
    ],
)
def test_no_room_on_a_fresh_report(report: LoadSnapshot, inflight: int, why: str) -> None:
    assert not has_room(report, inflight, NOW, RULES), why


@pytest.mark.parametrize("report", [None, load(at=NOW - 3.5), load(at=NOW + 10), load(at=math.nan)])
def test_without_a_fresh_report_a_node_takes_one_batch_request(report: LoadSnapshot | None) -> None:
    assert has_room(report, 0, NOW, RULES)
    assert not has_room(report, 1, NOW, RULES)


def test_the_thresholds_are_the_operators() -> None:
    loose = RoomRules(kv_threshold=0.9, max_waiting=2, max_inflight=1, stale_after_s=3.0)
    assert has_room(load(waiting=2, kv=0.8), 0, NOW, loose)
    assert not has_room(load(waiting=3), 0, NOW, loose)
    assert not has_room(load(), 1, NOW, loose)


# -- fair queueing ------------------------------------------------------------------------------


def closed_loop(
    queue: FairQueue[str],
    clients: dict[str, int],
    weights: dict[str, float],
    releases: int,
    *,
    slots: int = 2,
) -> Counter[str]:
    """Tenants with closed-loop clients (``clients[t]`` each) behind ``slots`` service slots:
    every client has one request queued or in service; a released request is served, and its
    client queues the next when the oldest request in service finishes (one per release).
    Returns the releases per tenant."""
    for tenant, n in clients.items():
        for _ in range(n):
            ticket, _ = queue.push(tenant, weights[tenant], "g", tenant)
            assert ticket is not None
    in_service: list[str] = []
    released: Counter[str] = Counter()
    for _ in range(releases):
        if len(in_service) == slots:
            done = in_service.pop(0)
            ticket, _ = queue.push(done, weights[done], "g", done)  # its client's next request
            assert ticket is not None
        ticket = next(queue.ordered())
        queue.grant(ticket)
        in_service.append(ticket.item)
        released[ticket.item] += 1
    return released


def test_a_tenant_offering_ten_times_the_load_gets_the_same_releases() -> None:
    released = closed_loop(FairQueue(4096), {"a": 40, "b": 4}, {"a": 1.0, "b": 1.0}, 1000)
    assert abs(released["a"] - released["b"]) <= 1, released


def test_weights_two_to_one_give_two_releases_to_one() -> None:
    released = closed_loop(FairQueue(4096), {"a": 10, "b": 10}, {"a": 2.0, "b": 1.0}, 900)
    assert abs(released["a"] - 2 * released["b"]) <= 2, released


def test_within_a_tenant_requests_keep_their_order() -> None:
    queue: FairQueue[int] = FairQueue(100)
    for i in range(5):
        queue.push("a", 1.0, "g", i)
    for i in range(5, 8):
        queue.push("b", 1.0, "g", i)
    order = []
    while len(queue):
        ticket = next(queue.ordered())
        queue.grant(ticket)
        order.append(ticket.item)
    assert order == [0, 5, 1, 6, 2, 7, 3, 4]


def test_an_idle_tenant_gets_no_credit_for_its_idle_time() -> None:
    """b was away while a was served alone; when b comes back it alternates with a rather
    than being released many times in a row."""
    queue: FairQueue[str] = FairQueue(100)
    for _ in range(30):
        queue.push("a", 1.0, "g", "a")
    for _ in range(20):
        queue.grant(next(queue.ordered()))
    for _ in range(5):
        queue.push("b", 1.0, "g", "b")
    order = []
    for _ in range(6):
        ticket = next(queue.ordered())
        queue.grant(ticket)
        order.append(ticket.item)
    assert order.count("b") <= 3 and order.count("a") >= 3


def test_the_gate_is_bounded_and_a_full_one_pushes_out_the_longest_queues_newest() -> None:
    queue: FairQueue[str] = FairQueue(4)
    tickets = [queue.push("a", 1.0, "g", f"a{i}")[0] for i in range(3)]
    assert all(t is not None for t in tickets)
    assert queue.push("b", 1.0, "g", "b0")[0] is not None
    # Full. a's next is refused: a holds the longest queue already.
    assert queue.push("a", 1.0, "g", "a3") == (None, None)
    # c has none: a's newest makes room for it.
    ticket, pushed_out = queue.push("c", 1.0, "g", "c0")
    assert ticket is not None and pushed_out is not None and pushed_out.item == "a2"
    assert not pushed_out.live and len(queue) == 4
    # Now a has 2, b 1, c 1: b's second would leave b with as many as a, so it is refused.
    assert queue.push("b", 1.0, "g", "b1") == (None, None)
    stats = queue.statistics()
    assert (stats.waiting, stats.tenants, stats.refused, stats.pushed_out) == (4, 3, 2, 1)


def test_tenants_are_forgotten_once_they_have_no_waiter() -> None:
    queue: FairQueue[str] = FairQueue(10_000)
    for i in range(5000):
        ticket, _ = queue.push(f"t{i}", 1.0, "g", "x")
        assert ticket is not None
        if i % 2:
            queue.cancel(ticket)
        else:
            queue.grant(ticket)
    assert queue.statistics().tenants == 0 and len(queue) == 0 and queue.groups() == 0


def test_cancelling_the_newest_waiter_gives_its_tenant_its_turn_back() -> None:
    queue: FairQueue[str] = FairQueue(100)
    queue.push("a", 1.0, "g", "a0")
    queue.push("a", 1.0, "g", "a1")
    ticket, _ = queue.push("a", 1.0, "g", "a2")
    assert ticket is not None
    queue.cancel(ticket)
    again, _ = queue.push("a", 1.0, "g", "a2'")
    assert again is not None and again.tag == ticket.tag


def test_groups_count_the_waiters_filters() -> None:
    queue: FairQueue[str] = FairQueue(100)
    x, _ = queue.push("a", 1.0, ("m1",), "x")
    y, _ = queue.push("b", 1.0, ("m2",), "y")
    queue.push("b", 1.0, ("m1",), "z")
    assert queue.groups() == 2
    assert x is not None and y is not None
    queue.grant(y)
    assert queue.groups() == 1
    queue.cancel(x)
    assert queue.groups() == 1  # z still waits for m1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["push", "grant", "cancel"]),
            st.integers(0, 5),  # tenant
            st.sampled_from([0.5, 1.0, 2.0]),  # weight
            st.integers(0, 30),  # which waiter
        ),
        max_size=200,
    )
)
def test_the_queue_stays_consistent_whatever_happens(
    ops: list[tuple[str, int, float, int]],
) -> None:
    """Counts, groups and tenants match the waiters; every tenant's waiters come out in the
    order they came; release order is by start tag; memory stays bounded."""
    queue: FairQueue[int] = FairQueue(16)
    live: dict[int, object] = {}
    seq = 0
    for what, tenant, weight, which in ops:
        if what == "push":
            seq += 1
            ticket, pushed_out = queue.push(f"t{tenant}", weight, tenant % 2, seq)
            if ticket is not None:
                live[seq] = ticket
            if pushed_out is not None:
                del live[pushed_out.item]
        elif live:
            ordered = list(queue.ordered())
            ticket = ordered[which % len(ordered)]
            if what == "grant":
                queue.grant(ticket)
            else:
                queue.cancel(ticket)
            del live[ticket.item]
        ordered = list(queue.ordered())
        assert sorted(t.item for t in ordered) == sorted(live) == sorted(t.item for t in queue)
        assert len(queue) == len(live) <= 16
        assert [(t.tag, t.seq) for t in ordered] == sorted((t.tag, t.seq) for t in ordered)
        by_tenant: dict[str, list[int]] = {}
        for t in ordered:
            by_tenant.setdefault(t.tenant, []).append(t.item)
        assert all(items == sorted(items) for items in by_tenant.values())
        assert queue.groups() == len({t.group for t in ordered})
        assert queue.statistics().tenants == len(by_tenant)
        assert all(len(s.queue) <= 2 * s.live + 1 for s in queue._tenants.values())


def test_pacing_spaces_a_nodes_batch_requests_by_their_prompt_tokens() -> None:
    # 1000 tokens at 4000 tokens/s hold the next request back 0.25 s
    assert next_paced(0.0, 10.0, 1000, 4000.0) == 10.25
    # sent while still paced: the delays add up
    assert next_paced(10.25, 10.1, 2000, 4000.0) == 10.75
    # no credit for idle time: a node idle for a minute still takes one request at a time
    assert next_paced(5.0, 65.0, 400, 4000.0) == 65.1
    assert next_paced(0.0, 1.0, 0, 1000.0) == 1.001  # an empty prompt still costs a token
