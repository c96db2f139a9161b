"""bench/federation.py (SkyLB's experiment as a model) still runs its four policies on the
trace and tells them apart where they must differ: site-local never crosses the WAN, the
central ingress crosses it for most requests and serves nothing of the other sites' clients
while its site is cut off, two-layer routing crosses only for what its site cannot take and
serves every client through the cut; and a run is deterministic for its seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO

pytestmark = pytest.mark.compute  # one process, no sockets: the compute lane

BENCH = REPO / "bench" / "federation.py"


def run(tmp_path: Path, name: str) -> dict[str, Any]:
    out = tmp_path / name
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--cut", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Splitwise" in done.stdout  # the trace's attribution
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_the_federation_model_tells_the_policies_apart_and_repeats_itself(tmp_path: Path) -> None:
    doc = run(tmp_path, "a.json")
    equal, cut = doc["equal"], doc["cut"]
    assert set(equal) == {"local", "central", "round-robin", "ours"}
    for o in equal.values():
        assert o["requests"] > 300 and o["failed"] == 0
        assert 0.0 < o["within"] <= 1.0
        assert o["cached"] < 0.05  # distinct prompts: only a preempted request's own blocks
    assert equal["local"]["crossed"] == 0.0 and equal["local"]["wan_mb"] == 0.0
    # two of three clients' requests cross to the central ingress (and most back out)
    assert equal["central"]["crossed"] > 0.5
    assert equal["ours"]["crossed"] < equal["round-robin"]["crossed"]
    assert equal["ours"]["wan_mb"] < equal["round-robin"]["wan_mb"]
    # site A cut off: the central ingress loses B's and C's clients; ours loses nobody
    assert cut["central"]["failed"] > 0
    assert cut["ours"]["failed"] == 0 and cut["local"]["failed"] == 0
    assert run(tmp_path, "b.json")["equal"] == equal


def test_with_tenants_prompts_share_system_prompts_and_both_push_variants_run(
    tmp_path: Path,
) -> None:
    """``--tenants``: every request starts with its site's tenant's system prompt, which the
    engines' prefix caches hold (none without tenants), and ``ours`` runs beside
    ``ours-noprefix`` (the cross-site cost without the prompt's prefix, ``sites`` rule 7)."""
    out = tmp_path / "tenants.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--tenants", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    equal = json.loads(out.read_text())["equal"]
    assert set(equal) == {"local", "central", "round-robin", "ours", "ours-noprefix"}
    for o in equal.values():
        assert o["failed"] == 0 and o["cached"] > 0.2
