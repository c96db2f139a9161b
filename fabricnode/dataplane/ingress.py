"""The ``/v1`` data plane's ingress: every agent's OpenAI-compatible front, on trio + httptools.

    client ──HTTP/1.1──► Ingress (this agent) ──pooled keep-alive──► serving agent ──► engine
                          parse (httptools), read only          (X-Fabric-Forward: HMAC
                          the routing fields, filter,            with the cluster key)
                          policy, fail over before the
                          first byte, relay unbuffered

``Ingress`` builds the data plane's parts, dispatches each request by its path and routes it.
A body is parsed once (orjson) only to read ``model``, ``stream`` and the prompt for
cache-aware routing (the audio endpoints' forms: their ``model`` field), and goes on as
received but for the per-node rewrites of ``attempt``.

Dispatch (``_handle``): the path is looked up in ``endpoints.ENDPOINTS`` first, every endpoint
routed by a model (chat's, the other OpenAI-style ones, Anthropic's Messages, and the ones vLLM
serves outside ``/v1`` such as ``/rerank`` and ``/tokenize``); then the rest of ``/v1``
(``/v1/models``, the Batch API's ``/v1/files`` and ``/v1/batches`` handed to its ASGI app, the
stateful Responses paths routed by the response id, else 404); any other path goes to the
agent's ASGI control app (``control.app.AdminApp``, handed in by the agent) through a small
inline adapter (``asgi_call``), so one public port serves both; the scope says whether API keys
are on and which key the caller named, and the app decides which paths need an admin key
(``control.access``). With ``--admin`` that app is also served on its own port by hypercorn.

Routing and failover (``_route``, ``_dispatch``): the candidates (``routetable``), the policy
(``routing``), then one attempt after another. A connection error, a timeout before the
response head, or a 502/503/504 answer is retried on the next candidate and the failed node is
ejected by the circuit breaker; how many nodes, for how long, and when to stop (a stream
continued elsewhere, the poison-request guard) is the ``failover.Failover`` machine's account.
The loop stays here because it holds a request's state across its attempts (the batch slot,
the splice) and the waiting rooms' shells wake through the ingress (``mesh_changed``).

Across sites (``sites``; docs/federation.md): a request for a model no node of our site serves
leaves through a gateway (``across.Across.out_routes``: a gateway of our site, or from a gateway
the peer sites' gateways), as does one whose every node of our site failed before answering; a
gateway serves what another ingress of the site asks it to take out (``X-Fabric-Out``) and what
a peer site's gateway sends over the link (``serve_remote``; marked ``X-Fabric-From-Site``), the
latter routed inside our site only (``_handle_across``). What may come in, where a request
goes out, residency's routes and refusals and where a Responses follow-up goes are decided by
``across.Across``; the ingress acts on its answers.

Elsewhere: the client connections and what is refused on them (``frontdoor``); the checks
before routing, the header grammars and a request's one routed record (``request.Routed``);
the state of its attempts (``job``); the request each node gets and the forwards we serve
(``attempt``); an attempt's exchange, its relay, and a broken stream resumed or ended
(``relay``); the ``/v1/models`` body (``routetable.models_body``); the bookkeeping once answered
(``settle``); and the waiting rooms an interactive request on a served model never enters, each
a sans-IO machine that takes the time and returns what to do: the batch gate (``gate``; its
trio side ``gatewait``), the wait for a replica (``coldstart``; ``coldwait``), Responses pinning
(``responses``) and the pending-aware hold (``hold``, waited for in ``_hold``). They are waited
for in one way: on events (a request ending, a batch request queued, the mesh changing) or until
the machine's ``next_deadline()``, never on a fixed period; the only periodic look left is at
the sockets of waiting clients, for a hang-up.

Request outcomes (OpenAI error shape ``{"error": {"message", "type", "code"}}``; on the
Anthropic paths, ``/v1/messages*``, Anthropic's ``{"type": "error", "error": {"type",
"message"}}``: ``request.error_body_for``):

* 400 malformed HTTP, JSON, form, ``model`` or a bad ``X-Fabric-*`` header; 401 missing/unknown
  API key (only when a keys file exists; ``Authorization: Bearer`` or ``x-api-key``), or a batch
  owner header that does not verify; 403 forward header that does not verify; 404 unknown
  path, a model no SERVING node announces, or a stored response whose node is gone; 405 wrong
  method; 413 body over ``max_body_bytes``; 429 rate limited (``Retry-After``); 431 header block
  too large; 503 no eligible node, every attempt failed before the first byte, or a batch
  request the gate refused or held too long (``Retry-After``). A broken stream: ``relay``.
* Priority tiers (``tiers``): a batch request (``X-Fabric-Priority: batch``, or this agent's
  Batch API worker with the batch owner header) goes only to a node with room for batch work
  (a fresh load report without a queue and with KV usage under ``batch_kv_threshold``, fewer
  than ``batch_max_inflight_per_node`` of our batch requests on it, and no prompt of ours still
  ahead on its prefill clock: one batch prefill at a time), else waits in the gate
  (``gate.BatchGate``), released in weighted fair order between API keys; 503
  ``batch_queue_full`` past ``max_batch_waiting`` waiters and ``batch_wait_timeout`` past
  ``batch_max_wait_s``. Then it is routed by the policy among the nodes with room, with
  failover. Interactive requests (the default) pay two header lookups and never wait in the
  gate.
* Prefill clocks (``prefill``): each prompt sent to a node (``endpoints.PREFILL_KINDS``) moves
  that node's clock (``relay``); the policies' load score weighs the backlog (``routing``) and
  the batch gate waits for it to run out.
* Sleeping engines (``fabric.sleeping``): a model whose replicas all sleep is routed to them,
  unranked (ours first, then by session id, so ingresses agree on one); the serving agent wakes
  its engine first (``attempt``). Requests for models with an awake replica never see them.
"""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from fabricnode.dataplane import responses, routing
from fabricnode.dataplane.across import Across
from fabricnode.dataplane.apikeys import ApiKeyStore, RateLimiter
from fabricnode.dataplane.asgi_call import KEY_SCOPE, KEYS_SCOPE, OWNER_SCOPE, AsgiApp, answer_asgi
from fabricnode.dataplane.attempt import Attempts
from fabricnode.dataplane.clientconn import ClientConn, ClientGone, send_error
from fabricnode.dataplane.coldstart import ReplicaRoom
from fabricnode.dataplane.coldwait import ReplicaWaits
from fabricnode.dataplane.endpoints import (
    ENDPOINT_DOCS,
    ENDPOINTS,
    FORM_KINDS,
    PREFILL_KINDS,
    RESPONSE_CANCEL,
    RESPONSES,
    response_follow_up,
    site_of_response,
)
from fabricnode.dataplane.failover import Failover
from fabricnode.dataplane.failure import RESUMED, TAKEN_BACK, Failed
from fabricnode.dataplane.forward_auth import HEADER as FORWARD_HEADER
from fabricnode.dataplane.forward_auth import ForwardRejected
from fabricnode.dataplane.frontdoor import FrontDoor
from fabricnode.dataplane.gate import BatchGate, BatchWaiter
from fabricnode.dataplane.gatewait import GateWaits
from fabricnode.dataplane.hold import Hold
from fabricnode.dataplane.http1 import Request, full_response, text_of
from fabricnode.dataplane.ingress_config import IngressConfig
from fabricnode.dataplane.job import BatchSlot, Job
from fabricnode.dataplane.metrics import (
    IngressMetrics,
    LabelCache,
)
from fabricnode.dataplane.prefill import PrefillClocks
from fabricnode.dataplane.relay import Relay
from fabricnode.dataplane.request import (
    Rejection,
    Routed,
    authorize,
    decode,
    decode_as,
    key_of,
    prompt_text,
    route_headers,
)
from fabricnode.dataplane.residency import (
    narrow,
)
from fabricnode.dataplane.responses import PinnedNode
from fabricnode.dataplane.routetable import CircuitBreaker, Route, RouteTable, models_body, route_of
from fabricnode.dataplane.settle import SETTLE_INTERVAL_S, Settler
from fabricnode.dataplane.sites import (
    FROM_SITE_HEADER,
    HOP_GATEWAY,
    HOP_NODE,
    HOP_SITE,
    OUT_HEADER,
    OUT_SUFFIX,
    PUSH_HEADER,
    PUSH_SUFFIX,
)
from fabricnode.dataplane.sockio import LoopClock, Reactor, Watchdog, close
from fabricnode.dataplane.tiers import OWNER_HEADER, RoomRules, owner_of
from fabricnode.dataplane.upstream import UpstreamPool
from fabricnode.dataplane.usage import UsageLedger
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.registry import State
from fabricnode.mesh.schema import Standing
from fabricnode.mesh.sites import DEFAULT_SITE
from fabricnode.requestlog.writer import RequestLog

