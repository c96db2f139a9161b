"""bench/federation_wan.py still runs and reports every figure docs/benchmarks.md quotes
("Sites over the emulated WAN"), at three sites and a short steady window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.sites import require_sites

BENCH = REPO / "bench" / "federation_wan.py"
pytestmark = pytest.mark.slow


def test_federation_wan_bench_reports_propagation_partitions_and_bytes(tmp_path: Path) -> None:
    require_sites()
    out_json = tmp_path / "fedwan.json"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--sites", "3", "--steady-s", "3", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout
    for figure in ("a new entry at every other site", "an update at every other site",
                   "false partitions", "WAN KB/s per gateway"):  # fmt: skip
        assert figure in out, out
    result = json.loads(out_json.read_text())
    assert result["new_s_reached"] == "6/6" and result["update_s_reached"] == "6/6", result
    assert result["view_samples"] > 0
    assert all(kbps > 0 for kbps in result["wan_kbps_per_gateway"].values())
