"""The dashboard's per-model ring (``fabricnode.dataplane.recent``): what it counts, its bounds,
and that agents' exports add up (``merge``) to figures read back by ``summarize``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.dataplane.recent import (
    BUCKET_S,
    BUCKETS,
    MAX_MODELS,
    OTHER,
    RecentStats,
    merge,
    summarize,
)

T0 = 1_750_000_000.0  # a bucket boundary (divisible by 10)


def test_a_request_is_counted_in_its_bucket_with_its_latencies() -> None:
    ring = RecentStats()
    ring.add(T0 + 1, "m", 200, 0.8, 0.1, 100, 20, batch=False)
    rows = ring.export(T0 + 5, 60)
    assert len(rows) == 1
    row = rows[0]
    assert row["i"] == int(T0 // BUCKET_S) and row["model"] == "m"
    assert (row["requests"], row["prompt_tokens"], row["output_tokens"], row["errors"]) == (
        1,
        100,
        20,
        0,
    )
    assert sum(row["ttft"].values()) == 1 and sum(row["e2e"].values()) == 1


def test_client_errors_are_not_counted_and_server_errors_are() -> None:
    ring = RecentStats()
    ring.add(T0, "m", 404, 0.01, None, 0, 0, batch=False)
    ring.add(T0, "m", 429, 0.01, None, 0, 0, batch=False)
    ring.add(T0, "m", 503, 0.01, None, 0, 0, batch=False)
    ring.add(T0, "m", 0, 0.01, None, 0, 0, batch=False)  # never answered
    (row,) = ring.export(T0, 60)
    assert row["requests"] == 2 and row["errors"] == 2
    assert row["ttft"] == {} and row["e2e"] == {}  # failures have no latency to report


def test_batch_requests_count_but_add_no_latency() -> None:
    ring = RecentStats()
    ring.add(T0, "m", 200, 30.0, 29.0, 10, 10, batch=True)
    (row,) = ring.export(T0, 60)
    assert row["requests"] == 1 and row["batch"] == 1
    assert row["ttft"] == {} and row["e2e"] == {}


def test_the_ring_keeps_only_its_buckets_and_drops_what_comes_too_late() -> None:
    ring = RecentStats()
    for k in range(BUCKETS + 5):
        ring.add(T0 + k * BUCKET_S, "m", 200, 0.1, None, 1, 1, batch=False)
    rows = ring.export(T0 + (BUCKETS + 5) * BUCKET_S, 10 * BUCKETS * BUCKET_S)
    assert len(rows) == BUCKETS
    ring.add(T0, "m", 200, 0.1, None, 1, 1, batch=False)  # older than everything kept
    assert len(ring.export(T0 + (BUCKETS + 5) * BUCKET_S, 10 * BUCKETS * BUCKET_S)) == BUCKETS


def test_made_up_model_names_cannot_grow_a_bucket() -> None:
    ring = RecentStats()
    for k in range(MAX_MODELS + 50):
        ring.add(T0, f"model-{k}", 200, 0.1, None, 1, 1, batch=False)
    rows = ring.export(T0, 60)
    assert len(rows) == MAX_MODELS + 1
    other = next(r for r in rows if r["model"] == OTHER)
    assert other["requests"] == 50


def test_exports_of_several_agents_add_up() -> None:
    a, b = RecentStats(), RecentStats()
    for k in range(30):
        a.add(T0 + k, "m", 200, 0.5, 0.05, 10, 5, batch=False)
        b.add(T0 + k, "m", 200, 2.0, 1.0, 10, 5, batch=False)
    merged = merge([a.export(T0 + 40, 600), b.export(T0 + 40, 600)])
    rows = list(merged.values())
    assert sum(r["requests"] for r in rows) == 60
    assert sum(r["output_tokens"] for r in rows) == 300
    doc = summarize(merged, T0 + 40, 600)
    summary = doc["m"]["summary"]
    assert summary["requests_per_s"] == pytest.approx(60 / 60)
    assert summary["output_tokens_per_s"] == pytest.approx(300 / 60)
    # Half the first tokens took 0.05 s, half 1 s: p50 falls in the low half, p95 in the high.
    assert summary["ttft_p50_s"] == pytest.approx(0.05, rel=0.2)
    assert summary["ttft_p95_s"] == pytest.approx(1.0, rel=0.2)
    series = doc["m"]["series"]
    assert len(series["t"]) == 600 // BUCKET_S
    assert series["t"] == sorted(series["t"])
    assert series["requests_per_s"][-4:-1] == [2.0, 2.0, 2.0]  # the three buckets of the 30 s
    assert series["ttft_p95_s"][0] is None  # an empty bucket has no percentile


def test_summarize_leaves_the_current_bucket_out() -> None:
    ring = RecentStats()
    ring.add(T0 + 1, "m", 200, 0.1, 0.1, 1, 1, batch=False)
    doc = summarize(merge([ring.export(T0 + 2, 600)]), T0 + 2, 600)
    assert doc == {}  # only the bucket still filling has requests


@pytest.mark.parametrize(
    "row",
    [
        "not a row",
        {"i": "1", "model": "m"},
        {"i": 1, "model": 5},
        {"i": True, "model": "m"},
        {"i": 1, "model": "m", "requests": -1},
        {"i": 1, "model": "m", "requests": 2**60},
        {"i": 1, "model": "m", "ttft": {"x": 1}},
        {"i": 1, "model": "m", "ttft": {"999": 1}},
        {"i": 1, "model": "m", "e2e": {"1": -4}},
        {"i": 1, "model": "m", "e2e": [1, 2]},
    ],
)
def test_rows_no_agent_exports_are_skipped(row: object) -> None:
    good = {"i": 1, "model": "m", "requests": 3}
    merged = merge([[row, good]])  # type: ignore[list-item]
    assert list(merged) == [(1, "m")]
    assert merged[(1, "m")]["requests"] == 3


rows_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "i": st.integers(0, 5),
            "model": st.sampled_from(["a", "b"]),
            "requests": st.integers(0, 100),
            "ttft": st.dictionaries(st.sampled_from(["0", "10", "20"]), st.integers(0, 9)),
        }
    ),
    max_size=8,
)


@given(rows_strategy, rows_strategy)
def test_merging_is_order_free(x: list[dict[str, object]], y: list[dict[str, object]]) -> None:
    assert merge([x, y]) == merge([y, x])
