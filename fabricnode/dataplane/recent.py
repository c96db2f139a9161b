"""What this ingress answered in the last minutes, per model, in 10-second buckets: the
dashboard's rates and latencies (``GET /fabric/v1/stats``).

Why not the request log: the log is on disk and optional, and reading it back per page refresh
would cost the agent far more than the dashboard's budget (under 1% of an idle agent's CPU).
This is a small ring in memory, fed by the settler (off the client's path) with what it already
has in hand, and bounded: ``BUCKETS`` buckets of ``BUCKET_S`` seconds, at most ``MAX_MODELS``
models a bucket (a client naming made-up models cannot grow it: the rest are counted under
``OTHER``).

Every figure is mergeable, so a mesh-wide view is the sum of every agent's export
(``merge``): counts and token sums, and latency histograms in the request log's TTFT buckets
(``ttft.ttft_bucket``, ~19% wide), from which ``summarize`` reads p50 and p95. Buckets
are aligned on wall-clock time (``index = floor(t / BUCKET_S)``), so agents' buckets line up as
far as their clocks agree (NTP on a cluster: well under a bucket).

Latencies (time to first token of streams, end-to-end of answered requests) are of the
interactive tier only: a batch request's times include its wait for spare capacity, which says
nothing of how the model is doing. Requests and tokens count both tiers.

Pure: no I/O and no clock reads; callers pass wall-clock times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from fabricnode.dataplane.ttft import TTFT_BUCKETS, ttft_bucket, ttft_quantile

BUCKET_S = 10.0
BUCKETS = 60  # ten minutes
MAX_MODELS = 64  # per bucket; past that, counted under OTHER
OTHER = "(other)"
SUMMARY_BUCKETS = 6  # the summary: the last minute of complete buckets

Json = dict[str, Any]


class ModelBucket:
    """One model's requests in one bucket."""

    __slots__ = ("batch", "e2e", "errors", "output_tokens", "prompt_tokens", "requests", "ttft")

    def __init__(self) -> None:
        self.requests = 0
        self.batch = 0
        self.errors = 0  # answered 5xx, or never answered (no status)
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.ttft: dict[int, int] = {}  # bucket -> first tokens (interactive streams)
        self.e2e: dict[int, int] = {}  # bucket -> answered interactive requests

    def as_json(self) -> Json:
        return {
            "requests": self.requests,
            "batch": self.batch,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft": {str(k): v for k, v in self.ttft.items()},
            "e2e": {str(k): v for k, v in self.e2e.items()},
        }


