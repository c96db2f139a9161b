"""bench/autoscale.py still replays the trace against every policy and reports each one's
figures, the trace's attribution and the targets; its replicas keep des.py's engine rules."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support import REPO

BENCH = REPO / "bench" / "autoscale.py"
TRACE = REPO.parent / "shared" / "data" / "azure-llm-2023-conv.csv"  # as the bench finds it
POLICIES = ("static", "static-min", "reactive", "forecast", "oracle")


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} is not on this machine")
def test_quick_autoscale_bench_reports_every_policy(tmp_path: Path) -> None:
    out_json = tmp_path / "autoscale.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Splitwise" in proc.stdout and "CC-BY 4.0" in proc.stdout
    assert "targets: forecast" in proc.stdout

    out = json.loads(out_json.read_text())
    assert "Splitwise" in out["attribution"]
    assert 0 < out["span_s"] <= 600
    assert set(out["policies"]) == set(POLICIES)
    for name, f in out["policies"].items():
        assert f["requests"] == out["requests"], name
        assert f["gpu_hours"] == pytest.approx(f["replica_hours"] * out["gpus_per_replica"])
        assert f["gpu_hours"] > 0, name
        assert 0 <= f["attainment"] <= 1, name
        assert f["ttft_p50_s"] <= f["ttft_p95_s"] <= f["ttft_p99_s"], name
        assert f["cold_starts"] >= 0 and f["scaling_events"] >= 0, name
        for half in ("first_half", "second_half"):
            assert f[half]["requests"] > 0, (name, half)
        assert f["first_half"]["requests"] + f["second_half"]["requests"] == f["requests"]
    static = out["policies"]["static"]
    assert static["scaling_events"] == 0 and static["cold_starts"] == 0
    assert static["peak_replicas"] == out["static_replicas"]
    assert out["policies"]["static-min"]["peak_replicas"] <= out["static_replicas"]
    assert set(out["targets"]["checks"]) == {
        "attainment >= 99%",
        ">= 30% fewer GPU-hours than static",
        ">= 15% fewer GPU-hours than reactive at equal or better attainment",
        "fewer scaling events than reactive",
    }


@pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} is not on this machine")
def test_bench_replicas_follow_the_des_engine_rules() -> None:
    """A fixed count of the bench's replicas serves the trace exactly as scheduler/des.py's
    engines do: the bench copies des.py's iteration rules and must not drift from them."""
    from bench import autoscale
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
