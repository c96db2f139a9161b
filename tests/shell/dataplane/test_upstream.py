"""The upstream pool on real loopback sockets: a reused keep-alive connection the server closed
is detected (peek) or, when trusted as recent, retried once on a fresh connection."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import trio

from fabricnode.dataplane.sockio import Watchdog
from fabricnode.dataplane.upstream import Exchange, UpstreamPool

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


Handler = Callable[[trio.SocketStream], Awaitable[None]]


async def serve(nursery: trio.Nursery, handler: Handler) -> tuple[str, int]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, handler, listeners)
    host, port = listeners[0].socket.getsockname()[:2]
    return host, port


def answer_each_request(answer: bytes) -> Handler:
    """Answers every request on a connection with ``answer``, keeping the connection open."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while piece := await stream.receive_some():
                data += piece
                while b"{}" in data:
                    _, _, data = data.partition(b"{}")
                    await stream.send_all(answer)

    return handle


async def test_a_cleanly_ended_exchange_leaves_connection_and_parser_for_the_next() -> None:
    async with trio.open_nursery() as nursery:
        origin = await serve(nursery, answer_each_request(ANSWER))
        pool = UpstreamPool()
        watchdog = Watchdog(0.05)
        first = Exchange(pool, watchdog, origin)
        await first.start(REQUEST, connect_timeout_s=5, first_byte_timeout_s=5)
        assert first.complete and b"".join(first.take_pieces()) == b"ok"
        first.finish()
        second = Exchange(pool, watchdog, origin)
        assert second._parser is first._parser  # reset, not rebuilt
        await second.start(REQUEST, connect_timeout_s=5, first_byte_timeout_s=5)
        assert second.status == 200 and b"".join(second.take_pieces()) == b"ok"
        assert second.content_type == b"" and second.content_length == 2
        second.finish()
        stats = pool.statistics()
        assert (stats.connects, stats.reuses, stats.idle) == (1, 1, 1)
        nursery.cancel_scope.cancel()


async def test_a_response_followed_by_stray_bytes_is_not_pooled() -> None:
    # The start of a second, unasked-for response after the answer: neither the connection
    # nor the parser (in the middle of that message) may serve another request.
    async with trio.open_nursery() as nursery:
        origin = await serve(nursery, answer_each_request(ANSWER + b"HTTP/1.1 200 OK\r\n"))
        pool = UpstreamPool()
        watchdog = Watchdog(0.05)
        assert await exchange(pool, watchdog, origin) == b"ok"
        assert pool.statistics().idle == 0
        fresh = Exchange(pool, watchdog, origin)
        assert fresh._parser.messages == 0 and not fresh._parser.headers
        nursery.cancel_scope.cancel()


async def test_a_body_with_gaps_is_read_piece_by_piece_as_it_arrives() -> None:
    """An engine streaming tokens: each piece is available as soon as it was sent, none waits
    for the next (the reads switch to waiting for readiness first, never to buffering)."""
    go = [trio.Event() for _ in range(3)]

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some()
            await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for i, event in enumerate(go):
                await event.wait()
                await stream.send_all(b"5\r\npiec%d\r\n" % i)
            await stream.send_all(b"0\r\n\r\n")

    async with trio.open_nursery() as nursery:
        origin = await serve(nursery, handle)
        ex = Exchange(UpstreamPool(), Watchdog(0.05), origin)
        await ex.start(REQUEST, connect_timeout_s=5, first_byte_timeout_s=5)
        assert ex.chunked and not ex.take_pieces()
        for i, event in enumerate(go):
            event.set()
            with trio.fail_after(5):
                while not (pieces := ex.take_pieces()):
                    await ex.read_more(5)
            assert pieces == [b"piec%d" % i]
        with trio.fail_after(5):
            while not ex.complete:
                await ex.read_more(5)
        ex.finish()
        nursery.cancel_scope.cancel()


async def test_while_waiting_runs_once_the_request_is_sent_and_before_the_answer() -> None:
    """The owner's deferred work (Ingress.settle) runs in the wait for the engine's answer: the
    server here answers only after that work ran, so calling it before the request went out,
    or after the answer came, or not at all, would hang the exchange."""
    ran = trio.Event()
    calls: list[int] = []

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while not data.endswith(b"{}"):
                data += await stream.receive_some()
            await ran.wait()
            await stream.send_all(ANSWER)

    def idle_work() -> None:
        calls.append(1)
        ran.set()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            nursery.start_soon(trio.serve_listeners, handle, listeners)
            origin = listeners[0].socket.getsockname()[:2]
            pool = UpstreamPool()
            pool.while_waiting = idle_work
            watchdog = Watchdog(0.05)
            nursery.start_soon(watchdog.run)
            assert await exchange(pool, watchdog, origin) == b"ok"
            assert calls == [1]
            nursery.cancel_scope.cancel()
