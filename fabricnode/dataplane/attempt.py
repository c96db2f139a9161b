"""An attempt on one node, and the attempts other ingresses make on us.

``Attempts.attempt`` turns a routed request and the node picked for it into the request that
node gets, and hands it to the relay (``relay.Relay.exchange``): the coroutine it returns is
the relay's, not one awaiting it, so no level of ``await`` is added on the way.

* To another node's agent: the request carries ``X-Fabric-Forward``, an HMAC with the cluster
  key over the method, the target and the body (``forward_auth``), and fails over as soon as
  the mesh says that node is gone (DOWN or dead; a LEAVING node finishes what it accepted).
* To our own engine (chosen by the policy): straight to its URL, and counted in
  ``local_inflight``, which the engine service publishes as the node's ``inflight`` load.
* The body as received, but for two rewrites per node: a ``POST /v1/responses`` sets its
  ``request_id`` so that the response's id names the node that stores it (``responses.tagged``),
  and a batch-tier chat, completion or Responses request to a node labelled
  ``fabric.priority_scheduling`` carries ``"priority": batch_priority`` (``tiers.prioritized``).
* Sleeping engines (``fabric.sleeping``, ``engine.sleep``): a model whose replicas all sleep is
  routed to them, and the serving agent wakes its engine before relaying (``wake_local``); a
  node that does not wake answers 503 and the ingress fails over.

* Across sites (``sites``): to a gateway of our site, as a forward signed for taking the
  request out (target ``<session>/out``, ``X-Fabric-Out``); from a gateway to a peer site's
  gateway over the link, naming our site (``X-Fabric-From-Site``) and no credentials.

Served for another ingress (``serve_forward``): a request whose forward header verifies goes to
our own engine as it came, unless the sites it carries (``residency``: ``X-Fabric-Sites``,
covered by the forward's MAC) exclude this agent's site: then 403 ``site_not_allowed``;
while leaving, forwards are refused with 503 so the ingress fails
over, and an engine that fails before answering is a 502 that tells it to.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fabricnode.dataplane import failure, residency, responses
from fabricnode.dataplane.across import refused_here
from fabricnode.dataplane.clientconn import ClientConn, send_error
from fabricnode.dataplane.failure import Failed
from fabricnode.dataplane.forward_auth import ForwardRejected, ForwardVerifier, sign_forward
from fabricnode.dataplane.http1 import Request
from fabricnode.dataplane.ingress_config import IngressConfig
from fabricnode.dataplane.job import BatchSlot, Job
from fabricnode.dataplane.metrics import IngressMetrics, LabelCache
from fabricnode.dataplane.relay import Relay, upstream_request
from fabricnode.dataplane.request import PRIORITY_HEADER
from fabricnode.dataplane.routetable import Origin, Route, origin_of
from fabricnode.dataplane.sites import (
    FROM_SITE_HEADER,
    HOP_GATEWAY,
    HOP_NODE,
    HOP_PUSH,
    OUT_HEADER,
    OUT_SUFFIX,
    PUSH_HEADER,
    PUSH_SUFFIX,
)
from fabricnode.dataplane.sockio import LoopClock
from fabricnode.dataplane.tiers import PRIORITY_KINDS, prioritized
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.schema import Standing
from fabricnode.mesh.sites import DEFAULT_SITE

OUT_LINE = OUT_HEADER + b": 1\r\n"
PUSH_LINE = PUSH_HEADER + b": 1\r\n"
# A batch request that leaves the site says so (``tiers``): the gateways route it as batch work.
BATCH_LINE = PRIORITY_HEADER + b": batch\r\n"


class Attempts:
    """Which request each node gets, and our own engine as a target (see the module docstring)."""

    def __init__(
        self,
        core: MeshCore,
        relay: Relay,
        *,
        config: IngressConfig,
        clock: LoopClock,
        wall_clock: Callable[[], float],
        metrics: IngressMetrics,
        serving_engine_url: Callable[[], str | None],
        local_engine_up: Callable[[], bool],
        wake_local: Callable[[], Awaitable[bool]] | None,
        site: str = DEFAULT_SITE,
    ) -> None:
        self.core = core
        self.relay = relay
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self.metrics = metrics
        # Our own engine's URL while it is serving (None otherwise): one call per request.
        self.serving_engine_url = serving_engine_url
        # Whether the engine a local relay went to still runs, checked while the relay waits
        # for the response head: the engine's listening socket outlives the engine (the agent
        # holds it for the next one), so a request sent as the engine died waits in the
        # socket's queue rather than failing, and would wait ``first_byte_timeout_s``.
        self.local_engine_up = local_engine_up
        # Engine sleep (``engine.sleep``): the agent sets ``local_asleep`` (through the
        # ingress) while our engine sleeps or falls asleep, and a request for it first awaits
        # ``wake_local`` (True once awake). Only then: a sleeping node is routed to only when
        # its model has no awake one.
        self.local_asleep = False
        self.wake_local = wake_local
        self._local_origin_cache: tuple[str, Origin | None] | None = None
        self.leaving = False  # refuse forwards (503) so ingresses fail over
        self.site = site  # this agent's site: a forward limited to sites must allow it
        self.forwards = ForwardVerifier(core.keyring, max_skew_s=config.forward_max_skew_s)
        self._forwards_served = LabelCache(metrics.forwards_served)

    def attempt(
        self, conn: ClientConn, job: Job, route: Route, now: float
    ) -> Coroutine[Any, Any, Failed | None] | Failed:
        """Try one node: await the result, None when the client got an answer (any status),
        else what failed (``failure.Failed``); a ``Failed`` right away when the node cannot be
        tried."""
        sid = route.info.session_id
        job.site = route.info.site
        job.cross = route.hop != HOP_NODE
        if job.cross:
            return self._across(conn, job, route, now)
        if job.retag:
            self._tag_response(job, sid)
        slot = job.slot
        if slot is not None and job.kind in PRIORITY_KINDS:
            self._prioritize(job, slot, route.priority)
        if route.is_self:
            url = self.serving_engine_url()
            if url is None:
                return Failed(failure.UNUSABLE, "local engine not serving")
            origin = self._local_origin(url)
            if origin is None:
                return Failed(failure.UNUSABLE, "local engine URL has no HOST:PORT")
            request = upstream_request(job, origin, forward=None)
            if self.local_asleep:
                return self._wake_then_relay(conn, job, origin, request, sid, now)
            return self.relay.exchange(
                conn, job, origin, request, sid, self.local_engine_up, now, local=True
            )
        sites = residency.encode(job.sites) if job.sites is not None else None
        forward = sign_forward(
            self.core.keyring,
            sender=self.core.self_id,
            target=sid,
            method=job.method,
            path=job.path,
            body=job.body,
            now=self.wall_clock(),
            sites=sites,
        )
        request = upstream_request(job, route.origin, forward=forward, sites=sites)
        return self.relay.exchange(
            conn, job, route.origin, request, sid, self._node_ok(sid), now, local=False
        )

    def _across(
        self, conn: ClientConn, job: Job, route: Route, now: float
    ) -> Coroutine[Any, Any, Failed | None]:
        """An attempt that leaves the site (``sites``): to a gateway of our site, as a forward
        signed for taking it out (``OUT_SUFFIX``), or from a gateway to a peer site's gateway
        over the link, naming our site. The body goes as it came (a Responses request is not
        retagged: the peer site's ingress does that for its node)."""
        sid = route.info.session_id
        # a request limited to sites carries its set (``residency``): in the forward's MAC to
        # our gateway, over the authenticated link to a peer site's
        sites = residency.encode(job.sites) if job.sites is not None else None
        if route.hop == HOP_GATEWAY or route.hop == HOP_PUSH:
            push = route.hop == HOP_PUSH
            forward = sign_forward(
                self.core.keyring,
                sender=self.core.self_id,
                target=sid + (PUSH_SUFFIX if push else OUT_SUFFIX),
                method=job.method,
                path=job.path,
                body=job.body,
                now=self.wall_clock(),
                sites=sites,
            )
            extra = PUSH_LINE if push else OUT_LINE
            if job.slot is not None:
                extra += BATCH_LINE
            request = upstream_request(job, route.origin, forward=forward, extra=extra, sites=sites)
            return self.relay.exchange(
                conn, job, route.origin, request, sid, self._node_ok(sid), now, local=False
            )
        extra = FROM_SITE_HEADER + b": " + self.site.encode() + b"\r\n"
        if sites is not None:
            extra += residency.SITES_HEADER + b": " + sites + b"\r\n"
        if job.slot is not None:  # batch work stays batch work at the site that takes it
            extra += BATCH_LINE
        request = upstream_request(job, route.origin, forward=None, extra=extra)
        return self.relay.exchange(conn, job, route.origin, request, sid, None, now, local=False)

    def _tag_response(self, job: Job, sid: str) -> None:
        """A ``POST /v1/responses`` about to go to node ``sid``: its body names that node
        (``responses.tagged``), without the priority field."""
        if job.doc is not None:
            owner = job.response_owner
            site = self.site if owner is not None else ""  # made for another site: named
            if owner is None:
                owner = job.key.key_id if job.key is not None else responses.ANONYMOUS
            job.body, job.response_id = responses.tagged(
                job.doc, sid, os.urandom(8), self.core.keyring, owner, site
            )
            if job.slot is not None:
                job.slot.unprioritized = None

    def _prioritize(self, job: Job, slot: BatchSlot, on: bool) -> None:
        """A batch request about to go to a node: its body carries ``"priority":
        batch_priority`` if that node's engine schedules by priority (``on``), and is as it
        came otherwise (vLLM refuses a non-zero priority under its default policy; ``tiers``).
        """
        if on:
            if slot.unprioritized is None:  # else it carries the field already
                body = prioritized(job.body, self.config.batch_priority)
                if body is not None:
                    slot.unprioritized = job.body
                    job.body = body
        elif slot.unprioritized is not None:
            job.body = slot.unprioritized
            slot.unprioritized = None

    async def _wake_then_relay(
        self, conn: ClientConn, job: Job, origin: Origin, request: bytes, sid: str, now: float
    ) -> Failed | None:
        """Our engine sleeps: wake it (the request waits), then send the request to it."""
        if not await self._wake_local():
            return Failed(failure.UNUSABLE, "local engine did not wake up")
        return await self.relay.exchange(
            conn, job, origin, request, sid, self.local_engine_up, now, local=True
        )

    async def _wake_local(self) -> bool:
        wake = self.wake_local
        if wake is None:
            return False
        woke = await wake()
        self.metrics.wake_ups.labels("woken" if woke else "failed").inc()
        return woke

    def _local_origin(self, url: str) -> Origin | None:
        cached = self._local_origin_cache
        if cached is None or cached[0] != url:
            self._local_origin_cache = cached = (url, origin_of(url))
        return cached[1]

    def _node_ok(self, sid: str) -> Callable[[], bool]:
        core = self.core

        def still_ok() -> bool:
            # GONE (DOWN or dead): the answer will never come, fail over now. LEAVING is fine:
            # a leaving node finishes what it accepted before it stops its engine.
            entry = core.registry.get(sid)
            return entry is not None and core.standing_of(entry) is not Standing.GONE

        return still_ok

    def check_forward(self, req: Request, forward: bytes, own_session: str) -> residency.Sites:
        """The allowed sites (``residency``) a forward carries, once it verifies: its header
        signs the method, the target with its query, the body and the sites, for
        ``own_session`` (our session id; with ``sites.OUT_SUFFIX``, a request to take out of
        the site). ``ForwardRejected`` (or ``ValueError`` for a malformed set) if not."""
        carried = req.headers.get(residency.SITES_HEADER)
        self.forwards.verify(
            forward,
            own_session=own_session,
            method=req.method,
            path=req.target,  # the path, and the query where the ingress kept one
            body=req.body,
            now=self.wall_clock(),
            sites=carried,
        )
        return residency.decode(carried) if carried is not None else None

    async def serve_forward(self, conn: ClientConn, req: Request, forward: bytes) -> bool:
        """A request another ingress routed to us, for our own engine: checked
        (``check_forward``), then relayed as it came."""
        path = req.path
        try:
            allowed = self.check_forward(req, forward, self.core.self_id)
        except (ForwardRejected, ValueError) as exc:
            self._forwards_served("refused").inc()
            # named: an ingress that meant another node at this address (one that left, its
            # port now ours) tries elsewhere (``failure.MISDIRECTED``)
            named = [(b"x-fabric-node", self.core.self_id.encode())]
            await send_error(
                conn, 403, f"forward refused: {exc}", "forward_refused", path=path, extra=named
            )
            return True
        elsewhere = refused_here(allowed, self.site)
        if elsewhere is not None:
            # Checked again here (``residency``): the ingress never picks a node outside the
            # request's sites, and a node never serves one for a site it is not.
            self._forwards_served("refused").inc()
            self.metrics.residency_refusals.labels(residency.FORWARD_ELSEWHERE).inc()
            await send_error(conn, 403, elsewhere.message, elsewhere.code, path=path)
            return True
        url = self.serving_engine_url()
        origin = self._local_origin(url) if url is not None else None
        if self.leaving or origin is None:
            self._forwards_served("unavailable").inc()
            why = "node is leaving" if self.leaving else "no serving engine on this node"
            await self._unavailable(conn, why, path)
            return True
        if self.local_asleep and not await self._wake_local():
            self._forwards_served("unavailable").inc()
            await self._unavailable(
                conn, "the engine of this node is asleep and did not wake up", path
            )
            return True
        started = self.clock.now()
        job = Job("forward", "", False, req.body, req.target, req.headers, None, started)
        job.method = req.method
        content_type = req.headers.get(b"content-type")
        if content_type is not None and content_type.startswith(b"multipart/"):
            job.content_type = content_type  # a form: its boundary
        request = upstream_request(job, origin, forward=None)
        failed = await self.relay.exchange(
            conn,
            job,
            origin,
            request,
            self.core.self_id,
            self.local_engine_up,
            started,
            local=True,
        )
        if failed is not None:
            self._forwards_served("failed").inc()
            if failed.kind == failure.LEAVING:
                # Handed over as this node leaves: a 503, which the ingress fails over without
                # counting an engine failure against the request (the poison guard).
                await self._unavailable(conn, "node is leaving: the request was handed over", path)
            else:
                # Our own engine failed before answering: tell the ingress to fail over.
                await send_error(
                    conn, 502, f"engine failed: {failed}", "engine_unavailable", path=path
                )
            return True
        self._forwards_served("served").inc()
        return not job.close

    async def _unavailable(self, conn: ClientConn, why: str, path: bytes) -> None:
        """The 503 a forward gets from a node that cannot serve it now: its ingress fails over."""
        extra = [(b"retry-after", b"%d" % self.config.retry_after_s)]
        await send_error(conn, 503, why, "node_unavailable", extra=extra, path=path)
