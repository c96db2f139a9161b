"""The agent's read-only control surface: a raw ASGI app (no framework) for hypercorn's trio worker.

Endpoints (all GET; HEAD is answered like GET without a body):

* ``/health`` — 200 ``{"status": "ok"}`` while the process runs.
* ``/ready`` — 200 ``{"status": "ready"}`` once the agent has joined (see ``agent.JoinTracker``),
  else 503 ``{"status": "joining"}``; 503 ``{"status": "left"}`` once it is leaving.
* ``/ping`` (GET or POST, as vLLM's) — the same answer as ``/ready``: whether this agent takes
  requests.
* ``/version`` — ``{"version": <fabricnode's>, "engines": [{"kind", "version", "nodes"}]}``: the
  agent's version and the engines SERVING nodes of the mesh run (an engine's own ``/version``
  answers for one engine; the mesh may run several kinds and versions).
* ``/fabric/v1/self`` — this agent's own entry (the entry view of ``views``).
* ``/fabric/v1/nodes`` — ``{"nodes": [...]}``; query filters ``state``, ``model``, ``gpu``,
  ``site`` (exact; 400 for a name no site can have), ``label=K=V`` (repeatable, all must
  match).
* ``/fabric/v1/nodes/{session_id}`` — one entry; a unique prefix of the id is accepted
  (404 unknown, 409 ambiguous prefix).
* ``/fabric/v1/models`` — ``{"models": [...]}``, see ``views.models_view``.
* ``/fabric/v1/assignments`` — GET: the engine assignments this agent holds
  (``fabricnode.mesh.assignment``); POST ``{"assignments": [{"signed", "signature"}, ...]}``
  (operator-signed, base64; what ``fabric plan --apply`` sends): each is verified, stored and
  spread through the mesh; the answer lists each one's outcome (``new``, ``stale``,
  ``untrusted``, ...). 400 malformed, 413 too large.
* ``/fabric/v1/services`` — GET: the service file this agent holds
  (``fabricnode.mesh.servicedoc``: ``{"services": {"issued_at", "operator", "digest", "bytes",
  "text"} | null, "trusted_operators"}``); POST ``{"signed", "signature"}`` (operator-signed,
  base64; what ``fabric services apply`` sends): verified, stored and spread; the answer is its
  outcome (``new``, ``stale``, ``untrusted``, ...). 400 malformed, 413 too large.
* ``/fabric/v1/controller`` — with ``--controller``: its role (acting or standby), the acting
  controller, each declared model's target and jobs, and the recent decisions with their
  reasons (``fabricnode.elastic.controller.summarise``); 404 without a controller.
* ``/fabric/v1/workload`` — this ingress's request log summarised per model over the last
  ``window`` seconds (default 3600): request count and token sums, the planner's workload.
  With ``after=<cursor>`` instead (``end`` to start): only what the log gained after the
  cursor, per model (requests, prompt and output tokens, a TTFT histogram:
  ``requestlog.sums.recent_sums``), and the next ``cursor``; the elastic controller polls it.
  With ``history=<seconds>&bin=<seconds>``: the same sums by bin (aligned to multiples of
  ``bin``) over the last ``history`` seconds, the ``cursor`` after them, and ``covers_from``
  (null: the log holds every request this agent ever answered; else the time from which its
  kept files do): a controller that takes over replays them into its scaling policy.
* ``/fabric/v1/stats`` — per model, requests/s, output tokens/s, errors and TTFT and
  end-to-end p50/p95 in 10-second buckets over the last ``window`` seconds (at most 600) and a
  summary of the last minute: the whole mesh's (every live agent asked, ``meshstats``), or
  with ``scope=self`` only this agent's counts, as mergeable rows (``dataplane.recent``).
* ``/fabric/v1/fleet`` — the service file this agent holds (without its text), the acting
  controller and its ``/fabric/v1/controller`` answer, asked from it wherever it runs
  (``fleet``); ``controller`` is null when the mesh runs none. Always 200.
* ``/fabric/v1/self/engine`` and ``/fabric/v1/nodes/{session_id}/engine`` — the engine command
  (secret-looking values hidden), which only the node's own agent knows: asked of it
  (``enginecmd``); ``command`` null with a ``reason`` when it cannot be told.
* ``/fabric/v1/nodes/{session_id}/load`` — that node's recent load reports
  (``loadhistory``): ``{"session_id", "samples": [{"at", "waiting", "running", "kv_usage",
  "inflight"}]}``.
* ``/fabric/v1/sites`` — on a gateway (``--gateway``): its site, key fingerprint and federation
  address, and per peer site whether it is routable, its summary's age and content (models and
  their capacity, gateways), the RTT and the links up (``federation.link.Gateway.sites_doc``);
  404 on an agent that is not a gateway.
* ``/metrics`` — Prometheus text, every name prefixed ``fabric_``.
* ``/ui`` (and ``/ui/<file>``) — the dashboard's files (``fabricnode.ui``), with a strict
  Content-Security-Policy; ``/`` redirects a browser (``Accept: text/html``) there, and
  ``/favicon.ico`` (which a browser asks of any page here) is the dashboard's icon.

Errors have the OpenAI shape ``{"error": {"message", "type", "code"}}``: 400 bad query, 404 unknown
path or session, 405 wrong method, 409 ambiguous prefix, 500 a bug (logged). The app reads the
``MeshCore`` synchronously from the same trio thread that drives it, so every response is a
consistent snapshot without locks.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, unquote

import trio
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from fabricnode import __version__, ui
from fabricnode.asgi import Receive, Send, header, lifespan
from fabricnode.control import access
from fabricnode.control.enginecmd import node_engine, own_engine
from fabricnode.control.fleet import fleet_view
from fabricnode.control.loadhistory import LoadHistory
from fabricnode.control.meshstats import MeshStats, window_of
from fabricnode.control.peerauth import (
    CONTROLLER_PATH,
    SELF_ENGINE_PATH,
    STATS_PATH,
    PeerRejected,
    PeerVerifier,
)
from fabricnode.control.peerauth import HEADER as PEER_HEADER
from fabricnode.control.views import Json, entry_view, match_sessions, models_view, node_views
from fabricnode.dataplane.request import error_body
from fabricnode.elastic.controller import Controller, summarise
from fabricnode.engine.models import DROP_REASONS
from fabricnode.engine.service import EngineStatistics
from fabricnode.errors import DecodeError, FabricError
from fabricnode.mesh.assignment import ASSIGNMENTS_PATH, Offer, SignedAssignment
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.registry import SignedEntry, State
from fabricnode.mesh.service import TransportStatistics
from fabricnode.mesh.servicedoc import MAX_SERVICES_BYTES, SERVICES_PATH, SignedServices
from fabricnode.mesh.sites import site_problem
from fabricnode.metricfamilies import CONTENT_TYPE as METRICS_CONTENT_TYPE
from fabricnode.metricfamilies import (
    counter,
    counters_by,
    gauge,
    gauges_by,
    registry_of,
)
from fabricnode.requestlog.cursor import (
    CURSOR_END,
    parse_cursor,
    read_request_log_after,
    read_request_log_since,
)
from fabricnode.requestlog.format import TraceRecord
from fabricnode.requestlog.reader import read_request_log, request_log_files
from fabricnode.requestlog.sums import binned_sums, recent_sums, workload_sums

log = logging.getLogger("fabricnode.control.app")

Scope = Mapping[str, Any]

NODES_PREFIX = "/fabric/v1/nodes/"
WORKLOAD_PATH = "/fabric/v1/workload"
FLEET_PATH = "/fabric/v1/fleet"
SITES_PATH = "/fabric/v1/sites"
LOAD_SUFFIX = "/load"
ENGINE_SUFFIX = "/engine"
UI_PATH = "/ui"
FAVICON_PATH = "/favicon.ico"
UI_PREFIX = "/ui/"
MAX_POST_BYTES = 1024 * 1024
MAX_ASSIGNMENTS_PER_POST = 4096
DEFAULT_WORKLOAD_WINDOW_S = 3600.0
# ?history=: at most a day back, in at most this many bins (the answer stays small)
MAX_WORKLOAD_HISTORY_S = 86400.0
MAX_WORKLOAD_BINS = 8640
NODE_FILTERS = ("state", "model", "gpu", "site", "label")


class HasTransportStatistics(Protocol):
    def statistics(self) -> TransportStatistics: ...


class KeyringReloads(Protocol):
    keyring_reloads: int
    keyring_errors: int


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[bytes, bytes], ...] = ()
    cache_control: bytes = b"no-store"


class HttpError(Exception):
    """Raised inside a handler to answer with an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def json_response(doc: Json, status: int = 200) -> Response:
    return Response(status, json.dumps(doc, separators=(",", ":")).encode())


