"""Smoke test of bench/router.py: a --quick run prints plausible figures and leaves no process.

One run (direct and fabric-1hop, the chat cells and the multipart upload and Responses stream
cells) in a subprocess, shared by the tests below. The fabric target is skipped, with the
bench's reason, while it reports itself unavailable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support import REPO

BENCH = REPO / "bench" / "router.py"
# A hang guard, not a speed check: the --quick run takes ~18 s on a quiet machine and went past
# 25 s with the rest of `make test` beside it (benches report speed; tests assert behaviour).
TIME_BUDGET_S = 120.0
MODES = ("json", "sse", "audio", "responses-sse")
LABELS = {f"c={c} {mode}" for c in (1, 32) for mode in MODES}

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class QuickRun:
    returncode: int
    stdout: str
    stderr: str
    report: dict[str, Any]
    leftovers: list[int]


def processes_with_env(token: str) -> list[int]:
    """Pids of live processes whose environment carries ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    out = tmp_path_factory.mktemp("bench-router") / "report.json"
    token = f"bench-router-test-{uuid.uuid4().hex}"
    env = {**os.environ, "FABRIC_BENCH_TEST_TOKEN": token}
    argv = [sys.executable, str(BENCH), "--quick", "--targets", "direct,fabric-1hop"]
    argv += ["--modes", ",".join(MODES)]
    try:
        done = subprocess.run(
            [*argv, "--no-install", "--json", str(out)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIME_BUDGET_S,
        )
    finally:
        time.sleep(0.2)  # let the kernel finish reaping what the bench killed
        leftovers = processes_with_env(token)
        for pid in leftovers:  # never leave them behind, even when the bench failed
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    report = json.loads(out.read_text()) if out.exists() else {}
    return QuickRun(done.returncode, done.stdout, done.stderr, report, leftovers)


def assert_plausible(cells: dict[str, dict[str, Any]], *, router: bool) -> None:
    assert set(cells) == LABELS
    for label, cell in cells.items():
        assert cell["unsupported"] is None, (label, cell["unsupported"])
        assert cell["requests"] > 0, label
        assert cell["errors"] == 0, (label, cell["error_samples"])
        assert 0.005 < cell["mean_ms"] < 200.0, (label, cell["mean_ms"])
        assert cell["p50_ms"] <= cell["p99_ms"], label
        assert cell["req_per_s"] > 10, label
        if label.endswith("sse"):
            assert 0 < cell["ttft_mean_ms"] <= cell["mean_ms"] + 1e-6, label
        if router:
            assert cell["added_mean_ms"] is not None, label
            assert cell["cpu_ms_per_req"] is not None and cell["cpu_ms_per_req"] >= 0, label


def test_quick_run_exits_cleanly_and_leaves_no_process(quick_run: QuickRun) -> None:
    assert quick_run.returncode == 0, quick_run.stderr[-2000:]
    assert quick_run.leftovers == []


def test_quick_run_prints_a_plausible_direct_baseline(quick_run: QuickRun) -> None:
    assert quick_run.returncode == 0, quick_run.stderr[-2000:]
    rows = [line.split() for line in quick_run.stdout.splitlines()]
    direct_rows = [r for r in rows if len(r) > 3 and r[2] == "direct"]
    assert len(direct_rows) == len(LABELS), quick_run.stdout
    for row in direct_rows:
        mean_ms, p50_ms, p99_ms = (float(x) for x in row[3:6])
        assert 0.005 < mean_ms < 200.0 and 0 < p50_ms <= p99_ms, row
    assert_plausible(quick_run.report["targets"]["direct"]["cells"], router=False)


def test_quick_run_measures_fabric_1hop(quick_run: QuickRun) -> None:
    assert quick_run.returncode == 0, quick_run.stderr[-2000:]
    fabric = quick_run.report["targets"]["fabric-1hop"]
    if fabric["unavailable"]:
        pytest.skip(f"fabric-1hop unavailable: {fabric['unavailable']}")
    assert any(" fabric-1hop " in line for line in quick_run.stdout.splitlines())
    assert_plausible(fabric["cells"], router=True)
