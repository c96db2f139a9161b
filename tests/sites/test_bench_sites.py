"""bench/sites.py still runs and reports every figure docs/benchmarks.md quotes ("Emulated
sites"), on its smallest topology."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchrun import run_bench
from tests.support.sites import require_sites

pytestmark = pytest.mark.slow


def test_sites_bench_reports_build_time_rtt_errors_and_router_cost(tmp_path: Path) -> None:
    require_sites()
    out, result = run_bench("sites.py", "--quick", json_path=tmp_path / "sites.json", timeout_s=120)
    for figure in ("built 13 namespaces in", "|error| max", "us of CPU per packet", "torn down"):
        assert figure in out, out
    assert [r["set_ms"] for r in result["rtts"]] == [10.0, 155.0, 300.0]
    assert all(r["min_ms"] >= r["set_ms"] for r in result["rtts"])  # never early
    assert result["shaped"]["packets"] > 0 and result["unshaped"]["mbit_s"] > 0
