"""Prometheus metric families read from live objects at scrape time, for prometheus-client.

The control app and the simulated engine keep no metric objects of their own: their numbers
live in the objects that count them (``MeshCore.statistics()``, the transport, the engine's
scheduler). Each exposes a prometheus-client ``Collector`` whose ``collect()`` reads those
objects and yields the families built here, and renders it with ``generate_latest`` on a
``CollectorRegistry`` of its own (``registry_of``), never the global default registry: several
agents or engines may live in one process (the tests, the local mesh).

A family appears with its first sample: ``gauges_by``/``counters_by`` yield nothing for an empty
mapping rather than a ``# HELP``/``# TYPE`` header without samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

# The text format ``generate_latest`` writes, as prometheus-client's own HTTP handlers label it
# by default (its CONTENT_TYPE_LATEST now names the 1.0.0 format, which we do not negotiate).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

COUNTER_SUFFIX = "_total"


def registry_of(*collectors: Collector) -> CollectorRegistry:
    """A registry of its own holding ``collectors``, in order (the order of the page)."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return registry


def gauge(
    name: str, documentation: str, value: float, labels: Mapping[str, str] | None = None
) -> Metric:
    """A gauge family of one sample."""
    family = GaugeMetricFamily(name, documentation, labels=list(labels or ()))
    family.add_metric(list((labels or {}).values()), value)
    return family


def counter(
    name: str, documentation: str, value: float, labels: Mapping[str, str] | None = None
) -> Metric:
    """A counter family of one sample, exposed as ``name``, which ends in ``_total``.

    prometheus-client names a counter family without the suffix and writes it back on the
    ``# HELP``/``# TYPE`` lines and the sample, so the page shows ``name`` everywhere.
    """
    if not name.endswith(COUNTER_SUFFIX):
        raise ValueError(f"counter {name!r} must end in {COUNTER_SUFFIX}")
    family = CounterMetricFamily(name, documentation, labels=list(labels or ()))
    family.add_metric(list((labels or {}).values()), value)
    return family


def gauges_by(
    name: str, documentation: str, label: str, values: Mapping[str, float]
) -> Iterator[Metric]:
    """One gauge family with a sample per key of ``values`` (``label=key``), if any."""
    if values:
        family = GaugeMetricFamily(name, documentation, labels=[label])
        for key, value in values.items():
            family.add_metric([key], value)
        yield family


def counters_by(
    name: str, documentation: str, label: str, values: Mapping[str, float]
) -> Iterator[Metric]:
    """One counter family (``name`` ends in ``_total``) with a sample per key, if any."""
    if not name.endswith(COUNTER_SUFFIX):
        raise ValueError(f"counter {name!r} must end in {COUNTER_SUFFIX}")
    if values:
        family = CounterMetricFamily(name, documentation, labels=[label])
        for key, value in values.items():
            family.add_metric([key], value)
        yield family
