"""The registry CRDT: lattice laws, convergence, lifecycle, GC and lifetime rules.

Entries are signed by a few pre-generated owners (``Identity.from_seed``) and one shared
``Verifier`` caches signature checks, so Hypothesis spends its time on orderings, not on crypto.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from fabricnode.errors import DecodeError
from fabricnode.mesh.identity import Identity, Verifier
from fabricnode.mesh.registry import (
    MAX_LABEL_VALUE,
    Hardware,
    MergeOutcome,
    ModelInfo,
    Registry,
    RegistryLimits,
    SignedEntry,
    State,
    join,
)
from fabricnode.mesh.schema import PARENTS_LABEL, model_parents, parents_labels
from fabricnode.testing.simnet import make_body

T0 = 1_750_000_000.0  # "now" of most tests: every pool entry is live then
OWNERS = [Identity.from_seed(f"registry-owner-{i}".encode()) for i in range(3)]
VERIFIER = Verifier(cache_size=1 << 16)
LIMITS = RegistryLimits()  # terminal_hold_s=300, max_entry_ttl_s=7200, max_clock_skew_s=60

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sign(
    owner: Identity,
    state: State = State.JOIN,
    version: int = 1,
    *,
    updated_at: float = T0,
    ttl_s: float = 3600.0,
    **changes: object,
) -> SignedEntry:
    """An entry of ``owner`` signed by its own key (what an honest or buggy owner can emit)."""
    body = make_body(owner, f"{owner.session_id[:8]}:7946", updated_at, ttl_s=ttl_s)
    body = replace(body, state=state, version=version, **changes)  # type: ignore[arg-type]
    return body.sign(owner)


def _pool_entry(owner: Identity, state: State, version: int, variant: int) -> SignedEntry:
    # Version v is signed at T0 - 100 + v, so its lease and terminal hold cover T0.
    return sign(
        owner,
        state,
        version,
        updated_at=T0 - 100 + version,
        labels=(("variant", str(variant)),),
    )


# Every (state, version) of every owner, twice with different content (same rank, other
# digest): covers state rollbacks (higher version, lower state) and equivocation ties.
POOL: list[list[SignedEntry]] = [
    [
        _pool_entry(owner, state, version, variant)
        for state in State
        for version in range(1, 5)
        for variant in range(2)
    ]
    for owner in OWNERS
]
ALL_ENTRIES = [e for entries in POOL for e in entries]


def same_session(n: int) -> st.SearchStrategy[list[SignedEntry]]:
    return st.sampled_from(POOL).flatmap(
        lambda entries: st.lists(st.sampled_from(entries), min_size=n, max_size=n)
    )


def registry_of(entries: list[SignedEntry], now: float = T0) -> Registry:
    reg = Registry(VERIFIER, LIMITS)
    for e in entries:
        reg.merge(e, now)
    return reg


def expected_digest(entries: list[SignedEntry]) -> dict[str, tuple[int, int, bytes]]:
    best: dict[str, SignedEntry] = {}
    for e in entries:
        best[e.session_id] = join(best[e.session_id], e) if e.session_id in best else e
    return {sid: e.rank for sid, e in best.items()}


# -- lattice laws of join ------------------------------------------------------------------------


@FAST
@given(same_session(2))
def test_join_is_commutative(pair: list[SignedEntry]) -> None:
    a, b = pair
    assert join(a, b) == join(b, a)
    assert join(a, b).rank == join(b, a).rank


@FAST
@given(same_session(3))
def test_join_is_associative(triple: list[SignedEntry]) -> None:
    a, b, c = triple
    assert join(join(a, b), c) == join(a, join(b, c))


@FAST
@given(same_session(1))
def test_join_is_idempotent(single: list[SignedEntry]) -> None:
    (a,) = single
    assert join(a, a) is a


@FAST
@given(same_session(2))
def test_join_is_inflationary_and_picks_an_input(pair: list[SignedEntry]) -> None:
    a, b = pair
    j = join(a, b)
    assert j.rank >= a.rank and j.rank >= b.rank
    assert j is a or j is b


def test_join_of_different_sessions_is_refused() -> None:
    with pytest.raises(ValueError, match="different sessions"):
        join(POOL[0][0], POOL[1][0])


def test_same_rank_entries_are_ordered_by_digest() -> None:
    a, b = sign(OWNERS[0], labels=(("x", "1"),)), sign(OWNERS[0], labels=(("x", "2"),))
    assert (a.body.state, a.body.version) == (b.body.state, b.body.version)
    assert a.digest != b.digest
    winner = a if a.digest > b.digest else b
    assert join(a, b) is winner and join(b, a) is winner


# -- lattice laws of Registry.merge ----------------------------------------------------------


@FAST
@given(st.lists(st.sampled_from(ALL_ENTRIES), max_size=30), st.randoms(use_true_random=False))
def test_merge_order_does_not_matter(entries: list[SignedEntry], rnd: random.Random) -> None:
    shuffled = list(entries)
    rnd.shuffle(shuffled)
    assert registry_of(entries).digest() == registry_of(shuffled).digest()
    assert registry_of(entries).digest() == expected_digest(entries)


@FAST
@given(
    st.lists(st.sampled_from(ALL_ENTRIES), max_size=15),
    st.lists(st.sampled_from(ALL_ENTRIES), max_size=15),
    st.lists(st.sampled_from(ALL_ENTRIES), max_size=15),
)
def test_registry_union_is_commutative_and_associative(
    xs: list[SignedEntry], ys: list[SignedEntry], zs: list[SignedEntry]
) -> None:
    def union(a: Registry, b: Registry) -> Registry:
        return registry_of([*a, *b])

    ra, rb, rc = registry_of(xs), registry_of(ys), registry_of(zs)
    assert union(ra, rb).digest() == union(rb, ra).digest()
    assert union(union(ra, rb), rc).digest() == union(ra, union(rb, rc)).digest()


@FAST
@given(st.lists(st.sampled_from(ALL_ENTRIES), min_size=1, max_size=20))
def test_merge_is_idempotent(entries: list[SignedEntry]) -> None:
    reg = registry_of(entries)
    before = reg.digest()
    outcomes = [reg.merge(e, T0) for e in entries]
    assert reg.digest() == before
    assert all(o is MergeOutcome.STALE for o in outcomes)


@FAST
@given(st.lists(st.sampled_from(ALL_ENTRIES), max_size=30))
def test_merge_never_lowers_a_sessions_rank(entries: list[SignedEntry]) -> None:
    reg = Registry(VERIFIER, LIMITS)
    for e in entries:
        before = reg.digest()
        outcome = reg.merge(e, T0)
        after = reg.digest()
        assert set(before) <= set(after)
        assert all(after[sid] >= rank for sid, rank in before.items())
        assert outcome.changed == (after != before)
        assert after[e.session_id] >= e.rank


# -- convergence under arbitrary delivery ------------------------------------------------------


def _timeline(owner: Identity, steps: list[tuple[State, int]]) -> list[SignedEntry]:
    return [
        sign(owner, state, version, updated_at=T0 - 50 + version, labels=(("step", str(i)),))
        for i, (state, version) in enumerate(steps)
    ]


J, S, D, L = State.JOIN, State.SERVING, State.DOWN, State.LEFT
TIMELINES = [
    # An honest owner: versions increase, states never go back.
    _timeline(OWNERS[0], [(J, 1), (J, 2), (S, 3), (S, 4), (S, 5), (D, 6), (L, 7)]),
    _timeline(OWNERS[1], [(J, 1), (S, 2), (S, 3), (L, 4)]),
    # A buggy owner: two different entries at the same rank, then a state rollback.
    _timeline(OWNERS[2], [(J, 1), (J, 1), (S, 2), (S, 2), (J, 3), (S, 4)]),
]
N_REPLICAS = 3


class RegistryConvergence(RuleBasedStateMachine):
    """Replicas receive entries in any order, duplicated, lost and repaired by anti-entropy."""

    messages = Bundle("messages")

    def __init__(self) -> None:
        super().__init__()
        self.replicas = [Registry(VERIFIER, LIMITS) for _ in range(N_REPLICAS)]
        self.published: list[SignedEntry] = []
        self.next_step = [0] * len(OWNERS)
        self.last_digest: list[dict[str, tuple[int, int, bytes]]] = [{} for _ in self.replicas]

    @rule(target=messages, owner=st.integers(0, len(OWNERS) - 1))
    def owner_signs_next_entry(self, owner: int) -> SignedEntry:
        step = self.next_step[owner]
        entry = TIMELINES[owner][min(step, len(TIMELINES[owner]) - 1)]
        self.next_step[owner] = step + 1
        if entry not in self.published:
            self.published.append(entry)
        # One in-flight copy per replica; the bundle lets Hypothesis reorder and duplicate.
        return entry

    @rule(msg=messages, replica=st.integers(0, N_REPLICAS - 1))
    def deliver(self, msg: SignedEntry, replica: int) -> None:
        self.replicas[replica].merge(msg, T0)

    @rule(msg=consumes(messages))
    def lose(self, msg: SignedEntry) -> None:
        pass  # a dropped datagram: only anti-entropy can repair it

    @rule(src=st.integers(0, N_REPLICAS - 1), dst=st.integers(0, N_REPLICAS - 1))
    def anti_entropy(self, src: int, dst: int) -> None:
        for e in self.replicas[src]:
            self.replicas[dst].merge(e, T0)

    @rule(data=st.data())
    def replay_old_entry(self, data: st.DataObject) -> None:
        if self.published:
            entry = data.draw(st.sampled_from(self.published))
            self.replicas[data.draw(st.integers(0, N_REPLICAS - 1))].merge(entry, T0)

    @rule()
    def deliver_everything_then_replicas_agree(self) -> None:
        self._deliver_all_and_check()

    @invariant()
    def ranks_never_decrease(self) -> None:
        for i, reg in enumerate(self.replicas):
            digest = reg.digest()
            old = self.last_digest[i]
            assert set(old) <= set(digest)
            assert all(digest[sid] >= rank for sid, rank in old.items())
            self.last_digest[i] = digest

    @invariant()
    def replicas_hold_only_published_entries(self) -> None:
        for reg in self.replicas:
            for e in reg:
                assert e in self.published

    def teardown(self) -> None:
        self._deliver_all_and_check()

    def _deliver_all_and_check(self) -> None:
        for reg in self.replicas:
            for e in reversed(self.published):
                reg.merge(e, T0)
        expected = expected_digest(self.published)
        for reg in self.replicas:
            assert reg.digest() == expected


RegistryConvergence.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRegistryConvergence = RegistryConvergence.TestCase


# -- lifecycle --------------------------------------------------------------------------------


def test_state_rollback_with_higher_version_loses() -> None:
    left = sign(OWNERS[0], State.LEFT, 3)
    rollback = sign(OWNERS[0], State.JOIN, 9)  # owner-signed, higher version, lower state
    for order in ([left, rollback], [rollback, left]):
        reg = registry_of(order)
        assert reg.get(OWNERS[0].session_id) == left
    reg = registry_of([left])
    assert reg.merge(rollback, T0) is MergeOutcome.STALE


def test_higher_version_in_same_state_wins() -> None:
    v1, v2 = sign(OWNERS[0], State.SERVING, 1), sign(OWNERS[0], State.SERVING, 2)
    reg = registry_of([v1])
    assert reg.merge(v2, T0) is MergeOutcome.UPDATED
    assert reg.merge(v1, T0) is MergeOutcome.STALE
    assert reg.get(OWNERS[0].session_id) == v2


def test_successor_refuses_to_move_lifecycle_backwards() -> None:
    body = sign(OWNERS[0], State.DOWN, 4).body
    assert body.successor(state=State.LEFT).version == 5
    with pytest.raises(ValueError, match="lifecycle cannot go from down to serving"):
        body.successor(state=State.SERVING)


def test_entry_can_only_be_signed_by_its_own_key() -> None:
    body = sign(OWNERS[0]).body
    with pytest.raises(ValueError, match="own session key"):
        body.sign(OWNERS[1])


def test_oversized_entry_cannot_be_signed() -> None:
    labels = tuple((f"k{i}", "v" * 250) for i in range(64))
    with pytest.raises(ValueError, match="exceeds"):
        sign(OWNERS[0], labels=labels)


# -- signatures at the registry -----------------------------------------------------------------


def test_entry_signed_by_another_key_never_enters() -> None:
    victim, forger = OWNERS[0], OWNERS[1]
    body = sign(victim, State.SERVING, 7).body
    forged = SignedEntry(body, body.canonical_bytes(), forger.sign(body.canonical_bytes()))
    reg = registry_of([sign(victim)])
    assert reg.merge(forged, T0) is MergeOutcome.INVALID
    assert reg.get(victim.session_id).body.version == 1  # type: ignore[union-attr]


def test_entry_whose_key_does_not_hash_to_its_id_never_enters() -> None:
    victim, forger = OWNERS[0], OWNERS[1]
    # The forger signs with its own key but claims the victim's session id.
    body = replace(sign(forger, State.SERVING, 7).body, session_id=victim.session_id)
    forged = SignedEntry(body, body.canonical_bytes(), forger.sign(body.canonical_bytes()))
    reg = Registry(VERIFIER, LIMITS)
    assert reg.merge(forged, T0) is MergeOutcome.INVALID
    assert victim.session_id not in reg


def test_entry_with_tampered_signed_bytes_never_enters() -> None:
    good = sign(OWNERS[0], State.SERVING, 2)
    tampered = SignedEntry(good.body, good.signed_bytes[:-1] + b"\x00", good.signature)
    assert Registry(VERIFIER, LIMITS).merge(tampered, T0) is MergeOutcome.INVALID


# -- lifetime validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("skew_s", "outcome"),
    [(0.0, MergeOutcome.NEW), (60.0, MergeOutcome.NEW), (60.5, MergeOutcome.INVALID)],
)
def test_future_dated_entry_is_refused_beyond_clock_skew(
    skew_s: float, outcome: MergeOutcome
) -> None:
    entry = sign(OWNERS[0], updated_at=T0 + skew_s)
    assert Registry(VERIFIER, LIMITS).merge(entry, T0) is outcome


@pytest.mark.parametrize(
    ("ttl_s", "outcome"),
    [
        (7200.0, MergeOutcome.NEW),
        (7200.5, MergeOutcome.INVALID),
        (10 * 86400, MergeOutcome.INVALID),
    ],
)
def test_lease_longer_than_max_entry_ttl_is_refused(ttl_s: float, outcome: MergeOutcome) -> None:
    entry = sign(OWNERS[0], ttl_s=ttl_s)
    assert Registry(VERIFIER, LIMITS).merge(entry, T0) is outcome


def test_entry_started_after_its_update_time_is_refused() -> None:
    entry = sign(OWNERS[0], started_at=T0 + 10)
    assert Registry(VERIFIER, LIMITS).merge(entry, T0 + 20) is MergeOutcome.INVALID


def test_entry_already_past_its_lease_is_refused_as_expired() -> None:
    entry = sign(OWNERS[0], updated_at=T0, ttl_s=100)
    assert Registry(VERIFIER, LIMITS).merge(entry, T0 + 100) is MergeOutcome.EXPIRED


def test_invalid_entries_are_counted_in_statistics() -> None:
    reg = Registry(VERIFIER, LIMITS)
    reg.merge(sign(OWNERS[0], ttl_s=99999), T0)
    reg.merge(sign(OWNERS[1]), T0)
    reg.merge(sign(OWNERS[1]), T0)
    stats = reg.statistics()
    assert stats.merges["invalid"] == 1
    assert stats.merges["new"] == 1
    assert stats.merges["stale"] == 1
    assert stats.entries == 1


# -- garbage collection -----------------------------------------------------------------------


def test_expired_entry_is_collected_and_never_resurrected_by_anti_entropy() -> None:
    owner = OWNERS[0]
    entry = sign(owner, State.SERVING, 2, updated_at=T0, ttl_s=100)
    collector, laggard = registry_of([entry]), registry_of([entry])
    assert collector.gc(T0 + 99) == []
    assert collector.gc(T0 + 100) == [owner.session_id]
    assert owner.session_id not in collector
    assert collector.is_tombstoned(owner.session_id)
    # The laggard has not collected yet and offers its copy in anti-entropy.
    assert owner.session_id in laggard
    for e in laggard:
        assert collector.merge(e, T0 + 101) is MergeOutcome.EXPIRED
    assert owner.session_id not in collector
    # Long after the tombstone is forgotten, the copy's own expiry still keeps it out.
    later = T0 + LIMITS.max_entry_ttl_s + LIMITS.max_clock_skew_s + 1
    collector.gc(later)
    assert not collector.is_tombstoned(owner.session_id)
    assert collector.merge(entry, later) is MergeOutcome.EXPIRED


def test_left_entry_is_collected_after_terminal_hold() -> None:
    owner = OWNERS[0]
    serving = sign(owner, State.SERVING, 2, updated_at=T0 - 10, ttl_s=3600)
    left = sign(owner, State.LEFT, 3, updated_at=T0, ttl_s=3600)
    reg = registry_of([serving, left])
    hold = LIMITS.terminal_hold_s
    assert reg.next_gc_at() == T0 + hold
    assert reg.gc(T0 + hold - 1) == []
    assert reg.gc(T0 + hold) == [owner.session_id]
    # Neither the LEFT copy nor the older SERVING one (whose lease still runs) come back.
    assert reg.merge(left, T0 + hold + 1) is MergeOutcome.EXPIRED
    assert reg.merge(serving, T0 + hold + 1) is MergeOutcome.EXPIRED
    assert owner.session_id not in reg
    assert reg.statistics().tombstones == 1


def test_older_version_after_tombstone_is_forgotten_is_still_refused() -> None:
    owner = OWNERS[0]
    serving = sign(owner, State.SERVING, 2, updated_at=T0 - 10, ttl_s=LIMITS.max_entry_ttl_s)
    left = sign(owner, State.LEFT, 3, updated_at=T0)
    reg = registry_of([serving, left])
    reg.gc(T0 + LIMITS.terminal_hold_s)
    forget_at = T0 + LIMITS.max_entry_ttl_s + LIMITS.max_clock_skew_s
    reg.gc(forget_at)
    assert not reg.is_tombstoned(owner.session_id)
    assert reg.merge(serving, forget_at) is MergeOutcome.EXPIRED
    assert reg.next_gc_at() is None


def test_genuinely_newer_version_after_gc_is_accepted() -> None:
    owner = OWNERS[0]
    old = sign(owner, State.SERVING, 2, updated_at=T0, ttl_s=100)
    reg = registry_of([old])
    reg.gc(T0 + 200)
    assert reg.is_tombstoned(owner.session_id)
    renewed = sign(owner, State.SERVING, 3, updated_at=T0 + 200, ttl_s=3600)
    assert reg.merge(renewed, T0 + 200) is MergeOutcome.NEW
    assert reg.get(owner.session_id) == renewed
    # The session is live again: it must not also be reported as collected.
    assert not reg.is_tombstoned(owner.session_id)
    assert reg.merge(old, T0 + 201) is MergeOutcome.STALE


def test_gc_keeps_live_entries_and_reports_next_deadline() -> None:
    short = sign(OWNERS[0], ttl_s=100)
    long = sign(OWNERS[1], ttl_s=1000)
    down = sign(OWNERS[2], State.DOWN, 2, ttl_s=3600)
    reg = registry_of([short, long, down])
    assert reg.next_gc_at() == T0 + 100
    assert reg.gc(T0 + 150) == [OWNERS[0].session_id]
    assert reg.next_gc_at() == T0 + LIMITS.terminal_hold_s
    assert sorted(reg.gc(T0 + 1000)) == sorted([OWNERS[1].session_id, OWNERS[2].session_id])
    assert len(reg) == 0


@FAST
@given(
    st.lists(st.sampled_from(ALL_ENTRIES), min_size=1, max_size=20),
    st.floats(min_value=T0, max_value=T0 + 4000),
    st.randoms(use_true_random=False),
)
def test_replicas_that_saw_everything_agree_after_gc(
    entries: list[SignedEntry], gc_time: float, rnd: random.Random
) -> None:
    a = registry_of(entries)
    shuffled = list(entries)
    rnd.shuffle(shuffled)
    b = registry_of(shuffled)
    a.gc(gc_time)
    # b collects later, after a has already offered it everything again.
    for e in entries:
        a.merge(e, gc_time)
    for e in a:
        b.merge(e, gc_time)
    b.gc(gc_time)
    for e in b:
        a.merge(e, gc_time)
    assert a.digest() == b.digest()
    hold = LIMITS.terminal_hold_s
    assert all(e.gc_at(hold) > gc_time for e in a)


def test_refreshed_lease_is_not_collected_at_the_old_expiry() -> None:
    owner = OWNERS[0]
    reg = registry_of([sign(owner, State.SERVING, 2, updated_at=T0, ttl_s=100)])
    refreshed = sign(owner, State.SERVING, 3, updated_at=T0 + 50, ttl_s=100)
    assert reg.merge(refreshed, T0 + 50) is MergeOutcome.UPDATED
    assert reg.gc(T0 + 120) == []
    assert reg.get(owner.session_id) == refreshed
    assert reg.gc(T0 + 150) == [owner.session_id]


def test_terminal_state_is_collected_before_the_older_lease_ends() -> None:
    owner = OWNERS[0]
    reg = registry_of([sign(owner, State.SERVING, 2, updated_at=T0, ttl_s=3600)])
    reg.merge(sign(owner, State.DOWN, 3, updated_at=T0 + 10, ttl_s=3600), T0 + 10)
    assert reg.gc(T0 + 10 + LIMITS.terminal_hold_s) == [owner.session_id]


class ReferenceRegistry:
    """The obvious O(n) registry, without signatures: what ``Registry`` must behave like."""

    def __init__(self) -> None:
        self.entries: dict[str, SignedEntry] = {}
        self.tombs: dict[str, tuple[tuple[int, int, bytes], float]] = {}

    def merge(self, e: SignedEntry, now: float) -> MergeOutcome:
        sid, b = e.session_id, e.body
        cur = self.entries.get(sid)
        if cur is not None and e.rank <= cur.rank:
            return MergeOutcome.STALE
        if sid in self.tombs and e.rank <= self.tombs[sid][0]:
            return MergeOutcome.EXPIRED
        if b.updated_at > now + LIMITS.max_clock_skew_s:
            return MergeOutcome.INVALID
        if b.expires_at > b.updated_at + LIMITS.max_entry_ttl_s:
            return MergeOutcome.INVALID
        if now >= e.gc_at(LIMITS.terminal_hold_s):
            if cur is None:
                return MergeOutcome.EXPIRED
            # A newer, already collectable entry: ours goes too, tombstoned by the newer one.
            del self.entries[sid]
            until = b.updated_at + LIMITS.max_entry_ttl_s + LIMITS.max_clock_skew_s
            self.tombs[sid] = (e.rank, max(until, now))
            return MergeOutcome.COLLECTED
        self.entries[sid] = e
        self.tombs.pop(sid, None)
        return MergeOutcome.NEW if cur is None else MergeOutcome.UPDATED

    def gc(self, now: float) -> list[str]:
        gone = [s for s, e in self.entries.items() if now >= e.gc_at(LIMITS.terminal_hold_s)]
        for sid in gone:
            e = self.entries.pop(sid)
            until = e.body.updated_at + LIMITS.max_entry_ttl_s + LIMITS.max_clock_skew_s
            self.tombs[sid] = (e.rank, max(until, now))
        for sid in [s for s, (_, until) in self.tombs.items() if now >= until]:
            del self.tombs[sid]
        return gone


# Entries signed at different times with short, medium and long leases.
TIMED_POOL = [
    sign(owner, state, version, updated_at=T0 + 200 * version, ttl_s=ttl)
    for owner in OWNERS
    for state in State
    for version in range(1, 5)
    for ttl in (50.0, 500.0, 7000.0)
]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(TIMED_POOL),
            st.floats(min_value=0, max_value=2000),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_gc_behaves_like_the_reference_registry(ops: list[tuple[SignedEntry, float, bool]]) -> None:
    reg, ref = Registry(VERIFIER, LIMITS), ReferenceRegistry()
    now = T0
    for entry, dt, collect in ops:
        now += dt
        assert reg.merge(entry, now) is ref.merge(entry, now)
        if collect:
            assert sorted(reg.gc(now)) == sorted(ref.gc(now))
            assert all(e.gc_at(LIMITS.terminal_hold_s) > now for e in reg)
        assert reg.digest() == {sid: e.rank for sid, e in ref.entries.items()}
        for owner in OWNERS:
            assert reg.is_tombstoned(owner.session_id) == (owner.session_id in ref.tombs)
    next_gc = reg.next_gc_at()
    if ref.entries:
        assert next_gc is not None
        assert next_gc <= min(e.gc_at(LIMITS.terminal_hold_s) for e in ref.entries.values())


# -- queries ------------------------------------------------------------------------------------


@pytest.fixture
def catalogue() -> Registry:
    a100 = Hardware("A100", 4, 80.0, "gpu1")
    h100 = Hardware("H100", 8, 80.0, "gpu2")
    return registry_of(
        [
            sign(
                OWNERS[0],
                State.SERVING,
                2,
                hardware=a100,
                models=(ModelInfo("llama-8b", 8192), ModelInfo("qwen-7b")),
                labels=(("site", "a"), ("tier", "gold")),
            ),
            sign(
                OWNERS[1],
                State.SERVING,
                2,
                hardware=h100,
                models=(ModelInfo("llama-70b", 32768, "fp8"),),
                labels=(("site", "b"),),
            ),
            sign(OWNERS[2], State.JOIN, 1, hardware=a100, labels=(("site", "a"),)),
        ]
    )


def _ids(entries: list[SignedEntry]) -> set[str]:
    return {e.session_id for e in entries}


def test_query_by_state(catalogue: Registry) -> None:
    assert _ids(catalogue.query(state=State.SERVING)) == {
        OWNERS[0].session_id,
        OWNERS[1].session_id,
    }
    assert _ids(catalogue.query(state=State.JOIN)) == {OWNERS[2].session_id}
    assert catalogue.query(state=State.LEFT) == []


def test_query_by_model(catalogue: Registry) -> None:
    assert _ids(catalogue.query(model="qwen-7b")) == {OWNERS[0].session_id}
    assert _ids(catalogue.query(model="llama-70b")) == {OWNERS[1].session_id}
    assert catalogue.query(model="llama") == []  # exact ids, no prefix match


def test_query_by_gpu_is_case_insensitive(catalogue: Registry) -> None:
    assert _ids(catalogue.query(gpu="a100")) == {OWNERS[0].session_id, OWNERS[2].session_id}
    assert _ids(catalogue.query(gpu="H100")) == {OWNERS[1].session_id}
    assert catalogue.query(gpu="MI300") == []


def test_query_by_labels_requires_all(catalogue: Registry) -> None:
    assert _ids(catalogue.query(labels=[("site", "a")])) == {
        OWNERS[0].session_id,
        OWNERS[2].session_id,
    }
    assert _ids(catalogue.query(labels=[("site", "a"), ("tier", "gold")])) == {OWNERS[0].session_id}
    assert catalogue.query(labels=[("site", "c")]) == []


def test_query_filters_combine(catalogue: Registry) -> None:
    assert _ids(catalogue.query(state=State.SERVING, gpu="A100", labels=[("site", "a")])) == {
        OWNERS[0].session_id
    }
    assert catalogue.query(state=State.JOIN, model="llama-8b") == []
    assert len(catalogue.query()) == 3


def test_statistics_count_entries_by_state(catalogue: Registry) -> None:
    stats = catalogue.statistics()
    assert stats.entries == 3
    assert stats.by_state == {"join": 1, "serving": 2, "down": 0, "left": 0}


def test_state_parse_accepts_labels_and_explains_errors() -> None:
    assert State.parse("Serving") is State.SERVING
    with pytest.raises(ValueError, match=r"join\|serving\|down\|left"):
        State.parse("running")


# -- bounds on what a key holder can make every replica store -----------------------------------


def test_new_sessions_past_the_caps_are_refused_and_counted() -> None:
    limits = RegistryLimits(max_entries=5, max_entries_per_provider=3)
    reg = Registry(VERIFIER, limits)
    owners = [Identity.from_seed(f"cap-{i}".encode()) for i in range(8)]
    outcomes = [reg.merge(sign(o, provider="flood"), T0) for o in owners[:4]]
    assert [o.value for o in outcomes] == ["new", "new", "new", "full"]  # 3 per provider
    assert reg.merge(sign(owners[4], provider="lab-a"), T0) is MergeOutcome.NEW
    assert reg.merge(sign(owners[5], provider="lab-b"), T0) is MergeOutcome.NEW
    assert reg.merge(sign(owners[6], provider="lab-c"), T0) is MergeOutcome.FULL  # 5 in all
    # Sessions already held still move on (a full registry never freezes a live node) ...
    assert reg.merge(sign(owners[0], State.SERVING, 2, provider="flood"), T0).changed
    # ... and this node's own entry is always taken.
    assert reg.merge(sign(owners[7], provider="lab-c"), T0, own=True) is MergeOutcome.NEW
    assert reg.statistics().merges["full"] == 2
    # Room comes back as entries are collected: the provider's share first, then the total.
    later = T0 + 1
    for owner, provider in ((owners[1], "flood"), (owners[5], "lab-b")):
        left = sign(owner, State.LEFT, 2, provider=provider)
        reg.merge(left, T0)
        later = max(later, left.gc_at(limits.terminal_hold_s) + 1)
    reg.gc(later)
    assert len(reg) == 4
    assert reg.merge(sign(owners[3], provider="flood", updated_at=later), later).changed
    assert (
        reg.merge(sign(owners[6], provider="lab-c", updated_at=later), later) is MergeOutcome.FULL
    )


# -- adopting another replica's state -------------------------------------------------------------


@FAST
@given(
    st.lists(st.sampled_from(ALL_ENTRIES), max_size=15),
    st.lists(st.sampled_from(ALL_ENTRIES), max_size=15),
    st.sampled_from([*(o.session_id for o in OWNERS), "none"]),
)
def test_adopting_a_replica_equals_merging_each_of_its_entries(
    xs: list[SignedEntry], ys: list[SignedEntry], excluded: str
) -> None:
    source, reg = registry_of(xs), registry_of(ys)
    reg.adopt(source, exclude=(excluded,))
    expected = registry_of([*ys, *(x for x in xs if x.session_id != excluded)])
    assert reg.digest() == expected.digest()
    assert reg._per_provider == expected._per_provider  # the caps count what was adopted
    later = T0 + 10 * LIMITS.max_entry_ttl_s
    assert sorted(reg.gc(later)) == sorted(expected.gc(later))
    assert reg._per_provider == expected._per_provider == {}


def test_adopting_never_brings_back_a_collected_entry() -> None:
    owner = OWNERS[0]
    entry = sign(owner, State.SERVING, 2, updated_at=T0, ttl_s=100)
    collector, laggard = registry_of([entry]), registry_of([entry])
    collector.gc(T0 + 100)
    collector.adopt(laggard)
    assert owner.session_id not in collector and collector.is_tombstoned(owner.session_id)
    laggard.adopt(collector)  # the tombstone travels too and covers the older copy
    assert owner.session_id not in laggard and laggard.is_tombstoned(owner.session_id)


def test_a_label_value_peers_would_refuse_is_never_signed() -> None:
    ident = Identity.generate()
    body = make_body(ident, "10.0.0.9:7946", 1000.0)
    replace(body, labels=(("k", "v" * MAX_LABEL_VALUE),)).sign(ident)
    too_long = replace(body, labels=(("k", "v" * (MAX_LABEL_VALUE + 1)),))
    with pytest.raises(ValueError, match="too long"):
        too_long.sign(ident)


def test_which_models_are_adapters_rides_in_a_label_every_peer_decodes() -> None:
    # The model row keeps its three fields (what every peer decodes, so older agents carry
    # the entry); an adapter's parent is the fabric.parents label: parent indices by model.
    owner = OWNERS[0]
    models = (ModelInfo("base", 512), ModelInfo("lora-a"), ModelInfo("other", 8), ModelInfo("b"))
    labels = parents_labels(models, {"lora-a": "base", "b": "other", "other": "missing"})
    assert labels == ((PARENTS_LABEL, ",0,,2"),)
    body = replace(make_body(owner, "10.0.0.1:7946", T0), models=models, labels=labels)
    entry = SignedEntry.from_wire(body.sign(owner).to_wire())
    assert entry.verify(VERIFIER)
    rows = entry.body.fields()[8]
    assert isinstance(rows, list) and all(len(row) == 3 for row in rows)
    assert model_parents(entry.body) == {"lora-a": "base", "b": "other"}
    assert parents_labels(models, {}) == ()
    assert parents_labels(models, {"base": "base"}) == ()  # not its own parent


@pytest.mark.parametrize(
    "value", ["", "0", ",0,", ",4", ",-1", ",x", ",0,0,0", ",²", ",00 ", ",1", ",000"]
)
def test_a_parents_label_that_does_not_match_the_models_says_nothing_wrong(value: str) -> None:
    models = (ModelInfo("base"), ModelInfo("lora"))
    body = replace(make_body(OWNERS[0], "10.0.0.1:7946", T0), models=models)
    body = replace(body, labels=((PARENTS_LABEL, value),))
    assert model_parents(body) == {}


@pytest.mark.parametrize("bad", ["a\nb", "a\x85b", "a\x9b2J", "a\u2028b", "a\u202eb", "a\x00"])
def test_a_model_id_that_is_not_printable_is_refused_where_it_is_decoded(bad: str) -> None:
    """A model id is routed, listed in tables and logged on every agent: one carrying a
    control, format or line-separator character (judged by its Unicode category, C1 controls
    and U+2028 included) is refused at decode, whoever signed it."""
    owner = OWNERS[0]
    body = replace(make_body(owner, "10.0.0.1:7946", T0), models=(ModelInfo(bad, 512),))
    wire = body.sign(owner).to_wire()
    with pytest.raises(DecodeError, match="model id: a character that is not printable"):
        SignedEntry.from_wire(wire)
    fine = replace(body, models=(ModelInfo("Qwen/Qwen3-8B:lora-día", 512),))
    assert SignedEntry.from_wire(fine.sign(owner).to_wire()).body.models[0].id.endswith("día")
