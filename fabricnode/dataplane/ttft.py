"""The time-to-first-token histogram: log-spaced buckets, their bounds and quantiles. Pure.

The request log's sums (``accounting.recent_sums``), the dashboard's last minutes per model
(``recent``) and the elastic controller's latency signal all count TTFTs in these buckets, so
histograms from different ingresses merge by adding counts. Here rather than in ``accounting``
so that the pure modules that read histograms do not import the log's writer and reader.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

TTFT_BUCKET_BASE_S = 0.01  # the TTFT histogram's first bucket holds up to this
TTFT_BUCKET_FACTOR = 2**0.25  # each bucket's bound is this much above the last (~19%)
TTFT_BUCKETS = 80  # the last bucket ends at 0.01 * 2**(79/4), about 8 minutes; it holds the rest


def ttft_bucket(ttft_s: float) -> int:
    """The histogram bucket of one time to first token: bucket ``i`` holds the times in
    ``(bound(i-1), bound(i)]``, ``bound(i) = TTFT_BUCKET_BASE_S * TTFT_BUCKET_FACTOR**i``."""
    if ttft_s <= TTFT_BUCKET_BASE_S:
        return 0
    i = math.ceil(math.log(ttft_s / TTFT_BUCKET_BASE_S) / math.log(TTFT_BUCKET_FACTOR) - 1e-9)
    return min(TTFT_BUCKETS - 1, i)


def ttft_bound(bucket: int) -> float:
    """The upper bound of a bucket (seconds)."""
    return TTFT_BUCKET_BASE_S * TTFT_BUCKET_FACTOR**bucket


def ttft_quantile(histogram: Mapping[int, float], q: float) -> float | None:
    """The ``q`` quantile of a TTFT histogram (bucket -> count), as the upper bound of the
    bucket it falls in (so at most ~19% above the true value); None when it is empty."""
    total = sum(histogram.values())
    if total <= 0:
        return None
    need = q * total
    seen = 0.0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= need - 1e-9:
            return ttft_bound(bucket)
    return ttft_bound(max(histogram))
