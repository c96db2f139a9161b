"""The data plane's Prometheus metrics (prometheus-client), rendered after the agent's own.

The per-request metrics keep their label children in a ``LabelCache`` (by model, status, kind),
so a request costs a few dict lookups and ``inc``/``observe`` calls, not a ``labels()``
resolution each. Names are prefixed ``fabric_``.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

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
            child = self._children[values] = self._metric.labels(*map(str, values))
        return child


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "fabric_ingress_requests",
            "Requests answered by this ingress",
            ["model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "fabric_ingress_request_seconds",
            "Request latency at the ingress (to the last byte)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "fabric_ingress_ttft_seconds",
            "Time to the first streamed body byte",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "fabric_ingress_tokens",
            "Tokens from the responses' usage (or counted chunks)",
            ["model", "kind"],
            registry=r,
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
        self.decisions = Counter(
            "fabric_ingress_policy_decisions",
            "Routing decisions by policy and outcome",
            ["policy", "outcome"],
            registry=r,
        )
        self.candidates = Histogram(
            "fabric_ingress_candidates",
            "Eligible nodes per request after the filters",
            buckets=CANDIDATE_BUCKETS,
            registry=r,
        )
        self.broken_streams = Counter(
            "fabric_ingress_broken_streams", "Responses broken after the first byte", registry=r
        )
        self.forwards_served = Counter(
            "fabric_forward_requests",
            "Forwarded requests served for other ingresses",
            ["outcome"],
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
        self.malformed = Counter(
            "fabric_ingress_malformed",
            "Malformed or refused HTTP requests",
            ["status"],
            registry=r,
        )
        self._requests = LabelCache(self.requests)
        self._latency = LabelCache(self.latency)
        self._ttft = LabelCache(self.ttft)
        self._tokens = LabelCache(self.tokens)

    def done(self, model: str, status: int, latency_s: float) -> None:
        self._requests(model, status).inc()
        self._latency(model).observe(latency_s)

    def first_token(self, model: str, ttft_s: float) -> None:
        self._ttft(model).observe(ttft_s)

    def count_tokens(self, model: str, prompt: int, completion: int) -> None:
        if prompt:
            self._tokens(model, "prompt").inc(prompt)
        if completion:
            self._tokens(model, "completion").inc(completion)

    def render(self) -> bytes:
        return generate_latest(self.registry)
