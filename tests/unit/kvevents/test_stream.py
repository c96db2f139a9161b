"""One publisher's sequence (``fabricnode.kvevents.stream``): apply in order, drop repeats,
report gaps with what is missing, and take a 0 after higher numbers as a new process."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.kvevents.stream import APPLY, DROP, GAP, RESTARTED, EventStream, Verdict


def test_in_order_batches_apply_and_a_repeat_is_dropped() -> None:
    s = EventStream()
    assert [s.accept(n).action for n in (0, 1, 2)] == [APPLY] * 3
    assert s.accept(1) == Verdict(DROP)
    assert (s.next_seq, s.applied, s.dropped) == (3, 3, 1)


def test_a_gap_says_what_is_missing_and_a_replay_fills_it_in_order() -> None:
    s = EventStream()
    s.accept(0)
    assert s.accept(4) == Verdict(GAP, (1, 3))
    for n in (1, 2, 3, 4):  # the replay socket's batches, then the one that showed the gap
        assert s.accept(n).action == APPLY
    assert (s.next_seq, s.gaps, s.lost) == (5, 1, 0)


def test_a_gap_no_replay_covers_is_lost_and_the_stream_goes_on_from_there() -> None:
    s = EventStream()
    s.accept(0)
    assert s.accept(9).action == GAP
    s.resync(9)
    assert (s.next_seq, s.lost) == (10, 8)
    assert s.accept(10).action == APPLY


def test_a_late_subscriber_sees_a_gap_from_zero() -> None:
    s = EventStream()
    assert s.accept(7) == Verdict(GAP, (0, 6))


def test_zero_after_higher_numbers_is_a_new_publisher() -> None:
    s = EventStream()
    for n in range(5):
        s.accept(n)
    assert s.accept(0) == Verdict(RESTARTED)
    assert s.accept(1).action == APPLY and s.restarts == 1


def test_a_negative_number_is_refused() -> None:
    with pytest.raises(ValueError):
        EventStream().accept(-1)


@given(st.lists(st.integers(0, 40), max_size=60))
def test_stream_laws(seqs: list[int]) -> None:
    """Whatever the order: a batch applies only as the next number (or 0, or the resync the
    shell makes after a gap); nothing is applied twice without a restart in between; the
    expected number never goes back but on a restart."""
    s = EventStream()
    seen: set[int] = set()
    for n in seqs:
        before = s.next_seq
        v = s.accept(n)
        if v.action == GAP:
            assert v.missing is not None and v.missing[1] == n - 1
            s.resync(n)
        if v.action == RESTARTED:
            seen = set()
        if v.action in (APPLY, RESTARTED) or v.action == GAP:
            assert n not in seen
            seen.add(n)
        if v.action == DROP:
            assert before is not None and n < before
        if v.action != RESTARTED:
            assert before is None or (s.next_seq is not None and s.next_seq >= before)
