"""Two-layer routing with real agents on loopback (``sites`` rule 5, SkyLB's): a burst at site A
beyond its two small replicas is served inside A while A's node can admit, and the overflow is
pushed to sites B and C, which can; no request fails, and each crosses between sites at most
once (the request logs of A's ingress and of B's and C's gateways agree). A conversation stays
on its site and replica while the site has room."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import pytest

from cli.localmesh import LocalMesh, wait_until
from fabricnode.federation.keygen import generate_site_key
from tests.support.meshload import sim_engine_args
from tests.support.meshview import free_port
from tests.support.pushburst import burst, check_request_logs, turns
from tests.system.test_federation import gateway_args, peer_dir, sites_of

pytestmark = pytest.mark.slow
MODEL = "sim-shared"
CLIENTS, CLIENT_REQUESTS = 12, 4  # the burst: twelve clients, each a request after another
BURST = CLIENTS * CLIENT_REQUESTS


def test_a_burst_beyond_a_sites_replicas_is_pushed_to_sites_that_can_admit_it(
    tmp_path: Path,
) -> None:
    names = ("A", "B", "C")
    keys = {s: generate_site_key(s, tmp_path / f"key-{s}") for s in names}
    ports = {s: free_port() for s in names}
    logs = {s: tmp_path / f"{s}-requests.jsonl" for s in names}
    with (
        LocalMesh(tmp_path / "site-a") as site_a,
        LocalMesh(tmp_path / "site-b") as site_b,
        LocalMesh(tmp_path / "site-c") as site_c,
    ):
        meshes = {"A": site_a, "B": site_b, "C": site_c}
        gateways = {}
        for s in names:
            others = [o for o in names if o != s]
            peers = peer_dir(tmp_path, s, *(keys[o] for o in others))
            dial = [f"{o}=127.0.0.1:{ports[o]}" for o in others]
            args = gateway_args(keys[s], peers, ports[s], *dial)
            gateways[s] = meshes[s].start(
                f"{s}-gateway", args=[*args, "--request-log", str(logs[s])]
            )
        # A's two replicas run two requests at a time each, slowly: a burst of twelve clients
        # and a conversation queue there
        small = sim_engine_args(MODEL, "L4", "--max-num-seqs", "2", "--slowdown", "4")
        for i in range(2):
            site_a.start(f"A-node-{i}", args=["--site", "A", *small])
        # B's and C's replicas take one at a time: the nearer one has a queue (and its summary
        # says so) after its first pushed request, and the overflow spills to the other (with
        # three at a time, a run sent all of it to C, whose summaries never showed a queue)
        middle = sim_engine_args(MODEL, "L4", "--max-num-seqs", "1", "--slowdown", "4")
        for s in ("B", "C"):
            meshes[s].start(f"{s}-node", args=["--site", s, *middle])
        ingress = site_a.start(
            "A-ingress", args=["--site", "A", "--request-log", str(tmp_path / "ingress.jsonl")]
        )

        def everyone_admits() -> bool:
            rows = sites_of(gateways["A"])
            return all(
                (rows.get(o) or {}).get("routable")
                and ((rows[o].get("summary") or {}).get("models", {}).get(MODEL) or {}).get(
                    "admitting"
                )
                for o in ("B", "C")
            )

        assert wait_until(everyone_admits, 40), sites_of(gateways["A"])
        assert wait_until(
            lambda: httpx.get(f"{ingress.http_url}/v1/models", timeout=5).json()["data"], 20
        )

        # while A has room, a conversation stays on A's replica
        calm = turns(ingress.http_url, MODEL, "calm", 3, "A")
        assert {site for site, _ in calm} == {"A"} and len({node for _, node in calm}) == 1, calm

        got = burst(ingress.http_url, MODEL, clients=CLIENTS, per_client=CLIENT_REQUESTS, home="A")
        print(f"results {dict(got.results)}; served at {dict(got.served_at)}; busy {got.busy}")
        assert got.results == Counter({"200": BURST}), got.results
        assert got.served_at["A"] > 0, got.served_at  # A served what it could admit
        # the overflow went out (to B and C in most runs; which one takes a pushed request is
        # what its summary said at that moment, so one of them may take it all)
        assert got.served_at["B"] + got.served_at["C"] > 0, got.served_at
        assert set(got.served_at) <= {"A", "B", "C"}, got.served_at
        # a conversation that begins while A is full is answered wherever there is room: a
        # turn goes back to the site it was pushed to while that site can admit (the gateway's
        # sessions: tests/unit/dataplane/test_across.py), else to one that can
        assert len(got.busy) == 5, got.busy
        # each request crossed between sites at most once (the request logs)
        check_request_logs(
            tmp_path / "ingress.jsonl",
            {s: logs[s] for s in ("B", "C")},
            BURST + len(calm) + len(got.busy),
        )
