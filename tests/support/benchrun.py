"""Run a bench script the way a reader of docs/benchmarks.md would, for its smoke test: its
figures printed on stdout, its result document written to ``--json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import REPO


def run_bench(script: str, *args: str, json_path: Path, timeout_s: float) -> tuple[str, Any]:
    """``bench/<script>`` run with ``args`` and ``--json json_path``: its stdout and the
    document it wrote (CalledProcessError if it failed, TimeoutExpired past ``timeout_s``)."""
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args, "--json", str(json_path)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    ).stdout
    return out, json.loads(json_path.read_text())
