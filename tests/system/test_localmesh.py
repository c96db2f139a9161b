"""LocalMesh's agents do not depend on the caller's FABRIC_* environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.localmesh import LocalMesh
from fabricnode.config import load_config
from fabricnode.host.slurm import DEFAULT_LEAVE_BEFORE_END_S


def test_agent_env_drops_the_callers_fabric_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    caller = {
        "FABRIC_JOIN": "10.0.0.1:7946",
        "FABRIC_CLUSTER_KEY": str(elsewhere / "cluster.key"),
        "FABRIC_AGENT": "http://10.0.0.1:8080",
        "FABRIC_HOME": str(elsewhere),
        "FABRIC_RENDEZVOUS": str(elsewhere / "rendezvous"),
        "FABRIC_LOG_DIR": str(elsewhere / "logs"),
        "FABRIC_JOB_LOG_DIR": str(elsewhere / "job"),
        "FABRIC_LEAVE_BEFORE_END": "5",
        "FABRIC_SITE": "elsewhere",
    }
    for name, value in caller.items():
        monkeypatch.setenv(name, value)
    mesh = LocalMesh(tmp_path / "mesh")

    env = mesh.env()

    assert {k: env.get(k) for k in caller} == {
        **dict.fromkeys(caller),
        "FABRIC_HOME": str(mesh.workdir),
    }
    config = load_config(env=env)
    assert config.join == ()
    assert config.cluster_key_path.is_relative_to(mesh.workdir)
    assert config.rendezvous_path == mesh.workdir / "rendezvous"
    assert config.log_dir == mesh.workdir / "logs"
    assert config.job_log_dir is None
    assert config.request_log_path is not None
    assert config.request_log_path.is_relative_to(mesh.workdir)
    assert config.leave_before_end_s == DEFAULT_LEAVE_BEFORE_END_S
    assert config.site != "elsewhere"


def test_agent_env_keeps_what_the_caller_passes_explicitly(tmp_path: Path) -> None:
    mesh = LocalMesh(tmp_path / "mesh")

    env = mesh.env({"FABRIC_LOG_DIR": str(tmp_path / "logs")})

    assert env["FABRIC_LOG_DIR"] == str(tmp_path / "logs")
