"""The ``/v1`` data plane: every agent's OpenAI-compatible ingress, on trio + httptools.

    client ──HTTP/1.1──► Ingress (this agent) ──pooled keep-alive──► serving agent ──► engine
                          parse (httptools), read only          (X-Fabric-Forward: HMAC
                          the routing fields, filter,            with the cluster key)
                          policy, fail over before the
                          first byte, relay unbuffered

One task per client connection, none per request; requests on a connection are handled in
order (pipelined ones queue in the parser). Bodies are forwarded as received, never
re-encoded: the body is parsed once (orjson) only to read ``model``, ``stream`` and the prompt
for cache-aware routing. Responses are relayed piece by piece as they arrive.

Paths outside ``/v1/`` go to the agent's ASGI control app (``admin.AdminApp``) through a small
inline adapter, so one public port serves both (SPEC). With ``--admin`` that app is also served
on its own port by hypercorn.

Request outcomes (OpenAI error shape ``{"error": {"message", "type", "code"}}``):

* 400 malformed HTTP, JSON, ``model`` or a bad ``X-Fabric-*`` header; 401 missing/unknown API
  key (only when a keys file exists); 403 forward header that does not verify; 404 unknown
  path or a model no SERVING node announces; 405 wrong method; 413 body over
  ``max_body_bytes``; 429 rate limited (``Retry-After``); 431 header block too large; 503 no
  eligible node, or every attempt failed before the first byte (``Retry-After``).
* Failover: a connection error, a timeout before the response head, or a 502/503/504 answer is
  retried on the next candidate, at most ``max_attempts`` nodes within ``retry_budget_s``; the
  failed node is ejected by the circuit breaker. Once the first byte went to the client nothing
  is retried: a broken SSE stream ends with a well-formed ``data: {"error": ...}`` event and the
  terminating chunk; any other broken body closes the connection.
* Served locally (this agent's own engine, chosen by the policy or asked by a verified
  forward): counted in ``local_inflight``, which the engine service publishes as the node's
  ``inflight`` load. While leaving, forwards are refused with 503 so the ingress fails over.
"""

from __future__ import annotations

import logging
import math
import random
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

import orjson
import trio

from fabricnode.dataplane import routing
from fabricnode.dataplane.accounting import RequestLog, StreamUsage, UsageLedger, usage_from_json
from fabricnode.dataplane.apikeys import ApiKey, ApiKeyStore, RateLimiter
from fabricnode.dataplane.forward_auth import HEADER as FORWARD_HEADER
from fabricnode.dataplane.forward_auth import ForwardRejected, ForwardVerifier, sign_forward
from fabricnode.dataplane.http1 import (
    CONTINUE_RESPONSE,
    HOP_RESPONSE_HEADERS,
    Request,
    RequestParser,
    full_response,
    status_line,
)
from fabricnode.dataplane.http1 import response_head as build_head
from fabricnode.dataplane.ingress_config import IngressConfig
from fabricnode.dataplane.metrics import IngressMetrics, LabelCache
from fabricnode.dataplane.routetable import CircuitBreaker, Origin, Route, RouteTable
from fabricnode.dataplane.sockio import (
    LoopClock,
    Reactor,
    SocketClosed,
    Watchdog,
    Watched,
    close,
    try_send,
)
from fabricnode.dataplane.upstream import BrokenResponse, Exchange, UpstreamError, UpstreamPool
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import State

log = logging.getLogger("fabricnode.dataplane.ingress")

ENDPOINTS = {
    b"/v1/chat/completions": "chat",
    b"/v1/completions": "completions",
    b"/v1/embeddings": "embeddings",
}
RETRYABLE_STATUS = (502, 503, 504)
# Request headers passed on to the upstream (anything else stays at the ingress).
FORWARDED_REQUEST_HEADERS = (b"accept", b"x-request-id", b"openai-organization")
JSON = b"application/json"
SSE = b"text/event-stream"
# Answered requests whose bookkeeping waits (see Ingress.settle): how many, and how long.
MAX_UNSETTLED = 256
SETTLE_INTERVAL_S = 0.5

AsgiApp = Callable[[Mapping[str, Any], Any, Any], Awaitable[None]]


@dataclass
class IngressStatistics:
    connections: int
    requests: int
    local_inflight: int
    remote_inflight: int
    retries: int
    ejections: int
    broken_streams: int
    watchdog_expired: int
    pool_connects: int
    pool_reuses: int
    route_rebuilds: int


class _Conn:
    """One client connection."""

    __slots__ = ("closing", "reactor", "sock", "watch")

    def __init__(self, sock: socket.socket, watch: Watched, reactor: Reactor) -> None:
        self.sock = sock
        self.watch = watch
        self.reactor = reactor  # the one its socket is registered with
        self.closing = False


