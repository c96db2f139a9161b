"""bench/batch_memory.py still runs end to end on real agents (a small output): the batch is
finalized, both downloads are byte-identical, and every agent's growth is reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

BENCH = REPO / "bench" / "batch_memory.py"


@pytest.mark.slow
def test_small_batch_memory_bench_reports_every_agents_growth(tmp_path: Path) -> None:
    out_json = tmp_path / "mem.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--output-mb", "12", "--agents", "2",
         "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "byte-identical" in proc.stdout
    figures = json.loads(out_json.read_text())
    assert figures["output_bytes"] > 11 * 1024 * 1024
    assert len(figures["agents"]) == 2
    assert all(row["baseline_mib"] > 0 for row in figures["agents"])
