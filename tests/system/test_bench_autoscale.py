"""bench/autoscale.py still replays the traces against the static frontier and every policy and
reports each one's point, the verdicts, the trace's attribution and the targets; its replicas
keep des.py's engine rules; the traces it builds keep the requests they are built from."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench import autoscale
from tests.support import REPO

pytestmark = pytest.mark.compute  # simulations in one process: the compute lane

BENCH = REPO / "bench" / "autoscale.py"
TRACE = autoscale.find_trace()  # shared/ beside the checkout, or beside its worktree folder
NO_TRACE = pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} is not on this machine")
TRACES = ("conv", "bursty", "diurnal")
POLICIES = ("forecast", "reactive", "oracle")


@NO_TRACE
def test_tiny_autoscale_bench_reports_a_monotone_frontier_and_a_verdict_per_policy(
    tmp_path: Path,
) -> None:
    out_json = tmp_path / "autoscale.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--minutes", "4", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Splitwise" in proc.stdout and "CC-BY 4.0" in proc.stdout
    assert "static frontier" in proc.stdout and "side by side" in proc.stdout

    out = json.loads(out_json.read_text())
    assert "Splitwise" in out["attribution"]
    gpus = out["gpus_per_replica"]
    assert set(out["traces"]) == set(TRACES)
    for name, t in out["traces"].items():
        frontier = t["frontier"]
        # every fixed count from 1 to the bound (2x the peak minute's), each billed count x span
        assert [p["count"] for p in frontier] == list(range(1, t["max_replicas"] + 1)), name
        assert t["max_replicas"] == max(2, 2 * t["static_replicas"])
        for p in frontier:
            assert p["gpu_hours"] == pytest.approx(p["count"] * gpus * t["span_s"] / 3600)
            assert 0 <= p["attainment"] <= 1
        # the frontier's cost of an attainment never falls as the attainment rises
        points = [autoscale.Point(**p) for p in frontier]
        levels = sorted({p.attainment for p in points})
        costs = [autoscale.cheapest_static(points, a) for a in levels]
        assert all(c is not None for c in costs)
        dear = [c.gpu_hours for c in costs if c is not None]
        assert dear == sorted(dear), name
        assert set(t["policies"]) == set(POLICIES)
        for policy, f in t["policies"].items():
            assert f["requests"] == t["requests"], (name, policy)
            assert f["gpu_hours"] == pytest.approx(f["replica_hours"] * gpus)
            assert 0 <= f["attainment"] <= 1
            assert f["ttft_p50_s"] <= f["ttft_p95_s"] <= f["ttft_p99_s"]
            v = t["verdicts"][policy]
            ref = autoscale.cheapest_static(points, f["attainment"])
            if ref is None:
                assert v["cheapest"] is None and v["on_or_below"]
            else:
                assert v["cheapest"]["count"] == ref.count
                assert v["on_or_below"] == (f["gpu_hours"] <= ref.gpu_hours * (1 + 1e-9))
                assert v["ratio"] == pytest.approx(f["gpu_hours"] / ref.gpu_hours)
    assert set(out["targets"]) == {
        "conv: on or below the static frontier",
        "bursty: on or below the static frontier",
        "diurnal: on or below the static frontier",
        "diurnal: >= 99% within the objective",
        "diurnal: <= 0.85x the cheapest static holding 99%",
    }


def synthetic(n: int = 2000, span_s: float = 600.0) -> autoscale.Trace:
    times = tuple(span_s * k / n for k in range(n))
    prompt = tuple(100 + k % 7 for k in range(n))
    return autoscale.Trace(times, prompt, tuple(50 + k % 5 for k in range(n)))


def test_a_burst_trace_keeps_every_request_and_each_window_s_demand_inside_one_burst() -> None:
    base = synthetic()
    bursty = autoscale.burst_trace(base, period_s=60.0, burst_s=10.0, seed=3)
    assert sorted(bursty.prompt) == sorted(base.prompt) and len(bursty) == len(base)
    assert list(bursty.arrival_s) == sorted(bursty.arrival_s)
    for w in range(10):
        before = [t for t in base.arrival_s if w * 60 <= t < (w + 1) * 60]
        after = [t for t in bursty.arrival_s if w * 60 <= t < (w + 1) * 60]
        assert len(after) == len(before)
        assert max(after) - min(after) <= 10.0


def test_a_diurnal_day_follows_its_shape_and_keeps_the_peak_s_rate() -> None:
    base = synthetic(6000, 600.0)  # 10 req/s
    day = autoscale.diurnal_trace(base, hours=2.4, trough=0.2, seed=1)
    hour_s = 2.4 * 3600 / 24
    for h in (4, 10, 16):
        got = sum(1 for t in day.arrival_s if h * hour_s <= t < (h + 1) * hour_s) / hour_s
        want = 10 * autoscale.diurnal_shape((h + 0.5) / 24, 0.2)
        assert got == pytest.approx(want, rel=0.1), h
    assert autoscale.diurnal_shape(16 / 24, 0.2) == pytest.approx(1.0)
    assert autoscale.diurnal_shape(4 / 24, 0.2) == pytest.approx(0.2)


@NO_TRACE
def test_bench_replicas_follow_the_des_engine_rules() -> None:
    """A fixed count of the bench's replicas serves the trace exactly as scheduler/des.py's
    engines do: the bench copies des.py's iteration rules and must not drift from them."""
    from fabricnode.elastic.policy import PolicyConfig, StaticPolicy
    from scheduler.catalog import builtin_catalog
    from scheduler.des import Request, SimConfig, simulate_requests
    from scheduler.placement import Allocation, Placement

    trace = autoscale.load_trace(TRACE, compress=1.0, minutes=6.0)
    args = argparse.Namespace(
        model="llama-3.3-70b", gpu="A100-80G", tp=4, compress=1.0, cold_start=90.0, tick=1.0
    )
    cluster = replace(autoscale.build_cluster(trace, args, PolicyConfig()), initial=3)
    run = autoscale.simulate(trace, cluster, StaticPolicy(3), "static")

    requests = [
        Request(t, "llama-3.3-70b", i, o)
        for t, i, o in zip(trace.arrival_s, trace.prompt, trace.output, strict=True)
    ]
    config = SimConfig(duration_s=trace.span_s + 1e-6, warmup_s=0.0, drain_s=600.0)
    placement = Placement.of([Allocation("llama-3.3-70b", "A100-80G", 4, 3)])
    des = simulate_requests(placement, requests, builtin_catalog(), config).total

    assert des.completed == len(trace) and math.inf not in run.ttft_s
    assert sum(run.ttft_s) / len(trace) == pytest.approx(des.ttft_mean_s, rel=1e-9)
    assert run.replica_s == pytest.approx(3 * trace.span_s)
