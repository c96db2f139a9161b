"""UdpTcpTransport on real sockets (127.0.0.1, port 0): datagrams, frames, hostile peers."""

from __future__ import annotations

import random
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity, Verifier
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.service import FRAME_HEADER, GossipService, UdpTcpTransport
from fabricnode.testing.simnet import make_body

TIMEOUT_S = 5.0


@asynccontextmanager
async def running_transports(n: int) -> AsyncIterator[list[UdpTcpTransport]]:
    async with trio.open_nursery() as nursery:
        transports = [await UdpTcpTransport.bind("127.0.0.1", 0, "127.0.0.1") for _ in range(n)]
        for t in transports:
            await nursery.start(t.run)
        yield transports
        nursery.cancel_scope.cancel()


async def nothing_arrives(t: UdpTcpTransport, wait_s: float = 0.3) -> bool:
    with trio.move_on_after(wait_s):
        await t.receive()
        return False
    return True


async def hung_up(stream: trio.SocketStream) -> bool:
    """The peer closed the connection (FIN, or RST because it did not read what we sent)."""
    try:
        return await stream.receive_some(10) == b""
    except trio.BrokenResourceError:
        return True


def port_of(t: UdpTcpTransport) -> int:
    return int(t.local_addr.rsplit(":", 1)[1])


async def test_datagram_and_reliable_frame_travel_between_two_transports() -> None:
    async with running_transports(2) as (a, b):
        assert a.local_addr.startswith("127.0.0.1:") and port_of(a) != 0
        with trio.fail_after(TIMEOUT_S):
            await a.send(b.local_addr, b"ping", False)
            assert await b.receive() == (b"ping", a.local_addr, False)  # UDP source: a's port
            frame = random.Random(1).randbytes(300_000)  # far larger than any datagram
            await a.send(b.local_addr, frame, True)
            assert await b.receive() == (frame, None, True)
            await b.send(a.local_addr, b"pong", False)
            assert await a.receive() == (b"pong", b.local_addr, False)
        sa, sb = a.statistics(), b.statistics()
        assert (sa.datagrams_out, sa.streams_out, sa.send_errors) == (1, 1, 0)
        assert (sb.datagrams_in, sb.streams_in, sb.oversized) == (1, 1, 0)


async def test_oversized_frame_length_is_refused() -> None:
    async with running_transports(2) as (a, b):
        b.max_frame_bytes = 1024
        # A header announcing more than the limit: the listener hangs up without reading on.
        with trio.fail_after(TIMEOUT_S):
            stream = await trio.open_tcp_stream("127.0.0.1", port_of(b))
            async with stream:
                await stream.send_all(FRAME_HEADER.pack(1025) + b"x" * 100)
                assert await hung_up(stream)
            # The same through the transport's own sender.
            await a.send(b.local_addr, b"y" * 2048, True)
            while b.statistics().oversized < 2:
                await trio.sleep(0.01)
        assert await nothing_arrives(b)
        assert b.statistics().streams_in == 0
        # Datagrams over the sender's limit are refused before they reach the socket.
        a.max_datagram_bytes = 100
        await a.send(b.local_addr, b"z" * 101, False)
        assert a.statistics().oversized == 1 and a.statistics().datagrams_out == 0
        # A frame at the limit still passes.
        with trio.fail_after(TIMEOUT_S):
            await a.send(b.local_addr, b"w" * 1024, True)
            assert await b.receive() == (b"w" * 1024, None, True)


async def test_garbage_on_the_tcp_port_does_not_crash_the_listener() -> None:
    async with running_transports(2) as (a, b):
        b.stream_timeout_s = 0.3
        port = port_of(b)
        rng = random.Random(2)
        with trio.fail_after(TIMEOUT_S):
            for payload in (
                rng.randbytes(5000),  # noise (its first 4 bytes are a huge length)
                b"\x00\x00",  # a truncated header
                FRAME_HEADER.pack(100) + b"short",  # a body cut off by the peer hanging up
                b"",  # connect and close at once
            ):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    await stream.send_all(payload)
            # A peer that connects and says nothing is dropped after stream_timeout_s.
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            async with idle:
                assert await hung_up(idle)
            # A peer that resets the connection mid-frame (RST, not FIN).
            rude = await trio.open_tcp_stream("127.0.0.1", port)
            await rude.send_all(FRAME_HEADER.pack(100) + b"partial")
            await trio.sleep(0.05)
            rude.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await rude.aclose()
            # Garbage datagrams are the core's business (it drops what does not open).
            await a.send(b.local_addr, b"\xff" * 10, False)
            assert await b.receive() == (b"\xff" * 10, a.local_addr, False)
            # The listener still serves well-formed frames.
            await a.send(b.local_addr, b"still here", True)
            assert await b.receive() == (b"still here", None, True)
        stats = b.statistics()
        assert stats.streams_in == 1 and stats.stream_errors == 1


