"""The gateway's numbers on the agent's ``/metrics`` page (``fabric_federation_*``, read at
scrape time from ``Gateway.statistics()``; ``metricfamilies`` explains the pattern)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from fabricnode.federation.link import LinkStatistics
from fabricnode.metricfamilies import counter, counters_by, gauges_by, registry_of


class FederationCollector(Collector):
    def __init__(self, statistics: Callable[[], LinkStatistics]) -> None:
        self.statistics = statistics

    def collect(self) -> Iterator[Metric]:
        s = self.statistics()
        yield from gauges_by(
            "fabric_federation_links_up",
            "Connections up with each peer site (both directions)",
            "site",
            s.links_up,
        )
        yield from gauges_by(
            "fabric_federation_routable",
            "1 while the site's summary is fresh enough to route to it (else a partition)",
            "site",
            {site: float(ok) for site, ok in s.routable.items()},
        )
        yield from gauges_by(
            "fabric_federation_rtt_seconds",
            "Round trip to each peer site's gateway (EWMA of the link's pings)",
            "site",
            s.rtt_s,
        )
        yield counter(
            "fabric_federation_summaries_accepted_total",
            "Peer sites' summaries accepted",
            s.accepted,
        )
        yield from counters_by(
            "fabric_federation_summaries_refused_total",
            "Peer sites' summaries refused, by reason (bad_signature, other_site, stale, ...)",
            "reason",
            s.refused,
        )
        yield from counters_by(
            "fabric_federation_connections_total",
            "Federation connections established, by direction",
            "direction",
            s.connections,
        )
        yield from counters_by(
            "fabric_federation_connections_closed_total",
            "Federation connections ended or refused, by reason (tls, hello, bad_frame, idle, "
            "slow, closed, too_many, alpn)",
            "reason",
            s.closed,
        )
        yield counter("fabric_federation_dials_total", "Connections tried to peer sites", s.dials)
        yield from gauges_by(
            "fabric_federation_http_connections",
            "Connections carrying cross-site requests open now (ALPN fabric-http/1), by direction",
            "direction",
            {d: float(n) for d, n in s.http_connections.items()},
        )
        yield counter(
            "fabric_federation_http_dials_total",
            "Request connections opened to peer sites' gateways",
            s.http_dials,
        )
        yield counter(
            "fabric_federation_http_dial_failures_total",
            "Request connections to peer sites' gateways that could not be opened",
            s.http_dial_failures,
        )
        yield counter(
            "fabric_federation_summaries_sent_total", "Our summaries sent to peer sites",
            s.summaries_sent,
        )  # fmt: skip


def render(statistics: Callable[[], LinkStatistics]) -> Callable[[], bytes]:
    registry = registry_of(FederationCollector(statistics))
    return lambda: generate_latest(registry)
