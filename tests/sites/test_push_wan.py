"""Two-layer routing over the emulated WAN (issue 41's acceptance with real agents): three sites
40, 150 and 250 ms apart (tests/support/sites.py), each its own mesh and cluster key, one
gateway each, the same model served at all three; every client runs inside site ``a``'s
ingress's namespace.

A burst at ``a`` beyond its two small replicas: ``a`` serves what it can admit, the overflow is
pushed to ``b`` and ``c`` over the WAN, no request fails, and each request crosses the WAN at most
once (the request logs of a's ingress and of b's and c's gateways agree). A conversation keeps
its site and replica across turns while its site has room. The figures are printed (``-s``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cli.localmesh import wait_until
from fabricnode.federation.keygen import generate_site_key
from tests.support.federation import Federation, start_meshes
from tests.support.meshload import sim_engine_args
from tests.support.pushburst import burst, check_request_logs, turns
from tests.support.sites import Link, Site, Topology, emulated_sites, require_sites

pytestmark = pytest.mark.slow

TOPOLOGY = Topology(
    sites=(Site("a", computes=3), Site("b"), Site("c")),
    links={
        ("a", "b"): Link(rtt_ms=40),
        ("a", "c"): Link(rtt_ms=150),
        ("b", "c"): Link(rtt_ms=250),
    },
)
MODEL = "sim-shared"
CLIENTS, CLIENT_REQUESTS = 12, 4
BURST = CLIENTS * CLIENT_REQUESTS
INGRESS = "a-c0"


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    require_sites()
    root = tmp_path_factory.mktemp("push-wan")
    keys = {s.name: generate_site_key(s.name, root / f"key-{s.name}") for s in TOPOLOGY.sites}
    with emulated_sites(TOPOLOGY) as sites:
        fed = Federation(sites, root, keys)
        try:
            start_meshes(fed)
            # a's two replicas run two requests at a time each, slowly: the burst queues there;
            # b's and c's take one at a time (as tests/system/test_push_across_sites.py's)
            small = sim_engine_args(MODEL, "L4", "--max-num-seqs", "2", "--slowdown", "4")
            one = sim_engine_args(MODEL, "L4", "--max-num-seqs", "1", "--slowdown", "4")
            fed.start("a-c1", *small)
            fed.start("a-c2", *small)
            fed.start("b-c0", *one)
            fed.start("c-c0", *one)
            fed.start(INGRESS, "--request-log", str(root / "ingress.jsonl"))
            for gw in ("a-gw0", "b-gw0", "c-gw0"):
                fed.gateway(gw, "--request-log", str(root / f"{gw}.jsonl"))
            for agent in fed.agents.values():
                agent.wait_ready(60)
            yield fed
        finally:
            fed.close()


def peers_admit(fed: Federation) -> bool:
    """a's gateway has b and c routable, each summary saying a replica of the model admits."""
    rows = fed.peer_sites("a-gw0")
    for site in ("b", "c"):
        row = rows.get(site) or {}
        model = ((row.get("summary") or {}).get("models") or {}).get(MODEL) or {}
        if not (row.get("routable") and model.get("admitting")):
            return False
    return True


def test_a_burst_at_one_site_is_served_by_the_others_over_the_wan(
    federation: Federation,
) -> None:
    fed = federation
    assert wait_until(lambda: peers_admit(fed), 60), fed.peer_sites("a-gw0")
    url = fed.url(INGRESS)

    def models() -> Any:
        return fed.at(INGRESS, lambda: httpx.get(f"{url}/v1/models", timeout=5).json()["data"])

    assert wait_until(lambda: bool(models()), 30)

    def run(fn: Any) -> Any:
        return fed.at(INGRESS, fn)

    calm = turns(url, MODEL, "calm", 3, "a", run)
    assert {site for site, _ in calm} == {"a"} and len({node for _, node in calm}) == 1, calm

    got = burst(url, MODEL, clients=CLIENTS, per_client=CLIENT_REQUESTS, home="a", run=run)
    print(f"\nburst of {BURST}: {dict(got.results)}; served at {dict(got.served_at)}")
    print(f"a conversation begun while a was full: {got.busy}")
    assert got.results == Counter({"200": BURST}), got.results
    assert got.served_at["a"] > 0, got.served_at
    assert got.served_at["b"] + got.served_at["c"] > 0, got.served_at
    assert set(got.served_at) <= {"a", "b", "c"}, got.served_at
    assert len(got.busy) == 5, got.busy
    root = fed.root
    at = check_request_logs(
        root / "ingress.jsonl",
        {"b": root / "b-gw0.jsonl", "c": root / "c-gw0.jsonl"},
        BURST + len(calm) + len(got.busy),
    )
    print(f"request logs: a's ingress by serving site {dict(at)}; each crossed at most once")