class _Job:
    """What the data plane knows of one routed request.

    A plain class, not a dataclass: one is made per request, and the compiled data plane
    runs a plain class's ``__init__`` natively (a dataclass's generated one stays interpreted).
    """

    __slots__ = (
        "body",
        "candidates",
        "close",
        "completion_tokens",
        "doc",
        "ended",
        "headers",
        "http10",
        "key",
        "kind",
        "model",
        "path",
        "prompt_tokens",
        "response",
        "response_sse",
        "served_by",
        "started",
        "status",
        "stream",
        "ttft_s",
    )

    def __init__(
        self,
        kind: str,
        model: str,
        stream: bool,
        body: bytes,
        path: bytes,
        headers: Mapping[bytes, bytes],
        key: ApiKey | None,
        started: float,
        doc: dict[str, Any] | None = None,
    ) -> None:
        self.kind = kind
        self.model = model
        self.stream = stream
        self.body = body
        self.path = path
        self.headers = headers
        self.key = key
        self.started = started
        # The parsed body: the request log's fields are read from it once the answer is out.
        self.doc = doc
        self.http10 = False  # an HTTP/1.0 client: no chunked coding, the body ends at close
        self.close = False  # the client connection must close after this response
        self.served_by = ""
        self.status = 0
        self.ttft_s: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        # Set when the answer is out; the rest of the bookkeeping waits for ``Ingress.settle``.
        self.ended = 0.0
        self.candidates = -1  # eligible nodes for the first attempt (-1: not routed)
        # A whole response body whose usage is read at settling (None: nothing to read).
        self.response: list[bytes] | None = None
        self.response_sse = False


class ClientGone(Exception):
    """The client went away while we were answering it."""


