"""Fixtures shared by the tests that run real agent processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from cli.localmesh import LocalMesh
from tests.support.browser import chromium  # noqa: F401 (the dashboard tests' browser)
from tests.support.sites import (  # noqa: F401 (fixtures for the emulated-sites tests)
    three_sites,
    three_sites_module,
)
from tests.support.slurmcluster import (  # noqa: F401 (fixtures for the real-Slurm tests)
    slurm,
    slurm_accounting_cluster,
    slurm_cluster,
)

# No per-example deadline: Hypothesis's default (200 ms) is a timing assertion, and the suite
# runs in lanes side by side on two cores, where an example that takes 0.1 ms alone once took
# 360 ms (tests/unit/dataplane/test_prefill.py, "Unreliable test timings"). Speed is measured
# in bench/, never asserted in a test.
settings.register_profile("fabric", deadline=None)
settings.load_profile("fabric")


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    """Agents under one temporary FABRIC_HOME; every process is killed and reaped afterwards.

    Their last log lines (and engine logs) are printed, which pytest shows when a test failed.
    """
    local = LocalMesh(tmp_path / "mesh")
    try:
        yield local
    finally:
        local.close()
        for agent in local.agents:
            print(f"--- {agent.name} (exit {agent.proc.returncode}) ---\n{agent.stderr_tail(20)}")
        for log in sorted((local.workdir / "logs").glob("*/engine.log")):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            print(f"--- {log} ---\n{tail}")
