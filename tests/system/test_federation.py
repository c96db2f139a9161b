"""Real agents as gateways of different sites (each site its own cluster key and mesh) on
loopback: a site's summary reaches the other site's gateway; killing the gateway is a
partition there (unroutable, kept) and restarting it heals; a gateway given a wrong
certificate for a site is refused by TLS and counts it."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.localmesh import AgentProcess, LocalMesh, wait_until
from fabricnode.federation.keygen import generate_site_key
from fabricnode.federation.sitekey import SiteKey
from tests.support.meshview import free_port

pytestmark = pytest.mark.slow
MODEL = "sim-llama"


def sites_of(agent: AgentProcess) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(f"{agent.http_url}/fabric/v1/sites", timeout=5).json()
    return {row["site"]: row for row in doc["sites"]}


def closed_tls(agent: AgentProcess) -> float:
    page = httpx.get(f"{agent.http_url}/metrics", timeout=5).text
    found = re.search(
        r'^fabric_federation_connections_closed_total\{reason="tls"\} (\S+)$', page, re.M
    )
    return float(found.group(1)) if found else 0.0


def gateway_args(key: SiteKey, peers: Path, port: int, *dial: str) -> list[str]:
    args = [
        "--site", key.site,
        "--gateway", f"127.0.0.1:{port}",
        "--site-key", str(key.key_path),
        "--peer-sites", str(peers),
    ]  # fmt: skip
    for peer in dial:
        args += ["--federation-peer", peer]
    return args


def peer_dir(root: Path, name: str, *keys: SiteKey) -> Path:
    d = root / f"peers-{name}"
    d.mkdir()
    for key in keys:
        (d / f"{key.site}.pem").write_bytes(key.cert.pem)
    return d


def test_sites_exchange_summaries_partition_and_heal(tmp_path: Path) -> None:
    keys = {}
    for name, site in (("A", "A"), ("C", "C"), ("C-fake", "C")):
        keys[name] = generate_site_key(site, tmp_path / f"key-{name}")
    port_a, port_c, port_a2 = free_port(), free_port(), free_port()
    peers_a = peer_dir(tmp_path, "A", keys["C"])
    peers_c = peer_dir(tmp_path, "C", keys["A"])
    peers_a2 = peer_dir(tmp_path, "A2", keys["C-fake"])  # a wrong certificate for C
    c_args = gateway_args(keys["C"], peers_c, port_c, f"A=127.0.0.1:{port_a}")
    with LocalMesh(tmp_path / "site-a") as site_a, LocalMesh(tmp_path / "site-c") as site_c:
        started = time.monotonic()
        site_c.start("c-node", args=["--site", "C", "--sim", MODEL])
        site_c.start("c-stray", args=["--site", "B", "--sim", "stray"])  # not C's: not summed
        gw_c = site_c.start("c-gateway", args=c_args)
        gw_a = site_a.start(
            "a-gateway", args=gateway_args(keys["A"], peers_a, port_a, f"C=127.0.0.1:{port_c}")
        )

        def c_serves_model() -> bool:
            row = sites_of(gw_a).get("C")
            return bool(
                row
                and row["routable"]
                and row["summary"]
                and row["summary"]["models"].get(MODEL, {}).get("replicas") == 1
            )

        assert wait_until(c_serves_model, 30), sites_of(gw_a)
        seen_after = time.monotonic() - started
        row = sites_of(gw_a)["C"]
        assert row["links_up"] >= 1 and row["rtt_ms"] is not None
        assert f"127.0.0.1:{port_c}" in row["summary"]["gateways"]
        assert "stray" not in row["summary"]["models"]  # a node of another site in C's mesh

        # a partition: C's gateway dies; A keeps C's summary, not routable
        gw_c.kill()
        gw_c.wait(10)
        killed = time.monotonic()
        assert wait_until(lambda: not sites_of(gw_a)["C"]["routable"], 20)
        partition_s = time.monotonic() - killed
        row = sites_of(gw_a)["C"]
        assert row["summary"]["models"][MODEL]["replicas"] == 1  # kept, not removed

        # healing: C's gateway back on its port
        gw_c2 = site_c.start("c-gateway-2", args=c_args)
        restarted = time.monotonic()
        assert wait_until(c_serves_model, 30), sites_of(gw_a)
        heal_s = time.monotonic() - restarted

        # a gateway of A given a wrong certificate for C: TLS refuses, counted, never routable
        gw_a2 = site_a.start(
            "a-gateway-wrong",
            args=gateway_args(keys["A"], peers_a2, port_a2, f"C=127.0.0.1:{port_c}"),
        )
        assert wait_until(lambda: closed_tls(gw_a2) >= 1, 20)
        assert not sites_of(gw_a2)["C"]["routable"]
        assert sites_of(gw_a2)["C"]["summary"] is None
        assert gw_c2.running
        print(
            f"C's model seen at A after {seen_after:.1f} s; unroutable {partition_s:.1f} s "
            f"after the kill; routable {heal_s:.1f} s after the restart"
        )
