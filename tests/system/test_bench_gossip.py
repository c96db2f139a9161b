"""The gossip bench still runs and reports every figure docs/benchmarks.md quotes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO

BENCH = REPO / "bench" / "gossip.py"
pytestmark = pytest.mark.compute  # one process simulating the mesh: the compute lane


@pytest.mark.slow
def test_gossip_bench_reports_dissemination_detection_false_positives_and_bandwidth() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--nodes", "120", "--minutes", "0.25", "--crashes", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    for figure in (
        "false positives (live node declared dead): 0",
        "bytes/s per node sent:",
        "new entry (a node joins): 99.9% in",
        "every live peer sees it dead after",
        "false positives in the whole run: 0",
    ):
        assert figure in out, out
    assert "not reached" not in out, out
