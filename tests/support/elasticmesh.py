"""An elastic-controller mesh on a throw-away Slurm (``slurmcluster``), for tests/slurm.

``elastic_mesh(cluster, workdir)`` starts an ingress and two ``--controller`` agents (one acts)
trusting a fresh operator key, with simulated engines; on exit it stops them first (so nothing
replaces the jobs cancelled next), cancels every job a controller submitted, waits for them to
leave the queue and prints the agents' and the last jobs' log tails. The rest reads Slurm's and
the mesh's view of the controller's jobs (``meshview.fabric`` runs the CLI against an agent).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh
from fabricnode.control.client import AdminClient
from fabricnode.elastic.slurmctl import Tag, parse_comment
from fabricnode.errors import AgentApiError
from fabricnode.mesh.identity import OperatorKey
from tests.support import REPO
from tests.support.slurmcluster import SlurmCluster

FABRIC = Path(sys.executable).parent / "fabric"


@dataclass
class Elastic:
    mesh: LocalMesh
    ingress: AgentProcess
    controllers: list[AgentProcess]
    controller_args: tuple[str, ...] = ()
    controller_env: dict[str, str] | None = None

    def live_controllers(self) -> list[AgentProcess]:
        return [a for a in self.controllers if a.proc.poll() is None]

    def ensure_controllers(self, count: int = 2) -> list[AgentProcess]:
        """At least ``count`` live controller agents (one acts): a test that killed one starts
        another (a standby: it is the newest candidate)."""
        while len(self.live_controllers()) < count:
            name = f"ctl-{len(self.controllers) + 1}"
            agent = self.mesh.start(name, args=self.controller_args, env=self.controller_env)
            self.controllers.append(agent)
        return self.live_controllers()


def controller_env(cluster: SlurmCluster, **extra: str) -> dict[str, str]:
    """The environment of a controller agent on ``cluster``, which its jobs inherit (sbatch
    --export=ALL): the cluster's Slurm, simulated H100s, and the ``fabric`` console script
    with PYTHONPATH making it import this checkout's sources (a worktree's), not those the
    environment was installed from; ``extra`` on top (``FABRIC_SITE``)."""
    return {**cluster.env, "FABRIC_BIN": str(FABRIC), "FABRIC_SIM_GPU": "H100",
            "FABRIC_LEAVE_BEFORE_END": "", "FABRIC_JOIN": "", "PYTHONPATH": str(REPO),
            **extra}  # fmt: skip


@contextlib.contextmanager
def elastic_mesh(cluster: SlurmCluster, workdir: Path) -> Iterator[Elastic]:
    """An ingress and two controller agents (one acts) trusting the mesh's operator key; the
    test is skipped when there is no ``fabric`` console script to run in the jobs."""
    if not FABRIC.exists():
        pytest.skip(f"no fabric console script next to {sys.executable}")
    local = LocalMesh(workdir / "mesh")
    key = OperatorKey.generate()
    key.save(local.workdir / "operator.key")
    trust = ("--trust-operator", key.fingerprint)
    env = controller_env(cluster)
    args = (*trust, "--controller")
    try:
        ingress = local.start("ingress", args=trust)
        controllers = [local.start(name, args=args, env=env) for name in ("ctl-a", "ctl-b")]
        yield Elastic(local, ingress, controllers, args, env)
    finally:
        local.close()  # the controllers first, so that nothing replaces the jobs cancelled next
        ours = tagged_jobs(cluster)
        if ours:
            cluster.run("scancel", *ours, check=False)
        # The next module's tests time Slurm's signals: leave them a quiet cluster, not jobs
        # still ending (their agents draining, slurmd running their epilogs).
        deadline = time.monotonic() + 60
        while tagged_jobs(cluster) and time.monotonic() < deadline:
            time.sleep(0.5)
        for agent in local.agents:
            print(f"--- {agent.name} (exit {agent.proc.returncode}) ---\n{agent.stderr_tail(25)}")
        for out in sorted((local.workdir / "logs").glob("slurm-*.out"))[-6:]:
            print(f"--- {out.name} ---\n" + "\n".join(out.read_text().splitlines()[-8:]))


def tagged_jobs(cluster: SlurmCluster) -> list[str]:
    """Every controller job of any model still in the queue (completing ones included)."""
    done = cluster.run("squeue", "-h", "-o", "%i|%k", check=False)
    return [line.split("|")[0] for line in done.stdout.splitlines() if "fabric-elastic" in line]


def controller_jobs(cluster: SlurmCluster) -> list[tuple[str, str, Tag]]:
    """(job id, state, tag) of the jobs an elastic controller submitted, any mesh."""
    done = cluster.run("squeue", "-h", "-o", "%i|%T|%k", check=False)
    out = []
    for line in done.stdout.splitlines():
        job_id, state, comment = [*line.split("|", 2), "", ""][:3]
        words = comment.split()
        mesh = next((w[5:] for w in words if w.startswith("mesh=")), "")
        tagged = parse_comment(comment, mesh) if mesh else None
        if tagged is not None:
            out.append((job_id, state, tagged))
    return out


def left_jobs(url: str, model: str) -> set[str] | None:
    """The Slurm jobs of ``model`` whose agent has left the mesh (a signed LEFT, and no new
    session of the job since) in the registry of the agent at ``url``: draining while squeue
    still shows them RUNNING, they serve nobody and count as no replica (None when the agent
    does not answer)."""
    try:
        with AdminClient(url, timeout_s=2.0) as client:
            nodes = client.nodes()
    except AgentApiError:
        return None
    left: set[str] = set()
    present: set[str] = set()
    for n in nodes:
        labels = n.get("labels") or {}
        job = labels.get("slurm.job_id", "")
        if not job or labels.get("fabric.service") != model:
            continue
        (left if n.get("state") == "left" else present).add(job)
    return left - present


def serving_count(url: str, model: str) -> int | None:
    """Alive SERVING replicas of ``model`` in the registry of the agent at ``url`` (None when
    it does not answer)."""
    try:
        with AdminClient(url, timeout_s=2.0) as client:
            nodes = client.nodes(state="serving")
    except AgentApiError:
        return None
    return sum(
        1
        for n in nodes
        if (n.get("labels") or {}).get("fabric.service") == model and n.get("liveness") == "alive"
    )


def steady_load(
    url: str, model: str, stop: threading.Event, results: Counter[str], pause_s: float = 0.5
) -> None:
    """One client at ``url`` sending a short chat request for ``model`` every ``pause_s``
    until ``stop``; each result (status code, or the exception's name) counted."""
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8}  # fmt: skip
            try:
                r = client.post("/v1/chat/completions", json=body)
                results[str(r.status_code)] += 1
            except httpx.HTTPError as exc:
                results[type(exc).__name__] += 1
            time.sleep(pause_s)
