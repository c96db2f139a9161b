"""The architecture's import rules catch what they are meant to catch.

`make lint` enforces the layers with import-linter ([tool.importlinter] in pyproject.toml) and the
"only fabricnode.config reads the environment" rule with ruff's banned-api (fabricnode/ruff.toml).
A rule that silently checks nothing (a misspelt module, a pattern that matches no file, a config
file ruff does not pick up) would look exactly like a rule that holds, so each test here copies
the source tree, adds one deliberately wrong import, runs the real `lint-imports` or `ruff check`
on the copy and asserts that the rule fails and names the offending import. The unmodified copy
must keep every contract.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LINT_IMPORTS = BIN / "lint-imports"
RUFF = BIN / "ruff"

# What the rules are checked on: the importable packages and the configuration.
TREE = ("fabricnode", "scheduler", "cli", "pyproject.toml")


@dataclass(frozen=True)
class Breach:
    """One deliberately wrong import: where it goes and what the failing rule must report."""

    rule: str  # an import-linter contract id, or "env" for the ruff rule
    module: str  # the file it is appended to
    line: str  # the wrong code
    reported: str  # what the failure must name

    def __str__(self) -> str:
        return f"{self.rule}:{self.module}:{self.reported}"


CONTRACT_BREACHES = (
    Breach(
        "layers",
        "fabricnode/host/slurm.py",
        "import fabricnode.control.app",
        "fabricnode.host.slurm -> fabricnode.control.app",
    ),
    Breach(
        "layers",
        "fabricnode/mesh/codec.py",
        "from fabricnode.engine import command",
        "fabricnode.mesh.codec -> fabricnode.engine.command",
    ),
    Breach(
        "layers",
        "fabricnode/requestlog/writer.py",
        "from fabricnode.dataplane import settle",
        "fabricnode.requestlog.writer -> fabricnode.dataplane.settle",
    ),
    Breach(
        "mesh-self-contained",
        "fabricnode/mesh/registry.py",
        "from fabricnode.host import hardware",
        "fabricnode.mesh.registry -> fabricnode.host.hardware",
    ),
    Breach(
        "mesh-sans-io",
        "fabricnode/mesh/registry.py",
        "import trio",
        "fabricnode.mesh.registry -> trio",
    ),
    Breach(
        "mesh-sans-io", "fabricnode/mesh/core.py", "import time", "fabricnode.mesh.core -> time"
    ),
    Breach(
        "mesh-sans-io",
        "fabricnode/mesh/wire.py",
        "from socket import AF_INET",
        "fabricnode.mesh.wire -> socket",
    ),
    Breach(
        "mesh-service-on-top",
        "fabricnode/mesh/registry.py",
        "from fabricnode.mesh import service",
        "fabricnode.mesh.registry -> fabricnode.mesh.service",
    ),
    Breach(
        "dataplane-below-services",
        "fabricnode/dataplane/routing.py",
        "from fabricnode.config import AgentConfig",
        "fabricnode.dataplane.routing -> fabricnode.config",
    ),
    Breach(
        "dataplane-below-services",
        "fabricnode/dataplane/upstream.py",
        "import fabricnode.engine.process",
        "fabricnode.dataplane.upstream -> fabricnode.engine.process",
    ),
    Breach(
        "agent-is-the-root",
        "fabricnode/control/app.py",
        "from fabricnode.agent import run_agent",
        "fabricnode.control.app -> fabricnode.agent",
    ),
    Breach(
        "testing-unimported",
        "fabricnode/engine/service.py",
        "from fabricnode.testing import simnet",
        "fabricnode.engine.service -> fabricnode.testing.simnet",
    ),
    Breach(
        "testing-unimported",
        "cli/demo.py",
        "import fabricnode.testing.fakenet",
        "cli.demo -> fabricnode.testing.fakenet",
    ),
    Breach(
        "cli-unimported",
        "fabricnode/host/slurm.py",
        "from cli import planning",
        "fabricnode.host.slurm -> cli.planning",
    ),
    Breach(
        "cli-unimported",
        "scheduler/plan.py",
        "import cli.localmesh",
        "scheduler.plan -> cli.localmesh",
    ),
    Breach("bench-unimported", "cli/demo.py", "import bench.gossip", "cli.demo -> bench"),
    Breach(
        "bench-unimported",
        "fabricnode/dataplane/routing.py",
        "from bench import routing",
        "fabricnode.dataplane.routing -> bench",
    ),
    Breach(
        "scheduler-standalone",
        "scheduler/plan.py",
        "from fabricnode.mesh import codec",
        "scheduler.plan -> fabricnode.mesh.codec",
    ),
    Breach(
        "elastic-layers",
        "fabricnode/elastic/vocab.py",
        "from fabricnode.elastic import controller",
        "fabricnode.elastic.vocab -> fabricnode.elastic.controller",
    ),
    Breach(
        "elastic-layers",
        "fabricnode/elastic/observe.py",
        "from fabricnode.elastic.controller import Controller",
        "fabricnode.elastic.observe -> fabricnode.elastic.controller",
    ),
    Breach(
        "elastic-pure",
        "fabricnode/elastic/policy.py",
        "import time",
        "fabricnode.elastic.policy -> time",
    ),
    Breach(
        "elastic-pure",
        "fabricnode/elastic/policy.py",
        "from fabricnode.host import slurm",
        "fabricnode.elastic.policy -> fabricnode.host.slurm",
    ),
    # reconcile reading Slurm's jobs itself instead of being handed them
    Breach(
        "elastic-pure",
        "fabricnode/elastic/reconcile.py",
        "from fabricnode.elastic.slurmctl import SlurmControl",
        "fabricnode.elastic.reconcile -> fabricnode.elastic.slurmctl",
    ),
    Breach(
        "elastic-pure",
        "fabricnode/elastic/jobs.py",
        "from datetime import datetime",
        "fabricnode.elastic.jobs -> datetime",
    ),
    # one deliberately impure import into each pure module of the data plane that a docstring
    # calls pure, and one that reaches I/O only through another module
    *(
        Breach(
            "dataplane-pure",
            f"fabricnode/dataplane/{module}.py",
            line,
            f"fabricnode.dataplane.{module} -> {target}",
        )
        for module, line, target in (
            ("request", "import time", "time"),
            ("request", "from fabricnode.dataplane import apikeys", "fabricnode.dataplane.apikeys"),
            ("routing", "import trio", "trio"),
            ("tiers", "from socket import socket", "socket"),
            ("prefill", "import time", "time"),
            (
                "resume",
                "from fabricnode.requestlog import writer",
                "fabricnode.requestlog.writer",
            ),
            ("endpoints", "import threading", "threading"),
            ("keytable", "import time", "time"),
            ("recent", "import datetime", "datetime"),
            ("sse", "import time", "time"),
            ("multipart", "import asyncio", "asyncio"),
            ("http1", "import socket", "socket"),
            ("forward_auth", "import time", "time"),
            # the admission machines: the ingress's waiting rooms, time passed in
            ("gate", "import trio", "trio"),
            ("coldstart", "import time", "time"),
            (
                "responses",
                "from fabricnode.dataplane import ingress",
                "fabricnode.dataplane.ingress",
            ),
            ("hold", "from time import monotonic", "time"),
        )
    ),
    # indirectly: the batch gate importing its trio side (gatewait) reaches trio
    Breach(
        "dataplane-pure",
        "fabricnode/dataplane/gate.py",
        "from fabricnode.dataplane import gatewait",
        "fabricnode.dataplane.gate -> fabricnode.dataplane.gatewait",
    ),
    # indirectly: the decoder importing the ingress's connection module reaches trio
    Breach(
        "dataplane-pure",
        "fabricnode/dataplane/request.py",
        "from fabricnode.dataplane import clientconn",
        "fabricnode.dataplane.request -> fabricnode.dataplane.clientconn",
    ),
    Breach(
        "engine-pure",
        "fabricnode/engine/metrics.py",
        "import httpx",
        "fabricnode.engine.metrics -> httpx",
    ),
    Breach(
        "engine-pure",
        "fabricnode/engine/liveness.py",
        "import time",
        "fabricnode.engine.liveness -> time",
    ),
    Breach(
        "engine-pure",
        "fabricnode/engine/models.py",
        "from fabricnode.engine import process",
        "fabricnode.engine.models -> fabricnode.engine.process",
    ),
    Breach(
        "simengine-pure",
        "fabricnode/simengine/model.py",
        "import time",
        "fabricnode.simengine.model -> time",
    ),
    Breach(
        "kvevents-pure",
        "fabricnode/kvevents/stream.py",
        "import time",
        "fabricnode.kvevents.stream -> time",
    ),
    Breach(
        "layers",
        "fabricnode/kvevents/wire.py",
        "from fabricnode.mesh import codec",
        "fabricnode.kvevents.wire -> fabricnode.mesh.codec",
    ),
    Breach(
        "batch-pure",
        "fabricnode/batch/upload.py",
        "import trio",
        "fabricnode.batch.upload -> trio",
    ),
    Breach(
        "batch-pure",
        "fabricnode/batch/validate.py",
        "from fabricnode.batch import worker",
        "fabricnode.batch.validate -> fabricnode.batch.worker",
    ),
    Breach(
        "federation-pure",
        "fabricnode/federation/view.py",
        "import ssl",
        "fabricnode.federation.view -> ssl",
    ),
    Breach(
        "federation-pure",
        "fabricnode/federation/summary.py",
        "from fabricnode.federation import link",
        "fabricnode.federation.summary -> fabricnode.federation.link",
    ),
    Breach(
        "layers",
        "fabricnode/federation/summary.py",
        "from fabricnode.dataplane import routing",
        "fabricnode.federation.summary -> fabricnode.dataplane.routing",
    ),
    Breach(
        "scheduler-pure",
        "scheduler/roofline.py",
        "import time",
        "scheduler.roofline -> time",
    ),
    # the cycle catalog <-> hf_config coming back
    Breach(
        "scheduler-layers",
        "scheduler/hf_config.py",
        "from scheduler import catalog",
        "scheduler.hf_config -> scheduler.catalog",
    ),
    Breach(
        "scheduler-layers",
        "scheduler/roofline.py",
        "from scheduler import plan",
        "scheduler.roofline -> scheduler.plan",
    ),
    Breach(
        "elastic-dataplane-allowlist",
        "fabricnode/elastic/controller.py",
        "from fabricnode.dataplane import routing",
        "fabricnode.elastic.controller -> fabricnode.dataplane.routing",
    ),
    Breach(
        "no-package-cycles",
        "fabricnode/errors.py",
        "import fabricnode.mesh.codec",
        ".errors -> .mesh",
    ),
)

ENV_BREACHES = (
    Breach("env", "fabricnode/engine/process.py", "PROBE = os.environ", "os.environ"),
    Breach("env", "fabricnode/mesh/identity.py", "PROBE = os.getenv('HOME')", "os.getenv"),
    Breach("env", "fabricnode/dataplane/apikeys.py", "from os import environ", "os.environ"),
)


def contract_ids() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [contract["id"] for contract in config["tool"]["importlinter"]["contracts"]]


def copy_tree(dest: Path) -> Path:
    for name in TREE:
        source = REPO / name
        if source.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "_native", "*.so")
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)
    return dest


def add_line(root: Path, breach: Breach) -> None:
    path = root / breach.module
    text = path.read_text()
    if breach.rule == "env" and not breach.line.startswith("from os"):
        text += "\nimport os  # noqa: E402\n"
    path.write_text(f"{text}\n{breach.line}  # deliberately wrong\n")


def lint_imports(root: Path, contract: str) -> subprocess.CompletedProcess[str]:
    # lint-imports puts its working directory first on sys.path, so it analyses the copy;
    # PYTHONPATH is cleared so that the tree the tests run from cannot shadow it.
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--contract", contract],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def ruff_check(root: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RUFF), "check", "--no-cache", "--output-format", "concise", *paths],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_every_contract_is_exercised() -> None:
    """A contract with no deliberate breach here could be checking nothing."""
    assert set(contract_ids()) == {breach.rule for breach in CONTRACT_BREACHES}


@pytest.mark.parametrize("breach", CONTRACT_BREACHES, ids=str)
def test_contract_rejects_a_wrong_import(tmp_path: Path, breach: Breach) -> None:
    root = copy_tree(tmp_path)
    add_line(root, breach)
    result = lint_imports(root, breach.rule)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout
    assert breach.reported in result.stdout, result.stdout


@pytest.mark.parametrize("contract", contract_ids())
def test_unmodified_tree_keeps_contract(tmp_path: Path, contract: str) -> None:
    result = lint_imports(copy_tree(tmp_path), contract)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KEPT" in result.stdout


@pytest.mark.parametrize("breach", ENV_BREACHES, ids=str)
def test_environment_read_outside_config_is_rejected(tmp_path: Path, breach: Breach) -> None:
    root = copy_tree(tmp_path)
    add_line(root, breach)
    result = ruff_check(root, breach.module)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{breach.module}:" in result.stdout
    assert f"TID251 `{breach.reported}` is banned" in result.stdout, result.stdout


def test_environment_may_be_read_by_config_native_and_cli(tmp_path: Path) -> None:
    root = copy_tree(tmp_path)
    allowed = ("fabricnode/config.py", "fabricnode/native.py", "fabricnode/native_build.py")
    for module in (*allowed, "cli/localmesh.py", "scheduler/plan.py"):
        add_line(root, Breach("env", module, "PROBE = os.environ", "os.environ"))
    result = ruff_check(root, *allowed, "cli", "scheduler", "--select", "TID251")
    assert result.returncode == 0, result.stdout + result.stderr


def test_unmodified_tree_reads_the_environment_only_in_config(tmp_path: Path) -> None:
    result = ruff_check(copy_tree(tmp_path), "fabricnode", "--select", "TID251")
    assert result.returncode == 0, result.stdout