def error_response(status: int, message: str, code: str) -> Response:
    """The same OpenAI error body (and ``type`` per status) as the data plane's."""
    return Response(status, error_body(status, message, code))


def _access(scope: Scope, method: str, path: str) -> Response | None:
    """Through the ingress: the dashboard's session question, or the refusal of a request its
    key may not make (``access``); None: the app answers. No cache-control: as the ingress
    answered these itself."""
    if path == access.UI_SESSION_PATH and method in ("GET", "HEAD"):
        return Response(200, json_response(access.ui_session(scope)).body, cache_control=b"")
    denied = access.refusal(scope)
    if denied is None:
        return None
    status, message, code = denied
    return Response(status, error_body(status, message, code), cache_control=b"")


def _page_headers(path: str, response: Response) -> tuple[tuple[bytes, bytes], ...]:
    """The dashboard's security headers (``ui.HEADERS``: CSP, nosniff, no framing) on every
    answer under its paths, not only on its files: ``/ui/session``, a 404 or a 405 there is
    read by the same origin's page."""
    if path not in ("/", FAVICON_PATH, UI_PATH) and not path.startswith(UI_PREFIX):
        return ()
    present = {name.lower() for name, _ in response.headers}
    return tuple(h for h in ui.HEADERS if h[0] not in present)


