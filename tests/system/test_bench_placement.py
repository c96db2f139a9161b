"""bench/placement.py still runs end to end on the paper's instance and reports, per model, the
served share and latency of every method the placement targets are judged against."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

BENCH = REPO / "bench" / "placement.py"
pytestmark = pytest.mark.compute  # the solvers in one process: the compute lane
MODELS = ("llama-2-13b", "codellama-34b", "llama-3.3-70b")


@pytest.mark.slow
def test_quick_placement_bench_reports_every_method_per_model(tmp_path: Path) -> None:
    out_json = tmp_path / "placement.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--instances", "paper", "--quick", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = {c["scale"]: c for c in json.loads(out_json.read_text())}
    assert set(cells) == {1.0, 0.25}
    overloaded, fitting = cells[1.0], cells[0.25]
    assert overloaded["overload"].startswith("overloaded: ")
    assert fitting["overload"] is None
    methods = {"memP", "default", "latency", "throughput", "max-min", "mm-0.9", "exact-eq1"}
    assert set(overloaded["methods"]) == methods
    assert set(fitting["methods"]) == methods - {"mm-0.9"}
    for cell in (overloaded, fitting):
        for method, row in cell["methods"].items():
            per_model = row["des"]["models"]
            assert set(per_model) == set(MODELS), method
            for figures in per_model.values():
                assert 0 <= figures["share"] <= 1.2
    # the default never switches a model off, which serving requests first does
    default = overloaded["methods"]["default"]["des"]["models"]
    latency = overloaded["methods"]["latency"]["des"]["models"]
    assert min(m["share"] for m in default.values()) > 5 * min(m["share"] for m in latency.values())
    assert "per model: DES served share" in proc.stdout
    assert "== targets (judged by the DES)" in proc.stdout
