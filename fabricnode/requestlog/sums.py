"""Sums over request-log records, per model: the planner's workload and the elastic
controller's recent demand.

* ``workload_summary``: arrival rate and token means/std of some records (one log).
* ``workload_sums`` and ``merge_workload_sums``: the same as sums that merge across ingresses
  (``/fabric/v1/workload?window=``; ``fabric plan`` merges every agent's).
* ``recent_sums``: counts, token sums and a TTFT histogram (``ttft``) of what a log gained
  after a cursor (``/fabric/v1/workload?after=``; the elastic controller merges them).

Every sum counts what was not refused as a client error (4xx): 5xx and 503 "no eligible node"
are demand the mesh failed to serve. Pure: records in, JSON-ready dicts out.
"""

from __future__ import annotations

import math
import statistics as stats
from collections.abc import Iterable, Mapping
from typing import Any

from fabricnode.requestlog.format import TraceRecord
from fabricnode.requestlog.ttft import ttft_bucket


def workload_summary(
    records: Iterable[TraceRecord], *, duration_s: float | None = None
) -> dict[str, dict[str, float]]:
    """Per model: arrival ``rate`` (req/s) and token means/std -- the planner's workload.

    The rate counts every request that was not refused as a client error (4xx): 5xx and 503
    "no eligible node" are demand the mesh failed to serve. It is over ``duration_s`` if given,
    else over the span of all the records' arrival times (at least 1 s). Token statistics use
    the requests whose input and output counts are known; std is the population std (0 for
    one sample); a model with no such request gets 0.0.
    """
    arrivals: dict[str, int] = {}
    inputs: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    first, last = math.inf, -math.inf
    for r in records:
        first, last = min(first, r.t), max(last, r.t)
        if 400 <= r.status < 500:
            continue
        arrivals[r.model] = arrivals.get(r.model, 0) + 1
        if r.input_tokens is not None and r.output_tokens is not None:
            inputs.setdefault(r.model, []).append(r.input_tokens)
            outputs.setdefault(r.model, []).append(r.output_tokens)
    if duration_s is not None:
        if duration_s <= 0:
            raise ValueError("duration_s must be positive")
        span = duration_s
    else:
        span = max(1.0, last - first) if math.isfinite(first) else 1.0
    summary: dict[str, dict[str, float]] = {}
    for model in sorted(arrivals):
        ins, outs = inputs.get(model, []), outputs.get(model, [])
        summary[model] = {
            "rate": arrivals[model] / span,
            "input_mean": stats.fmean(ins) if ins else 0.0,
            "output_mean": stats.fmean(outs) if outs else 0.0,
            "input_std": stats.pstdev(ins) if ins else 0.0,
            "output_std": stats.pstdev(outs) if outs else 0.0,
        }
    return summary


def workload_sums(records: Iterable[TraceRecord]) -> dict[str, dict[str, float]]:
    """Per model: request count and token sums -- mergeable across ingresses.

    ``requests`` counts what was not refused as a client error (as ``workload_summary``);
    ``measured`` those with both token counts known, over which the ``*_sum``/``*_sumsq``
    fields run. ``merge_workload_sums`` turns sums from any number of ingresses into rates and
    moments.
    """
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if 400 <= r.status < 500:
            continue
        row = out.setdefault(
            r.model,
            {
                "requests": 0.0,
                "measured": 0.0,
                "input_sum": 0.0,
                "input_sumsq": 0.0,
                "output_sum": 0.0,
                "output_sumsq": 0.0,
            },
        )
        row["requests"] += 1
        if r.input_tokens is not None and r.output_tokens is not None:
            row["measured"] += 1
            row["input_sum"] += r.input_tokens
            row["input_sumsq"] += r.input_tokens * r.input_tokens
            row["output_sum"] += r.output_tokens
            row["output_sumsq"] += r.output_tokens * r.output_tokens
    return out


