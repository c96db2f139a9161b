"""bench/sites.py still runs and reports every figure docs/benchmarks.md quotes ("Emulated
sites"), on its smallest topology."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.sites import require_sites

BENCH = REPO / "bench" / "sites.py"
pytestmark = pytest.mark.slow


def test_sites_bench_reports_build_time_rtt_errors_and_router_cost(tmp_path: Path) -> None:
    require_sites()
    out_json = tmp_path / "sites.json"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for figure in ("built 13 namespaces in", "|error| max", "us of CPU per packet", "torn down"):
        assert figure in out, out
    result = json.loads(out_json.read_text())
    assert [r["set_ms"] for r in result["rtts"]] == [10.0, 155.0, 300.0]
    assert all(r["min_ms"] >= r["set_ms"] for r in result["rtts"])  # never early
    assert result["shaped"]["packets"] > 0 and result["unshaped"]["mbit_s"] > 0
