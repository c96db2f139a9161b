"""bench/federation_bytes.py still prints a gateway's WAN traffic by models served and the CPU of a
summary, with its verdict; the WAN figures grow with models and not with nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.compute  # the summary code in one process: the compute lane


def test_the_federation_bench_reports_wan_bytes_by_models_and_a_verdict(tmp_path: Path) -> None:
    out = tmp_path / "fed.json"
    bench = REPO / "bench" / "federation_bytes.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "target: <= 50 KB/s per gateway" in done.stdout
    doc = json.loads(out.read_text())
    wan = doc["wan"]
    assert [r["models"] for r in wan] == sorted(r["models"] for r in wan)
    steady = [r["steady_bytes_s"] for r in wan]
    assert steady == sorted(steady) and steady[0] > 0  # more models, more bytes
    (cpu,) = doc["cpu"]
    assert cpu["nodes"] == 200 and cpu["models"] > 0 and cpu["cpu_ms_per_summary"] > 0