def merge_workload_sums(
    parts: Iterable[Mapping[str, Mapping[str, float]]], window_s: float
) -> dict[str, dict[str, float]]:
    """Sums from several ingresses (each over the same ``window_s``) -> rate and token moments
    per model, in ``workload_summary``'s shape (population std)."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    total: dict[str, dict[str, float]] = {}
    for part in parts:
        for model, row in part.items():
            acc = total.setdefault(model, {})
            for key, value in row.items():
                acc[key] = acc.get(key, 0.0) + float(value)
    summary: dict[str, dict[str, float]] = {}
    for model in sorted(total):
        acc = total[model]
        n = acc.get("measured", 0.0)

        def moments(prefix: str, n: float = n, acc: dict[str, float] = acc) -> tuple[float, float]:
            if n <= 0:
                return 0.0, 0.0
            mean = acc.get(f"{prefix}_sum", 0.0) / n
            var = max(0.0, acc.get(f"{prefix}_sumsq", 0.0) / n - mean * mean)
            return mean, math.sqrt(var)

        in_mean, in_std = moments("input")
        out_mean, out_std = moments("output")
        summary[model] = {
            "rate": acc.get("requests", 0.0) / window_s,
            "input_mean": in_mean,
            "output_mean": out_mean,
            "input_std": in_std,
            "output_std": out_std,
        }
    return summary


def recent_sums(records: Iterable[TraceRecord]) -> dict[str, dict[str, Any]]:
    """Per model, what the elastic controller's scaling policy needs of some records: counts
    and token sums (mergeable across ingresses) and a TTFT histogram.

    ``requests`` counts what was not refused as a client error (4xx), as ``workload_sums``;
    ``prompt_tokens`` sums the known input tokens of those, over ``prompt_known`` requests;
    ``output_tokens`` the known output tokens, over ``output_known`` (answered) requests;
    ``ttft`` maps a bucket (``ttft_bucket``, as a string: JSON keys) to the count of answered
    requests whose first token came in it (streams only: a JSON answer has no first token), of
    the interactive tier only: a batch request's first token includes its wait for spare
    capacity at the ingress (``tiers``), which a latency objective must not scale for.
    """
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if 400 <= r.status < 500:
            continue
        row = out.get(r.model)
        if row is None:
            row = out[r.model] = {
                "requests": 0,
                "prompt_tokens": 0,
                "prompt_known": 0,
                "output_tokens": 0,
                "output_known": 0,
                "ttft": {},
            }
        row["requests"] += 1
        if r.input_tokens is not None and r.input_tokens >= 0:
            row["prompt_tokens"] += r.input_tokens
            row["prompt_known"] += 1
        if r.output_tokens is not None and r.output_tokens >= 0:
            row["output_tokens"] += r.output_tokens
            row["output_known"] += 1
        if r.ttft_s is not None and r.status == 200 and r.ttft_s >= 0 and r.tier != "batch":
            key = str(ttft_bucket(r.ttft_s))
            row["ttft"][key] = row["ttft"].get(key, 0) + 1
    return out


def binned_sums(
    records: Iterable[TraceRecord], start: float, bin_s: float
) -> list[tuple[float, dict[str, dict[str, Any]]]]:
    """``recent_sums`` of ``records`` by the bin of ``bin_s`` seconds, counted from ``start``,
    that each ended in: ``(bin start, sums)`` for the bins that have records, in time order
    (records before ``start`` are left out). A controller that takes over replays them into its
    scaling policy (``/fabric/v1/workload?history=``)."""
    if not (bin_s > 0 and math.isfinite(bin_s) and math.isfinite(start)):
        raise ValueError("bins need a finite start and a positive width")
    by_bin: dict[int, list[TraceRecord]] = {}
    for r in records:
        if r.t >= start:
            by_bin.setdefault(int((r.t - start) // bin_s), []).append(r)
    return [(start + k * bin_s, recent_sums(by_bin[k])) for k in sorted(by_bin)]