async def _send(
    send: Send, method: str, response: Response, extra: tuple[tuple[bytes, bytes], ...]
) -> None:
    headers = [
        (b"content-type", response.content_type.encode()),
        (b"content-length", str(len(response.body)).encode()),
    ]
    if response.cache_control:
        headers.append((b"cache-control", response.cache_control))
    headers.extend(response.headers)
    headers.extend(extra)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    body = b"" if method == "HEAD" else response.body
    await send({"type": "http.response.body", "body": body, "more_body": False})


class AdminApp:
    """ASGI callable over one ``MeshCore`` plus the agent facts the core does not know.

    ``agent_endpoints=False`` serves only ``/health`` and ``/ready``: that is the public port
    when ``--admin`` moves the agent endpoints to a port of their own.
    """

    def __init__(
        self,
        core: MeshCore,
        *,
        is_ready: Callable[[], bool] = lambda: True,
        transport: HasTransportStatistics | None = None,
        keyring: KeyringReloads | None = None,
        wall_clock: Callable[[], float] = time.time,
        agent_endpoints: bool = True,
        extra_metrics: Callable[[], bytes] | None = None,
        request_log_path: Path | None = None,
        wake_gossip: Callable[[], None] = lambda: None,
        controller: Controller | None = None,
        engine: Callable[[], EngineStatistics | None] = lambda: None,
        stats: MeshStats | None = None,
        load_history: LoadHistory | None = None,
        engine_command: Callable[[], Sequence[str] | None] = lambda: None,
        sites: Callable[[], Json] | None = None,
    ) -> None:
        self.core = core
        self.sites = sites  # a gateway's view of the peer sites (None: not a gateway)
        self.engine_command = engine_command  # this node's engine argv (None: no engine)
        self.stats = stats  # the dashboard's rates and latencies (None: no data plane)
        self.load_history = load_history
        self.engine = engine  # the supervised engine's statistics (None: no engine)
        self.controller = controller  # --controller: its status and decisions
        self.wake_gossip = wake_gossip  # sends an accepted assignment now, not at the next tick
        self.is_ready = is_ready
        self.transport = transport
        self.keyring = keyring
        self.wall_clock = wall_clock
        self.agent_endpoints = agent_endpoints
        self.extra_metrics = extra_metrics  # the data plane's prometheus-client registry
        self.request_log_path = request_log_path
        self.started_at = wall_clock()
        self.requests = 0
        self.assignments_refused: Counter[str] = Counter()  # posted but not taken, by outcome
        self.services_refused: Counter[str] = Counter()
        self.metrics_registry = registry_of(AdminMetrics(self))
        # Other agents asking on a dashboard's behalf (``peerauth``): checked only where API
        # keys are on, which is the only place their header opens anything.
        self.peer_requests = PeerVerifier(core.keyring, core.self_entry.session_id)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets are not served; hypercorn closes the connection
        method = scope["method"]
        path = scope["path"]
        if access.KEYS_SCOPE in scope:  # through the ingress: its API keys rule (``access``)
            scope = self._peer_checked(scope, method)
            early = _access(scope, method, path)
            if early is not None:
                await _send(send, method, early, _page_headers(path, early))
                return
        self.requests += 1
        posting = self.agent_endpoints and path in (ASSIGNMENTS_PATH, SERVICES_PATH)
        try:
            if method == "POST" and path == "/ping":
                method = "GET"  # vLLM (and SageMaker) answer /ping to both
            if posting and method == "POST" and path == SERVICES_PATH:
                limit = 2 * MAX_SERVICES_BYTES  # base64 and the JSON around it
                response = self.post_services(await _read_body(receive, limit))
            elif posting and method == "POST":
                response = self.post_assignments(await _read_body(receive, MAX_POST_BYTES))
            elif method not in ("GET", "HEAD"):
                self.route(path)  # unknown paths are 404 whatever the method
                allowed = "GET or POST" if posting else "GET"
                raise HttpError(
                    405, f"method {method} not allowed; use {allowed}", "method_not_allowed"
                )
            elif self.agent_endpoints and path == WORKLOAD_PATH:
                response = await self.workload(_query(scope))
            elif self.agent_endpoints and path == STATS_PATH:
                response = await self.stats_view(_query(scope))
            elif self.agent_endpoints and path == SELF_ENGINE_PATH:
                response = json_response(own_engine(self.engine_command()))
            elif (
                self.agent_endpoints
                and path.startswith(NODES_PREFIX)
                and path.endswith(ENGINE_SUFFIX)
                and self.stats is not None
            ):
                sid = unquote(path[len(NODES_PREFIX) : -len(ENGINE_SUFFIX)])
                response = await self.node_engine(sid)
            elif self.agent_endpoints and path == FLEET_PATH and self.stats is not None:
                doc = await fleet_view(self.core, self.controller, self.stats.peers)
                response = json_response(doc)
            elif self.agent_endpoints and (path in ("/", FAVICON_PATH) or path.startswith(UI_PATH)):
                response = self.dashboard(path, scope)
            else:
                response = self.route(path)(_query(scope))
        except HttpError as exc:
            response = error_response(exc.status, exc.message, exc.code)
        except Exception:
            log.exception("admin request %s %s failed", method, scope.get("path"))
            response = error_response(500, "internal error", "internal_error")
        extra = _page_headers(path, response)
        if response.status == 405:
            extra = (*extra, (b"allow", b"GET, HEAD, POST" if posting else b"GET, HEAD"))
        await _send(send, method, response, extra)

    # -- routing ----------------------------------------------------------------------------

    def _peer_checked(self, scope: Scope, method: str) -> Scope:
        """``scope`` with what its ``X-Fabric-Peer`` header proves (``access.PEER_SCOPE``: the
        asking agent's session id) or why it proves nothing (``access.PEER_REFUSED_SCOPE``);
        unchanged without one."""
        value = header(scope, PEER_HEADER.encode())
        if value is None:
            return scope
        raw_path = scope.get("raw_path")
        if not isinstance(raw_path, bytes):
            raw_path = str(scope.get("path", "")).encode()
        query = scope.get("query_string") or b""
        target = raw_path + b"?" + query if query else raw_path
        try:
            sender = self.peer_requests.verify(
                value.encode("latin-1"), method=method, target=target, now=self.wall_clock()
            )
        except PeerRejected as exc:
            return {**scope, access.PEER_REFUSED_SCOPE: str(exc)}
        return {**scope, access.PEER_SCOPE: sender}

    def route(self, path: str) -> Callable[[list[tuple[str, str]]], Response]:
        if path == "/health":
            return self.health
        if path == "/ready" or path == "/ping":
            return self.ready
        if path == "/version":
            return self.version
        if self.agent_endpoints:
            if path == "/fabric/v1/self":
                return self.self_entry
            if path == "/fabric/v1/nodes":
                return self.nodes
            if path.startswith(NODES_PREFIX) and path.endswith(LOAD_SUFFIX):
                sid = unquote(path[len(NODES_PREFIX) : -len(LOAD_SUFFIX)])
                return lambda query: self.node_load(sid)
            if path.startswith(NODES_PREFIX) and len(path) > len(NODES_PREFIX):
                sid = unquote(path[len(NODES_PREFIX) :])
                return lambda query: self.node(sid)
            if path == "/fabric/v1/models":
                return self.models
            if path == ASSIGNMENTS_PATH:
                return self.assignments
            if path == SERVICES_PATH:
                return self.services
            if path == CONTROLLER_PATH:
                return self.controller_status
            if path == SITES_PATH:
                return self.sites_view
            if path == WORKLOAD_PATH:
                return lambda query: json_response({})  # answered in __call__ (async)
            if path == "/metrics":
                return self.metrics
        raise HttpError(404, f"no such endpoint: {path}", "not_found")

    # -- handlers ---------------------------------------------------------------------------

    def health(self, query: list[tuple[str, str]]) -> Response:
        return json_response({"status": "ok"})

    def ready(self, query: list[tuple[str, str]]) -> Response:
        if self.core.left:
            return json_response({"status": "left"}, 503)
        if self.is_ready():
            return json_response({"status": "ready"})
        return json_response({"status": "joining"}, 503)

    def version(self, query: list[tuple[str, str]]) -> Response:
        engines: Counter[tuple[str, str]] = Counter()
        for entry in self.core.registry:
            body = entry.body
            if body.state == State.SERVING and body.engine.kind:
                engines[(body.engine.kind, body.engine.version)] += 1
        return json_response(
            {
                "version": __version__,
                "engines": [
                    {"kind": kind, "version": version, "nodes": n}
                    for (kind, version), n in sorted(engines.items())
                ],
            }
        )

    def self_entry(self, query: list[tuple[str, str]]) -> Response:
        return json_response(entry_view(self.core, self.core.self_entry, self.wall_clock()))

    def nodes(self, query: list[tuple[str, str]]) -> Response:
        filters: dict[str, str] = {}
        labels: list[tuple[str, str]] = []
        for key, value in query:
            if key not in NODE_FILTERS:
                raise HttpError(
                    400,
                    f"unknown query parameter {key!r} (use {', '.join(NODE_FILTERS)})",
                    "invalid_parameter",
                )
            if key == "label":
                k, sep, v = value.partition("=")
                if not sep or not k:
                    raise HttpError(
                        400, f"label {value!r}: expected KEY=VALUE", "invalid_parameter"
                    )
                labels.append((k, v))
            else:
                filters[key] = value
        state: State | None = None
        if "state" in filters:
            try:
                state = State.parse(filters["state"])
            except ValueError as exc:
                raise HttpError(400, str(exc), "invalid_parameter") from None
        site = filters.get("site") or None
        if site is not None and site_problem(site):
            raise HttpError(400, f"site {site[:64]!r}: {site_problem(site)}", "invalid_parameter")
        views = node_views(
            self.core,
            self.wall_clock(),
            state=state,
            model=filters.get("model") or None,
            gpu=filters.get("gpu") or None,
            labels=labels,
            site=site,
        )
        return json_response({"nodes": views})

    def node(self, prefix: str) -> Response:
        return json_response(entry_view(self.core, self._one_node(prefix), self.wall_clock()))

    def _one_node(self, prefix: str) -> SignedEntry:
        matches = match_sessions(self.core, prefix)
        if not matches:
            raise HttpError(404, f"no node with session id {prefix!r}", "not_found")
        if len(matches) > 1:
            shown = ", ".join(e.session_id[:12] for e in matches[:5])
            raise HttpError(
                409,
                f"session id prefix {prefix!r} is ambiguous ({len(matches)} nodes: {shown})",
                "ambiguous_session_id",
            )
        return matches[0]

    def node_load(self, prefix: str) -> Response:
        entry = self._one_node(prefix)
        samples = [] if self.load_history is None else self.load_history.of(entry.session_id)
        return json_response({"session_id": entry.session_id, "samples": samples})

    async def node_engine(self, prefix: str) -> Response:
        entry = self._one_node(prefix)
        if entry.session_id == self.core.self_entry.session_id:
            doc = own_engine(self.engine_command())
        else:
            assert self.stats is not None
            doc = await node_engine(self.stats.peers, entry.session_id, entry.body.addresses.http)
        return json_response({"session_id": entry.session_id, **doc})

    async def stats_view(self, query: list[tuple[str, str]]) -> Response:
        if self.stats is None:
            raise HttpError(404, "this agent has no data plane to count requests", "not_found")
        params = dict(query)
        unknown = sorted(set(params) - {"scope", "window"})
        if unknown:
            raise HttpError(
                400,
                f"unknown query parameter {unknown[0]!r} (use scope, window)",
                "invalid_parameter",
            )
        try:
            window_s = window_of(params.get("window"))
        except ValueError as exc:
            raise HttpError(400, str(exc), "invalid_parameter") from None
        scope = params.get("scope", "mesh")
        if scope == "self":
            return json_response(self.stats.local(window_s))
        if scope != "mesh":
            raise HttpError(400, f"scope {scope!r}: expected mesh or self", "invalid_parameter")
        return json_response(await self.stats.gather(window_s))

    def dashboard(self, path: str, scope: Scope) -> Response:
        """The dashboard's files; ``/`` sends a browser to them."""
        if path == "/":
            if "text/html" not in (header(scope, b"accept") or ""):
                raise HttpError(404, "no such endpoint: / (the dashboard is at /ui)", "not_found")
            return Response(
                302, b"", "text/plain; charset=utf-8", ((b"location", UI_PATH.encode()),)
            )
        if path == FAVICON_PATH:
            name = "favicon.svg"  # what browsers ask any page of this origin for
        elif path in (UI_PATH, UI_PREFIX):
            name = ""
        elif path.startswith(UI_PREFIX):
            name = path[len(UI_PREFIX) :]
        else:
            raise HttpError(404, f"no such endpoint: {path}", "not_found")
        if name == "session":
            # On the --admin port (through the ingress it is answered first): no API keys are
            # checked here.
            return json_response(access.ui_session(scope))
        found = ui.asset(name)
        if found is None:
            raise HttpError(404, f"no such file: {path}", "not_found")
        headers = (*ui.HEADERS, (b"etag", found.etag.encode()))
        if header(scope, b"if-none-match") == found.etag:
            return Response(304, b"", found.content_type, headers, b"no-cache")
        return Response(200, found.body, found.content_type, headers, b"no-cache")

    def models(self, query: list[tuple[str, str]]) -> Response:
        return json_response({"models": models_view(self.core, self.wall_clock())})

    def assignments(self, query: list[tuple[str, str]]) -> Response:
        items = [a.describe() for a in self.core.assignments]
        trusted = sorted(self.core.assignments.trusted)
        return json_response({"assignments": items, "trusted_operators": trusted})

    def services(self, query: list[tuple[str, str]]) -> Response:
        current = self.core.services.current
        doc: Json | None = None
        if current is not None:
            doc = {**current.describe(), "text": current.body.text}
        trusted = sorted(self.core.services.trusted)
        return json_response({"services": doc, "trusted_operators": trusted})

    def sites_view(self, query: list[tuple[str, str]]) -> Response:
        if self.sites is None:
            raise HttpError(
                404, "this agent is not a gateway of its site (fabric start --gateway)", "not_found"
            )
        return json_response(self.sites())

    def controller_status(self, query: list[tuple[str, str]]) -> Response:
        if self.controller is None:
            raise HttpError(
                404, "this agent runs no controller (fabric start --controller)", "not_found"
            )
        return json_response(summarise(self.controller))

    def post_services(self, body: bytes) -> Response:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise HttpError(400, "body is not valid JSON", "invalid_json") from None
        try:
            item = SignedServices.from_json(doc)
        except DecodeError as exc:
            raise HttpError(400, f"malformed service file: {exc}", "invalid_services") from None
        outcome = self.core.publish_services(item, self.wall_clock())
        if outcome is Offer.NEW:
            log.info(
                "service file %s from operator %s: new",
                item.digest.hex()[:16],
                item.operator,
            )
        else:
            self.services_refused[outcome.value] += 1
            log.info("service file not taken: %s", outcome.value)
        self.wake_gossip()
        return json_response({"result": outcome.value, **item.describe()})

    def post_assignments(self, body: bytes) -> Response:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise HttpError(400, "body is not valid JSON", "invalid_json") from None
        raw = doc.get("assignments") if isinstance(doc, dict) else None
        if not isinstance(raw, list) or not raw:
            raise HttpError(
                400, 'expected {"assignments": [{"signed", "signature"}, ...]}', "invalid_body"
            )
        if len(raw) > MAX_ASSIGNMENTS_PER_POST:
            raise HttpError(
                413, f"at most {MAX_ASSIGNMENTS_PER_POST} assignments per request", "too_large"
            )
        try:
            items = [SignedAssignment.from_json(item) for item in raw]
        except DecodeError as exc:
            raise HttpError(400, f"malformed assignment: {exc}", "invalid_assignment") from None
        now = self.wall_clock()
        results = []
        refused: Counter[str] = Counter()
        for item in items:
            outcome = self.core.publish_assignment(item, now)
            results.append({"target": item.target, "result": outcome.value})
            if outcome is Offer.NEW:  # a trusted operator's new assignment: a line each
                log.info(
                    "assignment for %s (plan %s, operator %s): %s",
                    item.target[:8],
                    item.body.plan_id,
                    item.operator,
                    outcome.value,
                )
            else:  # anyone can post (or replay) these: counted, one line per request at most
                refused[outcome.value] += 1
        if refused:
            self.assignments_refused.update(refused)
            log.info(
                "assignments not taken: %s",
                ", ".join(f"{n} {why}" for why, n in sorted(refused.items())),
            )
        self.wake_gossip()
        return json_response({"results": results})

    async def workload(self, query: list[tuple[str, str]]) -> Response:
        params = dict(query)
        unknown = set(params) - {"window", "after", "history", "bin"}
        if unknown:
            raise HttpError(
                400,
                f"unknown query parameter {sorted(unknown)[0]!r} (use window, after or history)",
                "invalid_parameter",
            )
        if len({"window", "after", "history"} & set(params)) > 1:
            raise HttpError(400, "give one of window, after or history", "invalid_parameter")
        if "history" in params or "bin" in params:
            return await self._workload_history(params.get("history", ""), params.get("bin", ""))
        if "after" in params:
            if "window" in params:
                raise HttpError(400, "give window or after, not both", "invalid_parameter")
            return await self._workload_after(params["after"])
        try:
            window = float(params.get("window", DEFAULT_WORKLOAD_WINDOW_S))
        except ValueError:
            window = math.nan
        if not 0 < window <= 366 * 86400:
            raise HttpError(400, "window: expected seconds, more than 0", "invalid_parameter")
        path = self.request_log_path
        if path is None:
            return json_response({"window_s": window, "models": {}, "request_log": None})
        now = self.wall_clock()
        try:
            records = await trio.to_thread.run_sync(_read_log, path)
        except FabricError as exc:
            raise HttpError(500, str(exc), "request_log_unreadable") from None
        recent = [r for r in records if r.t >= now - window]
        return json_response(
            {"window_s": window, "models": workload_sums(recent), "request_log": str(path)}
        )

    async def _workload_history(self, history: str, bin_: str) -> Response:
        """The log's last ``history`` seconds in bins of ``bin_`` (``binned_sums``), with the
        cursor after what was read and how far back the kept files are complete."""
        history_s, bin_s = _seconds(history), _seconds(bin_)
        if not 0 < history_s <= MAX_WORKLOAD_HISTORY_S:
            raise HttpError(
                400,
                f"history: expected seconds, more than 0, at most {MAX_WORKLOAD_HISTORY_S:g}",
                "invalid_parameter",
            )
        if not (1 <= bin_s <= history_s and history_s / bin_s <= MAX_WORKLOAD_BINS):
            raise HttpError(
                400,
                f"bin: expected seconds, at least 1 and at most history "
                f"(at most {MAX_WORKLOAD_BINS} bins)",
                "invalid_parameter",
            )
        now = self.wall_clock()
        start = math.floor((now - history_s) / bin_s) * bin_s
        doc: dict[str, object] = {"history_s": history_s, "bin_s": bin_s, "start": start}
        path = self.request_log_path
        if path is None:
            return json_response(
                {**doc, "cursor": CURSOR_END, "covers_from": None, "bins": [], "request_log": None}
            )
        try:
            records, cursor, covers_from = await trio.to_thread.run_sync(
                read_request_log_since, path, start
            )
        except FabricError as exc:
            raise HttpError(500, str(exc), "request_log_unreadable") from None
        bins = [{"start": t, "models": sums} for t, sums in binned_sums(records, start, bin_s)]
        return json_response(
            {
                **doc,
                "cursor": cursor,
                "covers_from": covers_from,
                "bins": bins,
                "request_log": str(path),
            }
        )

    async def _workload_after(self, cursor: str) -> Response:
        """What the request log gained after ``cursor`` (``end``: nothing, the cursor at the
        end), per model (``recent_sums``), and the cursor to ask after next time."""
        try:
            parse_cursor(cursor)
        except ValueError as exc:
            raise HttpError(400, f"after: {exc}", "invalid_parameter") from None
        path = self.request_log_path
        if path is None:
            return json_response(
                {"after": cursor, "cursor": cursor, "models": {}, "request_log": None}
            )
        try:
            records, new = await trio.to_thread.run_sync(read_request_log_after, path, cursor)
        except FabricError as exc:
            raise HttpError(500, str(exc), "request_log_unreadable") from None
        return json_response(
            {
                "after": cursor,
                "cursor": new,
                "models": recent_sums(records),
                "request_log": str(path),
            }
        )

    def metrics(self, query: list[tuple[str, str]]) -> Response:
        body = generate_latest(self.metrics_registry)
        if self.extra_metrics is not None:
            body += self.extra_metrics()
        return Response(200, body, METRICS_CONTENT_TYPE)


