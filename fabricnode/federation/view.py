"""The federation view: the latest summary of every peer site, and whether to route there.

Pure (sans-IO, in the manner of ``mesh.core``): the link (``link``) hands it bytes, the site
the TLS handshake authenticated and the time; it answers with an outcome and keeps state.

Rules
-----
1. Only pinned sites exist. A summary is accepted only if it names the site of the link it came
   over (a site cannot publish for another: ``other_site``), that site is pinned
   (``unknown_site``), it decodes (``undecodable``), its signature holds under the pinned
   certificate (``bad_signature``), its ``seq`` is above the one held (``stale``; the same seq
   again is ``duplicate``), and it is not dated further ahead of our clock than
   ``max_clock_skew_s`` (``future``: a wrong clock cannot pin a summary).
2. Partitions, not deaths. A site is **routable** while its summary is younger (by our clock,
   from when we accepted it: no cross-site clock comparison) than
   ``max(stale_floor_s, rtt_factor * rtt + summary_period_s)``, ``rtt`` the site's measured
   round trip (an EWMA of the link's pings). Past that it is *unreachable*: no request goes
   there, but its summary is kept, never removed, and the next accepted summary makes it
   routable again (healing is one summary per site: no storm).
3. Everything is bounded: the sites are the pinned ones, one summary each, of bounded size.

``statistics()`` counts accepted summaries and refusals by reason (``fabric_federation_*``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fabricnode.errors import DecodeError
from fabricnode.federation.sitekey import PeerSites
from fabricnode.federation.summary import SiteSummary, as_json, decode

ACCEPTED = "accepted"
REFUSALS = (
    "undecodable",
    "unknown_site",
    "other_site",
    "bad_signature",
    "stale",
    "duplicate",
    "future",
)
MAX_RTT_S = 60.0


FRESH_SLACK_S = 1.0  # what ``fresh`` allows beyond a keep-alive period and a round trip


@dataclass(frozen=True)
class ViewConfig:
    stale_floor_s: float = 5.0  # never unreachable sooner than this after the last summary
    rtt_factor: float = 4.0  # round trips a summary may be late by
    summary_period_s: float = 2.0  # the longest a peer waits between summaries (keep-alive)
    rtt_alpha: float = 0.25  # weight of a new ping in the RTT estimate
    max_clock_skew_s: float = 60.0


@dataclass
class SiteState:
    summary: SiteSummary | None = None
    accepted_at: float | None = None  # our clock, when the summary held was accepted
    rtt_s: float | None = None
    pings: int = 0


@dataclass(frozen=True)
class SiteStatus:
    site: str
    routable: bool
    age_s: float | None  # since the summary held was accepted; None: none yet
    stale_after_s: float
    rtt_s: float | None
    seq: int | None


@dataclass(frozen=True)
class ViewStatistics:
    accepted: int
    refused: Mapping[str, int]
    sites: tuple[SiteStatus, ...] = field(default=())


class FederationView:
    """Latest accepted summary and RTT estimate per pinned peer site (module docstring)."""

    def __init__(self, peers: PeerSites, config: ViewConfig | None = None) -> None:
        self.peers = peers
        self.config = config or ViewConfig()
        self._sites: dict[str, SiteState] = {site: SiteState() for site in peers.sites}
        self.accepted = 0
        self.refused: Counter[str] = Counter()

    # -- input --------------------------------------------------------------------------

    def accept(self, data: bytes, from_site: str, now: float) -> str:
        """Take a summary that came over the link authenticated as ``from_site``: returns
        ``ACCEPTED`` or the reason it was refused (one of ``REFUSALS``)."""
        outcome, summary = self._check(data, from_site, now)
        if summary is None:
            self.refused[outcome] += 1
            return outcome
        state = self._sites[summary.site]
        state.summary = summary
        state.accepted_at = now
        self.accepted += 1
        return ACCEPTED

    def _check(self, data: bytes, from_site: str, now: float) -> tuple[str, SiteSummary | None]:
        try:
            summary = decode(data)
        except DecodeError:
            return "undecodable", None
        if summary.site != from_site:
            return "other_site", None
        cert = self.peers.get(summary.site)
        state = self._sites.get(summary.site)
        if cert is None or state is None:
            return "unknown_site", None
        if not summary.verify(cert.public_key):
            return "bad_signature", None
        held = state.summary
        if held is not None and summary.seq <= held.seq:
            return ("duplicate" if summary.seq == held.seq else "stale"), None
        if summary.body.issued_at > now + self.config.max_clock_skew_s:
            return "future", None
        return ACCEPTED, summary

    def observe_rtt(self, site: str, rtt_s: float) -> None:
        """A measured round trip to ``site`` (a ping answered)."""
        state = self._sites.get(site)
        if state is None or not (math.isfinite(rtt_s) and 0.0 <= rtt_s <= MAX_RTT_S):
            return
        alpha = self.config.rtt_alpha
        state.rtt_s = rtt_s if state.rtt_s is None else (1 - alpha) * state.rtt_s + alpha * rtt_s
        state.pings += 1

    # -- queries --------------------------------------------------------------------------

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(self._sites)

    def summary(self, site: str) -> SiteSummary | None:
        state = self._sites.get(site)
        return None if state is None else state.summary

    def rtt(self, site: str) -> float | None:
        state = self._sites.get(site)
        return None if state is None else state.rtt_s

    def stale_after(self, site: str) -> float:
        """How old the site's summary may grow before the site is unreachable."""
        cfg = self.config
        rtt = self.rtt(site) or 0.0
        return max(cfg.stale_floor_s, cfg.rtt_factor * rtt + cfg.summary_period_s)

    def fresh(self, site: str, now: float) -> bool:
        """Whether the site's summary is recent enough to say what it can admit *now*: no
        older than one keep-alive period and a round trip (and a second of scheduling: an idle
        site's unchanged summary comes once a keep-alive, often a little late),
        the longest a site that changed nothing waits between two summaries. A routable site
        whose summary is older is still served what only it serves; nothing is pushed to it
        on the word of that summary (two-layer routing prices a summary's age this way)."""
        state = self._sites.get(site)
        if state is None or state.accepted_at is None:
            return False
        rtt = state.rtt_s or 0.0
        return now - state.accepted_at <= self.config.summary_period_s + rtt + FRESH_SLACK_S

    def routable(self, site: str, now: float) -> bool:
        state = self._sites.get(site)
        if state is None or state.summary is None or state.accepted_at is None:
            return False
        return now - state.accepted_at <= self.stale_after(site)

    def sites_serving(self, model: str, now: float) -> list[str]:
        """Routable sites whose summary lists ``model`` with a replica, most admitting first."""
        found: list[tuple[int, int, str]] = []
        for site, state in self._sites.items():
            if state.summary is None or not self.routable(site, now):
                continue
            cap = state.summary.body.models.get(model)
            if cap is not None and cap.replicas > 0:
                found.append((-cap.admitting, cap.waiting, site))
        return [site for _, _, site in sorted(found)]

    def status(self, site: str, now: float) -> SiteStatus:
        state = self._sites[site]
        age = None if state.accepted_at is None else max(0.0, now - state.accepted_at)
        return SiteStatus(
            site,
            self.routable(site, now),
            age,
            self.stale_after(site),
            state.rtt_s,
            None if state.summary is None else state.summary.seq,
        )

    def statistics(self, now: float) -> ViewStatistics:
        return ViewStatistics(
            self.accepted,
            {reason: self.refused.get(reason, 0) for reason in REFUSALS},
            tuple(self.status(site, now) for site in self._sites),
        )

    def as_json(self, now: float) -> list[dict[str, Any]]:
        """Per peer site: routable or not, the summary's age and content, the RTT."""
        out = []
        for site in self._sites:
            st = self.status(site, now)
            summary = self._sites[site].summary
            cert = self.peers.get(site)
            out.append(
                {
                    "site": site,
                    "fingerprint": cert.fingerprint if cert is not None else None,
                    "routable": st.routable,
                    "age_s": None if st.age_s is None else round(st.age_s, 3),
                    "stale_after_s": round(st.stale_after_s, 3),
                    "rtt_ms": None if st.rtt_s is None else round(st.rtt_s * 1000, 3),
                    "summary": None if summary is None else as_json(summary.body),
                }
            )
        return out