class Ingress:
    def __init__(
        self,
        core: MeshCore,
        *,
        config: IngressConfig | None = None,
        wall_clock: Callable[[], float],
        serving_engine_url: Callable[[], str | None] = lambda: None,
        control_app: AsgiApp | None = None,
        api_keys: ApiKeyStore | None = None,
        request_log: RequestLog | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.core = core
        self.config = cfg = config or IngressConfig()
        self.wall_clock = wall_clock
        # Our own engine's URL while it is serving (None otherwise): one call per request.
        self.serving_engine_url = serving_engine_url
        self.control_app = control_app
        self.api_keys = api_keys
        self.rate_limiter = RateLimiter()
        self.request_log = request_log
        self.ledger = UsageLedger()
        self._finished: deque[_Job] = deque()  # answered, not yet settled (see settle)
        self.table = RouteTable(core, wall_clock)
        self.policy = routing.make_policy(cfg.policy, rng=rng or random.Random())
        self.breaker = CircuitBreaker(base_s=cfg.eject_base_s, max_s=cfg.eject_max_s)
        # Bound to the trio run's clock when serving starts (see LoopClock).
        self.clock = LoopClock()
        # Every data-plane socket (clients, upstreams) waits through this one reactor.
        self.reactor = Reactor()
        self.reactor.batching = False  # until requests overlap (Reactor.request_started)
        self._parks_reported = 0  # reactor waits already added to the metrics
        self.pool = UpstreamPool(clock=self.clock, reactor=self.reactor)
        self.pool.while_waiting = self.settle
        self.watchdog = Watchdog(cfg.watchdog_interval_s, self.reactor)
        self.watchdog.clock = self.clock
        self.forwards = ForwardVerifier(core.keyring, max_skew_s=cfg.forward_max_skew_s)
        self.metrics = IngressMetrics()
        self._forwards_served = LabelCache(self.metrics.forwards_served)
        self.remote_inflight: dict[str, int] = {}  # session id -> our requests in flight to it
        self.local_inflight = 0  # requests in flight to our own engine
        self.leaving = False  # refuse forwards (503) so ingresses fail over
        self.connections = 0
        self.requests = 0
        self.retries = 0
        self.broken_streams = 0
        self._holders = 0
        self._released = trio.Event()
        self._local_idle: trio.Event | None = None  # for wait_local_idle, made on demand
        self._local_origin_cache: tuple[str, Origin] | None = None
        self._conns: set[_Conn] = set()
        self._accepting = True

    # == statistics ==========================================================================

    def statistics(self) -> IngressStatistics:
        pool = self.pool.statistics()
        return IngressStatistics(
            connections=self.connections,
            requests=self.requests,
            local_inflight=self.local_inflight,
            remote_inflight=sum(self.remote_inflight.values()),
            retries=self.retries,
            ejections=self.breaker.ejections,
            broken_streams=self.broken_streams,
            watchdog_expired=self.watchdog.expired_total,
            pool_connects=pool.connects,
            pool_reuses=pool.reuses,
            route_rebuilds=self.table.rebuilds,
        )

    def render_metrics(self) -> bytes:
        self.settle()
        m = self.metrics
        m.inflight.labels("ingress").set(sum(self.remote_inflight.values()))
        m.inflight.labels("local").set(self.local_inflight)
        m.connections.set(self.connections)
        parks = self.reactor.parks
        m.reactor_waits.inc(parks - self._parks_reported)
        self._parks_reported = parks
        return m.render()

    # == serving =============================================================================

    async def serve(
        self,
        sock: socket.socket,
        shutdown: trio.Event,
        grace_s: float,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on a bound socket until ``shutdown``; then let requests finish for ``grace_s``."""
        self.clock.bind()
        sock.setblocking(False)
        sock.listen(1024)
        async with trio.open_nursery() as nursery:
            await nursery.start(self.reactor.run)
            await nursery.start(self.watchdog.run)
            nursery.start_soon(self._settle_loop)
            async with trio.open_nursery() as conn_nursery:
                accept_scope = trio.CancelScope()
                conn_nursery.start_soon(self._accept_loop, sock, conn_nursery, accept_scope)
                task_status.started()
                await shutdown.wait()
                self._accepting = False
                accept_scope.cancel()
                close(sock)
                for conn in list(self._conns):
                    conn.closing = True  # finish the current request, then close
                    if conn.watch.deadline != math.inf:  # idle between requests: close now
                        self.reactor.close(conn.sock)
                with trio.move_on_after(grace_s):
                    while self._conns:
                        await trio.sleep(0.05)
                conn_nursery.cancel_scope.cancel()
            self.pool.close_all()
            self.settle()
            nursery.cancel_scope.cancel()

    async def _accept_loop(
        self, sock: socket.socket, nursery: trio.Nursery, scope: trio.CancelScope
    ) -> None:
        with scope:
            while True:
                try:
                    client, _ = sock.accept()
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(sock)
                    continue
                except OSError as exc:  # EMFILE and friends: back off, do not spin
                    log.warning("accept failed: %s", exc)
                    await trio.sleep(0.1)
                    continue
                if self.connections >= self.config.max_connections:
                    client.close()
                    continue
                client.setblocking(False)
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.reactor.register(client)
                nursery.start_soon(self._connection, client)

    async def _connection(self, sock: socket.socket) -> None:
        cfg = self.config
        watch = Watched(sock, self.clock.now() + cfg.keepalive_timeout_s)
        conn = _Conn(sock, watch, self.reactor)
        self._conns.add(conn)
        self.watchdog.watched.add(watch)
        self.connections += 1
        parser = RequestParser(
            max_head_bytes=cfg.max_head_bytes,
            max_headers=cfg.max_headers,
            max_body_bytes=cfg.max_body_bytes,
        )
        reactor = self.reactor
        sent_continue = False
        answered = False  # a response just went out: the client's next bytes are not here yet
        try:
            while not conn.closing:
                if parser.ready:
                    req = parser.ready.popleft()
                    watch.deadline = math.inf  # our turn: no client timeout while we answer
                    reactor.request_started()
                    try:
                        keep = await self._handle(conn, req)
                    finally:
                        reactor.request_ended()
                    if not keep or not req.keep_alive:
                        break
                    sent_continue = False
                    answered = True
                    watch.deadline = self.clock.now() + (
                        cfg.request_timeout_s if parser.mid_request else cfg.keepalive_timeout_s
                    )
                    continue
                if parser.error is not None:
                    status, message = parser.error
                    self.metrics.malformed.labels(str(status)).inc()
                    await self._send_error(conn, status, message, _error_code(status), close=True)
                    break
                if parser.head_complete and not sent_continue:
                    pending = parser.pending
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
                    break  # the client closed (or half-closed: we cannot answer a request it
                    # did not finish sending; a complete one was already queued and answered)
                was_mid = parser.mid_request
                parser.feed(data)
                if not was_mid and parser.mid_request and not parser.ready:
                    # A request started and is incomplete: it has request_timeout_s to arrive
                    # (a request that came whole is answered at once and needs no deadline).
                    watch.deadline = self.clock.now() + cfg.request_timeout_s
        except (SocketClosed, ClientGone):
            pass
        finally:
            self.watchdog.watched.discard(watch)
            self._conns.discard(conn)
            self.connections -= 1
            reactor.close(sock)

    async def _send_error(
        self,
        conn: _Conn,
        status: int,
        message: str,
        code: str,
        *,
        close: bool = False,
        extra: list[tuple[bytes, bytes]] | None = None,
        head_only: bool = False,
    ) -> None:
        await self.reactor.send_all(
            conn.sock,
            full_response(
                status,
                error_body(status, message, code),
                extra=extra,
                keep_alive=not close,
                head_only=head_only,
            ),
        )

    async def _reject(
        self,
        conn: _Conn,
        status: int,
        message: str,
        code: str,
        *,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> bool:
        """An error answer to a request that was refused before routing (counted as such)."""
        self.metrics.done("-", status, 0.0)
        await self._send_error(conn, status, message, code, extra=extra)
        return True

    # == dispatch ============================================================================

    # The dispatchers below are plain functions that return the coroutine answering the
    # request, not coroutines awaiting it: every level of ``await`` is crossed twice per wait
    # (suspend and resume), and the hot path waits twice per request.

    def _handle(self, conn: _Conn, req: Request) -> Coroutine[Any, Any, bool]:
        """Answer one request (await the result); False closes the connection."""
        self.requests += 1
        path = req.path
        if path.startswith(b"/v1/"):
            return self._handle_v1(conn, req, path)
        return self._handle_control(conn, req)

    async def _handle_control(self, conn: _Conn, req: Request) -> bool:
        if self.control_app is None:
            await self._send_error(conn, 404, "no such endpoint", "not_found")
            return True
        status, headers, body = await call_asgi(self.control_app, req)
        # The app's own headers go out (Allow on a 405, caching, content type), framing ours.
        kept = [(n, v) for n, v in headers if n.lower() not in HOP_RESPONSE_HEADERS]
        kept.append((b"content-length", b"%d" % len(body)))
        head = build_head(status, kept)
        await self.reactor.send_all(conn.sock, head if req.method == b"HEAD" else head + body)
        return True

    def _handle_v1(self, conn: _Conn, req: Request, path: bytes) -> Coroutine[Any, Any, bool]:
        kind = ENDPOINTS.get(path)
        if kind is not None and req.method == b"POST":
            forward = req.headers.get(FORWARD_HEADER)
            if forward is not None:
                return self._serve_forward(conn, req, path, forward)
            return self._route(conn, req, path, kind)
        if path == b"/v1/models":
            if req.method not in (b"GET", b"HEAD"):
                return self._method_not_allowed(conn, b"GET, HEAD")
            return self._answer(conn, self.models_body(), head_only=req.method == b"HEAD")
        if kind is None:
            return self._answer_error(conn, 404, f"no such endpoint: {_text(path)}", "not_found")
        return self._method_not_allowed(conn, b"POST")

    async def _answer(self, conn: _Conn, body: bytes, *, head_only: bool) -> bool:
        await self.reactor.send_all(conn.sock, full_response(200, body, head_only=head_only))
        return True

    async def _answer_error(self, conn: _Conn, status: int, message: str, code: str) -> bool:
        await self._send_error(conn, status, message, code)
        return True

    async def _method_not_allowed(self, conn: _Conn, allow: bytes) -> bool:
        await self._send_error(
            conn,
            405,
            f"method not allowed; use {allow.decode()}",
            "method_not_allowed",
            extra=[(b"allow", allow)],
        )
        return True

    def models_body(self) -> bytes:
        data = [
            {
                "id": m.id,
                "object": "model",
                "created": m.created,
                "owned_by": "fabric",
                "max_model_len": m.max_model_len,
                "fabric_nodes": m.nodes,
            }
            for m in self.table.listing()
        ]
        return orjson.dumps({"object": "list", "data": data})

    # == routing =============================================================================

    def _route(
        self, conn: _Conn, req: Request, path: bytes, kind: str
    ) -> Coroutine[Any, Any, bool]:
        """Check and route a request: the coroutine that answers it (await it)."""
        started = self.clock.now()
        key: ApiKey | None = None
        store = self.api_keys
        if store is not None and store.enabled:
            key = store.lookup(_bearer(req.headers.get(b"authorization")))
            if key is None:
                return self._reject(
                    conn,
                    401,
                    "missing or invalid API key (Authorization: Bearer KEY)",
                    "invalid_api_key",
                )
            rate = key.rate
            if rate is not None:
                wait_s = self.rate_limiter.check(key.key_id, rate.rate_per_s, rate.burst, started)
                if wait_s > 0:
                    return self._reject(
                        conn,
                        429,
                        f"rate limit of {rate.rate_per_s:g} requests/s exceeded",
                        "rate_limit_exceeded",
                        extra=[(b"retry-after", b"%d" % max(1, math.ceil(wait_s)))],
                    )
        body = req.body
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return self._reject(conn, 400, "request body is not valid JSON", "invalid_json")
        if not isinstance(doc, dict):
            return self._reject(conn, 400, "request body must be a JSON object", "invalid_json")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            return self._reject(
                conn, 400, "'model' is required and must be a string", "invalid_model"
            )
        stream = doc.get("stream") is True and kind != "embeddings"
        try:
            providers = _providers(req.headers, key)
            requirements = _requirements(req.headers)
        except ValueError as exc:
            return self._reject(conn, 400, str(exc), "invalid_header")
        routes = self.table.routes(model)
        self._forget_removed()
        if not routes:
            return self._reject(
                conn, 404, f"model {model!r} is not served by any node", "model_not_found"
            )
        job = _Job(kind, model, stream, body, path, req.headers, key, started, doc)
        if req.http_version == "1.0":
            job.http10 = True
        rreq = routing.RouteRequest(
            model,
            self._prefix_blocks(doc, kind) if len(routes) > 1 else (),
            _session_key(req.headers, doc),
            len(body) // 4,
        )
        return self._dispatch(conn, job, rreq, routes, providers, requirements)

    def _prefix_blocks(self, doc: dict[str, Any], kind: str) -> tuple[int, ...]:
        if not self.policy.name.startswith("prefix"):
            return ()
        return routing.prompt_blocks(_prompt_text(doc, kind))

    def _forget_removed(self) -> None:
        if not self.table.removed:
            return
        for sid in self.table.take_removed():
            self.policy.on_removed(sid)
            self.breaker.forget(sid)
            self.remote_inflight.pop(sid, None)

    async def _dispatch(
        self,
        conn: _Conn,
        job: _Job,
        rreq: routing.RouteRequest,
        routes: list[Route],
        providers: frozenset[str],
        requirements: routing.Requirements | None,
    ) -> bool:
        """Try the candidates in turn until one answers (else 503), then account the request.

        False closes the connection.
        """
        cfg = self.config
        tried: set[str] = set()
        last_error = "no eligible node"
        deadline = job.started + cfg.retry_budget_s
        policy = self.policy
        answered = False
        observed = -1  # candidates for the first attempt, observed when the request is done
        try:
            while len(tried) < cfg.max_attempts:
                now = self.clock.now() if tried else job.started
                if tried and now >= deadline:
                    break
                wall = self.wall_clock()  # load reports carry wall-clock times
                candidates = self._candidates(routes, providers, requirements, tried, now, wall)
                if not tried:
                    observed = len(candidates)
                if not candidates:
                    break
                # One candidate: nothing to choose and no use holding (the request would wait
                # for the same node either way); the policy is skipped, as prompt hashing was.
                if len(candidates) == 1:
                    ranked: list[routing.Candidate] | None = candidates
                else:
                    ranked = policy.rank(rreq, candidates, wall)
                if ranked is None:
                    ranked = await self._hold(rreq, routes, providers, requirements, tried)
                    if not ranked:
                        break
                pick = ranked[0].node.session_id
                route = _route_of(routes, pick)
                tried.add(pick)
                policy.on_routed(rreq, pick, wall)
                attempt = self._attempt(conn, job, route, now)
                try:
                    outcome = attempt if isinstance(attempt, str) else await attempt
                finally:
                    # Metrics only: counted once the attempt is over, off the request's path.
                    self.metrics.decision(policy.name, "first" if len(tried) == 1 else "retry")
                if outcome is None:
                    self.breaker.succeeded(pick)
                    answered = True
                    break
                last_error = outcome
                self.breaker.failed(pick, self.clock.now())
                self.metrics.ejections.inc()
                self.retries += 1
                self.metrics.retries.labels(_reason_label(outcome)).inc()
                log.info("attempt on %s failed before the first byte: %s", pick[:8], outcome)
            if answered:
                keep = job.status != 0 and not job.close
            else:
                job.status = 503
                await self._send_error(
                    conn,
                    503,
                    f"no node could take the request for {job.model!r}: {last_error}",
                    "no_eligible_node",
                    extra=[(b"retry-after", b"%d" % cfg.retry_after_s)],
                )
                keep = True
        except ClientGone:
            job.status = job.status or 499
            self._account(job, observed)
            raise
        self._account(job, observed)
        return keep and not conn.closing

    def _candidates(
        self,
        routes: list[Route],
        providers: frozenset[str],
        requirements: routing.Requirements | None,
        tried: set[str],
        now: float,
        wall_now: float,
    ) -> list[routing.Candidate]:
        """Eligible nodes (``RouteTable.eligible``) this request has not tried yet."""
        eligible = self.table.eligible(
            routes,
            now=now,
            wall_now=wall_now,
            inflight=self.remote_inflight,
            breaker=self.breaker,
            providers=providers,
            requirements=requirements,
        )
        return [c for c in eligible if c.node.session_id not in tried] if tried else eligible

    async def _hold(
        self,
        rreq: routing.RouteRequest,
        routes: list[Route],
        providers: frozenset[str],
        requirements: routing.Requirements | None,
        tried: set[str],
    ) -> list[routing.Candidate] | None:
        """Pending-aware pushing: wait (bounded) until some node has room, then rank again."""
        cfg = self.config
        give_up = self.clock.now() + cfg.hold_max_s
        self.metrics.decision(self.policy.name, "hold")
        self._holders += 1
        try:
            while True:
                now = self.clock.now()
                with trio.move_on_after(min(0.05, max(0.0, give_up - now))):
                    await self._released.wait()
                now = self.clock.now()
                wall = self.wall_clock()
                cands = self._candidates(routes, providers, requirements, tried, now, wall)
                if not cands:
                    return None
                # Held long enough: the policy's best push (affinity kept) rather than wait on.
                ranked = self.policy.rank(rreq, cands, wall, allow_hold=now < give_up)
                if ranked is not None:
                    return ranked
        finally:
            self._holders -= 1

    def _release(self) -> None:
        if self._holders:
            released, self._released = self._released, trio.Event()
            released.set()

    # == one attempt =========================================================================

    def _attempt(
        self, conn: _Conn, job: _Job, route: Route, now: float
    ) -> Coroutine[Any, Any, str | None] | str:
        """Try one node: await the result, None when the client got an answer (any status),
        else why not; a str right away when the node cannot be tried."""
        sid = route.info.session_id
        if route.is_self:
            url = self.serving_engine_url()
            if url is None:
                return "local engine not serving"
            origin = self._local_origin(url)
            request = self._upstream_request(job, origin, forward=None)
            return self._relay(conn, job, origin, request, sid, None, now, local=True)
        forward = sign_forward(
            self.core.keyring,
            sender=self.core.self_id,
            target=sid,
            method=b"POST",
            path=job.path,
            body=job.body,
            now=self.wall_clock(),
        )
        request = self._upstream_request(job, route.origin, forward=forward)
        return self._relay(
            conn, job, route.origin, request, sid, self._node_ok(sid), now, local=False
        )

    def _local_origin(self, url: str) -> Origin:
        cached = self._local_origin_cache
        if cached is None or cached[0] != url:
            self._local_origin_cache = cached = (url, _origin_of(url))
        return cached[1]

    def _node_ok(self, sid: str) -> Callable[[], bool]:
        core = self.core

        def still_ok() -> bool:
            # DOWN or dead: the answer will never come, fail over now. LEFT is fine: a leaving
            # node finishes what it accepted before it stops its engine.
            entry = core.registry.get(sid)
            if entry is None or entry.body.state == State.DOWN:
                return False
            return core.members.status(sid) is not Liveness.DEAD

        return still_ok

    async def wait_local_idle(self) -> None:
        """Return once no request is in flight to our own engine."""
        if self.local_inflight == 0:
            await trio.lowlevel.checkpoint()
            return
        if self._local_idle is None:
            self._local_idle = trio.Event()  # set by _relay when the last one ends
        await self._local_idle.wait()

    def _upstream_request(self, job: _Job, origin: Origin, *, forward: bytes | None) -> bytes:
        lines = [
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n"
            % (job.path, origin[0].encode(), origin[1], len(job.body))
        ]
        headers = job.headers
        for name in FORWARDED_REQUEST_HEADERS:
            value = headers.get(name)
            if value is not None:
                lines.append(name + b": " + value + b"\r\n")
        if forward is not None:
            lines.append(FORWARD_HEADER + b": " + forward + b"\r\n")
            session = headers.get(b"x-session-id")
            if session is not None:
                lines.append(b"x-session-id: " + session + b"\r\n")
        lines.append(b"\r\n")
        lines.append(job.body)
        return b"".join(lines)

    async def _relay(
        self,
        conn: _Conn,
        job: _Job,
        origin: Origin,
        request: bytes,
        sid: str,
        still_wanted: Callable[[], bool] | None,
        now: float,
        *,
        local: bool,
    ) -> str | None:
        """One attempt on ``origin``, counted in flight (``local``: to our own engine)."""
        cfg = self.config
        inflight = self.remote_inflight
        if local:
            self.local_inflight += 1
        else:
            inflight[sid] = inflight.get(sid, 0) + 1
        try:
            ex = Exchange(self.pool, self.watchdog, origin)
            try:
                await ex.start(
                    request,
                    connect_timeout_s=cfg.connect_timeout_s,
                    first_byte_timeout_s=cfg.first_byte_timeout_s,
                    still_wanted=still_wanted,
                    now=now,
                )
            except UpstreamError as exc:
                return str(exc)
            try:
                status = ex.status
                if status in RETRYABLE_STATUS:
                    return f"node answered {status}"
                job.status = status
                job.served_by = sid
                head, chunked = self._response_head(conn, job, ex, sid)
                if not ex.complete:
                    await self._relay_body(conn, job, ex, sid, head, chunked)
                    return None
                # The whole response came with its head (any short JSON answer): one send, no
                # coroutine for the body.
                pieces = ex.take_pieces()
                if pieces and job.stream:
                    job.ttft_s = self.clock.now() - job.started
                out = head + _frame(pieces, chunked) if pieces else head
                if chunked:
                    out += b"0\r\n\r\n"
                sent = _send_now(conn, out)
                if sent < len(out):
                    await _send_rest(conn, out, sent, cfg.stream_idle_timeout_s)
                # Usage is read when the request is settled, off the client's path.
                job.response = pieces
                job.response_sse = ex.content_type.startswith(SSE)
                return None
            finally:
                ex.finish()
        finally:
            if local:
                self.local_inflight -= 1
                idle = self._local_idle
                if self.local_inflight == 0 and idle is not None:
                    self._local_idle = None
                    idle.set()
            else:
                n = inflight.get(sid, 1) - 1
                if n > 0:
                    inflight[sid] = n
                else:
                    inflight.pop(sid, None)
            self._release()

    def _response_head(self, conn: _Conn, job: _Job, ex: Exchange, sid: str) -> tuple[bytes, bool]:
        """Our response head for the upstream's, and whether the body goes out chunked."""
        length = ex.content_length
        chunked = length is None
        if length is not None:
            framing = b"content-length: %d\r\n" % length
        elif job.http10:
            # HTTP/1.0 has no chunked coding: send the body as it comes, end it by closing.
            chunked = False
            conn.closing = True
            framing = b""
        else:
            framing = b"transfer-encoding: chunked\r\n"
        if conn.closing:
            framing += b"connection: close\r\n"
        parts = (
            status_line(job.status),
            ex.end_to_end,
            b"x-fabric-node: ",
            sid.encode(),
            b"\r\n",
            framing,
            b"\r\n",
        )
        return b"".join(parts), chunked

    def _count_tokens(self, job: _Job, body: list[bytes], sse: bool) -> None:
        """Token counts from a whole response body's usage."""
        if sse:
            usage = StreamUsage()
            for piece in body:
                usage.feed(piece)
            prompt, completion = usage.result()
            job.prompt_tokens, job.completion_tokens = prompt or 0, completion
        elif job.status == 200:
            found = usage_from_json(b"".join(body))
            if found is not None:
                job.prompt_tokens, job.completion_tokens = found

    async def _relay_body(
        self, conn: _Conn, job: _Job, ex: Exchange, sid: str, head: bytes, chunked: bool
    ) -> None:
        """Relay a body that is still coming, piece by piece as it arrives."""
        cfg = self.config
        sse = ex.content_type.startswith(SSE)
        pieces = ex.take_pieces()
        usage = StreamUsage() if sse else None
        collected: list[bytes] | None = None if sse else []
        first = True
        idle_s = cfg.stream_idle_timeout_s
        while True:
            if pieces:
                if first and job.stream:
                    job.ttft_s = self.clock.now() - job.started
                first = False
                out = _frame(pieces, chunked)
            else:
                out = b""
            if head:
                out = head + out
                head = b""
            complete = ex.complete
            if complete and chunked:
                out += b"0\r\n\r\n"
            if out:
                sent = _send_now(conn, out)
                if sent < len(out):
                    await _send_rest(conn, out, sent, idle_s)
            # Usage is read after the piece went out, not on its way to the client.
            if usage is not None:
                for piece in pieces:
                    usage.feed(piece)
            elif collected is not None:
                collected.extend(pieces)
            if complete:
                break
            try:
                await ex.read_more(cfg.stream_idle_timeout_s)
            except BrokenResponse as exc:
                self.broken_streams += 1
                self.metrics.broken_streams.inc()
                log.warning("response from %s broke mid-stream: %s", sid[:8], exc)
                job.status = 502 if job.status < 400 else job.status
                if sse and chunked:
                    # The client gets a complete, well-framed response (error event, last
                    # chunk): the connection stays usable, and the client may already have
                    # sent its next request on it.
                    event = (
                        b"data: "
                        + error_body(
                            502, f"the serving node failed mid-stream: {exc}", "upstream_broken"
                        )
                        + b"\n\n"
                    )
                    await _client_send(conn, _frame([event], True) + b"0\r\n\r\n", idle_s)
                    return
                # A body with a length (or no framing) cannot be ended early: close.
                job.close = True
                conn.closing = True
                return
            pieces = ex.take_pieces()
        if usage is not None:
            prompt, completion = usage.result()
            job.prompt_tokens, job.completion_tokens = prompt or 0, completion
        elif collected is not None:
            job.response = collected

    # == forwarded requests (we are the serving node) ========================================

    async def _serve_forward(self, conn: _Conn, req: Request, path: bytes, forward: bytes) -> bool:
        try:
            self.forwards.verify(
                forward,
                own_session=self.core.self_id,
                method=req.method,
                path=path,
                body=req.body,
                now=self.wall_clock(),
            )
        except ForwardRejected as exc:
            self._forwards_served("refused").inc()
            await self._send_error(conn, 403, f"forward refused: {exc}", "forward_refused")
            return True
        url = self.serving_engine_url()
        if self.leaving or url is None:
            self._forwards_served("unavailable").inc()
            why = "node is leaving" if self.leaving else "no serving engine on this node"
            await self._send_error(
                conn,
                503,
                why,
                "node_unavailable",
                extra=[(b"retry-after", b"%d" % self.config.retry_after_s)],
            )
            return True
        started = self.clock.now()
        job = _Job("forward", "", False, req.body, path, req.headers, None, started)
        origin = self._local_origin(url)
        request = self._upstream_request(job, origin, forward=None)
        outcome = await self._relay(
            conn, job, origin, request, self.core.self_id, None, started, local=True
        )
        if outcome is not None:
            # Our own engine failed before answering: tell the ingress to fail over.
            self._forwards_served("failed").inc()
            await self._send_error(conn, 502, f"engine failed: {outcome}", "engine_unavailable")
            return True
        self._forwards_served("served").inc()
        return not job.close

    # == accounting ==========================================================================

    def _account(self, job: _Job, candidates: int = -1) -> None:
        """The request is answered: note when, and leave the rest to ``settle``."""
        job.ended = self.clock.now()
        job.candidates = candidates
        finished = self._finished
        finished.append(job)
        if len(finished) >= MAX_UNSETTLED:
            self.settle()

    def settle(self) -> None:
        """The bookkeeping of every request answered since the last call: metrics, usage (read
        from the response), the ledger and the request log.

        Deferred from the answer, which would otherwise hold up the client's next request on
        its connection, to moments the data plane would spend waiting anyway: just after a
        request went to its engine, while the engine works on it (``UpstreamPool.while_waiting``).
        Also before anything reads what it updates (``render_metrics``, the request log's
        flush), every ``SETTLE_INTERVAL_S`` while no request comes, and at most
        ``MAX_UNSETTLED`` requests late.
        """
        finished = self._finished
        if not finished:
            return
        wall_offset = self.wall_clock() - self.clock.now()
        while finished:
            job = finished.popleft()
            try:
                self._settle_one(job, wall_offset)
            except Exception:  # one request's bookkeeping must not fail the one that runs it
                log.exception("bookkeeping of an answered request failed")

    def _settle_one(self, job: _Job, wall_offset: float) -> None:
        if job.response is not None:
            self._count_tokens(job, job.response, job.response_sse)
            job.response = None
        if job.candidates >= 0:
            self.metrics.candidates.observe((), job.candidates)
        latency = job.ended - job.started
        status = job.status or 499
        self.metrics.done(job.model, status, latency)
        if job.ttft_s is not None:
            self.metrics.first_token(job.model, job.ttft_s)
        self.metrics.count_tokens(job.model, job.prompt_tokens, job.completion_tokens)
        name = job.key.name if job.key is not None else "anonymous"
        self.ledger.record(
            name, job.model, job.prompt_tokens, job.completion_tokens, error=status >= 400
        )
        if self.request_log is not None:
            max_tokens: int | None = None
            temperature: float | None = None
            doc = job.doc
            if doc is not None:
                max_tokens = _opt_int(doc.get("max_tokens") or doc.get("max_completion_tokens"))
                value = doc.get("temperature")
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    temperature = float(value)
            # A tuple in TraceRecord's field order: the record is built in the flush thread.
            self.request_log.append(
                (
                    job.started + wall_offset,
                    job.model,
                    job.prompt_tokens or None,
                    job.completion_tokens if status == 200 else None,
                    latency,
                    job.ttft_s,
                    status,
                    job.served_by,
                    name,
                    job.stream,
                    max_tokens,
                    temperature,
                )
            )

    async def _settle_loop(self) -> None:
        while True:
            await trio.sleep(SETTLE_INTERVAL_S)
            self.settle()


# == helpers =================================================================================


def error_body(status: int, message: str, code: str) -> bytes:
    kind = {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code}})


