"""Gateways of different sites over real loopback sockets and TLS, in one trio process:
summaries cross, a partition keeps the site (unroutable) and healing restores it, a wrong
pinned certificate or a hostile peer is refused and counted, never crashing the gateway."""

from __future__ import annotations

import ssl
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from fabricnode.federation.keygen import generate_site_key
from fabricnode.federation.link import Gateway
from fabricnode.federation.protocol import HEADER, Hello, encode
from fabricnode.federation.settings import FederationConfig
from fabricnode.federation.sitekey import SiteKey
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import ModelInfo, State
from fabricnode.testing.simnet import make_body
from tests.support.meshview import free_port

NOW = 1_750_000_000.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SiteKey]:
    root = tmp_path_factory.mktemp("sites")
    out = {}
    for name, site in (("A", "A"), ("C", "C"), ("C-fake", "C")):
        (root / name).mkdir()
        out[name] = generate_site_key(site, root / name)
    return out


def peer_dir(tmp: Path, name: str, *certs: SiteKey) -> Path:
    d = tmp / f"peers-{name}"
    d.mkdir()
    for key in certs:
        (d / f"{key.site}.pem").write_bytes(key.cert.pem)
    return d


def config(key: SiteKey, peers: Path, dial: tuple[tuple[str, str], ...] = ()) -> FederationConfig:
    return FederationConfig(
        gateway="127.0.0.1:1",  # rewritten once bound
        listen_host="127.0.0.1",
        listen_port=0,
        site_key_path=key.key_path,
        peer_sites_dir=peers,
        peers=dial,
        summary_period_s=0.05,
        keepalive_s=0.3,
        ping_interval_s=0.1,
        idle_timeout_s=2.0,
        handshake_timeout_s=2.0,
        backoff_min_s=0.05,
        backoff_max_s=0.3,
        stale_floor_s=1.0,
    )


def serving_core(model: str, site: str) -> MeshCore:
    """A gateway's core whose registry has one SERVING node of ``site`` serving ``model``."""
    me = Identity.from_seed(b"gw-core")
    core = MeshCore(me, Keyring.with_key(b"k" * 32), make_body(me, "10.0.0.1:7946", NOW), NOW)
    node = Identity.from_seed(b"node")
    entry = make_body(
        node,
        "10.0.0.2:7946",
        NOW,
        state=State.SERVING,
        models=(ModelInfo(model, 4096, None),),
        site=site,
    ).sign(node)
    core.registry.merge(entry, NOW)
    core.members.learn_address(entry.session_id, "10.0.0.2:7946", NOW)
    return core


async def start(nursery: trio.Nursery, gw: Gateway, core: MeshCore) -> tuple[str, trio.CancelScope]:
    scope = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[str]) -> None:
        with scope:
            await gw.run(core, task_status=task_status)

    addr: str = await nursery.start(run)
    return addr, scope


async def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():  # type: ignore[operator]
            await trio.sleep(0.02)


def clock() -> float:
    return NOW + trio.current_time()


async def test_summaries_cross_partitions_keep_the_site_and_healing_restores_it(
    tmp_path: Path, keys: dict[str, SiteKey]
) -> None:
    gw_c = Gateway.load(config(keys["C"], peer_dir(tmp_path, "C", keys["A"])), wall_clock=clock)
    async with trio.open_nursery() as nursery:
        addr_c, scope_c = await start(nursery, gw_c, serving_core("llama", "C"))
        port_c = addr_c.rsplit(":", 1)[1]
        cfg_a = config(
            keys["A"], peer_dir(tmp_path, "A", keys["C"]), (("C", f"127.0.0.1:{port_c}"),)
        )
        gw_a = Gateway.load(cfg_a, wall_clock=clock)
        await start(nursery, gw_a, serving_core("other", "A"))
        await wait_for(lambda: gw_a.view.routable("C", clock()))
        assert gw_a.view.sites_serving("llama", clock()) == ["C"]
        doc = gw_a.sites_doc()["sites"][0]
        assert doc["site"] == "C" and doc["summary"]["models"]["llama"]["replicas"] == 1
        await wait_for(lambda: gw_a.view.rtt("C") is not None)

        scope_c.cancel()  # C's gateway goes away: a partition, as A sees it
        await wait_for(lambda: not gw_a.view.routable("C", clock()))
        assert gw_a.view.summary("C") is not None  # kept for when it heals
        assert gw_a.statistics().links_up["C"] == 0

        gw_c2 = Gateway.load(replace(gw_c.config, listen_port=int(port_c)), wall_clock=clock)
        await start(nursery, gw_c2, serving_core("llama", "C"))
        await wait_for(lambda: gw_a.view.routable("C", clock()))
        stats = gw_a.statistics()
        assert stats.accepted >= 2 and stats.refused["bad_signature"] == 0
        nursery.cancel_scope.cancel()


