"""Capacity across sites on two real Slurms (``elastic.sitespread``; issue 41's acceptance): two
sites A and B, each its own mesh, cluster key and throw-away Slurm (tests/support/slurmcluster.py),
joined by their gateways on loopback; each gateway is also its site's controller. One service
file, applied at both: two replicas of a simulated model in all, ``prefer_sites = ["B", "A"]``.

B's partition is down (its jobs pend): A's controller starts the two replicas at A. Then B's
partition comes up: B's jobs start and serve, and A's controller drains its own, one for each
that serves at B, while a client at A sends requests the whole time: none fails, and the model
never has fewer than two replicas serving across the sites once A's two served. The timings
are printed (``-s``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.federation.keygen import generate_site_key
from fabricnode.mesh.identity import OperatorKey
from tests.support.elasticmesh import (
    FABRIC,
    controller_env,
    serving_count,
    steady_load,
    tagged_jobs,
)
from tests.support.meshview import fabric, free_port
from tests.support.slurmcluster import SlurmCluster, throwaway_cluster
from tests.system.test_federation import gateway_args, peer_dir, sites_of

pytestmark = pytest.mark.slow

MODEL = "sim-across"
SITES = ("A", "B")
SERVICE = f"""
[limits]
max_jobs = 4
max_gpus = 4

[[model]]
name = "{MODEL}"
engine = "sim"
gpus_per_replica = 1
min_replicas = 2
max_replicas = 2
sites = ["A", "B"]
prefer_sites = ["B", "A"]
time_limit = "30:00"
"""


@dataclass
class Site:
    name: str
    cluster: SlurmCluster
    mesh: LocalMesh
    gateway: AgentProcess


@dataclass
class Watch:
    """Every half second: the replicas serving at each site; the client's results."""

    serving: list[tuple[float, int, int]] = field(default_factory=list)
    results: Counter[str] = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Site]]:
    if not FABRIC.exists():
        pytest.skip(f"no fabric console script next to {sys.executable}")
    root = tmp_path_factory.mktemp("elastic-sites")
    operator = OperatorKey.generate()
    keys = {s: generate_site_key(s, root / f"key-{s}") for s in SITES}
    ports = {s: free_port() for s in SITES}
    with (
        throwaway_cluster(tmp_path_factory) as cluster_a,
        throwaway_cluster(tmp_path_factory) as cluster_b,
    ):
        clusters = {"A": cluster_a, "B": cluster_b}
        made: dict[str, Site] = {}
        try:
            for s in SITES:
                mesh = LocalMesh(root / f"site-{s}")
                operator.save(mesh.workdir / "operator.key")
                other = next(o for o in SITES if o != s)
                peers = peer_dir(root, s, keys[other])
                args = [
                    *gateway_args(keys[s], peers, ports[s], f"{other}=127.0.0.1:{ports[other]}"),
                    "--trust-operator", operator.fingerprint,
                    "--controller",
                ]  # fmt: skip
                # the jobs' agents inherit it: the site's Slurm, and the site's name
                env = controller_env(clusters[s], FABRIC_SITE=s)
                gateway = mesh.start(f"{s}-gateway", args=args, env=env)
                made[s] = Site(s, clusters[s], mesh, gateway)
            yield made
        finally:
            for site in made.values():
                site.mesh.close()  # the controllers first: nothing replaces what is cancelled
            for cluster in clusters.values():
                ours = tagged_jobs(cluster)
                if ours:
                    cluster.run("scancel", *ours, check=False)


LIVE = "PENDING,RUNNING,COMPLETING"  # squeue keeps an ended job's record MinJobAge (60 s)


def jobs_in(cluster: SlurmCluster, state: str) -> list[str]:
    done = cluster.run("squeue", "-h", "-t", state, "-o", "%i|%k", check=False)
    return [ln.split("|")[0] for ln in done.stdout.splitlines() if f"model={MODEL}" in ln]


def watch(a: Site, b: Site, w: Watch) -> None:
    while not w.stop.is_set():
        at_a = serving_count(a.gateway.http_url, MODEL)
        at_b = serving_count(b.gateway.http_url, MODEL)
        if at_a is not None and at_b is not None:
            w.serving.append((time.monotonic(), at_a, at_b))
        time.sleep(0.5)


def share_of(site: Site) -> str:
    doc = httpx.get(f"{site.gateway.http_url}/fabric/v1/controller", timeout=5).json()
    return str((doc.get("site_shares") or {}).get(MODEL, ""))


