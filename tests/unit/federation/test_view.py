"""The federation view under a fake clock: partitions keep a site, healing restores it, and
no forged, misdirected or replayed summary is ever taken."""

from __future__ import annotations

import pytest

from fabricnode.federation.sitekey import PeerSites, SiteKey
from fabricnode.federation.summary import ModelCapacity, SiteSummary, SummaryBody
from fabricnode.federation.view import ACCEPTED, FederationView, ViewConfig

T0 = 1_750_000_000.0


def summary(key: SiteKey, seq: int, at: float = T0, replicas: int = 2) -> bytes:
    models = {"llama": ModelCapacity(replicas, 1, 0, 0, 0.1)}
    body = SummaryBody(key.site, seq, at, ("gw.c:7950",), models)
    return SiteSummary.sign(body, key).encode()


@pytest.fixture
def view(site_keys: dict[str, SiteKey]) -> FederationView:
    peers = PeerSites.of([site_keys["B"].cert, site_keys["C"].cert], own=site_keys["A"].cert)
    config = ViewConfig(stale_floor_s=5.0, rtt_factor=4.0, summary_period_s=2.0)
    return FederationView(peers, config)


def test_partition_makes_a_site_unroutable_but_keeps_its_summary(
    view: FederationView, site_keys: dict[str, SiteKey]
) -> None:
    c = site_keys["C"]
    assert view.accept(summary(c, 1), "C", T0) == ACCEPTED
    assert view.routable("C", T0 + 4.9)
    assert view.sites_serving("llama", T0 + 1) == ["C"]
    # silent past the bound: unreachable, not gone
    assert not view.routable("C", T0 + 5.1)
    assert view.sites_serving("llama", T0 + 5.1) == []
    held = view.summary("C")
    assert held is not None and held.seq == 1
    assert view.as_json(T0 + 3600)[1]["summary"]["models"]["llama"]["replicas"] == 2
    # the link heals: the next summary makes it routable again, with its new content
    assert view.accept(summary(c, 2, T0 + 3600, replicas=5), "C", T0 + 3600) == ACCEPTED
    assert view.routable("C", T0 + 3600)
    again = view.summary("C")
    assert again is not None and again.body.models["llama"].replicas == 5


def test_the_staleness_bound_scales_with_the_measured_rtt(
    view: FederationView, site_keys: dict[str, SiteKey]
) -> None:
    assert view.accept(summary(site_keys["C"], 1), "C", T0) == ACCEPTED
    for _ in range(50):
        view.observe_rtt("C", 2.0)  # a very slow link
    assert view.rtt("C") == pytest.approx(2.0, rel=0.01)
    assert view.stale_after("C") == pytest.approx(4 * 2.0 + 2.0, rel=0.01)
    assert view.routable("C", T0 + 9.0)
    assert not view.routable("C", T0 + 10.5)
    view.observe_rtt("C", float("nan"))
    view.observe_rtt("C", -1.0)
    assert view.rtt("C") == pytest.approx(2.0, rel=0.01)


def test_a_summary_says_what_a_site_admits_now_for_a_keep_alive_period_and_a_round_trip(
    view: FederationView, site_keys: dict[str, SiteKey]
) -> None:
    """Two-layer routing pushes to a site only on a summary this fresh; the site stays
    routable (what only it serves still goes there) until the staleness bound."""
    assert not view.fresh("C", T0)  # nothing heard yet
    assert view.accept(summary(site_keys["C"], 1), "C", T0) == ACCEPTED
    assert view.fresh("C", T0 + 2.9)  # 2 s keep-alive + 1 s, no RTT measured yet
    assert not view.fresh("C", T0 + 3.1) and view.routable("C", T0 + 3.1)
    for _ in range(50):
        view.observe_rtt("C", 0.25)
    assert view.fresh("C", T0 + 3.2) and not view.fresh("C", T0 + 3.3)
    assert not view.fresh("Z", T0)  # not a peer


def test_forged_summary_is_refused(view: FederationView, site_keys: dict[str, SiteKey]) -> None:
    forged = summary(site_keys["C-fake"], 1)  # a key that calls itself C, not the pinned one
    assert view.accept(forged, "C", T0) == "bad_signature"
    assert view.summary("C") is None
    assert not view.routable("C", T0)


def test_a_site_cannot_publish_for_another(
    view: FederationView, site_keys: dict[str, SiteKey]
) -> None:
    # B relays (or makes up) a summary for C over B's link: refused whatever it holds
    assert view.accept(summary(site_keys["C"], 1), "B", T0) == "other_site"
    assert view.accept(summary(site_keys["A"], 1), "A", T0) == "unknown_site"
    assert view.statistics(T0).refused["other_site"] == 1


def test_replay_of_an_old_seq_is_refused(
    view: FederationView, site_keys: dict[str, SiteKey]
) -> None:
    c = site_keys["C"]
    old, new = summary(c, 5), summary(c, 6)
    assert view.accept(new, "C", T0) == ACCEPTED
    assert view.accept(new, "C", T0 + 1) == "duplicate"
    assert view.accept(old, "C", T0 + 1) == "stale"
    held = view.summary("C")
    assert held is not None and held.seq == 6
    # a replay does not refresh the age: the site still goes unreachable on time
    assert view.accept(new, "C", T0 + 4.0) == "duplicate"
    assert not view.routable("C", T0 + 5.5)
    stats = view.statistics(T0)
    assert stats.accepted == 1
    assert stats.refused["stale"] == 1 and stats.refused["duplicate"] == 2


def test_a_summary_dated_far_ahead_is_refused(
    view: FederationView, site_keys: dict[str, SiteKey]
) -> None:
    assert view.accept(summary(site_keys["C"], 1, T0 + 3600), "C", T0) == "future"
    assert view.accept(b"\x92\xc4\x01x\xc4\x01y", "C", T0) == "undecodable"