class RecentStats:
    """The ring (see the module docstring)."""

    __slots__ = ("_buckets",)

    def __init__(self) -> None:
        self._buckets: dict[int, dict[str, ModelBucket]] = {}

    def add(
        self,
        at: float,
        model: str,
        status: int,
        latency_s: float,
        ttft_s: float | None,
        prompt_tokens: int,
        output_tokens: int,
        batch: bool,
    ) -> None:
        """One settled request that arrived at wall-clock ``at``. Client errors (4xx) are not
        the model's doing and are not counted, as in the request log's sums."""
        if 400 <= status < 500 or not model or not math.isfinite(at):
            return
        index = int(at // BUCKET_S)
        buckets = self._buckets
        rows = buckets.get(index)
        if rows is None:
            if buckets and index < min(buckets):
                return  # older than everything kept (a settle that came very late)
            rows = buckets[index] = {}
            while len(buckets) > BUCKETS:
                del buckets[min(buckets)]
        row = rows.get(model)
        if row is None:
            if len(rows) >= MAX_MODELS:
                model = OTHER
                row = rows.get(model)
            if row is None:
                row = rows[model] = ModelBucket()
        row.requests += 1
        if batch:
            row.batch += 1
        if status == 0 or status >= 500:
            row.errors += 1
        if prompt_tokens > 0:
            row.prompt_tokens += prompt_tokens
        if output_tokens > 0:
            row.output_tokens += output_tokens
        if batch or status != 200:
            return
        if ttft_s is not None and ttft_s >= 0.0:
            b = ttft_bucket(ttft_s)
            row.ttft[b] = row.ttft.get(b, 0) + 1
        if latency_s >= 0.0:
            b = ttft_bucket(latency_s)
            row.e2e[b] = row.e2e.get(b, 0) + 1

    def export(self, now: float, window_s: float) -> list[Json]:
        """The buckets of the last ``window_s`` before ``now`` (the current one included), as
        mergeable JSON rows: ``{"i": bucket index, "model": ..., **ModelBucket.as_json()}``."""
        first = int((now - window_s) // BUCKET_S)
        out: list[Json] = []
        for index in sorted(self._buckets):
            if index < first:
                continue
            for model, row in sorted(self._buckets[index].items()):
                out.append({"i": index, "model": model, **row.as_json()})
        return out


COUNTS = ("requests", "batch", "errors", "prompt_tokens", "output_tokens")
HISTOGRAMS = ("ttft", "e2e")
MAX_COUNT = 2**53


def merge(exports: Iterable[Iterable[Mapping[str, Any]]]) -> dict[tuple[int, str], Json]:
    """Several agents' ``export`` rows summed per (bucket, model). Rows that are not what an
    agent exports (a peer on another version, or a hostile one) are skipped, never raised."""
    out: dict[tuple[int, str], Json] = {}
    for rows in exports:
        for raw in rows:
            row = _clean_row(raw)
            if row is None:
                continue
            key = (row["i"], row["model"])
            acc = out.get(key)
            if acc is None:
                out[key] = row
                continue
            for name in COUNTS:
                acc[name] = min(MAX_COUNT, acc[name] + row[name])
            for name in HISTOGRAMS:
                hist = acc[name]
                for b, c in row[name].items():
                    hist[b] = min(MAX_COUNT, hist.get(b, 0) + c)
    return out


def _clean_row(raw: Any) -> Json | None:
    if not isinstance(raw, Mapping):
        return None
    index, model = raw.get("i"), raw.get("model")
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(model, str):
        return None
    row: Json = {"i": index, "model": model[:256]}
    for name in COUNTS:
        value = raw.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_COUNT:
            return None
        row[name] = value
    for name in HISTOGRAMS:
        hist = raw.get(name, {})
        if not isinstance(hist, Mapping) or len(hist) > TTFT_BUCKETS:
            return None
        clean: dict[int, int] = {}
        for b, c in hist.items():
            try:
                bucket = int(b)
            except (TypeError, ValueError):
                return None
            if not 0 <= bucket < TTFT_BUCKETS:
                return None
            if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < MAX_COUNT:
                return None
            clean[bucket] = c
        row[name] = clean
    return row


def summarize(merged: Mapping[tuple[int, str], Json], now: float, window_s: float) -> Json:
    """Per model, series over the complete buckets of the last ``window_s`` (oldest first:
    bucket start ``t``, requests/s, output tokens/s, errors, TTFT and end-to-end p50/p95, null
    where a bucket had none) and a summary of the last ``SUMMARY_BUCKETS`` of them."""
    current = int(now // BUCKET_S)  # still filling: left out of rates
    count = max(1, min(BUCKETS, int(window_s // BUCKET_S)))
    indices = list(range(current - count, current))
    models = sorted({model for (i, model) in merged if i in range(indices[0], current)})
    out: Json = {}
    for model in models:
        series: Json = {
            "t": [],
            "requests_per_s": [],
            "output_tokens_per_s": [],
            "errors": [],
            "ttft_p50_s": [],
            "ttft_p95_s": [],
            "e2e_p50_s": [],
            "e2e_p95_s": [],
        }
        last: list[Json] = []
        for index in indices:
            row = merged.get((index, model))
            series["t"].append(index * BUCKET_S)
            if row is None:
                row = {name: 0 for name in COUNTS} | {name: {} for name in HISTOGRAMS}
            series["requests_per_s"].append(row["requests"] / BUCKET_S)
            series["output_tokens_per_s"].append(row["output_tokens"] / BUCKET_S)
            series["errors"].append(row["errors"])
            for name in HISTOGRAMS:
                series[f"{name}_p50_s"].append(ttft_quantile(row[name], 0.5))
                series[f"{name}_p95_s"].append(ttft_quantile(row[name], 0.95))
            if index >= current - SUMMARY_BUCKETS:
                last.append(row)
        span = SUMMARY_BUCKETS * BUCKET_S
        summary: Json = {
            "window_s": span,
            "requests_per_s": sum(r["requests"] for r in last) / span,
            "batch_requests_per_s": sum(r["batch"] for r in last) / span,
            "output_tokens_per_s": sum(r["output_tokens"] for r in last) / span,
            "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in last) / span,
            "errors": sum(r["errors"] for r in last),
        }
        for name in HISTOGRAMS:
            hist: dict[int, int] = {}
            for r in last:
                for b, c in r[name].items():
                    hist[b] = hist.get(b, 0) + c
            summary[f"{name}_p50_s"] = ttft_quantile(hist, 0.5)
            summary[f"{name}_p95_s"] = ttft_quantile(hist, 0.95)
        out[model] = {"series": series, "summary": summary}
    return out
