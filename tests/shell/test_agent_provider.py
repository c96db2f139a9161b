"""`fabric start --provider-key`: the agent's entry carries a certificate of its session key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabricnode.agent import Agent
from fabricnode.config import load_config
from fabricnode.errors import KeyFileError
from fabricnode.mesh.identity import ProviderKey, Verifier
from fabricnode.mesh.keyring import Keyring, new_cluster_key

NOW = 1_750_000_000.0


def config_with(tmp_path: Path, provider_key: Path) -> Agent:
    key = tmp_path / "cluster.key"
    Keyring.with_key(new_cluster_key()).save(key)
    cfg = load_config(
        cluster_key=str(key),
        provider="someone-else",
        provider_key=str(provider_key),
        env={"FABRIC_HOME": str(tmp_path), "USER": "u"},
    )
    return Agent(cfg)


def test_provider_key_certifies_the_session_and_names_the_provider(tmp_path: Path) -> None:
    pkey = ProviderKey.generate("nlp-lab")
    pkey.save(tmp_path / "provider.key")
    agent = config_with(tmp_path, tmp_path / "provider.key")
    entry = agent.join_body(NOW, "http://127.0.0.1:1", "127.0.0.1:2").sign(agent.identity)
    assert entry.body.provider == "nlp-lab"  # the certified name wins over --provider
    assert entry.verify(Verifier())
    assert entry.verified_provider(NOW, Verifier()) == pkey.fingerprint


def test_missing_provider_key_is_one_clear_error_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="provider key"):
        config_with(tmp_path, tmp_path / "absent.key")


def test_slurm_job_end_caps_the_lease_and_labels_the_entry(tmp_path: Path) -> None:
    from fabricnode.host.slurm import SlurmJob
    from fabricnode.mesh.registry import Hardware

    key = tmp_path / "cluster.key"
    Keyring.with_key(new_cluster_key()).save(key)
    agent = Agent(
        load_config(cluster_key=str(key), env={"FABRIC_HOME": str(tmp_path), "USER": "u"})
    )
    job = SlurmJob("4242", partition="gpu", end_time=NOW + 600)
    hw = Hardware("H100", 4, 79.6, "gpu017")
    body = agent.join_body(NOW, "http://h:1", "h:2", hw, job)
    assert body.expires_at == NOW + 600  # never past the job's end
    labels = dict(body.labels)
    assert labels["slurm.job_id"] == "4242" and labels["slurm.partition"] == "gpu"
    assert labels["fabric.job_end"] == f"{NOW + 600:.0f}"
    assert body.hardware == hw


def test_a_moved_job_end_moves_the_lease_cap(tmp_path: Path) -> None:
    """The time limit was extended: re-signing with the new ``fabric.job_end`` label lets the
    lease run past the old end (peers would drop the entry there otherwise)."""
    from fabricnode.host.slurm import SlurmJob
    from fabricnode.mesh.core import MeshCore

    key = tmp_path / "cluster.key"
    Keyring.with_key(new_cluster_key()).save(key)
    agent = Agent(
        load_config(cluster_key=str(key), env={"FABRIC_HOME": str(tmp_path), "USER": "u"})
    )
    job = SlurmJob("4242", partition="gpu", end_time=NOW + 600)
    body = agent.join_body(NOW, "http://h:1", "h:2", None, job)
    core = MeshCore(agent.identity, Keyring.with_key(b"k" * 32), body, NOW)
    assert core.update_self(NOW + 590).body.expires_at == NOW + 600  # capped at the old end
    kept = [(k, v) for k, v in body.labels if k != "fabric.job_end"]
    moved = core.update_self(
        NOW + 595, labels=tuple(sorted([*kept, ("fabric.job_end", f"{NOW + 4200:.0f}")]))
    )
    assert moved.body.expires_at > NOW + 600
    assert core.update_self(NOW + 4190).body.expires_at == NOW + 4200  # the new cap holds