def _error_code(status: int) -> str:
    return {
        400: "bad_request",
        408: "request_timeout",
        413: "request_too_large",
        414: "uri_too_long",
        431: "headers_too_large",
        505: "http_version_not_supported",
    }.get(status, "bad_request")


def _send_now(conn: _Conn, data: bytes) -> int:
    """Send what fits at once (most responses do: no coroutine); ``ClientGone`` if gone."""
    try:
        return try_send(conn.sock, data)
    except SocketClosed:
        raise ClientGone from None


async def _send_rest(conn: _Conn, data: bytes, sent: int, idle_s: float) -> None:
    """Send ``data[sent:]``; ``ClientGone`` if the client is gone or stopped reading.

    A client that stops reading must not hold the connection (and the upstream) for ever: when
    its socket buffer is full, it gets ``idle_s`` to take the rest of the piece (the same idle
    deadline as the upstream's). A send that goes through at once needs no deadline.
    """
    watch = conn.watch
    watch.deadline = trio.current_time() + idle_s
    try:
        await conn.reactor.send_all(conn.sock, memoryview(data)[sent:])
    except SocketClosed:
        raise ClientGone from None
    watch.deadline = math.inf


async def _client_send(conn: _Conn, data: bytes, idle_s: float) -> None:
    """Send a piece of a response (see ``_send_rest``)."""
    sent = _send_now(conn, data)
    if sent < len(data):
        await _send_rest(conn, data, sent, idle_s)