class AdminMetrics(Collector):
    """The agent's own families (identity, registry, gossip, transport, keyring, admin API),
    read from the mesh core and the app's collaborators at each scrape."""

    def __init__(self, app: AdminApp) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        app = self.app
        core = app.core
        stats = core.statistics()
        registry = core.registry.statistics()
        identity = {"session_id": core.self_id, "provider": _provider(app)}
        yield gauge("fabric_info", "Agent identity", 1, identity)
        yield gauge("fabric_ready", "1 once the agent has joined the mesh", int(app.is_ready()))
        yield gauge("fabric_left", "1 once the agent has signed LEFT", int(core.left))
        uptime = app.wall_clock() - app.started_at
        yield gauge("fabric_uptime_seconds", "Seconds since the agent started", uptime)
        yield from gauges_by(
            "fabric_registry_entries",
            "Registry entries by lifecycle state",
            "state",
            registry.by_state,
        )
        yield gauge(
            "fabric_registry_tombstones",
            "Collected sessions remembered as tombstones",
            stats.tombstones,
        )
        yield from counters_by(
            "fabric_registry_merges_total", "Merges by outcome", "outcome", stats.merges
        )
        yield from gauges_by(
            "fabric_members", "Members by local liveness view", "liveness", stats.members
        )
        yield gauge(
            "fabric_gossip_incarnation", "Our liveness incarnation (refutations)", stats.incarnation
        )
        yield counter("fabric_gossip_packets_in_total", "Sealed packets received", stats.packets_in)
        yield counter("fabric_gossip_packets_out_total", "Sealed packets sent", stats.packets_out)
        yield counter("fabric_gossip_bytes_in_total", "Sealed bytes received", stats.bytes_in)
        yield counter("fabric_gossip_bytes_out_total", "Sealed bytes sent", stats.bytes_out)
        yield from counters_by(
            "fabric_assignments_refused_total",
            "Assignments posted to this agent and not taken, by outcome (untrusted, stale, ...)",
            "outcome",
            dict(sorted(app.assignments_refused.items())),
        )
        if app.controller is not None:
            decisions = app.controller.decisions
            yield from counters_by(
                "fabric_controller_decisions_total",
                "Controller decisions by action (submit, cancel, refused, invalid) and reason kind",
                "action_reason",
                {f"{a}:{r}": n for (a, r), n in sorted(decisions.items())},
            )
            acting = 1.0 if app.controller.status.role == "acting" else 0.0
            yield gauge("fabric_controller_acting", "1 while this agent's controller acts", acting)
        yield from counters_by(
            "fabric_services_refused_total",
            "Service files posted to this agent and not taken, by outcome (untrusted, stale, ...)",
            "outcome",
            dict(sorted(app.services_refused.items())),
        )
        yield from counters_by(
            "fabric_gossip_dropped_total",
            "Inputs dropped, by reason",
            "reason",
            dict(sorted(stats.dropped.items())),
        )
        yield gauge(
            "fabric_gossip_broadcast_queue",
            "Records waiting to be gossiped",
            stats.broadcast_queue,
        )
        yield gauge(
            "fabric_gossip_load_queue", "Load reports waiting to be gossiped", stats.load_queue
        )
        yield counter(
            "fabric_signatures_verified_total", "Ed25519 verifications", core.verifier.verified
        )
        yield counter(
            "fabric_signature_cache_hits_total", "Verifications saved", core.verifier.cache_hits
        )
        if app.transport is not None:
            t = app.transport.statistics()
            yield counter(
                "fabric_transport_datagrams_in_total", "UDP datagrams received", t.datagrams_in
            )
            yield counter(
                "fabric_transport_datagrams_out_total", "UDP datagrams sent", t.datagrams_out
            )
            yield counter("fabric_transport_streams_in_total", "TCP frames received", t.streams_in)
            yield counter("fabric_transport_streams_out_total", "TCP frames sent", t.streams_out)
            yield counter("fabric_transport_send_errors_total", "Sends that failed", t.send_errors)
            yield counter(
                "fabric_transport_oversized_total", "Packets over the size limit", t.oversized
            )
            yield counter(
                "fabric_transport_streams_refused_total",
                "Incoming gossip connections closed unread: over 64 at once, or their frames over"
                " 64 MiB held before they were opened",
                t.streams_refused,
            )
        if app.keyring is not None:
            yield counter(
                "fabric_keyring_reloads_total",
                "Cluster keyring file reloads",
                app.keyring.keyring_reloads,
            )
            yield counter(
                "fabric_keyring_reload_errors_total",
                "Keyring file edits that could not be loaded",
                app.keyring.keyring_errors,
            )
        yield gauge("fabric_cluster_keys", "Keys in the cluster keyring", len(core.keyring.keys))
        yield counter("fabric_admin_requests_total", "Requests to the admin API", app.requests)
        engine = app.engine()
        if engine is not None:
            yield counter(
                "fabric_engine_model_reads_total",
                "Engine model lists read while serving (every models_interval_s)",
                engine.model_reads,
            )
            yield counter(
                "fabric_engine_model_read_errors_total",
                "Engine model lists that could not be read (the last good list stayed)",
                engine.model_read_errors,
            )
            yield from gauges_by(
                "fabric_engine_models_dropped",
                "Models of the engine's latest list that the entry leaves out, by reason"
                " (registry limits: too_many, entry_full, name_too_long, ...)",
                "reason",
                {reason: engine.models_dropped.get(reason, 0) for reason in DROP_REASONS},
            )
            kv = engine.kv_events
            if kv is not None:
                yield from counters_by(
                    "fabric_engine_kv_event_messages_total",
                    "The engine's KV-cache event messages, by what became of them (applied; "
                    "repeated; gap or restarted: the index was emptied first; malformed, "
                    "other_topic: dropped)",
                    "outcome",
                    kv.messages,
                )
                yield gauge(
                    "fabric_engine_kv_blocks",
                    "Blocks the engine's prefix cache holds, as its KV-cache events say",
                    kv.blocks,
                )
                yield counter(
                    "fabric_engine_kv_blocks_refused_total",
                    "Blocks the engine stored that the index did not keep (past its bound)",
                    kv.refused,
                )


def _provider(app: AdminApp) -> str:
    return app.core.self_entry.body.provider


def _seconds(text: str) -> float:
    """A query parameter's seconds (NaN when it is not a number: every range check fails)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def _read_log(path: Path) -> list[TraceRecord]:
    if not request_log_files(path):
        return []  # nothing logged yet
    return read_request_log(path, include_rotated=True)


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise HttpError(400, "request body incomplete", "invalid_body")
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"body larger than {limit} bytes", "too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _query(scope: Scope) -> list[tuple[str, str]]:
    raw = scope.get("query_string", b"")
    return parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
