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
            "--nodes",
            "2",  # every policy still chooses; two agents fewer to start per cell
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


TRACE = REPO.parent / "shared" / "data" / "azure-llm-2023-conv.csv"  # as the bench finds it
NO_TRACE = pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} is not on this machine")


@pytest.mark.slow
@NO_TRACE
def test_shared_prompts_through_every_agent_reports_cache_hits(tmp_path: Path) -> None:
    """The shared-prompts workload with every serving agent an ingress (``--via agents``): the
    conversations share four system prompts, so most prompt tokens are cache hits, and every
    agent serves."""
    out_json = tmp_path / "shared.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--workloads", "shared-prompts",
         "--policies", routing.DEFAULT_POLICY, "--via", "agents", "--clients", "8",
         "--nodes", "2", "--seconds", "6", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CC-BY 4.0" in proc.stdout
    (cell,) = json.loads(out_json.read_text())["cells"]
    # A turn takes a second or two here: 8 clients over 6 s answer a few each (what is
    # checked is that requests flow through both agents, not how fast).
    assert cell["errors"] == 0 and cell["requests"] >= 4, cell
    assert cell["hit_rate"] > 0.5, cell
    assert all(share > 0 for share in cell["spread"]), cell


MODEL = REPO / "bench" / "routing_model.py"


@pytest.mark.compute  # a model in one process: the compute lane
@NO_TRACE
def test_the_routing_model_is_deterministic_and_sees_the_shared_prefixes() -> None:
    """bench/routing_model.py: the same seeds give the same figures; on shared-prompts the
    prefix policy's hit rate is far above round robin's."""
    argv = [sys.executable, str(MODEL), "--seeds", "2", "--clients", "16", "--nodes", "2",
            "--warmup", "3", "--seconds", "6",
            "--workloads", "shared-prompts"]  # fmt: skip

    def run(policy: str) -> str:
        proc = subprocess.run(
            [*argv, "--policy", policy], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "CC-BY 4.0" in proc.stdout
        return proc.stdout

    first = run(routing.DEFAULT_POLICY)
    assert first == run(routing.DEFAULT_POLICY)

    def hit_rates(out: str) -> list[float]:
        rows = [line.split() for line in out.splitlines() if line.startswith("shared-prompts ")]
        return [float(row[5].partition("±")[0]) for row in rows]

    ours, theirs = hit_rates(first), hit_rates(run("round-robin"))
    assert len(ours) == 2 and len(theirs) == 2, (first, theirs)
    assert all(h > 0.6 for h in ours), first
    assert max(theirs) < min(ours), (ours, theirs)
