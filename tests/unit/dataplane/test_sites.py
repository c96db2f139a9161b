"""The data plane's cross-site rules (``fabricnode.dataplane.sites``): which peer site and
gateway a request leaving the site goes to, and that a request never leaves twice."""

from __future__ import annotations

from fabricnode.dataplane import routetable, sites
from fabricnode.dataplane.sites import (
    HOP_SITE,
    SiteOffer,
    choose,
    may_leave,
    may_leave_for,
    parse_site_origin,
    site_origin,
    site_routes,
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
) -> SiteOffer:
    return SiteOffer(site, gateways, routable, rtt, replicas, admitting, waiting)


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
