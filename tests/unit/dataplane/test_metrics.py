"""The ingress's per-request metrics: one labelled series per model (status, kind), cached."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from fabricnode.dataplane.metrics import (
    LATENCY_BUCKETS,
    FastCollectorFor,
    FastHistogram,
    IngressMetrics,
)
from fabricnode.engine.metrics import parse_samples


def samples(metrics: IngressMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels))): s.value for s in parse_samples(metrics.render().decode())
    }


def test_request_metrics_accumulate_per_model_status_and_kind() -> None:
    metrics = IngressMetrics()

    metrics.done("m1", 200, 0.02)
    metrics.done("m1", 200, 0.2)
    metrics.done("m1", 503, 0.001)
    metrics.done("m2", 200, 1.5)
    metrics.first_token("m1", 0.01)
    metrics.count_tokens("m1", 7, 3)
    metrics.count_tokens("m1", 5, 0)

    got = samples(metrics)
    assert got[("fabric_ingress_requests_total", (("model", "m1"), ("status", "200")))] == 2
    assert got[("fabric_ingress_requests_total", (("model", "m1"), ("status", "503")))] == 1
    assert got[("fabric_ingress_requests_total", (("model", "m2"), ("status", "200")))] == 1
    assert got[("fabric_ingress_request_seconds_count", (("model", "m1"),))] == 3
    assert got[("fabric_ingress_request_seconds_sum", (("model", "m2"),))] == 1.5
    assert got[("fabric_ingress_ttft_seconds_count", (("model", "m1"),))] == 1
    assert got[("fabric_ingress_tokens_total", (("kind", "prompt"), ("model", "m1")))] == 12
    assert got[("fabric_ingress_tokens_total", (("kind", "completion"), ("model", "m1")))] == 3


def test_no_series_before_the_first_request_of_a_model() -> None:
    metrics = IngressMetrics()

    metrics.count_tokens("m1", 0, 0)

    names = {name for name, _ in samples(metrics)}
    assert not names & {
        "fabric_ingress_requests_total",
        "fabric_ingress_request_seconds_count",
        "fabric_ingress_ttft_seconds_count",
        "fabric_ingress_tokens_total",
    }


@given(st.lists(st.sampled_from([0.0, 0.005, 0.01, 1.0, 300.0, 301.0]) | st.floats(0, 400)))
@settings(max_examples=50, deadline=None)
def test_fast_histogram_exposes_what_a_prometheus_histogram_would(values: list[float]) -> None:
    """Boundary values included: a bucket counts values less than OR EQUAL to its bound."""
    reference_registry = CollectorRegistry()
    reference = Histogram(
        "h", "doc", ["model"], buckets=LATENCY_BUCKETS, registry=reference_registry
    )
    fast = FastHistogram("h", "doc", ("model",), LATENCY_BUCKETS)
    for value in values:
        reference.labels("m").observe(value)
        fast.observe(("m",), value)
    fast_registry = CollectorRegistry()
    fast_registry.register(FastCollectorFor([fast]))
    if not values:
        return  # prometheus-client shows a labelled series only once it is used, as we do
    want = {
        (s.name, tuple(sorted(s.labels))): s.value
        for s in parse_samples(generate_latest(reference_registry).decode())
    }
    got = {
        (s.name, tuple(sorted(s.labels))): s.value
        for s in parse_samples(generate_latest(fast_registry).decode())
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-9), key