def test_replicas_go_to_the_other_site_while_the_preferred_one_refuses_and_come_back(
    sites: dict[str, Site], tmp_path: Path
) -> None:
    a, b = sites["A"], sites["B"]
    assert wait_until(lambda: all(sites_of(s.gateway).get(o, {}).get("routable")
                                  for s, o in ((a, "B"), (b, "A"))), 40)  # fmt: skip
    # B's partition takes jobs but runs none: its queue pends
    b.cluster.run("scontrol", "update", "PartitionName=low", "State=DOWN")
    service = tmp_path / "services.toml"
    service.write_text(SERVICE)
    for s in (a, b):
        done = fabric(s.mesh, s.gateway, "services", "apply", str(service))
        assert done.returncode == 0, done.stdout + done.stderr
    started = time.monotonic()

    assert wait_until(lambda: serving_count(a.gateway.http_url, MODEL) == 2, 120), (
        share_of(a),
        jobs_in(a.cluster, "all"),
        jobs_in(b.cluster, "all"),
    )
    at_a_s = time.monotonic() - started
    assert len(jobs_in(b.cluster, "PENDING")) == 2  # B keeps trying: its jobs wait in its queue
    assert "site A's share: 2 to 2" in share_of(a), share_of(a)
    w = Watch()
    threads = [
        threading.Thread(target=watch, args=(a, b, w), daemon=True),
        threading.Thread(
            target=steady_load,
            args=(a.gateway.http_url, MODEL, w.stop, w.results, 0.3),
            daemon=True,
        ),
    ]
    for t in threads:
        t.start()
    try:
        assert wait_until(lambda: sum(w.results.values()) >= 5, 30), w.results
        up = time.monotonic()
        b.cluster.run("scontrol", "update", "PartitionName=low", "State=UP")
        assert wait_until(lambda: serving_count(b.gateway.http_url, MODEL) == 2, 120), (
            share_of(a),
            jobs_in(b.cluster, "all"),
        )
        at_b_s = time.monotonic() - up
        # A drains what B serves: its jobs end, its share is none
        assert wait_until(lambda: not jobs_in(a.cluster, LIVE), 120), (
            share_of(a),
            jobs_in(a.cluster, "all"),
        )
        drained_s = time.monotonic() - up
        assert "site A's share: 0 to 0" in share_of(a), share_of(a)
        served = sum(w.results.values())
        # requests at A served at B through the gateways once A has no replica
        assert wait_until(lambda: sum(w.results.values()) >= served + 5, 30), w.results
    finally:
        w.stop.set()
        for t in threads:
            t.join(60)
    print(
        f"\nA served both replicas {at_a_s:.1f} s after the file was applied; B served both "
        f"{at_b_s:.1f} s after its partition came up; A drained {drained_s:.1f} s after; "
        f"client at A: {dict(w.results)}"
    )
    assert w.results and set(w.results) == {"200"}, w.results
    # Never fewer than two serving across the sites (make-before-break across sites).
    # serving_count reads each site's registry: a replica A drains is SERVING until it leaves
    low = [(round(t - up, 1), x, y) for t, x, y in w.serving if x + y < 2]
    assert not low, low


ZERO = "sim-zero"
SERVICE_ZERO = (
    SERVICE
    + f"""
[[model]]
name = "{ZERO}"
engine = "sim"
gpus_per_replica = 1
min_replicas = 0
max_replicas = 1
sites = ["A", "B"]
idle_to_zero = "5m"
hold_requests = "2m"
time_limit = "30:00"
"""
)


def zero_jobs(cluster: SlurmCluster) -> list[str]:
    done = cluster.run("squeue", "-h", "-t", "all", "-o", "%i|%k", check=False)
    return [ln.split("|")[0] for ln in done.stdout.splitlines() if f"model={ZERO}" in ln]


def test_scale_from_zero_goes_to_the_site_that_can_start_while_ours_refuses(
    sites: dict[str, Site], tmp_path: Path
) -> None:
    """``sites`` rule 8 on real processes: a declared model no site serves, A's partition
    refusing new jobs. A request at A waits for a start; A's controller's submission is
    refused, so A's gateway sends the waiting request to B, whose summary expects a start; it
    waits at B, B's controller starts the replica, and the request is answered there. A
    submits nothing that runs, and the next request at A goes to B's replica at once."""
    a, b = sites["A"], sites["B"]
    assert wait_until(lambda: all(sites_of(s.gateway).get(o, {}).get("routable")
                                  for s, o in ((a, "B"), (b, "A"))), 40)  # fmt: skip
    a.cluster.run("scontrol", "update", "PartitionName=low", "State=DRAIN")  # sbatch refused
    b.cluster.run("scontrol", "update", "PartitionName=low", "State=UP")
    try:
        service = tmp_path / "services.toml"
        service.write_text(SERVICE_ZERO)
        for s in (a, b):
            done = fabric(s.mesh, s.gateway, "services", "apply", str(service))
            assert done.returncode == 0, done.stdout + done.stderr

        def start_at_b() -> object:
            row = sites_of(a.gateway).get("B", {}).get("summary") or {}
            return (row.get("models") or {}).get(ZERO, {}).get("start_s")

        assert wait_until(lambda: start_at_b() is not None, 30), sites_of(a.gateway)
        asked = time.monotonic()
        body = {"model": ZERO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        first = httpx.post(f"{a.gateway.http_url}/v1/chat/completions", json=body, timeout=150)
        waited_s = time.monotonic() - asked
        assert first.status_code == 200, first.text
        assert first.headers.get("x-fabric-site") == "B", dict(first.headers)
        second = httpx.post(f"{a.gateway.http_url}/v1/chat/completions", json=body, timeout=30)
        assert second.status_code == 200 and second.headers.get("x-fabric-site") == "B"
        assert zero_jobs(a.cluster) == []  # refused: nothing of it queued or ran at A
        assert len(zero_jobs(b.cluster)) == 1
        decisions = httpx.get(f"{a.gateway.http_url}/fabric/v1/controller", timeout=5).json()
        print(
            f"\nscale from zero at B while A refuses: first answer after {waited_s:.1f} s; "
            f"A's controller: {[d for d in decisions.get('decisions', []) if ZERO in str(d)][-2:]}"
        )
    finally:
        a.cluster.run("scontrol", "update", "PartitionName=low", "State=UP")
