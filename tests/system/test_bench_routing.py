"""bench/routing.py still runs end to end on real agents and reports a sane row per policy."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from fabricnode.dataplane import routing
from tests.support import REPO

BENCH = REPO / "bench" / "routing.py"
POLICIES = ["round-robin", "least-load", "prefix", routing.DEFAULT_POLICY]


@pytest.mark.slow
def test_quick_routing_bench_reports_a_plausible_row_per_policy(tmp_path: Path) -> None:
    out_json = tmp_path / "routing.json"
    policies = list(dict.fromkeys(POLICIES))
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--policies",
            ",".join(policies),
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("workload"))
    rows = [line.split() for line in lines[header + 2 :] if line.startswith("tot ")]
    assert [row[1] for row in rows] == policies, proc.stdout
    assert any(line.startswith("targets:") for line in lines), proc.stdout

    cells = json.loads(out_json.read_text())["cells"]
    assert [c["policy"] for c in cells] == policies
    for c in cells:
        assert c["errors"] == 0, c
        assert c["requests"] >= 20, c
        assert c["req_s"] > 0 and c["tok_s"] >= c["req_s"], c
        assert 0 < c["ttft_p50"] <= c["ttft_p90"] <= c["e2e_p90"] < 30, c
        assert 0 < c["e2e_p50"] <= c["e2e_p90"], c
        assert 0 <= c["hit_rate"] <= 1, c
        assert math.isclose(sum(c["spread"]), 100, abs_tol=0.5), c
        assert c["holds"] >= 0 and c["cpu_cores"] > 0, c
    # Trees share prefixes (a child's prompt extends its parent's): every policy gets hits.
    assert all(c["hit_rate"] > 0.2 for c in cells), cells
