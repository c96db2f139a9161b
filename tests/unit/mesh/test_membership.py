"""MemberTable and SuspicionTiming: the local liveness view's rules (see the module docstring).

Records are built directly: the table does not verify signatures (the core does before it
applies a record), so keys and signatures here are placeholders.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.mesh.membership import (
    NO_RECORD,
    Change,
    Liveness,
    MemberTable,
    SuspicionTiming,
)
from fabricnode.mesh.wire import DEAD, SUSPECT, Accusation, Alive

SELF = "s" * 32
TIMING = SuspicionTiming(
    probe_interval_s=1.0, suspicion_mult=4.0, max_factor=6.0, expected_confirmations=3
)


def sid(i: int) -> str:
    return f"{i:032x}"


def addr(i: int) -> str:
    return f"10.0.0.{i % 250}:{7000 + i}"


def alive(i: int, incarnation: int, address: str | None = None) -> Alive:
    return Alive(sid(i), b"key", incarnation, address or addr(i), b"sig")


def accuse(kind: int, i: int, incarnation: int, accuser: int = 900) -> Accusation:
    return Accusation(kind, sid(i), incarnation, sid(accuser), b"key", b"sig")


def table(members: int = 0, seed: int = 0) -> MemberTable:
    t = MemberTable(SELF, TIMING, random.Random(seed))
    for i in range(members):
        t.learn_address(sid(i), addr(i), 0.0)
    return t


# -- learning addresses ---------------------------------------------------------------------------


def test_a_learned_member_is_alive_without_a_record_and_reachable() -> None:
    t = table()
    m = t.learn_address(sid(1), addr(1), 5.0)
    assert (m.status, m.addr, m.since, m.incarnation) == (Liveness.ALIVE, addr(1), 5.0, 0)
    assert m.sync_code == NO_RECORD
    assert t.reachable() == [m]
    assert t.live_count() == 2  # self included


def test_learning_a_known_member_again_keeps_its_address() -> None:
    t = table()
    first = t.learn_address(sid(1), addr(1), 0.0)
    again = t.learn_address(sid(1), "10.9.9.9:1", 3.0)
    assert again is first
    assert (first.addr, first.since) == (addr(1), 0.0)


def test_a_member_without_an_address_is_unreachable_until_one_is_learned() -> None:
    t = table()
    t.learn_address(sid(1), "", 0.0)
    assert t.reachable() == []
    assert t.next_probe_target() is None
    t.learn_address(sid(1), addr(1), 1.0)
    assert [m.session_id for m in t.reachable()] == [sid(1)]


def test_an_accusation_about_an_unknown_member_learns_it_at_that_incarnation() -> None:
    t = table()
    assert t.apply_accusation(accuse(SUSPECT, 1, 4), 1.0, addr_hint=addr(1)) == Change.UPDATED
    m = t.get(sid(1))
    assert m is not None
    assert (m.status, m.incarnation, m.addr) == (Liveness.SUSPECT, 4, addr(1))


# -- alive and accusations, by incarnation ----------------------------------------------------


def test_our_own_alive_record_is_ignored() -> None:
    t = table()
    assert t.apply_alive(Alive(SELF, b"key", 9, "10.0.0.1:1", b"sig"), 0.0) == Change.NONE
    assert t.get(SELF) is None


def test_an_accusation_about_ourselves_asks_for_a_refutation() -> None:
    t = table()
    rec = Accusation(SUSPECT, SELF, 0, sid(2), b"key", b"sig")
    assert t.apply_accusation(rec, 0.0) == Change.REFUTE
    assert t.apply_accusation(Accusation(DEAD, SELF, 0, sid(2), b"k", b"s"), 0.0) == Change.REFUTE
    assert t.get(SELF) is None


def test_alive_records_apply_only_with_a_higher_incarnation() -> None:
    t = table(2)
    assert t.apply_alive(alive(1, 0), 1.0) == Change.UPDATED  # the first record, same incarnation
    assert t.apply_alive(alive(1, 0), 2.0) == Change.NONE
    assert t.apply_alive(alive(1, 3, "10.1.1.1:9"), 3.0) == Change.UPDATED
    assert t.apply_alive(alive(1, 2), 4.0) == Change.NONE
    m = t.get(sid(1))
    assert m is not None
    assert (m.incarnation, m.addr, m.sync_code) == (3, "10.1.1.1:9", int(Liveness.ALIVE))
    assert m.alive_record == alive(1, 3, "10.1.1.1:9")


def test_suspect_wins_over_alive_at_the_same_or_lower_incarnation_only() -> None:
    t = table(2)
    t.apply_alive(alive(1, 3), 0.0)
    assert t.apply_accusation(accuse(SUSPECT, 1, 2), 1.0) == Change.NONE
    assert t.status(sid(1)) == Liveness.ALIVE
    assert t.apply_accusation(accuse(SUSPECT, 1, 3), 1.0) == Change.UPDATED
    m = t.get(sid(1))
    assert m is not None
    assert (m.status, m.since, m.liveness_record()) == (
        Liveness.SUSPECT,
        1.0,
        accuse(SUSPECT, 1, 3),
    )


def test_alive_overturns_a_suspicion_only_at_a_higher_incarnation() -> None:
    t = table(2)
    t.apply_alive(alive(1, 3), 0.0)
    t.apply_accusation(accuse(SUSPECT, 1, 3), 1.0)
    assert t.apply_alive(alive(1, 3), 2.0) == Change.NONE
    assert t.status(sid(1)) == Liveness.SUSPECT
    assert t.apply_alive(alive(1, 4), 3.0) == Change.UPDATED
    m = t.get(sid(1))
    assert m is not None
    assert (m.status, m.since, m.accusation, m.accusers) == (Liveness.ALIVE, 3.0, None, set())
    assert t.expired_suspicions(1e9) == []


def test_a_newer_suspicion_replaces_an_older_one() -> None:
    t = table(2)
    t.apply_accusation(accuse(SUSPECT, 1, 1, accuser=901), 0.0)
    assert t.apply_accusation(accuse(SUSPECT, 1, 0, accuser=902), 1.0) == Change.NONE
    assert t.apply_accusation(accuse(SUSPECT, 1, 2, accuser=902), 1.0) == Change.UPDATED
    m = t.get(sid(1))
    assert m is not None
    assert (m.incarnation, m.accusers, m.suspicion_started) == (2, {sid(902)}, 1.0)


def test_dead_wins_over_alive_and_suspect_at_the_same_or_lower_incarnation() -> None:
    t = table(3)
    t.apply_alive(alive(1, 2), 0.0)
    assert t.apply_accusation(accuse(DEAD, 1, 1), 1.0) == Change.NONE
    assert t.apply_accusation(accuse(DEAD, 1, 2), 1.0) == Change.UPDATED
    assert t.status(sid(1)) == Liveness.DEAD
    t.apply_accusation(accuse(SUSPECT, 2, 5), 1.0)
    assert t.apply_accusation(accuse(DEAD, 2, 5), 2.0) == Change.UPDATED
    m = t.get(sid(2))
    assert m is not None
    assert (m.status, m.since, m.sync_code) == (Liveness.DEAD, 2.0, int(Liveness.DEAD))


def test_dead_is_replaced_only_by_a_newer_dead_or_a_newer_alive() -> None:
    t = table(2)
    t.apply_accusation(accuse(DEAD, 1, 3), 0.0)
    assert t.apply_accusation(accuse(DEAD, 1, 3, accuser=901), 1.0) == Change.NONE
    assert t.apply_accusation(accuse(SUSPECT, 1, 9), 1.0) == Change.NONE
    assert t.apply_alive(alive(1, 3), 1.0) == Change.NONE
    assert t.status(sid(1)) == Liveness.DEAD
    assert t.apply_accusation(accuse(DEAD, 1, 4), 2.0) == Change.UPDATED
    assert t.get(sid(1)).incarnation == 4  # type: ignore[union-attr]
    assert t.apply_alive(alive(1, 5), 3.0) == Change.UPDATED  # the owner refuted
    assert t.status(sid(1)) == Liveness.ALIVE


def test_dead_members_are_unreachable_but_listed_as_dead() -> None:
    t = table(3)
    t.apply_accusation(accuse(DEAD, 1, 0), 0.0)
    assert sid(1) not in {m.session_id for m in t.reachable()}
    assert [m.session_id for m in t.dead_members()] == [sid(1)]
    assert t.live_count() == 1 + 2


_records = st.lists(
    st.tuples(st.sampled_from(["alive", "suspect", "dead"]), st.integers(0, 4), st.integers(0, 3)),
    max_size=25,
)


@given(_records)
def test_the_order_key_never_goes_backwards(records: list[tuple[str, int, int]]) -> None:
    """A record is applied only if its (incarnation, status) is newer than what is held."""
    t = table(2)
    t.apply_alive(alive(1, 0), 0.0)
    for step, (kind, incarnation, accuser) in enumerate(records):
        m = t.get(sid(1))
        assert m is not None
        before = (m.incarnation, int(m.status))
        if kind == "alive":
            change = t.apply_alive(alive(1, incarnation), float(step))
        else:
            code = SUSPECT if kind == "suspect" else DEAD
            change = t.apply_accusation(accuse(code, 1, incarnation, accuser), float(step))
        after = (m.incarnation, int(m.status))
        if change == Change.UPDATED:
            if kind == "alive":
                assert after[0] > before[0] or before == (incarnation, int(Liveness.ALIVE))
            else:
                assert after > before
        else:
            assert after == before


# -- suspicion timing -----------------------------------------------------------------------------


def test_suspicion_bounds_grow_with_the_log_of_the_cluster_and_respect_the_floor() -> None:
    assert TIMING.bounds(1) == (4.0, 24.0)
    assert TIMING.bounds(10) == (4.0, 24.0)
    assert TIMING.bounds(1000) == (12.0, 72.0)
    fast = SuspicionTiming(0.1, 1.0, 6.0, 3, floor_s=1.0)
    assert fast.bounds(10) == (1.0, 6.0)


@given(members=st.integers(1, 10_000), confirmations=st.integers(0, 20))
def test_the_timeout_shrinks_with_confirmations_from_high_to_low(
    members: int, confirmations: int
) -> None:
    low, high = TIMING.bounds(members)
    timeout = TIMING.timeout(members, confirmations)
    assert low <= timeout <= high
    assert TIMING.timeout(members, confirmations + 1) <= timeout
    if confirmations == 0:
        assert timeout == high
    if confirmations >= TIMING.expected_confirmations:
        assert timeout == pytest.approx(low)  # high - (high - low) * 1.0 may round above low
    elif confirmations > 0:
        assert timeout < TIMING.timeout(members, confirmations - 1)


def test_without_expected_confirmations_the_timeout_is_the_low_bound() -> None:
    timing = SuspicionTiming(1.0, 4.0, 6.0, expected_confirmations=0)
    assert timing.timeout(100, 0) == timing.bounds(100)[0]


def test_each_new_accuser_confirms_and_brings_the_deadline_closer() -> None:
    t = table(5)
    assert t.apply_accusation(accuse(SUSPECT, 1, 0, accuser=901), 10.0) == Change.UPDATED
    m = t.get(sid(1))
    assert m is not None
    n = t.live_count()
    deadlines = [m.suspicion_deadline]
    assert deadlines[0] == 10.0 + TIMING.bounds(n)[1]
    for accuser in (902, 903, 904):
        change = t.apply_accusation(accuse(SUSPECT, 1, 0, accuser=accuser), 11.0)
        assert change == Change.CONFIRMED
        deadlines.append(m.suspicion_deadline)
    assert deadlines == sorted(deadlines, reverse=True) and len(set(deadlines)) == 4
    assert deadlines[-1] == pytest.approx(
        10.0 + TIMING.bounds(n)[0]
    )  # counted from the first accusation


def test_the_same_accuser_twice_confirms_nothing() -> None:
    t = table(3)
    t.apply_accusation(accuse(SUSPECT, 1, 0, accuser=901), 10.0)
    deadline = t.get(sid(1)).suspicion_deadline  # type: ignore[union-attr]
    assert t.apply_accusation(accuse(SUSPECT, 1, 0, accuser=901), 12.0) == Change.NONE
    assert t.get(sid(1)).suspicion_deadline == deadline  # type: ignore[union-attr]


def test_suspicions_expire_at_their_deadline() -> None:
    t = table(4)
    t.apply_accusation(accuse(SUSPECT, 1, 0), 10.0)
    t.apply_accusation(accuse(SUSPECT, 2, 0), 20.0)
    first = t.get(sid(1)).suspicion_deadline  # type: ignore[union-attr]
    second = t.get(sid(2)).suspicion_deadline  # type: ignore[union-attr]
    assert first < second
    assert t.next_suspicion_deadline() == first
    assert t.expired_suspicions(first - 0.001) == []
    assert [m.session_id for m in t.expired_suspicions(first)] == [sid(1)]
    assert {m.session_id for m in t.expired_suspicions(second)} == {sid(1), sid(2)}


def test_a_suspicion_being_confirmed_by_probe_neither_expires_nor_sets_the_next_deadline() -> None:
    t = table(4)
    t.apply_accusation(accuse(SUSPECT, 1, 0), 10.0)
    t.apply_accusation(accuse(SUSPECT, 2, 0), 20.0)
    t.get(sid(1)).confirming = True  # type: ignore[union-attr]
    later = t.get(sid(2)).suspicion_deadline  # type: ignore[union-attr]
    assert t.next_suspicion_deadline() == later
    assert [m.session_id for m in t.expired_suspicions(1e9)] == [sid(2)]


def test_no_suspects_no_deadline() -> None:
    t = table(3)
    assert t.next_suspicion_deadline() is None
    t.apply_accusation(accuse(SUSPECT, 1, 0), 0.0)
    t.apply_accusation(accuse(DEAD, 1, 0), 1.0)
    assert t.next_suspicion_deadline() is None
    assert t.expired_suspicions(1e9) == []


def test_clearing_a_suspicion_ignores_later_suspicions_at_that_incarnation() -> None:
    t = table(3)
    t.apply_accusation(accuse(SUSPECT, 1, 2), 0.0)
    t.clear_suspicion(sid(1), 5.0)
    m = t.get(sid(1))
    assert m is not None
    assert (m.status, m.since, m.accusers, m.cleared_suspect_inc) == (Liveness.ALIVE, 5.0, set(), 2)
    assert t.next_suspicion_deadline() is None
    assert t.apply_accusation(accuse(SUSPECT, 1, 2, accuser=905), 6.0) == Change.NONE
    assert t.apply_accusation(accuse(SUSPECT, 1, 3, accuser=905), 7.0) == Change.UPDATED
    assert t.status(sid(1)) == Liveness.SUSPECT


def test_clearing_a_member_that_is_not_suspect_does_nothing() -> None:
    t = table(3)
    t.apply_accusation(accuse(DEAD, 1, 0), 0.0)
    t.clear_suspicion(sid(1), 1.0)
    t.clear_suspicion(sid(77), 1.0)
    assert t.status(sid(1)) == Liveness.DEAD
    assert t.get(sid(77)) is None


# -- leaving and removal --------------------------------------------------------------------------


def test_left_is_final() -> None:
    t = table(3)
    t.apply_accusation(accuse(SUSPECT, 1, 0), 0.0)
    assert t.mark_left(sid(1), 2.0) is True
    assert t.mark_left(sid(1), 3.0) is False
    m = t.get(sid(1))
    assert m is not None
    assert (m.status, m.since) == (Liveness.LEFT, 2.0)
    assert t.apply_alive(alive(1, 99), 4.0) == Change.NONE
    assert t.apply_accusation(accuse(DEAD, 1, 99), 4.0) == Change.NONE
    assert t.apply_accusation(accuse(SUSPECT, 1, 99), 4.0) == Change.NONE
    assert t.status(sid(1)) == Liveness.LEFT
    assert sid(1) not in {m.session_id for m in t.reachable()}
    assert t.next_suspicion_deadline() is None


def test_marking_an_unknown_member_left_does_nothing() -> None:
    t = table()
    assert t.mark_left(sid(1), 0.0) is False
    assert t.get(sid(1)) is None


def test_a_removed_member_is_forgotten_everywhere() -> None:
    t = table(3)
    t.apply_accusation(accuse(SUSPECT, 1, 0), 0.0)
    t.reachable()  # fill the cache, which remove must reset
    t.remove(sid(1))
    t.remove(sid(1))  # twice is harmless
    assert t.get(sid(1)) is None and t.status(sid(1)) is None
    assert sid(1) not in {m.session_id for m in t.reachable()}
    assert t.next_suspicion_deadline() is None
    assert t.expired_suspicions(1e9) == []
    targets = {t.next_probe_target().session_id for _ in range(4)}  # type: ignore[union-attr]
    assert targets == {sid(0), sid(2)}


def test_every_status_change_is_reported_to_the_observer() -> None:
    seen: list[tuple[str, Liveness, float]] = []
    t = MemberTable(SELF, TIMING, random.Random(0), on_status=lambda *a: seen.append(a))
    t.learn_address(sid(1), addr(1), 0.0)
    t.apply_accusation(accuse(SUSPECT, 1, 0), 1.0)
    t.apply_accusation(accuse(DEAD, 1, 0), 2.0)
    t.mark_left(sid(1), 3.0)
    assert seen == [
        (sid(1), Liveness.ALIVE, 0.0),
        (sid(1), Liveness.SUSPECT, 1.0),
        (sid(1), Liveness.DEAD, 2.0),
        (sid(1), Liveness.LEFT, 3.0),
    ]


# -- probing and picking members ------------------------------------------------------------------


@given(
    alive_count=st.integers(1, 12),
    dead=st.integers(0, 4),
    seed=st.integers(0, 2**32),
)
def test_each_probe_pass_visits_every_reachable_member_once(
    alive_count: int, dead: int, seed: int
) -> None:
    t = table(alive_count + dead, seed)
    for i in range(alive_count, alive_count + dead):
        t.apply_accusation(accuse(DEAD, i, 0), 0.0)
    t.learn_address(sid(500), "", 0.0)  # no address: never probed
    expected = sorted(sid(i) for i in range(alive_count))
    for _ in range(3):
        one_pass = [t.next_probe_target() for _ in range(alive_count)]
        assert sorted(m.session_id for m in one_pass if m is not None) == expected


def test_suspects_are_still_probed() -> None:
    t = table(2)
    t.apply_accusation(accuse(SUSPECT, 1, 0), 0.0)
    targets = {t.next_probe_target().session_id for _ in range(2)}  # type: ignore[union-attr]
    assert targets == {sid(0), sid(1)}


@given(done=st.integers(1, 5), seed=st.integers(0, 2**32))
def test_a_member_learned_mid_pass_is_probed_in_that_pass(done: int, seed: int) -> None:
    t = table(6, seed)
    for _ in range(6):  # finish the pass built while learning
        t.next_probe_target()
    firsts = [t.next_probe_target() for _ in range(done)]
    t.learn_address(sid(99), addr(99), 1.0)
    rest = [t.next_probe_target() for _ in range(6 - done + 1)]
    visited = sorted(m.session_id for m in firsts + rest if m is not None)
    assert visited == sorted([*(sid(i) for i in range(6)), sid(99)])


def test_no_probe_target_without_reachable_members() -> None:
    t = table(1)
    t.apply_accusation(accuse(DEAD, 0, 0), 0.0)
    assert t.next_probe_target() is None
    assert table().next_probe_target() is None


def test_reachable_leaves_out_the_excluded() -> None:
    t = table(4)
    assert {m.session_id for m in t.reachable(exclude=(sid(1), sid(3)))} == {sid(0), sid(2)}
    assert len(t.reachable()) == 4  # the exclusion did not stick to the cache


@given(
    members=st.integers(0, 10),
    dead=st.sets(st.integers(0, 9), max_size=3),
    k=st.integers(0, 6),
    exclude=st.sets(st.integers(0, 12), max_size=4),
    seed=st.integers(0, 2**32),
)
def test_random_reachable_picks_k_distinct_reachable_members_outside_the_exclusion(
    members: int, dead: set[int], k: int, exclude: set[int], seed: int
) -> None:
    t = table(members, seed)
    for i in dead & set(range(members)):
        t.apply_accusation(accuse(DEAD, i, 0), 0.0)
    excluded = tuple(sid(i) for i in sorted(exclude))
    picked = [m.session_id for m in t.random_reachable(k, exclude=excluded)]
    available = {m.session_id for m in t.reachable()} - set(excluded)
    assert len(picked) == len(set(picked)) == min(k, len(available))
    assert set(picked) <= available


def test_random_reachable_draws_from_the_table_rng() -> None:
    picks = [
        [m.session_id for m in table(20, seed).random_reachable(3, exclude=(sid(0),))]
        for seed in (1, 1, 2)
    ]
    assert picks[0] == picks[1]
    assert picks[0] != picks[2]


@pytest.mark.parametrize("status", [Liveness.ALIVE, Liveness.SUSPECT])
def test_live_count_counts_self_and_reachable_members(status: Liveness) -> None:
    t = table(3)
    if status == Liveness.SUSPECT:
        t.apply_accusation(accuse(SUSPECT, 1, 0), 0.0)
    t.apply_accusation(accuse(DEAD, 2, 0), 0.0)
    assert t.live_count() == 1 + 2


# -- adopting another table's view (simulations of a formed cluster) ------------------------------


def test_adopted_members_are_shared_until_a_table_writes_one() -> None:
    source = table(4)
    for i in range(4):
        source.apply_alive(alive(i, 0), 0.0)
    a = MemberTable(sid(0), TIMING, random.Random(1))
    b = MemberTable(sid(1), TIMING, random.Random(2))
    a.adopt(source)
    b.adopt(source)
    assert a.get(sid(0)) is None and b.get(sid(1)) is None  # never yourself
    assert a.get(sid(2)) is b.get(sid(2)) is source.get(sid(2))
    assert a.apply_accusation(accuse(SUSPECT, 2, 0), 1.0) is Change.UPDATED
    assert a.status(sid(2)) == Liveness.SUSPECT
    assert b.status(sid(2)) == source.status(sid(2)) == Liveness.ALIVE
    assert b.get(sid(2)) is source.get(sid(2)) is not a.get(sid(2))
    assert a.expired_suspicions(1e9) == [a.get(sid(2))]
    assert b.expired_suspicions(1e9) == []


def test_adopted_view_counts_and_picks_like_one_built_record_by_record() -> None:
    source = table(6)
    source.apply_accusation(accuse(DEAD, 3, 0), 0.0)
    source.apply_accusation(accuse(SUSPECT, 4, 0), 0.0)
    adopted = MemberTable(sid(5), TIMING, random.Random(0))
    adopted.adopt(source)
    assert adopted.live_count() == 1 + 4  # 0, 1, 2, 4 (suspect); not 3 (dead), not ourselves
    assert [m.session_id for m in adopted.dead_members()] == [sid(3)]
    assert [m.session_id for m in adopted.expired_suspicions(1e9)] == [sid(4)]
    adopted.apply_accusation(accuse(DEAD, 0, 0), 1.0)
    assert adopted.live_count() == 1 + 3
    assert source.live_count() == 1 + 5  # the write stayed in the adopting table
    assert {m.session_id for m in adopted.random_reachable(10)} == {sid(1), sid(2), sid(4)}


def test_reachability_index_follows_every_flip_but_not_incarnations() -> None:
    t = table(3)
    assert t.live_count() == 4
    t.apply_alive(alive(1, 1), 1.0)
    t.apply_accusation(accuse(SUSPECT, 1, 1), 2.0)
    assert t.live_count() == 4  # a suspect is still probed and still counts
    t.apply_accusation(accuse(DEAD, 1, 1), 3.0)
    assert t.live_count() == 3
    t.apply_alive(alive(1, 2), 4.0)  # the refutation brings it back
    assert t.live_count() == 4
    t.mark_left(sid(2), 5.0)
    assert {m.session_id for m in t.reachable()} == {sid(0), sid(1)}
