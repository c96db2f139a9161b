"""bench/tiers.py still runs end to end on real agents: a short slice of the trace alone and
with a batch worked beside it, reporting a sane row for each.

The smoke run is as small as still shows each of these: 15 s of trace (a dozen and more
interactive requests after a 3 s warm-up) and 300 batch lines (more than the two nodes finish
in that time, so the batch runs through the whole window). What it measures is the bench's
business (docs/benchmarks.md); here only that the figures are there and sane."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

BENCH = REPO / "bench" / "tiers.py"
TRACE = REPO.parent / "shared" / "data" / "azure-llm-2023-conv.csv"  # as the bench finds it
NO_TRACE = pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} is not on this machine")


@pytest.mark.slow
@NO_TRACE
def test_quick_tiers_bench_reports_latency_and_batch_throughput(tmp_path: Path) -> None:
    out_json = tmp_path / "tiers.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--minutes", "0.25", "--warmup-s", "3",
         "--batch-lines", "300", "--cells", "interactive,tiered", "--json", str(out_json),
         "--step-log", str(tmp_path / "steps")],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TTFT p95 with the batch / without" in proc.stdout
    assert "CC-BY 4.0" in proc.stdout  # the trace's attribution travels with its figures
    cells = {c["cell"]: c for c in json.loads(out_json.read_text())["cells"]}
    alone, tiered = cells["interactive"], cells["tiered"]
    for cell in (alone, tiered):
        assert cell["interactive"] > 10 and cell["errors"] == 0
        assert 0 < cell["ttft_p50_s"] <= cell["ttft_p95_s"] < 30
    assert alone["batch_lines_per_s"] == 0
    assert tiered["batch_lines_per_s"] > 0  # the batch ran beside the interactive load
    # Each engine's step log, summarized after each cell; what the ingress learned, too.
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == [
        "interactive-n0.jsonl",
        "interactive-n1.jsonl",
        "tiered-n0.jsonl",
        "tiered-n1.jsonl",
    ]
    assert proc.stderr.count("interactive admissions") == 4
    assert "steps admitting batch prompts" in proc.stderr
    assert "fabric_ingress_prefill_rate_tokens_per_second{node=" in proc.stderr


MODEL = REPO / "bench" / "tiers_model.py"


@pytest.mark.compute  # a model in one process: the compute lane
@NO_TRACE
def test_the_tiers_model_is_deterministic_and_tells_the_cells_apart(tmp_path: Path) -> None:
    """bench/tiers_model.py: the same seeds give the same figures, and the cells keep their
    order: the batch beside the replay costs it far less than greedy clients do, and takes
    less of the idle capacity than greedy."""
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / f"{run}.json"
        proc = subprocess.run(
            [sys.executable, str(MODEL), "--minutes", "1", "--seeds", "2",
             "--cells", "interactive,tiered,greedy", "--json", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "CC-BY 4.0" in proc.stdout
        outputs.append(json.loads(out.read_text())["cells"])
    assert outputs[0] == outputs[1]
    cells = {c["cell"]: c for c in outputs[0]}
    alone, tiered, greedy = cells["interactive"], cells["tiered"], cells["greedy"]
    assert alone["batch_lines_per_s"] == 0
    assert 0 < tiered["batch_lines_per_s"] < greedy["batch_lines_per_s"]
    assert 0 < alone["ttft_p50_s"] <= alone["ttft_p95_s"] < 2
    assert tiered["ttft_p95_s"] < 2 * alone["ttft_p95_s"] < greedy["ttft_p95_s"]
