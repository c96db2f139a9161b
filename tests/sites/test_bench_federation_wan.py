"""bench/federation_wan.py still runs and reports every figure docs/benchmarks.md quotes
("Sites over the emulated WAN"), at three sites and a short steady window."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benchrun import run_bench
from tests.support.sites import require_sites

pytestmark = pytest.mark.slow


def test_federation_wan_bench_reports_propagation_partitions_and_bytes(tmp_path: Path) -> None:
    require_sites()
    out, result = run_bench(
        "federation_wan.py",
        "--sites", "3", "--steady-s", "3",
        json_path=tmp_path / "fedwan.json",
        timeout_s=240,
    )  # fmt: skip
    for figure in ("a new entry at every other site", "an update at every other site",
                   "false partitions", "WAN KB/s per gateway"):  # fmt: skip
        assert figure in out, out
    assert result["new_s_reached"] == "6/6" and result["update_s_reached"] == "6/6", result
    assert result["view_samples"] > 0
    assert all(kbps > 0 for kbps in result["wan_kbps_per_gateway"].values())