async def test_every_gateway_of_a_site_with_two_gets_the_peer_sites_summary(
    tmp_path: Path, keys: dict[str, SiteKey]
) -> None:
    """A's gateway dials C's first gateway; C's second dials A's: A's summary must reach both
    of C's (each keeps its own view), not only the one whose connection is A's oldest."""
    peers_c = peer_dir(tmp_path, "C", keys["A"])

    def at(cfg: FederationConfig) -> FederationConfig:
        """Each gateway says its own address in its HELLO, as ``--gateway`` makes it."""
        port = free_port()
        return replace(cfg, gateway=f"127.0.0.1:{port}", listen_port=port)

    gw_c1 = Gateway.load(at(config(keys["C"], peers_c)), wall_clock=clock)
    async with trio.open_nursery() as nursery:
        addr_c1, _ = await start(nursery, gw_c1, serving_core("llama", "C"))
        cfg_a = config(keys["A"], peer_dir(tmp_path, "A", keys["C"]), (("C", addr_c1),))
        gw_a = Gateway.load(at(cfg_a), wall_clock=clock)
        addr_a, _ = await start(nursery, gw_a, serving_core("other", "A"))
        gw_c2 = Gateway.load(at(config(keys["C"], peers_c, (("A", addr_a),))), wall_clock=clock)
        await start(nursery, gw_c2, serving_core("llama", "C"))
        for gw in (gw_c1, gw_c2):
            await wait_for(lambda gw=gw: gw.view.routable("A", clock()))  # type: ignore[misc]
            assert gw.view.sites_serving("other", clock()) == ["A"]
        await wait_for(lambda: gw_a.view.routable("C", clock()))
        nursery.cancel_scope.cancel()


async def test_a_wrong_pinned_certificate_is_refused_and_counted(
    tmp_path: Path, keys: dict[str, SiteKey]
) -> None:
    gw_c = Gateway.load(config(keys["C"], peer_dir(tmp_path, "C", keys["A"])), wall_clock=clock)
    async with trio.open_nursery() as nursery:
        addr_c, _ = await start(nursery, gw_c, serving_core("llama", "C"))
        # A was given an impostor's certificate for C
        cfg_a = config(keys["A"], peer_dir(tmp_path, "A", keys["C-fake"]), (("C", addr_c),))
        gw_a = Gateway.load(cfg_a, wall_clock=clock)
        await start(nursery, gw_a, serving_core("other", "A"))
        await wait_for(lambda: gw_a.statistics().closed["tls"] >= 2)
        assert not gw_a.view.routable("C", clock())
        assert gw_a.view.summary("C") is None
        assert gw_c.statistics().links_up["A"] == 0
        nursery.cancel_scope.cancel()


async def test_garbage_and_oversized_frames_are_dropped_and_counted(
    tmp_path: Path, keys: dict[str, SiteKey]
) -> None:
    gw_c = Gateway.load(config(keys["C"], peer_dir(tmp_path, "C", keys["A"])), wall_clock=clock)
    async with trio.open_nursery() as nursery:
        addr_c, _ = await start(nursery, gw_c, serving_core("llama", "C"))
        host, port = addr_c.rsplit(":", 1)
        # not TLS at all
        raw = await trio.open_tcp_stream(host, int(port))
        await raw.send_all(b"GET / HTTP/1.1\r\n\r\n" * 10)
        await wait_for(lambda: gw_c.statistics().closed["tls"] >= 1)
        await raw.aclose()
        # an authenticated peer (A's key) that sends a HELLO, then an oversized frame
        client_a = Gateway.load(
            config(keys["A"], peer_dir(tmp_path, "A", keys["C"])), wall_clock=clock
        ).client_context
        tls = trio.SSLStream(await trio.open_tcp_stream(host, int(port)), client_a)
        await tls.do_handshake()
        await tls.send_all(encode(Hello(1, "A", "")))
        await tls.send_all(HEADER.pack(64 * 1024 * 1024))
        await wait_for(lambda: gw_c.statistics().closed["bad_frame"] >= 1)
        # a peer that lies about its site in HELLO
        tls2 = trio.SSLStream(await trio.open_tcp_stream(host, int(port)), client_a)
        await tls2.do_handshake()
        await tls2.send_all(encode(Hello(1, "B", "")))
        await wait_for(lambda: gw_c.statistics().closed["hello"] >= 1)
        assert gw_c.statistics().links_up["A"] == 0
        with pytest.raises((trio.BrokenResourceError, ssl.SSLError)):
            for _ in range(50):
                await tls2.send_all(b"x" * 1024)
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