def _frame(pieces: list[bytes], chunked: bool) -> bytes:
    if not chunked:
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)
    out = []
    for piece in pieces:
        if piece:
            out.append(b"%x\r\n" % len(piece))
            out.append(piece)
            out.append(b"\r\n")
    return b"".join(out)


def _route_of(routes: list[Route], sid: str) -> Route:
    for route in routes:
        if route.info.session_id == sid:
            return route
    raise KeyError(sid)  # a policy ranks only the candidates it was given


def _bearer(value: bytes | None) -> str:
    if not value:
        return ""
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer":
        return ""
    return token.strip().decode("latin-1")


def _providers(headers: Mapping[bytes, bytes], key: ApiKey | None) -> frozenset[str]:
    raw = headers.get(b"x-fabric-providers")
    allowed = routing.parse_providers(raw.decode("latin-1")) if raw else frozenset()
    if key is not None and key.providers is not None:
        # The key's allowlist always applies; a header can only narrow it.
        own = frozenset(key.providers)
        allowed = allowed & own if allowed else own
        if not allowed:
            raise ValueError("X-Fabric-Providers names no provider this API key may use")
    return allowed


def _requirements(headers: Mapping[bytes, bytes]) -> routing.Requirements | None:
    raw = headers.get(b"x-fabric-require")
    return routing.parse_require(raw.decode("latin-1")) if raw else None


