"""bench/fleet.py still runs end to end on a small fleet and reports, per policy, GPU-hours and
first-token times by what each request found, with the books balanced: every request is awake,
asleep or at zero; always-on bills every model all day; no sleep means no wake-ups."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import autoscale
from tests.support import REPO

pytestmark = pytest.mark.compute  # a simulation in one process: the compute lane

BENCH = REPO / "bench" / "fleet.py"
TRACE = autoscale.find_trace()
NO_TRACE = pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} is not on this machine")
POLICIES = ("always-on", "ours", "ours-nosleep", "what-if")


@NO_TRACE
def test_tiny_fleet_bench_balances_its_books(tmp_path: Path) -> None:
    out_json = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--models", "8", "--day-hours", "0.5",
         "--idle-sweep", "60,600", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Splitwise" in proc.stdout and "CC-BY 4.0" in proc.stdout
    assert "first-token time" in proc.stdout

    out = json.loads(out_json.read_text())
    span_h = out["span_s"] / 3600
    assert len(out["models"]) == 8
    assert sum(m["requests"] for m in out["models"]) == out["requests"]
    assert out["always_on_gpus"] == sum(m["gpus"] for m in out["models"])
    for m in out["models"]:
        assert 0 < m["wake_s"] < m["cold_start_s"]
    figures = {**out["policies"], **{f"sweep {k}": f for k, f in out["idle_sweep"].items()}}
    assert set(out["policies"]) == set(POLICIES)
    for name, f in figures.items():
        groups = (f["awake"], f["asleep"], f["zero"])
        assert sum(g["requests"] for g in groups) == out["requests"], name
        for g in groups:
            if g["requests"]:
                assert g["p10_s"] <= g["p50_s"] <= g["p90_s"] <= g["p99_s"] <= g["max_s"], name
        assert 0 <= f["within"] <= 1 and f["peak_gpus"] <= out["budget_gpus"], name
        assert f["gpu_hours"] <= out["always_on_gpus"] * span_h * (1 + 1e-9), name
        assert f["saving_vs_always_on"] == pytest.approx(
            1 - f["gpu_hours"] / (out["always_on_gpus"] * span_h)
        )
    always = out["policies"]["always-on"]
    assert always["gpu_hours"] == pytest.approx(out["always_on_gpus"] * span_h)
    assert always["awake"]["requests"] == out["requests"] and always["cold_starts"] == 0
    nosleep = out["policies"]["ours-nosleep"]
    assert nosleep["asleep"]["requests"] == 0 and nosleep["wake_ups"] == 0
    assert nosleep["gpu_hours_asleep"] == 0
    assert out["policies"]["what-if"]["gpu_hours_asleep"] == 0  # not billed while asleep
    # a model at zero is started: the first request of a dynamic policy finds it at zero
    assert out["policies"]["ours"]["zero"]["requests"] >= 1
    assert set(out["targets"]) == {
        ">= 60% fewer GPU-hours than always-on",
        ">= 99% of requests to awake models within the objective",
    }
