"""Capacity across sites (``fabricnode.elastic.sitespread``): each site's share of a model's
replicas from the preference and what the other sites serve."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fabricnode.elastic.sitespread import share

PREFER = ("B", "A")


def test_the_preferred_site_takes_the_whole_floor_and_the_next_makes_up_what_it_does_not_serve():
    # B accepts and serves both: A keeps none
    assert share("B", PREFER, 2, 2, {"A": 0}).floor == 2
    a = share("A", PREFER, 2, 2, {"B": 2})
    assert (a.floor, a.ceiling) == (0, 0)
    # B's partition refuses: B serves none, A makes up both
    a = share("A", PREFER, 2, 2, {"B": 0})
    assert (a.floor, a.ceiling) == (2, 2)
    assert share("B", PREFER, 2, 2, {"A": 2}).floor == 2  # B keeps trying
    # B accepts again: each replica B serves lets A drain one, never before
    a = share("A", PREFER, 2, 2, {"B": 1})
    assert (a.floor, a.ceiling) == (1, 1)
    assert "1 serving at sites preferred before it" in a.describe("A", PREFER)


def test_the_ceiling_bounds_the_sum_over_every_site_and_demand_above_the_floor_is_each_sites():
    a = share("A", PREFER, 1, 5, {"B": 3})
    assert (a.floor, a.ceiling) == (0, 2)
    b = share("B", PREFER, 1, 5, {"A": 2})
    assert (b.floor, b.ceiling) == (1, 3)


def test_a_site_not_preferred_keeps_none_and_an_unknown_site_serves_nothing():
    c = share("C", PREFER, 2, 4, {"A": 1, "B": 1})
    assert (c.floor, c.ceiling) == (0, 0)
    assert "not in prefer_sites" in c.describe("C", PREFER)
    # B unknown (its summary stale: left out): A makes up the whole floor
    assert share("A", PREFER, 2, 4, {}).floor == 2


SITES = ("A", "B", "C", "D")


@given(
    st.permutations(SITES).flatmap(lambda p: st.tuples(st.just(tuple(p)), st.integers(1, 4))),
    st.integers(0, 6),
    st.integers(0, 6),
    st.dictionaries(st.sampled_from(SITES), st.integers(-1, 8)),
)
def test_share_laws(
    prefer_n: tuple[tuple[str, ...], int], low: int, extra: int, serving: dict[str, int]
) -> None:
    prefer = prefer_n[0][: prefer_n[1]]
    high = max(low, 1) + extra
    floors = {}
    for ours in SITES:
        others = {s: n for s, n in serving.items() if s != ours}
        got = share(ours, prefer, low, high, others)
        assert 0 <= got.floor <= got.ceiling <= high
        floors[ours] = got.floor
        if ours in prefer and got.floor < low:
            # an earlier site serving more never raises our floor
            more = dict(others)
            first = prefer[0]
            if first != ours:
                more[first] = more.get(first, 0) + 1
                assert share(ours, prefer, low, high, more).floor <= got.floor
    # at the fixed point (every site serves its floor), the floors sum to min_replicas
    fixed: dict[str, int] = {}
    for ours in prefer:
        fixed[ours] = share(ours, prefer, low, high, fixed).floor
    assert sum(fixed.values()) == min(low, high)
    assert fixed[prefer[0]] == min(low, high)