def _session_key(headers: Mapping[bytes, bytes], doc: dict[str, Any]) -> str | None:
    raw = headers.get(b"x-session-id")
    if raw:
        return raw.decode("latin-1")[:256]
    user = doc.get("user")
    return user[:256] if isinstance(user, str) and user else None


def _prompt_text(doc: dict[str, Any], kind: str) -> str:
    if kind == "chat":
        messages = doc.get("messages")
        if not isinstance(messages, list):
            return ""
        parts: list[str] = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            role = m.get("role")
            parts.append(role if isinstance(role, str) else "")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for c in content:
                    if isinstance(c, dict) and isinstance(c.get("text"), str):
                        parts.append(c["text"])
        return "\x1e".join(parts)
    prompt = doc.get("prompt") if kind == "completions" else doc.get("input")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return str(prompt[0])
    return ""


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _origin_of(url: str) -> Origin:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def _reason_label(outcome: str) -> str:
    if "answered" in outcome:
        return "status"
    if "no response" in outcome or "timed out" in outcome:
        return "timeout"
    if "eligible" in outcome:
        return "ineligible"
    return "connect"


def _text(raw: bytes) -> str:
    return raw[:200].decode("latin-1")


async def call_asgi(app: AsgiApp, req: Request) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Run one request through an ASGI app in this task (no hypercorn on the public port)."""
    raw_path, _, query = req.target.partition(b"?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method.decode("latin-1"),
        "scheme": "http",
        "path": unquote_to_bytes(raw_path).decode("utf-8", "replace"),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": list(req.headers.items()),
        "server": None,
        "client": None,
    }
    body_sent = False
    status = 500
    headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if body_sent:
            await trio.sleep_forever()
        body_sent = True
        return {"type": "http.request", "body": req.body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))

    await app(scope, receive, send)
    return status, headers, b"".join(chunks)
