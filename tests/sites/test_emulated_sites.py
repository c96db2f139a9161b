"""The emulated sites of tests/support/sites.py do what the federation tests rely on: the RTT
set is the RTT measured, compute nodes are unreachable from other sites, a cut partitions and a
heal mends, loss and bandwidth are what was set, and nothing is left behind.

Root only (network namespaces); they skip with the reason elsewhere, and fail on CI. Figures
are printed (``-s``): docs/benchmarks.md, "Emulated sites", has the larger runs.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.sites import (
    MARKER,
    NETNS_DIR,
    THREE_SITES,
    Link,
    Site,
    Sites,
    Topology,
    emulated_sites,
    pids_in,
    require_sites,
)

pytestmark = pytest.mark.slow

PROBES = 20


def test_rtt_measured_through_the_wan_is_the_rtt_set_within_5_percent(
    three_sites: Sites,
) -> None:
    pairs = [("a-gw0", "b-gw0"), ("a-gw0", "c-gw0"), ("b-gw0", "c-gw0")]
    measured: dict[tuple[str, str], list[float]] = {}

    def probe(src: str, dst: str) -> None:
        measured[(src, dst)] = three_sites.probe_rtts_ms(src, dst, PROBES)

    threads = [threading.Thread(target=probe, args=pair) for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    late = three_sites.statistics()
    for src, dst in pairs:
        rtts = measured[(src, dst)]
        want = three_sites.link(src[0], dst[0]).rtt_ms
        median = statistics.median(rtts)
        print(
            f"\nsites: {src} -> {dst} set {want:.0f} ms, median of {PROBES} connects"
            f" {median:.2f} ms ({(median / want - 1) * 100:+.2f}%), min {min(rtts):.2f},"
            f" max {max(rtts):.2f}"
        )
        assert min(rtts) >= want  # never early: the router holds each packet its full time
        assert median == pytest.approx(want, rel=0.05)
    print(
        f"sites: releases late by {late.late_s_mean * 1e6:.0f} us on average,"
        f" {late.late_s_max * 1e3:.2f} ms at most"
    )


def test_a_link_set_at_run_time_changes_the_rtt(three_sites: Sites) -> None:
    three_sites.set_link("a", "b", Link(rtt_ms=100))
    assert statistics.median(three_sites.probe_rtts_ms("b-gw0", "a-gw0", 5)) >= 100
    three_sites.reset()
    assert three_sites.link("a", "b") == THREE_SITES.link("a", "b")
    assert statistics.median(three_sites.probe_rtts_ms("b-gw0", "a-gw0", 5)) < 100


def test_jitter_spreads_the_rtt_within_its_bounds(three_sites: Sites) -> None:
    three_sites.set_link("a", "b", Link(rtt_ms=40, jitter_ms=5))
    rtts = three_sites.probe_rtts_ms("a-gw0", "b-gw0", PROBES)
    print(f"\nsites: 40 ms ± 5 ms jitter each way: RTTs {min(rtts):.1f}-{max(rtts):.1f} ms")
    assert min(rtts) >= 30  # 40 - 2 x 5: the router is never early
    # 40 + 2 x 5 at most, with the RTT test's slack; a probe or two may meet a busy host.
    assert sorted(rtts)[-3] < 50 * 1.05
    assert max(rtts) - min(rtts) > 2


def connect_error(sites: Sites, src: str, host: str, port: int, timeout_s: float) -> int:
    """0 if ``src`` connects to ``host:port``, else the errno (ETIMEDOUT on a timeout)."""
    with sites.socket(src) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect((host, port))
        except TimeoutError:
            return errno.ETIMEDOUT
        except OSError as exc:
            return exc.errno or -1
        return 0


def listening(sites: Sites, node: str) -> tuple[socket.socket, int]:
    server = sites.socket(node)
    server.bind(("0.0.0.0", 0))
    server.listen(16)
    return server, server.getsockname()[1]


def test_compute_nodes_are_unreachable_from_other_sites_but_reach_their_own(
    three_sites: Sites,
) -> None:
    sites = three_sites
    a_c0, a_c1, b_c0 = sites.node("a-c0"), sites.node("a-c1"), sites.node("b-c0")
    b_gw0, a_gw0 = sites.node("b-gw0"), sites.node("a-gw0")
    assert b_gw0.wan_address is not None
    servers = {name: listening(sites, name) for name in ("a-c1", "a-gw0", "b-c0", "b-gw0")}
    try:
        # Inside site a: LAN timing, every node reaches every other.
        assert connect_error(sites, "a-c0", a_c1.address, servers["a-c1"][1], 2) == 0
        assert connect_error(sites, "a-c0", a_gw0.address, servers["a-gw0"][1], 2) == 0
        # No route off the site: a direct connect fails at once.
        t0 = time.monotonic()
        assert (
            connect_error(sites, "a-c0", b_c0.address, servers["b-c0"][1], 2) == errno.ENETUNREACH
        )
        assert connect_error(sites, "a-c0", b_gw0.wan_address, servers["b-gw0"][1], 2) == (
            errno.ENETUNREACH
        )
        assert connect_error(sites, "b-gw0", a_c0.address, servers["a-gw0"][1], 2) == (
            errno.ENETUNREACH
        )
        assert time.monotonic() - t0 < 1
        # A gateway reaches the other sites' gateways (the only way between sites).
        assert connect_error(sites, "b-gw0", a_gw0.wan_address or "", servers["a-gw0"][1], 2) == 0
        # Even a route added by hand leads nowhere: the router knows no site's LAN.
        route = ["ip", "route", "add", "10.200.0.0/24", "via", "10.201.1.1"]
        assert sites.run("b-gw0", route, capture_output=True).returncode == 0
        try:
            unrouted = sites.statistics().unrouted
            assert connect_error(sites, "b-gw0", a_c1.address, servers["a-c1"][1], 1) == (
                errno.ETIMEDOUT
            )
            assert sites.statistics().unrouted > unrouted
        finally:
            sites.run("b-gw0", ["ip", "route", "del", "10.200.0.0/24"], check=True)
    finally:
        for server, _ in servers.values():
            server.close()


def test_a_cut_passes_no_packet_and_a_heal_lets_a_held_connection_resume(
    three_sites: Sites,
) -> None:
    sites = three_sites
    a_wan = sites.node("a-gw0").wan_address or ""
    server, port = listening(sites, "a-gw0")
    with server, sites.socket("b-gw0") as client:
        client.connect((a_wan, port))
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            client.sendall(b"before")
            assert conn.recv(100) == b"before"
            sites.cut("a", "b")
            before = sites.statistics()
            client.sendall(b"during")
            conn.settimeout(1)
            with pytest.raises(TimeoutError):
                conn.recv(100)
            assert connect_error(sites, "b-gw0", a_wan, port, 1) == errno.ETIMEDOUT
            # The other links are untouched.
            assert connect_error(sites, "c-gw0", a_wan, port, 2) == 0
            after = sites.statistics()
            assert after.direction("b", "a").passed == before.direction("b", "a").passed
            assert after.direction("b", "a").cut > before.direction("b", "a").cut
            sites.heal("a", "b")
            conn.settimeout(10)  # TCP retransmits after its backed-off timeout
            assert conn.recv(100) == b"during"
            assert connect_error(sites, "b-gw0", a_wan, port, 2) == 0


def test_an_isolated_site_reaches_no_other_until_reconnected(three_sites: Sites) -> None:
    sites = three_sites
    sites.isolate("c")
    for other in ("a-gw0", "b-gw0"):
        assert connect_error(sites, "c-gw0", sites.node(other).wan_address or "", 9, 0.5) == (
            errno.ETIMEDOUT
        )
    assert connect_error(sites, "c-c0", sites.node("c-gw0").address, 9, 1) == errno.ECONNREFUSED
    sites.reconnect("c")
    assert connect_error(sites, "c-gw0", sites.node("b-gw0").wan_address or "", 9, 2) == (
        errno.ECONNREFUSED  # reached: nothing listens on port 9
    )


def test_loss_drops_about_the_share_set(three_sites: Sites) -> None:
    sites = three_sites
    sites.set_link("a", "b", Link(rtt_ms=10, loss=0.25))
    sent = 400
    got: set[int] = set()
    with sites.socket("b-gw0", kind=socket.SOCK_DGRAM) as rx:
        rx.bind(("0.0.0.0", 0))
        rx.settimeout(1)
        port = rx.getsockname()[1]

        def receive() -> None:  # as they come: no socket buffer fills up
            with contextlib.suppress(TimeoutError):
                while True:
                    got.add(int.from_bytes(rx.recv(16), "big"))

        before = sites.statistics().direction("a", "b")
        reader = threading.Thread(target=receive)
        reader.start()
        with sites.socket("a-gw0", kind=socket.SOCK_DGRAM) as tx:
            for i in range(sent):
                tx.sendto(i.to_bytes(4, "big"), (sites.node("b-gw0").wan_address, port))
                if i % 20 == 19:
                    time.sleep(0.002)  # no burst beyond the TUN device's queue
        reader.join(30)
    after = sites.statistics().direction("a", "b")
    lost = after.lost - before.lost
    print(f"\nsites: loss 0.25: {sent - len(got)} of {sent} datagrams lost")
    assert lost == sent - len(got)  # every datagram not received was dropped for the loss set
    assert 0.15 < lost / sent < 0.35  # 0.25 ± 4.6 standard deviations


def test_a_bulk_transfer_takes_about_size_over_bandwidth(three_sites: Sites) -> None:
    sites = three_sites
    sites.set_link("a", "b", Link(rtt_ms=20, bandwidth_mbit=8))
    size = 1_000_000
    server, port = listening(sites, "b-gw0")
    received = []

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            n = 0
            while chunk := conn.recv(1 << 16):
                n += len(chunk)
            received.append((n, time.monotonic()))

    with server:
        reader = threading.Thread(target=receive)
        reader.start()
        with sites.socket("a-gw0") as client:
            client.connect((sites.node("b-gw0").wan_address, port))
            t0 = time.monotonic()
            client.sendall(bytes(size))
        reader.join(60)
    n, took = received[0][0], received[0][1] - t0
    ideal = size * 8 / 8e6
    print(f"\nsites: {size} bytes over 8 Mbit/s in {took:.2f} s (payload alone: {ideal:.2f} s)")
    assert n == size
    assert took >= ideal * 0.98  # the payload alone needs that long on the wire
    assert took < ideal * 3  # generous: slow start, headers, a loaded machine


def test_a_process_started_in_a_compute_node_serves_its_site_only(three_sites: Sites) -> None:
    sites = three_sites
    node = sites.node("a-c1")
    server = sites.popen(
        "a-c1",
        [sys.executable, "-m", "http.server", "--bind", node.address, "8000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while connect_error(sites, "a-gw0", node.address, 8000, 1) != 0:
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with sites.socket("a-c0") as sock:
            sock.settimeout(5)
            sock.connect((node.address, 8000))
            sock.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.0 200")
        assert connect_error(sites, "b-gw0", node.address, 8000, 1) == errno.ENETUNREACH
    finally:
        server.terminate()
        server.wait(10)


def test_teardown_leaves_no_namespace_and_no_process() -> None:
    require_sites()
    # A run whose owner is gone (a pid no process can have): its namespace and the process
    # left in it are removed by the next run's start.
    stale = f"{MARKER}-4194305-1-0-x-c0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    topology = Topology(sites=(Site("x", computes=1), Site("y", computes=1, gateways=2)))
    try:
        with emulated_sites(topology) as sites:
            assert not (NETNS_DIR / stale).exists()
            assert orphan.wait(10) == -9
            names = sites.namespaces()
            assert len(names) == 2 + 5 + 1  # two switches, five nodes, the router
            delay = sites.delay_pid
            assert delay is not None
            # One process that stops on SIGTERM, one that ignores it and has left its session.
            sites.popen("x-c0", ["sleep", "600"])
            escape = (
                "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                " os.setsid(); print(os.getpid(), flush=True); time.sleep(600)"
            )
            parent = (
                "import subprocess, sys, time;"
                f" subprocess.Popen([sys.executable, '-c', {escape!r}]); time.sleep(600)"
            )
            shell = sites.popen("y-gw1", [sys.executable, "-c", parent], stdout=subprocess.PIPE)
            assert shell.stdout is not None
            escaped = int(shell.stdout.readline())
            assert set(pids_in(names)) >= {delay, escaped}
        shell.stdout.close()
        assert not [n for n in names if (NETNS_DIR / n).exists()]
        assert not Path(f"/proc/{delay}").exists()
        assert not Path(f"/proc/{escaped}").exists() or _zombie(escaped)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert sites.prefix not in listed
    finally:
        if orphan.poll() is None:
            orphan.kill()
        orphan.wait()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
