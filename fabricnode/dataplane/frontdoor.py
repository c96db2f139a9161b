"""The client side of the ingress: accepting connections and reading their requests.

One task per client connection, none per request: requests on a connection are answered in
order (pipelined ones queue in the parser, ``http1.RequestParser``), each handed to the
ingress's dispatch (``answer``: ``Ingress._handle``, called as a plain function that returns
the coroutine answering the request; no level of ``await`` is added). What is refused here,
before any request reaches the ingress: a connection over ``max_connections`` or the client's
``max_connections_per_client`` (closed at once), malformed HTTP and the limits of the parser
(400, 413, 431: answered, then the rest of the body is drained for a moment, ``linger``), and
a request whose head already shows it will get 401 (no body is read for it). An
``Expect: 100-continue`` gets its interim answer once the head passed those checks.

A connection a peer site's gateway opened over the federation port (``adopt``) is served the
same way, each request marked with ``sites.FROM_SITE_HEADER`` (the site the link authenticated);
that header is deleted from every other connection's requests, so no client can set it.

Deadlines, kept by the watchdog (``sockio.Watchdog``): a request that started has
``request_timeout_s`` to arrive whole; between requests a connection idles for
``keepalive_timeout_s``, or ``busy_keepalive_s`` while more than ``busy_connections`` are open;
none while the ingress answers. Whatever fails inside one connection is counted and logged
(throttled) and ends that connection only.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import trio

from fabricnode.dataplane.apikeys import ApiKeyStore
from fabricnode.dataplane.clientconn import ClientConn, ClientGone, linger, send_error
from fabricnode.dataplane.endpoints import ENDPOINTS
from fabricnode.dataplane.forward_auth import HEADER as FORWARD_HEADER
from fabricnode.dataplane.http1 import CONTINUE_RESPONSE, BodyBudget, Request, RequestParser
from fabricnode.dataplane.ingress_config import IngressConfig
from fabricnode.dataplane.metrics import IngressMetrics
from fabricnode.dataplane.request import KEY_REJECTION, key_of, malformed_code
from fabricnode.dataplane.sites import FROM_SITE_HEADER
from fabricnode.dataplane.sockio import LoopClock, Reactor, SocketClosed, Watchdog, Watched
from fabricnode.dataplane.tiers import OWNER_HEADER
from fabricnode.logs import ThrottledErrors

log = logging.getLogger("fabricnode.dataplane.frontdoor")

# How the ingress answers one request: the coroutine that answers it (False closes the
# connection).
Answer = Callable[[ClientConn, Request], Coroutine[Any, Any, bool]]


class FrontDoor:
    """The ingress's client connections (see the module docstring)."""

    def __init__(
        self,
        *,
        config: IngressConfig,
        clock: LoopClock,
        reactor: Reactor,
        watchdog: Watchdog,
        metrics: IngressMetrics,
        api_keys: ApiKeyStore | None,
        answer: Answer,
    ) -> None:
        self.config = config
        self.clock = clock
        self.reactor = reactor
        self.watchdog = watchdog
        self.metrics = metrics
        self.api_keys = api_keys
        self.answer = answer
        # At least one whole request of the largest size allowed must fit.
        self.body_budget = BodyBudget(max(config.max_buffered_body_bytes, config.max_body_bytes))
        self.connections = 0
        self.conns: set[ClientConn] = set()
        self._per_client: dict[str, int] = {}  # client address -> open connections
        self._internal_errors = ThrottledErrors(
            log, "a connection failed on an unexpected error (%d since the last report)"
        )

    def close_all(self) -> None:
        """At shutdown: each connection finishes the request it is answering, then closes; one
        idle between requests closes now."""
        for conn in list(self.conns):
            conn.closing = True
            if conn.watch.deadline != math.inf:  # idle between requests
                self.reactor.close(conn.sock)

    async def accept_loop(
        self, sock: socket.socket, nursery: trio.Nursery, scope: trio.CancelScope
    ) -> None:
        with scope:
            while True:
                try:
                    client, addr = sock.accept()
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(sock)
                    continue
                except OSError as exc:  # EMFILE and friends: back off, do not spin
                    log.warning("accept failed: %s", exc)
                    await trio.sleep(0.1)
                    continue
                cfg = self.config
                peer = str(addr[0]) if isinstance(addr, tuple) else ""
                held = self._per_client.get(peer, 0)
                if self.connections >= cfg.max_connections:
                    self.metrics.connections_refused.labels("total").inc()
                    client.close()
                    continue
                if held >= cfg.max_connections_per_client:
                    self.metrics.connections_refused.labels("per_client").inc()
                    client.close()
                    continue
                self._per_client[peer] = held + 1
                client.setblocking(False)
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.reactor.register(client)
                nursery.start_soon(self._connection, client, peer)

    def adopt(self, sock: socket.socket, site: str, nursery: trio.Nursery) -> bool:
        """Serve a connection from a peer site's gateway (``Ingress.serve_remote``): within
        the same limits as any client's, each request marked with ``FROM_SITE_HEADER``."""
        cfg = self.config
        peer = "site:" + site
        held = self._per_client.get(peer, 0)
        if self.connections >= cfg.max_connections or held >= cfg.max_connections_per_client:
            self.metrics.connections_refused.labels("total").inc()
            return False
        self._per_client[peer] = held + 1
        sock.setblocking(False)
        self.reactor.register(sock)
        nursery.start_soon(self._connection, sock, peer, site.encode())
        return True

    async def _connection(self, sock: socket.socket, peer: str = "", site: bytes = b"") -> None:
        cfg = self.config
        busy = self.connections >= cfg.busy_connections
        watch = Watched(
            sock, self.clock.now() + (cfg.busy_keepalive_s if busy else cfg.keepalive_timeout_s)
        )
        conn = ClientConn(sock, watch, self.reactor)
        self.conns.add(conn)
        self.watchdog.watched.add(watch)
        self.connections += 1
        parser = RequestParser(
            max_head_bytes=cfg.max_head_bytes,
            max_headers=cfg.max_headers,
            max_body_bytes=cfg.max_body_bytes,
            budget=self.body_budget,
        )
        reactor = self.reactor
        sent_continue = False
        answered = False  # a response just went out: the client's next bytes are not here yet
        try:
            while not conn.closing:
                if parser.ready:
                    req = parser.ready.popleft()
                    # The mark of a request from a peer site: set on the link's connections
                    # only, never taken from a client (``sites``).
                    if site:
                        req.headers[FROM_SITE_HEADER] = site
                    elif FROM_SITE_HEADER in req.headers:
                        del req.headers[FROM_SITE_HEADER]
                    watch.deadline = math.inf  # our turn: no client timeout while we answer
                    reactor.request_started()
                    try:
                        keep = await self.answer(conn, req)
                    finally:
                        reactor.request_ended()
                        parser.answered(req)
                    if not keep or not req.keep_alive:
                        break
                    sent_continue = False
                    answered = True
                    if parser.mid_request:
                        idle_s = cfg.request_timeout_s
                    elif self.connections > cfg.busy_connections:
                        idle_s = cfg.busy_keepalive_s  # many held: idle ones make room sooner
                    else:
                        idle_s = cfg.keepalive_timeout_s
                    watch.deadline = self.clock.now() + idle_s
                    continue
                if parser.error is not None:
                    status, message = parser.error
                    self.metrics.malformed.labels(str(status)).inc()
                    code = malformed_code(status)
                    pending = parser.pending
                    path = pending.path if pending is not None else b""
                    await send_error(conn, status, message, code, close=True, path=path)
                    await linger(conn, cfg.linger_s, cfg.linger_max_bytes)
                    break
                if parser.head_complete and not sent_continue:
                    pending = parser.pending
                    if pending is not None and not site and self._refused_by_head(pending):
                        # Checked from the head: a request that will be refused sends no body.
                        self.metrics.malformed.labels("401").inc()
                        await send_error(
                            conn,
                            KEY_REJECTION.status,
                            KEY_REJECTION.message,
                            KEY_REJECTION.code,
                            close=True,
                            path=pending.path,
                        )
                        await linger(conn, cfg.linger_s, cfg.linger_max_bytes)
                        break
                    if pending is not None and pending.expect_continue:
                        await reactor.send_all(sock, CONTINUE_RESPONSE)
                    sent_continue = True
                data: bytes | None = None
                if answered and not parser.mid_request:
                    # A closed-loop client sends its next request only after reading our
                    # answer: wait for it instead of trying a read that would fail.
                    answered = False
                    try:
                        await reactor.wait_readable(sock)
                    except (trio.ClosedResourceError, OSError):
                        break  # closed by the watchdog (keep-alive timeout) or at shutdown
                    data = reactor.try_recv(sock)
                if data is None:
                    data = await reactor.recv_some(sock)
                if not data:
                    break  # the client closed or half-closed (the same FIN: a hang-up; a
                    # request it did not finish sending cannot be answered anyway)
                was_mid = parser.mid_request
                parser.feed(data)
                if not was_mid and parser.mid_request and not parser.ready:
                    # A request started and is incomplete: it has request_timeout_s to arrive
                    # (a request that came whole is answered at once and needs no deadline).
                    watch.deadline = self.clock.now() + cfg.request_timeout_s
        except (SocketClosed, ClientGone):
            pass
        except Exception:
            # The error boundary: whatever a client, a node or an engine sent, one connection
            # failing must not end the agent (the nursery would cancel every connection).
            self.metrics.internal_errors.inc()
            self._internal_errors.exception(self.clock.now())
        finally:
            parser.release()
            self.watchdog.watched.discard(watch)
            self.conns.discard(conn)
            self.connections -= 1
            left = self._per_client.get(peer, 1) - 1
            if left > 0:
                self._per_client[peer] = left
            else:
                self._per_client.pop(peer, None)
            reactor.close(sock)

    def _refused_by_head(self, req: Request) -> bool:
        """A ``/v1`` (or other model-routed) request whose head already shows it will get 401:
        API keys are on and it names no valid key (a forward is authenticated by its own header
        instead)."""
        keys = self.api_keys
        if keys is None or not keys.enabled:
            return False
        path = req.path
        if not path.startswith(b"/v1/") and path not in ENDPOINTS:
            return False
        if FORWARD_HEADER in req.headers or OWNER_HEADER in req.headers:
            return False  # checked with the body: its own HMAC, or the batch owner's token
        return key_of(req.headers, keys) is None
