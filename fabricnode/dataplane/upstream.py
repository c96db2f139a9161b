"""Pooled keep-alive HTTP/1.1 connections from the data plane to agents and engines.

One LIFO idle list per origin: the most recently used connection is the one most likely still
open and warm. A pooled connection idle longer than ``trust_recent_s`` is checked before reuse (a
non-blocking peek: a server that closed an idle connection shows EOF) and dropped once idle
longer than ``max_idle_s`` — uvicorn
(vLLM) and hypercorn close idle connections after 5 s, so reusing an older one would race the
server's close.

``Exchange`` sends one request and parses its response with ``http1.ResponseParser``. A reused
connection that fails before any response byte arrived is retried once on a fresh connection
(the server closed it between our peek and our send; it cannot have processed the request).
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools
import trio

from fabricnode.dataplane import failure
from fabricnode.dataplane.clientconn import ClientGone
from fabricnode.dataplane.http1 import ResponseParser
from fabricnode.dataplane.sockio import (
    CLIENT_GONE,
    LoopClock,
    Reactor,
    SocketClosed,
    Watchdog,
    Watched,
    connect,
    peer_closed,
    try_send,
)

Origin = tuple[str, int]
SITE_ORIGIN_PREFIX = "site:"  # sites.SITE_ORIGIN_PREFIX (sites imports routetable, not us)


@dataclass(frozen=True)
class PoolStatistics:
    connects: int
    reuses: int
    stale_dropped: int
    idle: int


class UpstreamPool:
    def __init__(
        self,
        *,
        max_idle_per_origin: int = 256,
        max_idle_s: float = 4.0,
        trust_recent_s: float = 0.5,
        clock: LoopClock | None = None,
        reactor: Reactor | None = None,
    ) -> None:
        self.clock = clock if clock is not None else LoopClock()
        # Pooled connections are registered here once, when they connect.
        self.reactor = reactor if reactor is not None else Reactor()
        # Work to do while a sent request is being answered (the owner's deferred bookkeeping):
        # the engine is busy with the request then, and this task would only wait.
        self.while_waiting: Callable[[], None] | None = None
        # Dials a peer site's gateway through the federation link (a gateway's agent sets it):
        # origins whose host starts with ``SITE_ORIGIN_PREFIX`` (``sites.site_origin``) are
        # connected by it, the others by TCP. It returns a connected non-blocking socket whose
        # bytes the link carries over TLS, or raises ``OSError``.
        self.dialer: Callable[[Origin], Awaitable[socket.socket]] | None = None
        self.max_idle_per_origin = max_idle_per_origin
        self.max_idle_s = max_idle_s
        self.trust_recent_s = trust_recent_s
        self._idle: dict[Origin, list[tuple[socket.socket, float]]] = {}
        self._parsers: list[ResponseParser] = []  # spare parsers of cleanly ended exchanges
        self.connects = 0
        self.reuses = 0
        self.stale_dropped = 0

    def statistics(self) -> PoolStatistics:
        idle = sum(len(v) for v in self._idle.values())
        return PoolStatistics(self.connects, self.reuses, self.stale_dropped, idle)

    def take_idle(self, origin: Origin, now: float | None = None) -> socket.socket | None:
        """The most recently released open connection to ``origin`` (``now``: trio time)."""
        idle = self._idle.get(origin)
        if not idle:
            return None
        if now is None:
            now = self.clock.now()
        oldest_ok = now - self.max_idle_s
        recent = now - self.trust_recent_s
        while idle:
            sock, since = idle.pop()
            # A connection that answered a moment ago skips the peek (a system call per
            # request): servers close idle keep-alive connections after seconds, and a close
            # that races us anyway is caught as stale and retried.
            if since >= recent or (since >= oldest_ok and not peer_closed(sock)):
                self.reuses += 1
                return sock
            self.stale_dropped += 1
            self.reactor.close(sock)
        return None

    async def new_connection(self, origin: Origin) -> socket.socket:
        if origin[0].startswith(SITE_ORIGIN_PREFIX):
            dialer = self.dialer
            if dialer is None:
                raise OSError("this agent is not a gateway: no link to other sites")
            sock = await dialer(origin)
        else:
            sock = await connect(origin[0], origin[1])
        self.reactor.register(sock)
        self.connects += 1
        return sock

    def release(self, origin: Origin, sock: socket.socket) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self.max_idle_per_origin:
            self.reactor.close(sock)
            return
        idle.append((sock, self.clock.now()))

    def parser(self, on_body: Callable[[bytes], None]) -> ResponseParser:
        """A response parser (a spare one when there is one)."""
        if self._parsers:
            parser = self._parsers.pop()
            parser.reset(on_body)
            return parser
        return ResponseParser(on_body)

    def spare_parser(self, parser: ResponseParser) -> None:
        """Keep the parser of an exchange that ended cleanly for the next one."""
        if len(self._parsers) < self.max_idle_per_origin:
            parser.on_body_cb = None
            self._parsers.append(parser)

    def close_origin(self, origin: Origin) -> None:
        for sock, _ in self._idle.pop(origin, []):
            self.reactor.close(sock)

    def close_all(self) -> None:
        for origin in list(self._idle):
            self.close_origin(origin)


class UpstreamError(Exception):
    """The exchange failed before a complete response head arrived (safe to fail over); its
    ``kind`` is one of ``failure``'s (what the failure says, for the callers that ask)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class BrokenResponse(Exception):
    """The upstream connection broke after the response had started."""


