"""bench/federation_live.py (the live cell of bench/federation.py) still runs both policies with
real agents over the emulated WAN: with the gateways up, some of A's burst is served at B or C;
with them stopped, none is; no request fails in either."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.sites import require_sites

pytestmark = pytest.mark.slow


def test_the_live_cell_serves_a_burst_with_and_without_the_other_sites(tmp_path: Path) -> None:
    require_sites()
    out = tmp_path / "live.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "federation_live.py"),
         "--clients", "8", "--seconds", "10", "--json", str(out)],
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    ours, local = json.loads(out.read_text())["runs"]
    assert (ours["policy"], local["policy"]) == ("ours", "site-local")
    for run in (ours, local):
        assert run["answered"] > 0 and run["failed"] == {}, run
    assert ours["served_elsewhere"] > 0, ours
    assert local["served_elsewhere"] == 0, local
