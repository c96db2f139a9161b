"""Which nodes may take a request: the registry, reduced to what the ingress needs per model.

``RouteTable`` caches, per model, the SERVING entries with their static routing facts
(``routing.NodeInfo``), and rebuilds only when the registry's ``generation`` moves, so the hot
path does a dict lookup instead of walking and verifying entries. Per request it adds what
changes by the millisecond: local liveness (the SWIM view), the circuit breaker, the last
gossiped load report and this ingress's own in-flight count (``eligible``).

Nodes whose engine sleeps (``fabric.sleeping``) are kept apart (``sleeping``): the ingress
goes to them only for a model that has no awake node, and the request wakes one. A route also
says whether its node's engine schedules by priority (``fabric.priority_scheduling``): batch
requests sent there carry the batch priority (``tiers``).

Filter order (issue: filters before the policy): model served → SERVING, lease not expired,
routable by ``schema.standing`` (a probed member, never DEAD/LEFT, nor an entry whose owner no
probe vouches for; SUSPECT only when no ROUTABLE node is left) → the request's allowed sites
(data residency, ``residency``: the key's, ``X-Fabric-Require: site=``'s and the model's, against
the site the node's owner signed; never relaxed) → provider allowlist
against the *verified* provider → ``X-Fabric-Require`` constraints → not ejected by the circuit
breaker (unless every remaining node is: then they are tried anyway, a breaker must not turn a
brief blip into an outage).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import orjson

from fabricnode.addr import split_hostport
from fabricnode.dataplane.request import Requirements
from fabricnode.dataplane.routing import (
    Candidate,
    LoadSnapshot,
    NodeInfo,
    meets,
    provider_allowed,
)
from fabricnode.errors import ConfigError
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.registry import SignedEntry, State
from fabricnode.mesh.schema import (
    PRIORITY_SCHEDULING_LABEL,
    SLEEPING_LABEL,
    Standing,
    model_parents,
)
from fabricnode.mesh.wire import Load

Origin = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Route:
    """One node serving one model."""

    info: NodeInfo
    origin: Origin  # the node agent's HTTP address
    expires_at: float
    is_self: bool
    # Its engine serves waiting requests by their ``priority`` field (fabric.priority_scheduling).
    priority: bool = False
    # What it leads to (``sites``): a node of our site (0), a gateway of our site that takes
    # the request out (1), a gateway of a peer site over the federation link (2), a gateway of
    # our site that routes it anywhere, our site first (3).
    hop: int = 0


@dataclass(frozen=True, slots=True)
class ModelListing:
    id: str
    max_model_len: int | None
    nodes: int
    created: int
    parent: str | None = None  # the base model of an adapter (the entries' fabric.parents)


class CircuitBreaker:
    """Ejects a node for a while after it failed a request; doubles on repeated failures."""

    def __init__(self, *, base_s: float = 2.0, max_s: float = 60.0) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self._until: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self.ejections = 0

    def ejected(self, sid: str, now: float) -> bool:
        until = self._until.get(sid)
        return until is not None and until > now

    def next_readmission(self, now: float) -> float:
        """When the soonest ejection ends (a waiter may then see that node), else inf."""
        return min((u for u in self._until.values() if u > now), default=math.inf)

    def failed(self, sid: str, now: float) -> None:
        n = self._failures.get(sid, 0) + 1
        self._failures[sid] = n
        self._until[sid] = now + min(self.max_s, self.base_s * (2 ** (n - 1)))
        self.ejections += 1

    def succeeded(self, sid: str) -> None:
        if sid in self._failures:
            del self._failures[sid]
            self._until.pop(sid, None)

    def forget(self, sid: str) -> None:
        self._failures.pop(sid, None)
        self._until.pop(sid, None)


class RouteTable:
    def __init__(self, core: MeshCore, wall_clock: Callable[[], float]) -> None:
        self.core = core
        self.wall_clock = wall_clock
        self._generation = -1
        self._self_id = ""
        self._by_model: dict[str, list[Route]] = {}
        self._sleeping: dict[str, list[Route]] = {}  # nodes whose engine sleeps, by model
        self._by_session: dict[str, Route] = {}  # one route of each SERVING node, asleep or not
        self._gateways: list[Route] = []  # our site's gateways but us (``gateways``)
        self._listing: list[ModelListing] = []
        self._snapshots: dict[str, tuple[Load, LoadSnapshot]] = {}
        self.rebuilds = 0
        self.removed: list[str] = []  # sessions that left the table since the last take

    def _refresh(self) -> None:
        core = self.core
        if core.registry.generation == self._generation and core.self_id == self._self_id:
            return
        self._generation = core.registry.generation
        self._self_id = core.self_id
        now = self.wall_clock()
        before = {r.info.session_id for routes in self._by_model.values() for r in routes}
        by_model: dict[str, list[Route]] = {}
        sleeping: dict[str, list[Route]] = {}
        parents: dict[str, dict[str, int]] = {}  # adapter -> parent -> entries that say so
        by_session: dict[str, Route] = {}
        gateways: list[Route] = []
        for entry in core.registry:
            body = entry.body
            if body.state in (State.JOIN, State.SERVING) and body.session_id != core.self_id:
                gateway = _gateway_route(
                    body.session_id, body.addresses.http, body.labels, body.site
                )
                if gateway is not None:
                    gateways.append(replace(gateway, expires_at=body.expires_at))
            if body.state != State.SERVING or not body.addresses.http:
                continue
            origin = origin_of(body.addresses.http)
            if origin is None:
                continue
            verified = entry.verified_provider(now, core.verifier)
            table = sleeping if _asleep(body.labels) else by_model
            priority = (PRIORITY_SCHEDULING_LABEL, "1") in body.labels
            for model_id, parent in model_parents(body).items():
                said = parents.setdefault(model_id, {})
                said[parent] = said.get(parent, 0) + 1
            for model in body.models:
                info = NodeInfo(
                    session_id=body.session_id,
                    url=body.addresses.http,
                    provider=body.provider,
                    verified_provider=verified,
                    certified_name=body.provider if verified else None,
                    gpu_type=body.hardware.gpu_type,
                    gpu_count=body.hardware.gpu_count,
                    max_model_len=model.max_model_len,
                    quantization=model.quantization,
                    site=body.site,
                )
                route = Route(
                    info, origin, body.expires_at, body.session_id == core.self_id, priority
                )
                table.setdefault(model.id, []).append(route)
                by_session.setdefault(body.session_id, route)
        for routes in sleeping.values():  # the one to wake first: our own, else by id
            routes.sort(key=lambda r: (not r.is_self, r.info.session_id))
        self._by_model = by_model
        self._sleeping = sleeping
        self._by_session = by_session
        gateways.sort(key=lambda r: r.info.session_id)
        self._gateways = gateways
        self._listing = _listing(core, _merged(by_model, sleeping), parents)
        after = {r.info.session_id for routes in by_model.values() for r in routes}
        self.removed.extend(before - after)
        self.rebuilds += 1

    def routes(self, model: str) -> list[Route] | None:
        """Every SERVING entry that announces ``model`` (None: nobody announces it)."""
        self._refresh()
        return self._by_model.get(model)

    def sleeping(self, model: str) -> list[Route] | None:
        """The SERVING entries announcing ``model`` whose engine sleeps (labelled
        ``fabric.sleeping``), ours first, then by session id; ``routes`` leaves them out."""
        self._refresh()
        return self._sleeping.get(model)

    def node(self, sid: str) -> Route | None:
        """A route to the SERVING node ``sid`` (whatever model it serves; asleep or not), None
        if no SERVING entry of it announces a model. The stateful Responses follow-ups are
        routed by node, not by model."""
        self._refresh()
        return self._by_session.get(sid)

    def gateways(self) -> list[Route]:
        """Routes to the gateways of our site but ourselves (entries labelled
        ``sites.GATEWAY_LABEL``, joined or serving), by session id: a request no node of the
        site serves leaves through one of them (``sites.HOP_GATEWAY``)."""
        self._refresh()
        return self._gateways

    def listing(self) -> list[ModelListing]:
        """Models with at least one routable node (standing ``SUSPECT`` or better: a probed
        member not known dead or left; ``/v1/models``), each with the number of such nodes,
        sleeping ones included (a request wakes one; standing is not part of the cached table:
        count now)."""
        self._refresh()
        core = self.core
        out = []
        for m in self._listing:
            usable = sum(_usable(core, r) for r in self._by_model.get(m.id, ()))
            usable += sum(_usable(core, r) for r in self._sleeping.get(m.id, ()))
            if usable:
                out.append(m if usable == m.nodes else replace(m, nodes=usable))
        return out

    def take_removed(self) -> list[str]:
        removed, self.removed = self.removed, []
        return removed

    def load_of(self, sid: str) -> LoadSnapshot | None:
        load = self.core.loads.get(sid)
        if load is None:
            return None
        cached = self._snapshots.get(sid)
        if cached is not None and cached[0] is load:
            return cached[1]
        snap = LoadSnapshot(load.waiting, load.running, load.kv_usage, load.inflight, load.at)
        self._snapshots[sid] = (load, snap)
        return snap

    def eligible(
        self,
        routes: list[Route],
        *,
        now: float,
        wall_now: float,
        inflight: Mapping[str, int],
        breaker: CircuitBreaker,
        providers: frozenset[str],
        requirements: Requirements | None,
        sites: frozenset[str] | None = None,
        exclude: str | None = None,
    ) -> list[Candidate]:
        """Candidates that pass every filter, ALIVE ones before SUSPECT ones. ``sites``: the
        request's allowed sites (None: any); every pick of a node goes through here, so a node
        outside them is never a candidate (``residency``)."""
        core = self.core
        alive: list[Candidate] = []
        suspect: list[Candidate] = []
        ejected: list[Candidate] = []
        for r in routes:
            info = r.info
            sid = info.session_id
            if r.expires_at <= wall_now or sid == exclude:
                continue
            standing = core.standing(sid, State.SERVING)  # the table holds SERVING entries only
            if standing < Standing.SUSPECT:
                continue
            # a gateway of our site serves nothing itself: it takes the request out (or routes
            # a pushed one), and checks the set again against the sites it offers (``sites``,
            # rule 4); a pushed request's route to it is a gateway route too (its hop aside)
            if sites is not None and info.site not in sites and r.hop not in GATEWAY_HOPS:
                continue
            if providers and not provider_allowed(info, providers):
                continue
            if requirements is not None and not meets(info, requirements):
                continue
            cand = Candidate(info, self.load_of(sid), inflight.get(sid, 0))
            if breaker.ejected(sid, now):
                ejected.append(cand)
            elif standing is Standing.SUSPECT:
                suspect.append(cand)
            else:
                alive.append(cand)
        return alive or suspect or ejected


GATEWAY_LABEL = "fabric.gateway"  # sites.GATEWAY_LABEL (sites imports this module)
# What a route leads to (``Route.hop``), named in ``sites`` (which imports this module).
HOP_NODE = 0  # a node of our site (or our own engine)
HOP_GATEWAY = 1  # a gateway of our site, which takes the request out
HOP_SITE = 2  # a gateway of a peer site, over the federation link
# a gateway of our site that routes it anywhere: our site's nodes first, else a peer site that
# can admit it now (our site's nodes could not: two-layer routing, ``sites``)
HOP_PUSH = 3
GATEWAY_HOPS = (HOP_GATEWAY, HOP_PUSH)  # the routes to a gateway of our site


def _gateway_route(
    sid: str, url: str, labels: tuple[tuple[str, str], ...], site: str
) -> Route | None:
    if not url or not any(key == GATEWAY_LABEL and value for key, value in labels):
        return None
    origin = origin_of(url)
    if origin is None:
        return None
    info = NodeInfo(
        session_id=sid,
        url=url,
        provider="",
        verified_provider=None,
        certified_name=None,
        gpu_type="",
        gpu_count=0,
        max_model_len=None,
        quantization=None,
        site=site,  # ours: what a request the gateway serves inside the site is logged with
    )
    return Route(info, origin, 0.0, False, False, HOP_GATEWAY)


def _asleep(labels: tuple[tuple[str, str], ...]) -> bool:
    return any(key == SLEEPING_LABEL for key, _ in labels)


def _merged(a: Mapping[str, list[Route]], b: Mapping[str, list[Route]]) -> dict[str, list[Route]]:
    out = {model: list(routes) for model, routes in a.items()}
    for model, routes in b.items():
        out.setdefault(model, []).extend(routes)
    return out


def _usable(core: MeshCore, r: Route) -> bool:
    """Whether a route counts in ``/v1/models``: routable, as ``eligible`` sees it."""
    return core.standing(r.info.session_id, State.SERVING) >= Standing.SUSPECT


def _listing(
    core: MeshCore,
    by_model: Mapping[str, list[Route]],
    parents: Mapping[str, Mapping[str, int]],
) -> list[ModelListing]:
    out = []
    for model_id in sorted(by_model):
        routes = by_model[model_id]
        lens = [r.info.max_model_len for r in routes if r.info.max_model_len]
        created = min(int(_started(core, r)) for r in routes)
        said = parents.get(model_id)
        # the parent most entries name (then the first by name): one answer for every ingress
        parent = min(said, key=lambda p: (-said[p], p)) if said else None
        out.append(
            ModelListing(model_id, max(lens) if lens else None, len(routes), created, parent)
        )
    return out


def _started(core: MeshCore, r: Route) -> float:
    entry: SignedEntry | None = core.registry.get(r.info.session_id)
    return entry.body.started_at if entry is not None else 0.0


def origin_of(url: str) -> Origin | None:
    """``(host, port)`` of an ``http://HOST:PORT[/...]`` URL, None when it has no usable one."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    try:
        host, port = split_hostport(rest)
    except ConfigError:
        return None
    if not host or not port:
        return None
    return host, port


def route_of(routes: list[Route], sid: str) -> Route:
    for route in routes:
        if route.info.session_id == sid:
            return route
    raise KeyError(sid)  # a policy ranks only the candidates it was given


def models_body(listing: list[ModelListing], declared: list[str] | None) -> bytes:
    """The ``/v1/models`` body: the models of ``listing`` (``RouteTable.listing``), then the
    ``declared`` ones without a replica now (scale from zero: the first request starts one)."""
    data = [
        {
            "id": m.id,
            "object": "model",
            "created": m.created,
            "owned_by": "fabric",
            "max_model_len": m.max_model_len,
            "parent": m.parent,  # an adapter's (LoRA) base model, as vLLM lists it
            "fabric_nodes": m.nodes,
        }
        for m in listing
    ]
    if declared is not None:
        listed = {d["id"] for d in data}
        for model in declared:
            if model not in listed:
                data.append(
                    {"id": model, "object": "model", "created": 0, "owned_by": "fabric",
                     "fabric_nodes": 0, "fabric_scaled_to_zero": True}
                )  # fmt: skip
    return orjson.dumps({"object": "list", "data": data})