log = logging.getLogger("fabricnode.dataplane.ingress")

# Kinds whose requests need more than the table lookup (``Ingress._route``).
PREPARED_KINDS = frozenset((RESPONSES, *FORM_KINDS))
BATCH_API_PREFIXES = (b"/v1/files", b"/v1/batches")


@dataclass
class IngressStatistics:
    connections: int
    requests: int
    local_inflight: int
    remote_inflight: int
    retries: int
    ejections: int
    broken_streams: int
    batch_waiting: int  # batch requests held at the gate
    batch_inflight: int  # batch requests in flight to nodes (ours included)
    watchdog_expired: int
    pool_connects: int
    pool_reuses: int
    route_rebuilds: int


class Ingress:
    """One agent's ``/v1`` ingress (see the module docstring); the agent builds and serves it."""

    def __init__(
        self,
        core: MeshCore,
        *,
        config: IngressConfig | None = None,
        wall_clock: Callable[[], float],
        serving_engine_url: Callable[[], str | None] = lambda: None,
        local_engine_up: Callable[[], bool] = lambda: True,
        control_app: AsgiApp | None = None,
        api_keys: ApiKeyStore | None = None,
        request_log: RequestLog | None = None,
        rng: random.Random | None = None,
        declared: Callable[[str], float | None] | None = None,
        declared_models: Callable[[], list[str]] | None = None,
        model_sites: Callable[[str], frozenset[str] | None] | None = None,
        site: str = DEFAULT_SITE,
        on_waiting: Callable[[Mapping[str, int]], None] | None = None,
        wake_local: Callable[[], Awaitable[bool]] | None = None,
        batch_token: str | None = None,
    ) -> None:
        self.core = core
        # The secret of this agent's batch owner header (``tiers.owner_of``), made by the agent
        # at start and read by its Batch API worker; None: no request may use the header.
        self.batch_token = batch_token
        # Scale from zero (the elastic controller): how long a request for a model declared in
        # the mesh's service file may wait for a replica (None: not declared), and the declared
        # models. Who is told which models have requests waiting: ``replica_waits``.
        self.declared = declared
        self.declared_models = declared_models
        # Data residency (``residency``): the sites the service file lets serve a model (None:
        # any), and this agent's own site, which a forward's allowed set must hold.
        self.model_sites = model_sites
        self.site = site
        self.config = cfg = config or IngressConfig()
        self._idle_s = cfg.stream_idle_timeout_s  # an app answer streamed to a stalled client
        self.wall_clock = wall_clock
        self.control_app = control_app
        # The Batch API (``fabricnode.batch.api``), handed in by the agent; None: off.
        self.batch_app: AsgiApp | None = None
        self.api_keys = api_keys
        self.rate_limiter = RateLimiter()
        self.request_log = request_log
        self.ledger = UsageLedger()
        self.table = RouteTable(core, wall_clock)
        self.policy = routing.make_policy(cfg.policy, rng=rng or random.Random())
        self.breaker = CircuitBreaker(base_s=cfg.eject_base_s, max_s=cfg.eject_max_s)
        # Bound to the trio run's clock when serving starts (see LoopClock).
        self.clock = LoopClock()
        # The wait for a replica (``coldstart``) and its trio side (``coldwait``).
        self.replica_room = ReplicaRoom(cfg.max_waiting_for_replica)
        self.replica_waits = ReplicaWaits(
            self.replica_room,
            clock=self.clock,
            keepalive_s=cfg.replica_keepalive_s,
            send_timeout_s=cfg.stream_idle_timeout_s,
            on_waiting=on_waiting,
        )
        # Every data-plane socket (clients, upstreams) waits through this one reactor.
        self.reactor = Reactor()
        self.reactor.batching = False  # until requests overlap (Reactor.request_started)
        self._parks_reported = 0  # reactor waits already added to the metrics
        self.metrics = IngressMetrics()
        # Answered requests' bookkeeping, deferred to moments the data plane waits anyway.
        self.settler = Settler(self.metrics, self.ledger, request_log, wall_clock, self.clock)
        self.pool = UpstreamPool(clock=self.clock, reactor=self.reactor)
        self.pool.while_waiting = self.settler.settle
        self.watchdog = Watchdog(cfg.watchdog_interval_s, self.reactor)
        self.watchdog.clock = self.clock
        # What this ingress sent each node to prefill, and how fast each prefills (routing).
        self.prefill = PrefillClocks()
        # The batch tier (``gate``, ``tiers``): the machine decides, the shell waits. Its
        # counts are shared: our batch requests in flight per node, those hidden from an
        # interactive request's routing score, and the attempts it may take back.
        self.gate = BatchGate(
            max_waiting=cfg.max_batch_waiting,
            max_wait_s=cfg.batch_max_wait_s,
            rules=RoomRules(
                kv_threshold=cfg.batch_kv_threshold,
                max_waiting=cfg.batch_max_waiting,
                max_inflight=cfg.batch_max_inflight_per_node,
                stale_after_s=routing.DEFAULT_CONFIG.load_stale_after_s,
            ),
            prefill_tokens_per_s=cfg.batch_prefill_tokens_per_s,
            preempt_kv_threshold=cfg.batch_preempt_kv_threshold,
            preempt_per_report=cfg.batch_preempt_per_report,
            policy=self.policy,
            prefill=self.prefill,
            lookup=self._gate_lookup,
            load_of=self.table.load_of,
        )
        self.batch_inflight = self.gate.inflight
        self.batch_hidden = self.gate.hidden
        self.batch_preemptible = self.gate.preemptible
        # Its trio side: the waiting tasks, the attempts it may take back, its one loop.
        self.gate_waits = GateWaits(
            self.gate,
            clock=self.clock,
            wall_clock=wall_clock,
            breaker=self.breaker,
            metrics=self.metrics,
        )
        # One attempt on a node (``attempt``) and its exchange and relay (``relay``), which
        # counts our requests in flight per node: routing reads the same dict.
        self.relay = Relay(
            config=cfg,
            clock=self.clock,
            wall_clock=wall_clock,
            pool=self.pool,
            watchdog=self.watchdog,
            metrics=self.metrics,
            prefill=self.prefill,
            gate_waits=self.gate_waits,
        )
        self.remote_inflight = self.relay.remote_inflight
        self.attempts = Attempts(
            core,
            self.relay,
            config=cfg,
            clock=self.clock,
            wall_clock=wall_clock,
            metrics=self.metrics,
            serving_engine_url=serving_engine_url,
            local_engine_up=local_engine_up,
            wake_local=wake_local,
            site=site,
        )
        # The decisions about sites (``across``); on a gateway the agent sets ``across.offers``,
        # what it knows of the peer sites.
        self.across = Across(
            site,
            self.table,
            lambda: core.keyring,
            lambda reason: self.metrics.residency_refusals.labels(reason).inc(),
            declared,
        )
        self._conn_nursery: trio.Nursery | None = None
        self._batch_waiting = LabelCache(self.metrics.batch_waiting)
        self._waiting_labels: set[str] = set()  # batch_waiting labels set so far
        self.requests = 0
        self.answering = 0  # interactive requests in ``_dispatch`` now
        self.retries = 0
        # The client side: accepting within the limits, one task per connection, each
        # request it reads handed to ``_handle``.
        self.front = FrontDoor(
            config=cfg,
            clock=self.clock,
            reactor=self.reactor,
            watchdog=self.watchdog,
            metrics=self.metrics,
            api_keys=api_keys,
            answer=self._handle,
        )

    # == what the agent reads and sets ======================================================

    @property
    def connections(self) -> int:
        """Client connections open now."""
        return self.front.connections

    @property
    def local_inflight(self) -> int:
        """Requests in flight to our own engine (the node's ``inflight`` load)."""
        return self.relay.local_inflight

    @property
    def local_served(self) -> int:
        """Requests sent to our own engine, ever (its idle clock)."""
        return self.relay.local_served

    @property
    def local_asleep(self) -> bool:
        """Set by the agent while our engine sleeps: a request for it wakes it first."""
        return self.attempts.local_asleep

    @local_asleep.setter
    def local_asleep(self, asleep: bool) -> None:
        self.attempts.local_asleep = asleep

    @property
    def leaving(self) -> bool:
        """Set by the agent as it leaves: forwards are refused (503) so ingresses fail over."""
        return self.attempts.leaving

    @leaving.setter
    def leaving(self, leaving: bool) -> None:
        self.attempts.leaving = leaving

    @property
    def relayed_inflight(self) -> int:
        """Interactive requests this ingress is answering now, on any node (a leaving node's
        drain keeps its doors open for them: ``engine.drain``; batch-tier work, such as this
        agent's own Batch API worker's, is not waited for)."""
        return self.answering

    async def wait_inflight_change(self) -> None:
        """Return once a request in flight (to our engine or another node) ended."""
        await self.relay.wait_inflight_change()

    def hand_over(self) -> int:
        """A leaving node's drain is over: break off the requests still running on our own
        engine, for their ingresses to continue them elsewhere (``Relay.hand_over``)."""
        return self.relay.hand_over()

    # == statistics ==========================================================================

    def statistics(self) -> IngressStatistics:
        pool = self.pool.statistics()
        return IngressStatistics(
            connections=self.front.connections,
            requests=self.requests,
            local_inflight=self.relay.local_inflight,
            remote_inflight=sum(self.remote_inflight.values()),
            retries=self.retries,
            ejections=self.breaker.ejections,
            broken_streams=self.relay.broken_streams,
            batch_waiting=len(self.gate),
            batch_inflight=sum(self.batch_inflight.values()),
            watchdog_expired=self.watchdog.expired_total,
            pool_connects=pool.connects,
            pool_reuses=pool.reuses,
            route_rebuilds=self.table.rebuilds,
        )

    def render_metrics(self) -> bytes:
        self.settle()
        m = self.metrics
        m.inflight.labels("ingress").set(sum(self.remote_inflight.values()))
        m.inflight.labels("local").set(self.relay.local_inflight)
        m.connections.set(self.front.connections)
        waiting = dict.fromkeys(self._waiting_labels, 0)
        waiting.update(self.gate.waiting_by_label())
        for label, n in waiting.items():
            self._batch_waiting(label).set(n)
        self._waiting_labels.update(waiting)
        m.prefill_rate.clear()  # nodes forgotten since the last scrape go too
        for sid, rate in self.prefill.learned().items():
            m.prefill_rate.labels(sid).set(rate)
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
            nursery.start_soon(self.gate_waits.run)
            async with trio.open_nursery() as conn_nursery:
                accept_scope = trio.CancelScope()
                front = self.front
                self._conn_nursery = conn_nursery
                conn_nursery.start_soon(front.accept_loop, sock, conn_nursery, accept_scope)
                task_status.started()
                await shutdown.wait()
                self._conn_nursery = None
                accept_scope.cancel()
                close(sock)
                front.close_all()
                with trio.move_on_after(grace_s):
                    while front.conns:
                        await trio.sleep(0.05)
                conn_nursery.cancel_scope.cancel()
            self.pool.close_all()
            self.settle()
            nursery.cancel_scope.cancel()

    def serve_remote(self, sock: socket.socket, site: str) -> bool:
        """Serve a connection a peer site's gateway opened over the federation port (its
        bytes carried by the link, ``federation.link``): as a client connection whose every
        request is marked as arrived from ``site`` (``sites.FROM_SITE_HEADER``). False when
        not serving or at the connection limit (the link closes it)."""
        nursery = self._conn_nursery
        if nursery is None:
            return False
        return self.front.adopt(sock, site, nursery)

    # == dispatch ============================================================================

    async def _reject(self, conn: ClientConn, why: Rejection, path: bytes) -> bool:
        """An error answer to a request that was refused before routing (counted as such)."""
        self.metrics.done("-", why.status, 0.0)
        await send_error(conn, why.status, why.message, why.code, extra=why.headers, path=path)
        return True

    # The dispatchers below are plain functions that return the coroutine answering the
    # request, not coroutines awaiting it: every level of ``await`` is crossed twice per wait
    # (suspend and resume), and the hot path waits twice per request.

    def _handle(self, conn: ClientConn, req: Request) -> Coroutine[Any, Any, bool]:
        """Answer one request (await the result); False closes the connection.

        Dispatch: a path of ``ENDPOINTS`` (every model-routed endpoint, chat's included, and
        the few vLLM serves outside ``/v1``) is one dict lookup away from routing; then the
        rest of ``/v1`` (``_handle_v1``); anything else is the agent's control app.
        """
        self.requests += 1
        path = req.path
        kind = ENDPOINTS.get(path)
        if kind is not None:
            if req.method == b"POST":
                headers = req.headers
                forward = headers.get(FORWARD_HEADER)
                if forward is not None or FROM_SITE_HEADER in headers:
                    return self._handle_across(conn, req, path, kind, forward)
                return self._route(conn, req, path, kind)
            return self._method_not_allowed(conn, b"POST", path)
        if FROM_SITE_HEADER in req.headers:
            # A peer site's gateway reaches our model-routed endpoints only: not the Batch API,
            # stored responses, nor this agent's control app.
            return self._answer_error(
                conn, 403, "only model-routed endpoints are served to other sites", "site", path
            )
        if path.startswith(b"/v1/"):
            return self._handle_v1(conn, req, path)
        return self._handle_control(conn, req)

    async def _handle_control(self, conn: ClientConn, req: Request) -> bool:
        """Any other path: the agent's control app, told whether API keys are on and which key
        the caller named (``asgi_call.KEYS_SCOPE``): it decides which paths need an admin key
        and answers the dashboard's ``/ui/session`` (``control.access``)."""
        if self.control_app is None:
            await send_error(conn, 404, "no such endpoint", "not_found")
            return True
        keys = self.api_keys
        on = keys is not None and keys.enabled
        key = key_of(req.headers, keys) if keys is not None and on else None
        scope = {KEYS_SCOPE: on, KEY_SCOPE: key}
        return await answer_asgi(conn, req, self.control_app, scope, self._idle_s)

    def _handle_v1(self, conn: ClientConn, req: Request, path: bytes) -> Coroutine[Any, Any, bool]:
        """``/v1`` paths that are not in ``ENDPOINTS``: the model list, the stateful Responses
        follow-ups (routed by the response id), and 404 for anything else."""
        if path == b"/v1/models":
            if req.method not in (b"GET", b"HEAD"):
                return self._method_not_allowed(conn, b"GET, HEAD", path)
            # With keys on, the list needs a key, as OpenAI's and vLLM's do.
            checked = authorize(req.headers, self.api_keys, self.rate_limiter, self.clock.now())
            if isinstance(checked, Rejection):
                return self._reject(conn, checked, path)
            return self._answer(conn, self.models_body(), head_only=req.method == b"HEAD")
        if path.startswith(BATCH_API_PREFIXES):
            return self._handle_batch_api(conn, req, path)
        follow_up = response_follow_up(path)
        if follow_up is not None:
            kind, rid = follow_up
            allow = b"POST" if kind == RESPONSE_CANCEL else b"GET"
            if req.method != allow:
                return self._method_not_allowed(conn, allow, path)
            forward = req.headers.get(FORWARD_HEADER)
            if forward is not None:
                return self.attempts.serve_forward(conn, req, forward)
            return self._route_follow_up(conn, req, kind, rid)
        return self._answer_error(
            conn,
            404,
            f"no such endpoint: {text_of(path)} (the endpoints this mesh serves are listed in "
            f"{ENDPOINT_DOCS})",
            "not_found",
            path,
        )

    async def _handle_batch_api(self, conn: ClientConn, req: Request, path: bytes) -> bool:
        """``/v1/files*`` and ``/v1/batches*``: the Batch API (``fabricnode.batch.api``, handed
        in by the agent), after the same key and rate checks as any ``/v1`` request; the app
        learns the caller's key id (``fabric.owner``), which owns what it creates."""
        app = self.batch_app
        if app is None:
            await send_error(
                conn, 404, "the Batch API is off on this agent", "not_found", path=path
            )
            return True
        checked = authorize(req.headers, self.api_keys, self.rate_limiter, self.clock.now())
        if isinstance(checked, Rejection):
            return await self._reject(conn, checked, path)
        owner = checked.key_id if checked is not None else "-"
        return await answer_asgi(conn, req, app, {OWNER_SCOPE: owner}, self._idle_s)

    async def _answer(self, conn: ClientConn, body: bytes, *, head_only: bool) -> bool:
        await self.reactor.send_all(conn.sock, full_response(200, body, head_only=head_only))
        return True

    async def _answer_error(
        self, conn: ClientConn, status: int, message: str, code: str, path: bytes = b""
    ) -> bool:
        await send_error(conn, status, message, code, path=path)
        return True

    async def _method_not_allowed(self, conn: ClientConn, allow: bytes, path: bytes) -> bool:
        await send_error(
            conn,
            405,
            f"method not allowed; use {allow.decode()}",
            "method_not_allowed",
            extra=[(b"allow", allow)],
            path=path,
        )
        return True

    def models_body(self) -> bytes:
        declared = self.declared_models() if self.declared_models is not None else None
        return models_body(self.table.listing(), declared)

    # == routing =============================================================================

    def _handle_across(
        self, conn: ClientConn, req: Request, path: bytes, kind: str, forward: bytes | None
    ) -> Coroutine[Any, Any, bool]:
        """A model-routed request that is not a client's own: one a peer site's gateway sent
        over the link (``FROM_SITE_HEADER``, set by the frontdoor only on such connections),
        one another ingress of our site asks us, a gateway, to take out of the site
        (``OUT_HEADER``, its forward signed for that) or to route anywhere, our site first
        (``PUSH_HEADER``: its nodes could not admit it), or an ordinary forward to our engine."""
        headers = req.headers
        from_site = headers.get(FROM_SITE_HEADER)
        if from_site is not None:
            site = from_site.decode("ascii", "replace")
            allowed = self.across.taken_in(site, headers)
            if isinstance(allowed, Rejection):
                return self._reject(conn, allowed, path)
            routed = decode_as(kind, headers, req.body, None)
            if isinstance(routed, Rejection):
                return self._reject(conn, routed, path)
            routed.sites = narrow(routed.sites, allowed)
            if routed.batch:  # batch work of another site: queued fairly beside our tenants
                routed.tenant = f"site:{site}"
            return self._route_decoded(conn, req, path, kind, routed, self.clock.now(), site)
        assert forward is not None
        push = PUSH_HEADER in headers  # route it anywhere, our site first (``sites`` rule 5)
        if OUT_HEADER not in headers and not push:
            return self.attempts.serve_forward(conn, req, forward)
        target = self.core.self_id + (PUSH_SUFFIX if push else OUT_SUFFIX)
        try:
            allowed = self.attempts.check_forward(req, forward, target)
        except (ForwardRejected, ValueError) as exc:
            why = Rejection(403, f"forward refused: {exc}", "forward_refused")
            return self._reject(conn, why, path)
        if self.across.offers is None:
            why = Rejection(
                503, "this agent is not a gateway", "no_eligible_node", [(b"retry-after", b"1")]
            )
            return self._reject(conn, why, path)
        # The ingress that sent it checked the client's key; its credentials stayed there,
        # its limits came as the allowed sites the forward signs.
        routed = decode_as(kind, headers, req.body, None)
        if isinstance(routed, Rejection):
            return self._reject(conn, routed, path)
        routed.sites = narrow(routed.sites, allowed)
        now = self.clock.now()
        return self._route_decoded(conn, req, path, kind, routed, now, "", not push)

    def _route(
        self, conn: ClientConn, req: Request, path: bytes, kind: str
    ) -> Coroutine[Any, Any, bool]:
        """Check and route a request: the coroutine that answers it (await it)."""
        started = self.clock.now()
        body = req.body
        headers = req.headers
        owner = headers.get(OWNER_HEADER)
        if owner is None:
            routed = decode(kind, headers, body, self.api_keys, self.rate_limiter, started)
        else:  # our Batch API worker, for a tenant: batch tier, no rate limit (the gate governs)
            owned = owner_of(owner, self.batch_token, self.api_keys)
            if isinstance(owned, Rejection):
                return self._reject(conn, owned, path)
            routed = decode_as(kind, headers, body, owned[0], owned[1])
        if isinstance(routed, Rejection):
            return self._reject(conn, routed, path)
        return self._route_decoded(conn, req, path, kind, routed, started)

    def _route_decoded(
        self,
        conn: ClientConn,
        req: Request,
        path: bytes,
        kind: str,
        routed: Routed,
        started: float,
        from_site: str = "",
        out: bool = False,
    ) -> Coroutine[Any, Any, bool]:
        """Route a checked request (``from_site``: it came from that peer site; ``out``: we,
        a gateway, take it out of our site: to peer sites only)."""
        body = req.body
        headers = req.headers
        model = routed.model
        model_sites = self.model_sites(model) if self.model_sites is not None else None
        if model_sites is not None:
            routed.sites = narrow(routed.sites, model_sites)
        routes = None if out else self.table.routes(model)
        self._forget_removed()
        hold_s = None
        waking = False
        if routed.sites is not None and not out:
            # Data residency: only the replicas at an allowed site (awake ones first), or the
            # 403 when there are none and none may come. A request limited to sites never
            # leaves this site until the gateways check residency (docs/federation.md).
            within = self.across.within(routed, model_sites, routes)
            if isinstance(within, Rejection):
                return self._reject(conn, within, path)
            routes, waking = within
        elif not routes and not out:
            # Only sleeping replicas (if any): one is woken by the request (the cold path).
            routes = self.table.sleeping(model)
            waking = routes is not None
        doc = routed.doc
        response_owner = None
        elsewhere = False  # continues a response another site stores: only there
        if kind == RESPONSES and not out:
            held = self.across.responses_routes(routed, routes, from_site, self._pinned_node)
            if isinstance(held, Rejection):
                return self._reject(conn, held, path)
            routes, response_owner, held_at = held
            elsewhere = bool(held_at)
        leaving = False
        if not routes:
            # No node of our site: another site's, or the wait for a declared model's start
            if not out and not elsewhere and self.declared is not None:
                hold_s = self.declared(model)
            retry_after_s = self.config.retry_after_s
            there = self.across.without_nodes(routed, out, from_site, hold_s, retry_after_s)
            if isinstance(there, Rejection):
                return self._reject(conn, there, path)
            routes, hold_s = there
            leaving = bool(routes) and not out
        job = Job(kind, model, routed.stream, body, path, headers, routed.key, started, doc)
        job.sites = routed.sites
        if from_site:
            job.from_site = from_site
        if out:
            job.out = True
        if req.http_version == "1.0":
            job.http10 = True
        if waking:
            job.waking = True
        if routed.batch:
            job.slot = BatchSlot(routed.tenant)
        if kind in PREFILL_KINDS:
            job.prefill_tokens = routed.prompt_tokens_est
        if kind in PREPARED_KINDS:
            if kind == RESPONSES and leaving:
                # to another site: its gateway names its node; ours, the owner (``responses``)
                job.body = self.across.outgoing_response(routed)
            elif kind == RESPONSES and not out:
                job.retag = True  # each attempt names its node in the response id
                job.response_owner = response_owner
            else:  # a form goes on with its boundary
                job.content_type = req.headers.get(b"content-type", job.content_type)
        if not routes:
            assert hold_s is not None
            return self._wait_for_replica(conn, job, routed, hold_s, frozenset())
        # a gateway prices prefixes across sites even with one node (``sites`` rule 7)
        if (len(routes) > 1 or self.across.prices(job)) and self.policy.name.startswith("prefix"):
            routed.prefix_blocks = routing.prompt_blocks(prompt_text(doc, kind))
        return self._dispatch(conn, job, routed, routes)

    def _pinned_node(self, sid: str) -> PinnedNode:
        """What the mesh says of node ``sid`` (its registry state and ``schema.standing``
        verdict), for a Responses refusal's reason."""
        entry = self.core.registry.get(sid)
        state = entry.body.state if entry is not None else State.LEFT
        return PinnedNode(state, self.core.standing(sid, state), self.table.node(sid) is not None)

    def _route_follow_up(
        self, conn: ClientConn, req: Request, kind: str, rid: str
    ) -> Coroutine[Any, Any, bool]:
        """``GET /v1/responses/{id}`` or ``POST /v1/responses/{id}/cancel``: to the node whose
        engine stored the response, which its id names (``endpoints.response_id``). The same
        checks as a routed request (key, rate, provider and requirement headers), no policy and
        no failover to another node (no other node holds the response)."""
        started = self.clock.now()
        path = req.path
        headers = req.headers
        checked = authorize(headers, self.api_keys, self.rate_limiter, started)
        if isinstance(checked, Rejection):
            return self._reject(conn, checked, path)
        filters = route_headers(headers, checked)
        if isinstance(filters, Rejection):
            return self._reject(conn, filters, path)
        held_at = site_of_response(rid)
        if held_at and held_at != self.site:
            return self._reject(conn, responses.held_elsewhere(rid, held_at), path)
        if checked is not None and not responses.owned(rid, checked.key_id, self.core.keyring):
            return self._reject(conn, responses.not_yours(rid), path)  # keys on: its owner's
        stream = kind != RESPONSE_CANCEL and b"stream=true" in req.target.partition(b"?")[2]
        providers, requirements = filters
        routed = Routed(kind, "-", stream, {}, checked, providers, requirements, None, 0)
        route = responses.follow_up(
            rid,
            self.table.node,
            lambda r: bool(self._candidates([r], routed, set(), started, self.wall_clock())),
            self._pinned_node,
        )
        self._forget_removed()
        if isinstance(route, Rejection):
            return self._reject(conn, route, path)
        # The query (``stream``, ``starting_after``) goes with it: the target is what is sent.
        job = Job(kind, "-", stream, b"", req.target, headers, checked, started, None)
        job.sites = routed.sites
        job.method = req.method
        if req.http_version == "1.0":
            job.http10 = True
        return self._dispatch(conn, job, routed, [route])

    async def _wait_for_replica(
        self,
        conn: ClientConn,
        job: Job,
        routed: Routed,
        hold_s: float,
        failed: frozenset[str],
    ) -> bool:
        """Scale from zero: hold a request for a declared model while a replica starts, then
        route it (``coldstart`` decides, ``coldwait`` waits). A stream gets its 200 SSE head
        at once and a comment every ``replica_keepalive_s``; past ``hold_s`` (from the
        request's arrival) the answer is 503 (Retry-After) or, for a stream, the error event.
        Also where a request whose every node failed before answering (``failed``) waits for
        another. The cold path: no cost to requests for served models."""
        model = job.model
        full = self.replica_room.enter(model)
        if full is not None:
            await send_error(conn, 503, full.message, full.code, extra=full.headers, path=job.path)
            return True

        def lookup(tried: set[str]) -> list[Route] | None:
            routes = self.table.routes(model)
            if not routes:
                routes = self.table.sleeping(model)
                job.waking = routes is not None
            if not routes:
                # no node of ours: a peer site that serves it by now, or that would start it
                # sooner than ours (our Slurm refused it meanwhile: ``sites`` rule 8)
                routes = self.across.waits_elsewhere(routed, job.from_site)
            if routes and self._candidates(
                routes, routed, tried, self.clock.now(), self.wall_clock()
            ):
                return routes
            return None

        try:
            got = await self.replica_waits.wait(conn, job, hold_s, failed, lookup)
        except ClientGone:
            job.status = 499
            self._account(job, 0)
            raise
        if isinstance(got, Rejection):
            job.status = 503
            if job.held_head:
                await self.relay.end_stream(conn, job, got.message, got.code)
            else:
                await send_error(conn, 503, got.message, got.code, extra=got.headers, path=job.path)
            self._account(job, 0)
            return not conn.closing
        return await self._dispatch(conn, job, routed, got)

    def _forget_removed(self) -> None:
        if not self.table.removed:
            return
        for sid in self.table.take_removed():
            self.policy.on_removed(sid)
            self.breaker.forget(sid)
            self.remote_inflight.pop(sid, None)
            self.gate.forget(sid)
            self.prefill.forget(sid)

    async def _dispatch(
        self,
        conn: ClientConn,
        job: Job,
        routed: Routed,
        routes: list[Route],
    ) -> bool:
        """Try the candidates in turn until one answers (else 503), then account the request.

        False closes the connection.
        """
        cfg = self.config
        fo = Failover(job.started, cfg.max_attempts, cfg.retry_budget_s, cfg.max_engine_failures)
        tried = fo.tried
        policy = self.policy
        answered = False
        fallback: float | None = None  # seconds a request no node answered may wait for one
        observed = -1  # candidates for the first attempt, observed when the request is done
        refusal = ""  # why the batch gate sent the request away (GATE_FULL, GATE_TIMEOUT)
        slot = job.slot  # a batch request's (``tiers``); None for an interactive one
        left = False  # the routes left the site (failover to a peer site, or pushed)
        home: list[Route] | None = None  # our site's routes, while the request is pushed
        if slot is None:
            self.answering += 1
        try:
            while fo.may_try(now := self.clock.now() if tried else job.started):
                wall = self.wall_clock()  # load reports carry wall-clock times
                candidates = self._candidates(
                    routes, routed, tried, now, wall, interactive=slot is None
                )
                if not candidates and not left and self.across.may_go_out(job, routes):
                    # Every node of our site failed or none is eligible: another site.
                    left = True
                    out = self.across.out_routes(job.model, job.sites)
                    if out:
                        routes = out
                        candidates = self._candidates(routes, routed, tried, now, wall)
                if not candidates and home is not None:
                    # Pushed, and no gateway or site took it before its first byte: it waits
                    # for our own nodes after all.
                    routes, home = home, None
                    candidates = self._candidates(routes, routed, tried, now, wall)
                if not tried:
                    observed = len(candidates)
                if not candidates:
                    break
                ranked: list[routing.Candidate] | None
                if slot is not None and routes[0].hop == HOP_NODE:
                    # Only to a node with room for batch work, else held in the gate. (A batch
                    # request leaving the site goes on as batch work: the gate of the site that
                    # takes it in holds it, where the nodes' load is known.)
                    admitted = await self.gate_waits.admit(conn, job, routed, tried)
                    if isinstance(admitted, str):
                        refusal = admitted
                        break
                    if admitted is None:
                        break  # no eligible node left
                    ranked, routes = admitted
                    now, wall = self.clock.now(), self.wall_clock()
                    fo.restart_clock(now)  # the time it waited is not failover time
                elif (
                    (len(candidates) == 1 and (left or not self.across.federated()))
                    or job.waking
                    or routes[0].hop != HOP_NODE
                ):
                    # One candidate: nothing to choose and no use holding (the request would
                    # wait for the same node either way) unless the site is federated, where
                    # a request that node cannot admit is pushed; the policy is skipped, as
                    # prompt hashing was.
                    ranked = candidates
                else:
                    ranked = policy.rank(routed, candidates, wall)
                if not left and (
                    ranked is None
                    or ranked[0].prefill_s > 0.0
                    or (routed.prefix_blocks and self.across.prices(job))  # rule 7
                ):
                    # Two-layer routing: none of our nodes can admit it now (``sites`` rule 5),
                    # or the pick would answer it later than a peer site would (rules 6 and 7):
                    # pushed to a gateway of ours, or from a gateway to that site; with
                    # neither, it waits here for our nodes.
                    wait = None if ranked is None else ranked[0].prefill_s
                    prompt = self.across.prompt(
                        job,
                        len(routed.prefix_blocks),
                        ranked,
                        lambda sid: policy.held_blocks(routed, sid),
                        self.prefill.rate,
                    )
                    out = self.across.push(job, routes, routed.session_key, wait, prompt)
                    pushed = self._candidates(out, routed, tried, now, wall) if out else []
                    if pushed:
                        left = True
                        home, routes, ranked = routes, out, pushed
                        self.metrics.decision(policy.name, "push")
                if ranked is None:
                    ranked = await self._hold(routed, routes, tried, candidates)
                    if not ranked:
                        break
                pick = ranked[0].node.session_id
                route = route_of(routes, pick)
                fo.picked(pick)
                if home is not None and route.hop == HOP_SITE:
                    self.across.pushed_to(routed.session_key, route.info.site)
                if job.splice is not None:
                    log.info("stream continuation %d goes to %s", job.resumes, pick[:8])
                policy.on_routed(routed, pick, wall)
                attempt = self.attempts.attempt(conn, job, route, now)
                outcome: Failed | None
                try:
                    if isinstance(attempt, Failed):
                        outcome = attempt
                    elif (
                        slot is not None
                        and route.hop == HOP_NODE
                        and slot.preemptions < cfg.batch_max_preemptions
                    ):
                        outcome = await self.gate_waits.preemptible(job, pick, attempt)
                    else:
                        outcome = await attempt
                finally:
                    # Metrics only: counted once the attempt is over, off the request's path.
                    self.metrics.decision(policy.name, "first" if len(tried) == 1 else "retry")
                    if slot is not None and slot.node is not None:
                        self.gate_waits.done(job)  # its slot on that node is free again
                if outcome is None:
                    self.breaker.succeeded(pick)
                    answered = True
                    break
                if outcome is TAKEN_BACK:
                    fo.preempted(pick)
                    continue
                self.breaker.failed(pick, self.clock.now())
                self.metrics.ejections.inc()
                if outcome is RESUMED:
                    # The stream broke mid-answer and a continuation is ready: it gets attempts
                    # and time of its own, on the nodes not tried yet.
                    if not job.waking:
                        routes = self.table.routes(job.model) or routes  # joined since
                    fo.resumed(self.clock.now())
                    self.metrics.stream_resumes.labels("resumed").inc()
                    log.info("stream from %s broke: continuing it on another node", pick[:8])
                    continue
                if fo.failed(outcome):
                    self.metrics.poisoned.inc()
                    log.warning("%s: %s", job.model, fo.poison_message())
                    break
                self.retries += 1
                self.metrics.retries.labels(outcome.retry_reason).inc()
                log.info("attempt on %s failed before the first byte: %s", pick[:8], outcome)
            if answered:
                keep = job.status != 0 and not job.close
            elif refusal:
                job.status = 503
                why = self.gate.refusal(refusal)
                if job.held_head:
                    await self.relay.end_stream(conn, job, why.message, why.code)
                else:
                    await send_error(
                        conn, 503, why.message, why.code, extra=why.headers, path=job.path
                    )
                keep = not job.close
            elif job.splice is not None:
                # A resumed stream no node could continue: the client holds an open stream,
                # which ends well-formed with the error event.
                self.metrics.stream_resumes.labels("failed").inc()
                job.status = 502
                await self.relay.end_stream(
                    conn, job, f"the serving node failed mid-stream: {fo.last_error}"
                )
                keep = not job.close
            elif fo.poisoned:
                # Engines failed on this request on several nodes: it is not tried on more
                # (nor held for a replica), so that it cannot take down every one in turn.
                job.status = 502
                message = fo.poison_message()
                if job.held_head:
                    await self.relay.end_stream(conn, job, message)
                    keep = not job.close
                else:
                    await send_error(conn, 502, message, "request_failed_on_nodes", path=job.path)
                    keep = True
            elif (wait_s := self._may_wait(job)) is not None:
                # Every node failed before answering (leaving, preempted, crashed) and the model
                # is declared: wait for another replica rather than fail the request.
                fallback = wait_s
                keep = True
            elif job.held_head:
                job.status = 502
                await self.relay.end_stream(
                    conn, job, f"no node could take the request: {fo.last_error}"
                )
                keep = not job.close
            else:
                job.status = 503
                what = repr(job.model) if job.model != "-" else "the stored response"
                await send_error(
                    conn,
                    503,
                    f"no node could take the request for {what}: {fo.last_error}",
                    "no_eligible_node",
                    extra=[(b"retry-after", b"%d" % cfg.retry_after_s)],
                    path=job.path,
                )
                keep = True
        except ClientGone:
            job.status = job.status or 499
            self._account(job, observed)
            raise
        finally:
            if slot is None:
                self.answering -= 1
                self.relay.notify()  # a leaving node's drain may be waiting for the last one
            if job.transcript is not None:
                job.transcript.release()
            if slot is not None and slot.node is not None:  # left between admission and attempt
                self.gate_waits.done(job)
        if fallback is not None:
            log.info("no node answered for %s: waiting for a replica", job.model)
            return await self._wait_for_replica(conn, job, routed, fallback, frozenset(tried))
        self._account(job, observed)
        return keep and not conn.closing

    def _may_wait(self, job: Job) -> float | None:
        """The hold time of a declared model if a request no node answered may still wait
        for a replica (its hold time, counted from its arrival, is not over), else None."""
        if self.declared is None:
            return None
        hold_s = self.declared(job.model)
        if not hold_s or self.clock.now() >= job.started + hold_s:
            return None
        return hold_s

    def _candidates(
        self,
        routes: list[Route],
        routed: Routed,
        tried: set[str],
        now: float,
        wall_now: float,
        *,
        interactive: bool = False,
    ) -> list[routing.Candidate]:
        """Eligible nodes (``RouteTable.eligible``) this request has not tried yet, with their
        prefill backlogs; for an ``interactive`` request, with our batch requests it will not
        wait for marked hidden (``routing.Candidate.hidden``). Routes that leave the site:
        ``_gateway_candidates``."""
        if routes and routes[0].hop != HOP_NODE:
            return self._gateway_candidates(routes, tried, now)
        eligible = self.table.eligible(
            routes,
            now=now,
            wall_now=wall_now,
            inflight=self.remote_inflight,
            breaker=self.breaker,
            providers=routed.providers,
            requirements=routed.requirements,
            sites=routed.sites,
        )
        if tried:
            eligible = [c for c in eligible if c.node.session_id not in tried]
        prefill = self.prefill
        if len(prefill):
            for c in eligible:
                c.prefill_s = prefill.backlog(c.node.session_id, now)
        hidden = self.batch_hidden
        if interactive and hidden:
            by_priority = {r.info.session_id for r in routes if r.priority}
            for c in eligible:
                sid = c.node.session_id
                if sid in by_priority:
                    c.hidden = hidden.get(sid, 0)
        return eligible

    def _gateway_candidates(
        self, routes: list[Route], tried: set[str], now: float
    ) -> list[routing.Candidate]:
        """The gateways (ours, or a peer site's) not tried yet, in the routes' order: ours
        while the mesh says they are up, a peer site's while its summary is routable (the
        chooser kept only those); ejected ones last (a breaker must not turn a blip into an
        outage)."""
        core = self.core
        breaker = self.breaker
        inflight = self.remote_inflight
        ok: list[routing.Candidate] = []
        ejected: list[routing.Candidate] = []
        for r in routes:
            sid = r.info.session_id
            if sid in tried:
                continue
            if r.hop == HOP_GATEWAY:
                entry = core.registry.get(sid)
                if entry is None or core.standing_of(entry) < Standing.LIVE:
                    continue
            cand = routing.Candidate(r.info, None, inflight.get(sid, 0))
            (ejected if breaker.ejected(sid, now) else ok).append(cand)
        return ok or ejected

    async def _hold(
        self,
        routed: Routed,
        routes: list[Route],
        tried: set[str],
        held: list[routing.Candidate],
    ) -> list[routing.Candidate] | None:
        """Pending-aware pushing (``hold``): wait (bounded) until some node has room, then rank
        again. It wakes when one of our requests ends or the mesh changes (``Relay.release``), or
        at the hold's deadline (its end, or a report that kept it going stale)."""
        now = self.clock.now()
        hold = Hold(
            self.policy,
            routed,
            now,
            hold_max_s=self.config.hold_max_s,
            stale_after_s=routing.DEFAULT_CONFIG.load_stale_after_s,
        )
        hold.held(held, now, self.wall_clock())
        self.metrics.decision(self.policy.name, "hold")
        relay = self.relay
        relay.holders += 1
        try:
            while True:
                # A node back from ejection may be open: also look again then.
                wake = min(hold.next_deadline(), self.breaker.next_readmission(now))
                with trio.move_on_at(wake):
                    await relay.released.wait()
                now = self.clock.now()
                wall = self.wall_clock()
                cands = self._candidates(routes, routed, tried, now, wall, interactive=True)
                if not cands:
                    return None
                ranked = hold.rank(cands, now, wall)
                if ranked is not None:
                    return ranked
        finally:
            relay.holders -= 1

    # == the batch gate (``gate``) ==========================================================

    def _gate_lookup(
        self, w: BatchWaiter, now: float, wall: float
    ) -> tuple[list[Route], list[routing.Candidate]] | None:
        """What the gate sees of a waiter's nodes: its routes (only sleeping replicas: one is
        woken; a stored response's node only) and the eligible ones it has not tried."""
        job = w.job
        routes = self.table.routes(job.model)
        if not routes:
            routes = self.table.sleeping(job.model)
            job.waking = routes is not None
        if routes and w.routed.pinned is not None:
            pinned = w.routed.pinned
            routes = [r for r in routes if r.info.session_id == pinned]
        if not routes:
            return None
        return routes, self._candidates(routes, w.routed, w.tried, now, wall)

    def mesh_changed(self) -> None:
        """The mesh's view may have changed (the agent's gossip service received or timed
        something: a load report, a node joining or going): what waits for it looks again."""
        self.gate_waits.wake()
        self.relay.release()  # held requests look again
        self.replica_waits.wake()  # requests waiting for a replica too

    # == accounting ==========================================================================

    def _account(self, job: Job, candidates: int = -1) -> None:
        """The request is answered: note when, and leave the rest to ``settle``."""
        self.settler.answered(job, candidates, self.clock.now())

    def settle(self) -> None:
        """The bookkeeping of every request answered so far (see ``Settler.settle``)."""
        self.settler.settle()

    def recent_export(self, now: float, window_s: float) -> list[dict[str, Any]]:
        """What this ingress answered in the last ``window_s`` (wall clock ``now``), per model
        and 10-second bucket, as mergeable rows (``recent``; the dashboard's figures)."""
        self.settle()
        return self.settler.recent.export(now, window_s)

    async def _settle_loop(self) -> None:
        while True:
            await trio.sleep(SETTLE_INTERVAL_S)
            self.settle()