async def test_datagrams_to_a_closed_port_do_not_break_the_udp_loop() -> None:
    async with running_transports(2) as (a, b):
        closed = trio.socket.socket(type=socket.SOCK_DGRAM)
        await closed.bind(("127.0.0.1", 0))
        dead_addr = f"127.0.0.1:{closed.getsockname()[1]}"
        closed.close()  # ICMP port unreachable from now on: a crashed peer
        with trio.fail_after(TIMEOUT_S):
            for _ in range(5):
                await a.send(dead_addr, b"anyone?", False)
                await a.send("not-an-address", b"x", False)
            await trio.sleep(0.05)
            await b.send(a.local_addr, b"alive", False)
            assert await a.receive() == (b"alive", b.local_addr, False)
        assert a.statistics().send_errors == 5  # the bad address; the dead peer is silent


async def test_two_gossip_services_over_real_sockets_see_each_other_alive() -> None:
    verifier = Verifier()
    async with running_transports(2) as transports, trio.open_nursery() as nursery:
        cores = []
        for i, t in enumerate(transports):
            identity = Identity.from_seed(b"udp-%d" % i)
            now = time.time()
            core = MeshCore(
                identity,
                Keyring.with_key(b"u" * 32),
                make_body(identity, t.local_addr, now),
                now,
                verifier=verifier,
            )
            cores.append(core)
            if i:
                core.bootstrap([transports[0].local_addr])
            await nursery.start(GossipService(core, t).run)
        a, b = cores
        with trio.fail_after(TIMEOUT_S):
            while not (
                a.liveness(b.self_id) == Liveness.ALIVE
                and b.liveness(a.self_id) == Liveness.ALIVE
                and len(a.registry) == len(b.registry) == 2
            ):
                await trio.sleep(0.02)
        assert a.stats_dropped == {} and b.stats_dropped == {}
        nursery.cancel_scope.cancel()


async def test_unauthenticated_frames_and_connections_are_bounded() -> None:
    """Frames are opened (authenticated) only by the core: before that, at most
    ``max_inbound_streams`` connections may be sending one, and the frames being received or
    waiting may hold at most ``max_frame_bytes_held`` bytes; more is refused, not buffered."""
    async with running_transports(1) as (b,):
        b.max_inbound_streams = 3
        b.max_frame_bytes_held = 1000
        port = port_of(b)
        with trio.fail_after(TIMEOUT_S):
            # Three connections announce 300 bytes each and send half: 900 bytes held.
            slow = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
            for s in slow:
                await s.send_all(FRAME_HEADER.pack(300) + b"x" * 150)
            while b._frame_bytes_held < 900:
                await trio.sleep(0.01)
            # A fourth connection is over the connection bound: closed unread.
            extra = await trio.open_tcp_stream("127.0.0.1", port)
            await extra.send_all(FRAME_HEADER.pack(10) + b"y" * 10)
            assert await hung_up(extra)
            assert b.statistics().streams_refused == 1
            # The slow ones finish: each frame arrives, and its bytes come back once taken.
            for s in slow:
                await s.send_all(b"x" * 150)
                await s.aclose()
            for _ in range(3):
                assert await b.receive() == (b"x" * 300, None, True)
            assert b._frame_bytes_held == 0
            # A frame that would take the held bytes over the bound is refused.
            big = await trio.open_tcp_stream("127.0.0.1", port)
            await big.send_all(FRAME_HEADER.pack(1001))
            assert await hung_up(big)
            assert b.statistics().streams_refused == 2
            assert await nothing_arrives(b)