class Exchange:
    """One request on a pooled connection; read the head, then pull body pieces.

    Timeouts are deadlines on the watchdog: ``connect_timeout_s`` to connect,
    ``first_byte_timeout_s`` until the response head, ``idle_timeout_s`` between body reads.
    ``still_wanted`` is checked by the watchdog while we wait for the head (a node that went
    DOWN or dead: give up on it and fail over). ``client`` is the connection of the client we
    answer: when it goes away the watchdog closes ours, so the engine aborts the request, and
    the wait raises ``ClientGone`` (never a reason to fail over).
    """

    __slots__ = ("_gaps", "_parser", "_pieces", "origin", "pool", "sock", "watch", "watchdog")

    def __init__(self, pool: UpstreamPool, watchdog: Watchdog, origin: Origin) -> None:
        self.pool = pool
        self.watchdog = watchdog
        self.origin = origin
        self.sock: socket.socket | None = None
        self.watch: Watched | None = None
        self._pieces: list[bytes] = []
        self._parser = pool.parser(self._pieces.append)
        self._gaps = False  # a body read found nothing yet: wait before the next ones

    @property
    def status(self) -> int:
        return self._parser.status

    @property
    def chunked(self) -> bool:
        return self._parser.chunked

    @property
    def content_length(self) -> int | None:
        return self._parser.content_length

    @property
    def end_to_end(self) -> bytes:
        """The response's header lines a proxy passes on (``ResponseParser.end_to_end``)."""
        return self._parser.end_to_end

    @property
    def content_type(self) -> bytes:
        """The first Content-Type header's value (b"" if none)."""
        return self._parser.content_type

    @property
    def fabric_node(self) -> bytes:
        """The ``X-Fabric-Node`` the upstream named (an agent's answer; b"" from an engine)."""
        return self._parser.fabric_node

    @property
    def fabric_site(self) -> bytes:
        """The ``X-Fabric-Site`` the upstream named (a cross-site answer; b"" otherwise)."""
        return self._parser.fabric_site

    @property
    def complete(self) -> bool:
        return self._parser.complete

    @property
    def bodiless(self) -> bool:
        """A 204 or 304: the response ends with its head."""
        return self._parser.bodiless

    async def start(
        self,
        request: bytes,
        *,
        connect_timeout_s: float,
        first_byte_timeout_s: float,
        still_wanted: Callable[[], bool] | None = None,
        now: float | None = None,
        client: socket.socket | None = None,
    ) -> None:
        """Send ``request`` and wait for the response head (``UpstreamError`` if none).

        ``now`` (trio time, read by the caller a moment ago) saves reading the clock again.
        """
        if now is None:
            now = self.pool.clock.now()
        sock = self.pool.take_idle(self.origin, now)
        reused = sock is not None
        parser = self._parser
        reactor = self.pool.reactor
        # One coroutine for the whole hot path (no helper per attempt or per read): each level
        # of ``await`` costs twice per wait.
        while True:
            if sock is None:
                sock = await self._connect(connect_timeout_s)
            self.sock = sock
            self.watch = watch = Watched(sock, now + first_byte_timeout_s, still_wanted)
            watch.client = client
            self.watchdog.watched.add(watch)
            try:
                try:
                    sent = try_send(sock, request)
                    if sent < len(request):
                        await reactor.send_all(sock, memoryview(request)[sent:])
                    idle_work = self.pool.while_waiting
                    if idle_work is not None:
                        idle_work()
                    # The answer cannot be there yet: wait for it rather than try a read that
                    # would fail (a system call and an exception).
                    await reactor.wait_readable(sock)
                    data = reactor.try_recv(sock)
                    while True:
                        if data is None:
                            data = await reactor.recv_some(sock)
                        if not data:
                            if reused and not parser.headers and parser.status == 0:
                                raise _Stale
                            raise UpstreamError(
                                "connection closed before the response head", failure.BROKEN
                            )
                        reused = False  # bytes arrived: this is the real answer, no retry
                        try:
                            parser.feed(data)
                        except httptools.HttpParserError as exc:
                            raise UpstreamError(
                                f"malformed response: {exc}", failure.MALFORMED
                            ) from None
                        if parser.head_complete:
                            break
                        data = None
                except (SocketClosed, trio.ClosedResourceError, OSError) as exc:
                    if watch.expired:
                        expired = watch.expired
                        if expired == CLIENT_GONE:
                            raise ClientGone from None
                        if expired == "timeout":
                            raise UpstreamError("no response", failure.NO_RESPONSE) from None
                        if expired == failure.HANDED_OVER:
                            raise UpstreamError(expired, failure.LEAVING) from None
                        raise UpstreamError("node or engine went down", failure.DOWN) from None
                    if reused:
                        raise _Stale from None
                    raise UpstreamError(f"connection failed: {exc}", failure.BROKEN) from None
            except _Stale:
                # A reused connection the server had closed: retry once on a fresh one (only
                # reused connections raise this, so the retry cannot loop).
                self._drop()
                sock, reused, now = None, False, self.pool.clock.now()
                continue
            except BaseException:
                self._drop()
                raise
            watch.still_wanted = None
            return

    async def _connect(self, connect_timeout_s: float) -> socket.socket:
        # Only new connections pay for a timeout scope; the hot path reuses pooled ones.
        sock = None
        with trio.move_on_after(connect_timeout_s):
            try:
                sock = await self.pool.new_connection(self.origin)
            except OSError as exc:
                raise UpstreamError(
                    f"cannot connect: {exc.strerror or exc}", failure.REFUSED
                ) from None
        if sock is None:
            raise UpstreamError("connect timed out", failure.CONNECT_TIMEOUT)
        return sock

    def take_pieces(self) -> list[bytes]:
        """Body pieces parsed so far (decoded: chunked framing removed)."""
        pieces = self._pieces[:]
        self._pieces.clear()
        return pieces

    async def read_more(self, idle_timeout_s: float) -> None:
        """Read and parse more of the body (``BrokenResponse`` if the connection broke)."""
        sock, watch = self.sock, self.watch
        assert sock is not None and watch is not None
        watch.deadline = self.pool.clock.now() + idle_timeout_s
        try:
            # Read at once while the body comes back to back; once a read found nothing (an
            # engine streaming tokens), wait for readiness first: the next piece is not there.
            reactor = self.pool.reactor
            data = None if self._gaps else reactor.try_recv(sock)
            if data is None:
                self._gaps = True
                data = await reactor.recv_later(sock)
        except SocketClosed as exc:
            if watch.expired == CLIENT_GONE:
                raise ClientGone from None
            raise BrokenResponse(watch.expired or str(exc)) from None
        if not data:
            raise BrokenResponse("upstream closed the connection mid-response")
        try:
            self._parser.feed(data)
        except httptools.HttpParserError as exc:
            raise BrokenResponse(f"malformed response body: {exc}") from None

    def finish(self) -> None:
        """Return the connection to the pool if the response ended cleanly, else close it."""
        sock, watch = self.sock, self.watch
        self.sock = None
        if watch is not None:
            self.watchdog.watched.discard(watch)
        if sock is None:
            return
        parser = self._parser
        if parser.reusable and not (watch and watch.expired):
            self.pool.release(self.origin, sock)
            self.pool.spare_parser(parser)
        else:
            self.pool.reactor.close(sock)

    def _drop(self) -> None:
        sock, watch = self.sock, self.watch
        self.sock = None
        if watch is not None:
            self.watchdog.watched.discard(watch)
        if sock is not None:
            self.pool.reactor.close(sock)


class _Stale(Exception):
    """A reused pooled connection turned out to be closed: retry on a fresh one."""
