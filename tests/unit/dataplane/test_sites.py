"""The data plane's cross-site rules (``fabricnode.dataplane.sites``): which peer site and
gateway a request leaving the site goes to, and that a request never leaves twice."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from fabricnode.dataplane import routetable, sites
from fabricnode.dataplane.sites import (
    HOP_SITE,
    Prompt,
    SiteOffer,
    by_cost,
    choose,
    expected_wait_s,
    may_leave,
    may_leave_for,
    parse_site_origin,
    quicker,
    quicker_start,
    site_origin,
    site_routes,
    site_sid,
    taken_in,
)
from fabricnode.federation.summary import GATEWAY_LABEL


def offer(
    site: str,
    *gateways: str,
    routable: bool = True,
    rtt: float | None = 0.01,
    replicas: int = 1,
    admitting: int = 1,
    waiting: int = 0,
    fresh: bool = True,
    backlog: float = 0.0,
    start: float | None = None,
) -> SiteOffer:
    return SiteOffer(
        site, gateways, routable, rtt, replicas, admitting, waiting, fresh, backlog, start
    )


def test_admitting_sites_first_then_by_round_trip() -> None:
    pairs = choose(
        [
            offer("far", "f:1", rtt=0.080),
            offer("busy", "b:1", rtt=0.001, admitting=0, waiting=3),
            offer("near", "n:1", "n:2", rtt=0.005),
        ]
    )
    assert pairs == [("near", "n:1"), ("near", "n:2"), ("far", "f:1"), ("busy", "b:1")]


def test_unroutable_sites_and_sites_without_a_replica_are_never_chosen() -> None:
    pairs = choose(
        [
            offer("cut", "c:1", routable=False),
            offer("none", "z:1", replicas=0, admitting=0),
            offer("nogw"),
            offer("ok", "o:1"),
        ]
    )
    assert pairs == [("ok", "o:1")]


def test_unknown_round_trip_after_measured_ones_and_ties_by_fewer_waiting_then_name() -> None:
    pairs = choose(
        [
            offer("unmeasured", "u:1", rtt=None),
            offer("b", "b:1", rtt=0.01, waiting=2),
            offer("a", "a:1", rtt=0.01, waiting=2),
            offer("c", "c:1", rtt=0.01, waiting=0),
        ]
    )
    assert [site for site, _ in pairs] == ["c", "a", "b", "unmeasured"]


def test_a_request_from_another_site_or_already_leaving_never_leaves_again() -> None:
    assert may_leave("", False)
    assert not may_leave("C", False)  # came over the link: served inside this site only
    assert not may_leave("", True)  # a gateway taking it out sends it to peer sites only
    assert not may_leave("C", True)


def test_a_request_limited_to_sites_is_offered_only_the_allowed_peer_sites() -> None:
    offers = [offer("B", "b:1", rtt=0.001), offer("C", "c:1", rtt=0.2), offer("D", "d:1")]
    assert [s for s, _ in choose(offers, frozenset({"C", "D"}))] == ["D", "C"]
    assert choose(offers, frozenset({"A"})) == []  # our own site only: no peer at all
    assert choose(offers, frozenset()) == []  # no site at all
    assert [s for s, _ in choose(offers, None)] == ["B", "D", "C"]


def test_a_request_leaves_only_for_a_site_its_set_names_and_is_taken_in_only_there() -> None:
    assert may_leave_for(None, "A")
    assert may_leave_for(frozenset({"A", "C"}), "A")
    assert not may_leave_for(frozenset({"A"}), "A")
    assert not may_leave_for(frozenset(), "A")
    assert taken_in(None, "C") and taken_in(frozenset({"A", "C"}), "C")
    assert not taken_in(frozenset({"A"}), "C") and not taken_in(frozenset(), "C")


def test_site_routes_are_peer_gateways_over_the_link() -> None:
    routes = site_routes([("C", "gw.c.example:7950"), ("C", "10.0.0.2:7950")])
    assert [r.hop for r in routes] == [HOP_SITE, HOP_SITE]
    assert routes[0].info.site == "C"
    assert parse_site_origin(routes[0].origin) == ("C", "gw.c.example:7950")
    assert parse_site_origin(("10.0.0.1", 8080)) is None
    assert site_origin("C", "[::1]:7950")[0].startswith(sites.SITE_ORIGIN_PREFIX)
    assert parse_site_origin(site_origin("C", "[::1]:7950")) == ("C", "[::1]:7950")
    assert len({r.info.session_id for r in routes}) == 2  # one breaker per gateway


def test_the_gateway_label_is_the_federations() -> None:
    assert routetable.GATEWAY_LABEL == sites.GATEWAY_LABEL == GATEWAY_LABEL
    from fabricnode.dataplane import upstream

    assert upstream.SITE_ORIGIN_PREFIX == sites.SITE_ORIGIN_PREFIX


def test_a_sites_expected_wait_is_its_round_trip_and_reported_backlog() -> None:
    """Rule 6's price: the measured round trip and the backlog the summary reports (never
    negative); a site whose round trip is unknown is never the quicker one."""
    assert expected_wait_s(offer("b", "b:1", rtt=0.04, backlog=0.25)) == 0.29
    assert expected_wait_s(offer("b", "b:1", rtt=0.04, backlog=-1.0)) == 0.04
    assert expected_wait_s(offer("b", "b:1", rtt=None)) == math.inf


def test_the_quicker_sites_admit_now_and_start_sooner_than_the_local_wait() -> None:
    offers = [
        offer("near", "n:1", rtt=0.04, backlog=0.3),  # 0.34 s
        offer("far", "f:1", rtt=0.25),  # 0.25 s
        offer("full", "u:1", rtt=0.01, admitting=0, waiting=4),  # cannot admit: not priced
        offer("old", "o:1", rtt=0.01, fresh=False),  # its summary is too old to say
        offer("unknown", "x:1", rtt=None),
    ]
    assert [o.site for o in quicker(offers, 1.0)] == ["far", "near"]
    assert [o.site for o in quicker(offers, 0.3)] == ["far"]
    assert quicker(offers, 0.25) == []  # no sooner: it stays at our site
    assert quicker(offers, 0.0) == []


@given(
    st.lists(
        st.tuples(
            st.sampled_from("abcdef"),
            st.one_of(st.none(), st.floats(0.0, 1.0)),
            st.integers(0, 2),
            st.booleans(),
            st.floats(-1.0, 2.0),
        ),
        max_size=6,
    ),
    st.floats(0.0, 3.0),
)
def test_quicker_laws(rows: list[tuple[str, float | None, int, bool, float]], wait: float) -> None:
    """Every site it returns can admit now, on a fresh summary, and is priced below the local
    wait; none left out is; they come cheapest first."""
    offers = [
        offer(s, f"{s}:1", rtt=rtt, admitting=adm, replicas=2, fresh=fr, backlog=b)
        for s, rtt, adm, fr, b in rows
    ]
    found = quicker(offers, wait)
    costs = [expected_wait_s(o) for o in found]
    assert costs == sorted(costs)
    for o in offers:
        eligible = o.admitting > 0 and o.fresh and expected_wait_s(o) < wait
        assert (o in found) == eligible


def prompt(blocks: int, here: int, block_s: float = 0.01, **held: int) -> Prompt:
    """A prompt of ``blocks`` blocks, ``here`` of them at the pick, and per site (its
    gateway ``<site>:1``) the blocks we sent there."""
    by_sid = {site_sid(site, f"{site}:1"): n for site, n in held.items()}
    return Prompt(blocks, here, block_s, lambda sid: by_sid.get(sid, 0))


def test_a_prompts_uncached_blocks_are_priced_where_they_would_be_computed() -> None:
    """Rule 7: ours is the pick's wait plus the blocks it does not hold; a peer site's is its
    expected wait plus the blocks we did not send it (its best gateway)."""
    p = prompt(100, 40, b=100, c=10)
    assert p.here_s() == 0.6
    b = offer("b", "b:1", rtt=0.04)
    assert expected_wait_s(b, p) == 0.04
    c = offer("c", "x:1", "c:1", rtt=0.02)  # its second gateway got them
    assert math.isclose(expected_wait_s(c, p), 0.02 + 0.9)
    assert expected_wait_s(offer("d", "d:1", rtt=0.01), p) == 0.01 + 1.0


def test_a_prefix_sent_to_a_site_draws_its_next_prompts_there_and_one_held_here_stays() -> None:
    near = offer("near", "near:1", rtt=0.04)
    far = offer("far", "far:1", rtt=0.15)
    offers = [near, far]
    # our pick starts it now but holds none of it; we sent the prefix to the far site
    sent = prompt(200, 0, far=200)
    assert [o.site for o in quicker(offers, 0.0, sent)] == ["far"]  # near computes it all too
    # our pick holds it all: its wait would have to exceed the far site's round trip
    assert quicker(offers, 0.1, prompt(200, 200, far=200)) == []
    assert [o.site for o in quicker(offers, 0.2, prompt(200, 200, far=200))] == ["far"]
    # rule 5's order: the far site first while it holds the prefix, else the nearest
    pairs = [("near", "near:1"), ("far", "far:1")]
    assert by_cost(pairs, offers, sent) == [("far", "far:1"), ("near", "near:1")]
    assert by_cost(pairs, offers, prompt(200, 0)) == pairs
    assert by_cost(pairs, offers, None) == pairs


# sixty-fourths: every sum of these is exact, so equal costs compare equal
SIXTY_FOURTHS = st.integers(0, 192).map(lambda k: k / 64)


@given(
    st.lists(
        st.tuples(
            st.sampled_from("abcdef"),
            st.one_of(st.none(), SIXTY_FOURTHS),
            st.integers(0, 2),
            st.integers(0, 300),
        ),
        max_size=6,
    ),
    SIXTY_FOURTHS,
    st.integers(0, 256),
    st.integers(0, 256),
    st.integers(0, 4).map(lambda k: k / 64),
)
def test_prompt_cost_laws(
    rows: list[tuple[str, float | None, int, int]],
    wait: float,
    blocks: int,
    here: int,
    block_s: float,
) -> None:
    """A prompt no place holds any of costs the same everywhere and cancels (``quicker`` as
    without it); holding more of it never makes a site costlier."""
    offers = [offer(s, f"{s}:1", rtt=rtt, admitting=adm) for s, rtt, adm, _ in rows]
    even = Prompt(blocks, 0, block_s, lambda sid: 0)
    assert quicker(offers, wait, even) == quicker(offers, wait)
    held = {site_sid(s, f"{s}:1"): n for s, _, _, n in rows}
    p = Prompt(blocks, min(here, blocks), block_s, lambda sid: held.get(sid, 0))
    less = Prompt(blocks, min(here, blocks), block_s, lambda sid: held.get(sid, 0) // 2)
    for o in offers:
        assert expected_wait_s(o, p) <= expected_wait_s(o, less)


def test_a_model_no_site_serves_waits_at_the_site_that_would_serve_it_first() -> None:
    """Rule 8: the sites whose round trip plus expected start is below ours, the soonest
    first, each with its gateways; never one that says no start, is cut off, has an old
    summary or is not allowed."""
    offers = [
        offer("near", "n:1", rtt=0.04, replicas=0, start=40.0),
        offer("far", "f:1", "f:2", rtt=0.25, replicas=0, start=20.0),
        offer("none", "x:1", rtt=0.01, replicas=0),  # its controller would start none
        offer("cut", "c:1", rtt=0.01, replicas=0, start=1.0, routable=False),
        offer("old", "o:1", rtt=0.01, replicas=0, start=1.0, fresh=False),
    ]
    assert quicker_start(offers, 30.0) == [("far", "f:1"), ("far", "f:2")]
    assert quicker_start(offers, math.inf)[:3] == [("far", "f:1"), ("far", "f:2"), ("near", "n:1")]
    assert quicker_start(offers, 20.0) == []  # ours is as quick: it waits here
    assert quicker_start(offers, math.inf, frozenset({"near"})) == [("near", "n:1")]
