"""Sums over records: the planner's workload, mergeable sums, the recent sums' TTFT histogram."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.requestlog.format import TraceRecord
from fabricnode.requestlog.sums import (
    merge_workload_sums,
    recent_sums,
    workload_summary,
    workload_sums,
)
from fabricnode.requestlog.ttft import (
    TTFT_BUCKET_FACTOR,
    TTFT_BUCKETS,
    ttft_bucket,
    ttft_quantile,
)
from tests.unit.requestlog.test_format import record


def test_workload_summary_gives_rates_and_token_statistics() -> None:
    records = [record(t=100.0 + i, model="a", i=100 + 20 * (i % 2), o=10) for i in range(11)]
    records += [record(t=105.0, model="b", i=50, o=None)]  # tokens unknown: rate only
    records += [record(t=106.0, model="c", i=1, o=1)]
    records += [
        TraceRecord(t=107.0, model="c", input_tokens=1, output_tokens=0, latency_s=0, status=404)
    ]
    summary = workload_summary(records)
    assert set(summary) == {"a", "b", "c"}
    a = summary["a"]
    assert a["rate"] == pytest.approx(11 / 10)  # span of arrivals: 100 .. 110
    assert a["input_mean"] == pytest.approx((6 * 100 + 5 * 120) / 11)
    assert a["input_std"] == pytest.approx(20 * (6 * 5) ** 0.5 / 11)  # 20 * sqrt(p * q)
    assert (a["output_mean"], a["output_std"]) == (10.0, 0.0)
    assert summary["b"] == {
        "rate": pytest.approx(0.1),
        "input_mean": 0.0,
        "output_mean": 0.0,
        "input_std": 0.0,
        "output_std": 0.0,
    }
    assert summary["c"]["rate"] == pytest.approx(0.1), "client errors are not demand"
    assert workload_summary(records, duration_s=100.0)["a"]["rate"] == pytest.approx(0.11)
    assert workload_summary([]) == {}


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.one_of(st.none(), st.integers(1, 5000)),
            st.integers(1, 500),
            st.sampled_from([200, 200, 404, 503]),
        ),
        max_size=40,
    ),
    st.integers(1, 4),
)
@settings(max_examples=100, deadline=None)
def test_workload_sums_merged_over_ingresses_equal_one_summary(
    rows: list[tuple[str, int | None, int, int]], parts: int
) -> None:
    records = [
        TraceRecord(t=float(i), model=m, input_tokens=inp, output_tokens=out, latency_s=1.0,
                    status=status)
        for i, (m, inp, out, status) in enumerate(rows)
    ]  # fmt: skip
    split = [workload_sums(records[i::parts]) for i in range(parts)]
    merged = merge_workload_sums(split, 100.0)
    whole = workload_summary(records, duration_s=100.0)
    assert set(merged) == set(whole)
    for model, row in whole.items():
        for key, value in row.items():
            assert merged[model][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def test_recent_sums_count_tokens_and_a_ttft_histogram() -> None:
    rows = [
        TraceRecord(1.0, "m", 100, 10, 1.0, ttft_s=0.2, stream=True),
        TraceRecord(2.0, "m", None, 20, 1.0, ttft_s=1.0, stream=True),
        TraceRecord(3.0, "m", 50, None, 1.0, status=503),
        TraceRecord(4.0, "m", 70, None, 0.1, status=429),  # a client error: not demand
    ]
    sums = recent_sums(rows)
    assert set(sums) == {"m"}
    m = sums["m"]
    assert (m["requests"], m["prompt_tokens"], m["prompt_known"]) == (3, 150, 2)
    assert (m["output_tokens"], m["output_known"]) == (30, 2)
    histogram = {int(k): v for k, v in m["ttft"].items()}
    assert sum(histogram.values()) == 2
    p50 = ttft_quantile(histogram, 0.5)
    p95 = ttft_quantile(histogram, 0.95)
    assert p50 is not None and 0.2 <= p50 < 0.2 * TTFT_BUCKET_FACTOR
    assert p95 is not None and 1.0 <= p95 < 1.0 * TTFT_BUCKET_FACTOR
    assert ttft_quantile({}, 0.95) is None
    assert ttft_bucket(0.0) == 0
    assert ttft_bucket(1e9) == TTFT_BUCKETS - 1


def test_batch_requests_count_as_demand_but_not_in_the_ttft_histogram() -> None:
    """A batch request's first token includes its wait for spare capacity: the latency
    objective the controller scales for is the interactive requests'."""
    rows = [
        TraceRecord(1.0, "m", 10, 5, 1.0, ttft_s=0.2, stream=True, tier="interactive"),
        TraceRecord(2.0, "m", 10, 5, 300.0, ttft_s=299.0, stream=True, tier="batch"),
        TraceRecord(3.0, "m", 10, 5, 1.0, ttft_s=0.3, stream=True),  # logged before tiers
    ]
    m = recent_sums(rows)["m"]
    assert m["requests"] == 3 and m["output_tokens"] == 15
    assert sum(m["ttft"].values()) == 2
    p95 = ttft_quantile({int(k): v for k, v in m["ttft"].items()}, 0.95)
    assert p95 is not None and p95 < 1.0
