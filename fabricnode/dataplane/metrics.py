"""The data plane's Prometheus metrics (prometheus-client), rendered after the agent's own.

The metrics every request touches (requests, latency, TTFT, tokens, policy decisions,
candidates) are plain dicts of numbers kept by the event loop (``FastCounter``,
``FastHistogram``) and turned into Prometheus families only when ``/metrics`` is scraped: a
prometheus-client child takes a lock and a few Python calls per ``inc``/``observe``, several
times what these counters cost (docs/benchmarks.md, "Per-call costs behind the data plane").
The rare ones (retries, ejections, malformed requests, forwards, gauges) are prometheus-client
metrics, their children cached in a ``LabelCache``. Names are prefixed ``fabric_``.

Only the event loop's thread updates or renders these (the control app runs on that loop too).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import Generic, TypeVar, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# The ``*_created`` timestamp series double the output and nobody graphs them.
disable_created_metrics()  # type: ignore[no-untyped-call]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CANDIDATE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)

M = TypeVar("M", Counter, Gauge, Histogram)


class LabelCache(Generic[M]):
    """The children of one labelled metric by label values, resolved by ``labels()`` once each.

    ``cache(model, 200)`` is ``metric.labels(model, "200")``: values are the key as given and
    become label strings with ``str`` on first use only.
    """

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[object, ...], M] = {}

    def __call__(self, *values: object) -> M:
        child = self._children.get(values)
        if child is None:
            # mypyc's type check (unlike mypy's) needs the cast to M; mypy calls it redundant
            labels = self._metric.labels(*map(str, values))
            child = self._children[values] = cast(M, labels)  # type: ignore[redundant-cast]
        return child


class FastCounter:
    """A labelled counter as a dict: label values (as given) -> total."""

    __slots__ = ("documentation", "labelnames", "name", "values")

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.values: dict[tuple[object, ...], float] = {}

    def inc(self, labels: tuple[object, ...], amount: float = 1.0) -> None:
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            family.add_metric([str(v) for v in labels], value)
        return family


class FastHistogram:
    """A labelled histogram as a dict: label values -> [count per bucket..., +Inf, sum]."""

    __slots__ = ("bounds", "documentation", "labelnames", "name", "series")

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        bounds: tuple[float, ...],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.bounds = tuple(sorted(float(b) for b in bounds))
        self.series: dict[tuple[object, ...], list[float]] = {}

    def observe(self, labels: tuple[object, ...], value: float) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        # Buckets are "less than or equal": the first bound >= value takes it (past the last
        # bound: the +Inf bucket).
        series[bisect_left(self.bounds, value)] += 1
        series[-1] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        edges = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for labels, series in list(self.series.items()):
            cumulative, buckets = 0.0, []
            for edge, count in zip(edges, series, strict=False):
                cumulative += count
                buckets.append((edge, cumulative))
            family.add_metric([str(v) for v in labels], buckets, series[-1])
        return family


class FastCollectorFor(Collector):
    """Exposes fast counters and histograms to a prometheus-client registry."""

    def __init__(self, metrics: list[FastCounter | FastHistogram]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            yield metric.family()


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = FastCounter(
            "fabric_ingress_requests", "Requests answered by this ingress", ("model", "status")
        )
        self.latency = FastHistogram(
            "fabric_ingress_request_seconds",
            "Request latency at the ingress (to the last byte)",
            ("model",),
            LATENCY_BUCKETS,
        )
        self.ttft = FastHistogram(
            "fabric_ingress_ttft_seconds",
            "Time to the first streamed body byte",
            ("model",),
            LATENCY_BUCKETS,
        )
        self.tokens = FastCounter(
            "fabric_ingress_tokens",
            "Tokens from the responses' usage (or counted chunks)",
            ("model", "kind"),
        )
        self.endpoint_requests = FastCounter(
            "fabric_ingress_endpoint_requests",
            "Requests answered by this ingress, by endpoint kind (chat, responses, messages,"
            " rerank, transcriptions, ...) and status",
            ("endpoint", "status"),
        )
        self.endpoint_tokens = FastCounter(
            "fabric_ingress_endpoint_tokens",
            "Tokens from the responses' usage (or counted chunks), by endpoint kind",
            ("endpoint", "kind"),
        )
        self.audio_seconds = FastCounter(
            "fabric_ingress_audio_seconds",
            "Seconds of audio transcribed or translated, as the engines report them",
            ("model",),
        )
        self.decisions = FastCounter(
            "fabric_ingress_policy_decisions",
            "Routing decisions by policy and outcome",
            ("policy", "outcome"),
        )
        self.candidates = FastHistogram(
            "fabric_ingress_candidates",
            "Eligible nodes per request after the filters",
            (),
            CANDIDATE_BUCKETS,
        )
        self.tier_requests = FastCounter(
            "fabric_ingress_tier_requests",
            "Requests answered by this ingress, by priority tier (interactive, batch)",
            ("tier",),
        )
        self.batch_wait = FastHistogram(
            "fabric_ingress_batch_wait_seconds",
            "How long batch requests waited at the ingress for a node with room for batch work"
            " (0 when one had room at once)",
            (),
            LATENCY_BUCKETS,
        )
        r.register(
            FastCollectorFor(
                [
                    self.requests,
                    self.latency,
                    self.ttft,
                    self.tokens,
                    self.endpoint_requests,
                    self.endpoint_tokens,
                    self.audio_seconds,
                    self.decisions,
                    self.candidates,
                    self.tier_requests,
                    self.batch_wait,
                ]
            )
        )
        self.retries = Counter(
            "fabric_ingress_retries",
            "Attempts failed over to another node",
            ["reason"],
            registry=r,
        )
        self.ejections = Counter(
            "fabric_ingress_ejections", "Nodes ejected by the circuit breaker", registry=r
        )
        self.broken_streams = Counter(
            "fabric_ingress_broken_streams", "Responses broken after the first byte", registry=r
        )
        self.poisoned = Counter(
            "fabric_ingress_poisoned_requests",
            "Requests not tried on another node because engines failed on them on"
            " max_engine_failures nodes (the poison-request guard)",
            registry=r,
        )
        self.stream_resumes = Counter(
            "fabric_ingress_stream_resumes",
            "Streams broken mid-answer, by outcome: resumed on another node, not_resumable"
            " (ended with the error event), or failed (no node could continue it)",
            ["outcome"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "fabric_ingress_client_disconnects",
            "Requests whose client went away before the answer ended (the upstream request"
            " was aborted), by phase: waiting for the response head, relaying it, or waiting"
            " in the batch gate (gate)",
            ["phase"],
            registry=r,
        )
        self.wake_ups = Counter(
            "fabric_engine_wake_ups",
            "Requests that found this node's engine asleep and waited for it to wake, by outcome"
            " (woken, failed)",
            ["outcome"],
            registry=r,
        )
        self.forwards_served = Counter(
            "fabric_forward_requests",
            "Forwarded requests served for other ingresses",
            ["outcome"],
            registry=r,
        )
        self.residency_refusals = Counter(
            "fabric_ingress_residency_refusals",
            "Requests refused for data residency (403 site_not_allowed), by reason: the key,"
            " X-Fabric-Require and the service file allow no site together (no_common_site),"
            " the model has replicas but none at an allowed site (not_served_in_allowed_sites),"
            " a forward whose allowed sites exclude this node's (forward_outside_site)",
            ["reason"],
            registry=r,
        )
        self.inflight = Gauge(
            "fabric_ingress_inflight",
            "Requests in flight through this agent",
            ["side"],
            registry=r,
        )
        self.connections = Gauge(
            "fabric_ingress_connections", "Open client connections", registry=r
        )
        self.reactor_waits = Counter(
            "fabric_ingress_reactor_waits",
            "Socket waits the data plane batched through its reactor (it does under load)",
            registry=r,
        )
        self.malformed = Counter(
            "fabric_ingress_malformed",
            "Malformed or refused HTTP requests",
            ["status"],
            registry=r,
        )
        self.connections_refused = Counter(
            "fabric_ingress_connections_refused",
            "Client connections closed at accept, by reason: the agent holds max_connections"
            " (total) or the client's address holds max_connections_per_client (per_client)",
            ["reason"],
            registry=r,
        )
        self.batch_admitted = Counter(
            "fabric_ingress_batch_admitted",
            "Batch requests sent on to a node with room, by API key name (the tenant when the"
            " request has no key); a request taken back (fabric_ingress_batch_preempted) counts"
            " again when it is sent on again",
            ["key"],
            registry=r,
        )
        self.batch_waiting = Gauge(
            "fabric_ingress_batch_waiting",
            "Batch requests waiting at this ingress for a node with room, by API key name",
            ["key"],
            registry=r,
        )
        self.batch_preempted = Counter(
            "fabric_ingress_batch_preempted",
            "Batch requests taken back from a node whose engine queued requests with its KV"
            " cache nearly full (they waited for room again)",
            registry=r,
        )
        self.prefill_rate = Gauge(
            "fabric_ingress_prefill_rate_tokens_per_second",
            "Prefill rate this ingress learned for each node from its streamed requests' first"
            " tokens, in estimated prompt tokens (prompt bytes / 4) per second; routing weighs"
            " the prefill it sent a node by it",
            ["node"],
            registry=r,
        )
        self.internal_errors = Counter(
            "fabric_ingress_internal_errors",
            "Connections closed because answering them raised an unexpected error (a bug: the"
            " agent logs it and serves on)",
            registry=r,
        )

    def done(self, model: str, status: int, latency_s: float) -> None:
        self.requests.inc((model, status))
        self.latency.observe((model,), latency_s)

    def first_token(self, model: str, ttft_s: float) -> None:
        self.ttft.observe((model,), ttft_s)

    def count_tokens(self, model: str, prompt: int, completion: int) -> None:
        if prompt:
            self.tokens.inc((model, "prompt"), prompt)
        if completion:
            self.tokens.inc((model, "completion"), completion)

    def count_endpoint(self, endpoint: str, status: int, prompt: int, completion: int) -> None:
        self.endpoint_requests.inc((endpoint, status))
        if prompt:
            self.endpoint_tokens.inc((endpoint, "prompt"), prompt)
        if completion:
            self.endpoint_tokens.inc((endpoint, "completion"), completion)

    def decision(self, policy: str, outcome: str) -> None:
        self.decisions.inc((policy, outcome))

    def render(self) -> bytes:
        return generate_latest(self.registry)
