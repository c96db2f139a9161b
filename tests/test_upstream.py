"""The upstream pool on real loopback sockets: a reused keep-alive connection the server closed
is detected (peek) or, when trusted as recent, retried once on a fresh connection."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import trio

from fabricnode.sockio import Watchdog
from fabricnode.upstream import Exchange, UpstreamPool

REQUEST = b"POST /v1/x HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}"
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def exchange(pool: UpstreamPool, watchdog: Watchdog, origin: tuple[str, int]) -> bytes:
    ex = Exchange(pool, watchdog, origin)
    await ex.start(REQUEST, connect_timeout_s=5, first_byte_timeout_s=5)
    body = b"".join(ex.take_pieces())
    while not ex.complete:
        await ex.read_more(5)
        body += b"".join(ex.take_pieces())
    ex.finish()
    return body


async def serve_once_per_connection(nursery: trio.Nursery, served: list[int]) -> tuple[str, int]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, _handler(served), listeners)
    host, port = listeners[0].socket.getsockname()[:2]
    return host, port


def _handler(served: list[int]) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """Answers ONE request per connection with keep-alive, then closes it: the server-side
    close of an idle keep-alive connection that pools must survive."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while not data.endswith(b"{}"):
                piece = await stream.receive_some()
                if not piece:
                    return
                data += piece
            served.append(1)
            await stream.send_all(ANSWER)

    return handle


async def test_a_recent_connection_the_server_closed_is_retried_once_fresh() -> None:
    served: list[int] = []
    async with trio.open_nursery() as nursery:
        origin = await serve_once_per_connection(nursery, served)
        pool = UpstreamPool(trust_recent_s=60.0)  # always trusted: no peek
        watchdog = Watchdog(0.05)
        nursery.start_soon(watchdog.run)
        assert await exchange(pool, watchdog, origin) == b"ok"
        await trio.sleep(0.05)  # the server closes its side
        assert await exchange(pool, watchdog, origin) == b"ok"
        stats = pool.statistics()
        assert (stats.reuses, stats.connects, stats.stale_dropped) == (1, 2, 0)
        assert len(served) == 2  # each request processed exactly once
        nursery.cancel_scope.cancel()


async def test_an_older_idle_connection_is_peeked_and_dropped_before_reuse() -> None:
    served: list[int] = []
    async with trio.open_nursery() as nursery:
        origin = await serve_once_per_connection(nursery, served)
        pool = UpstreamPool(trust_recent_s=0.0)  # always peek
        watchdog = Watchdog(0.05)
        nursery.start_soon(watchdog.run)
        assert await exchange(pool, watchdog, origin) == b"ok"
        await trio.sleep(0.05)
        assert await exchange(pool, watchdog, origin) == b"ok"
        stats = pool.statistics()
        assert (stats.reuses, stats.connects, stats.stale_dropped) == (0, 2, 1)
        assert len(served) == 2
        nursery.cancel_scope.cancel()


async def test_connections_idle_past_max_idle_are_not_reused() -> None:
    served: list[int] = []
    async with trio.open_nursery() as nursery:
        origin = await serve_once_per_connection(nursery, served)
        pool = UpstreamPool(max_idle_s=0.01, trust_recent_s=0.0)
        watchdog = Watchdog(0.05)
        nursery.start_soon(watchdog.run)
        # A server that keeps connections open: the pool still retires them by age.
        a, b = socket.socketpair()
        a.setblocking(False)
        pool.release(origin, a)
        await trio.sleep(0.05)
        assert pool.take_idle(origin) is None
        assert pool.statistics().stale_dropped == 1
        b.close()
        nursery.cancel_scope.cancel()
