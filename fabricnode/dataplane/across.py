"""The ingress's decisions about sites: what may come in from a peer site, where a request no
node of our site can take goes, which routes a request limited to sites may use, and where a
``POST /v1/responses`` that continues a stored response may go. Pure: no sockets, no clock.

The rules are ``sites``' (no bounce, the chooser, credentials, residency across gateways),
``residency``'s (the allowed sites, never relaxed) and ``responses``' ("Across sites": a
response is stored and its owner checked at the site whose node made it). The ingress asks, and
acts on the answer: a list of routes, or a ``Rejection`` to send (already counted in the
residency refusals where it is one).

What it reads of the shell: the route table (our site's nodes, sleeping ones and gateways), the
service file's declared models (``declared``: a declared model may still get a replica at an
allowed site), the cluster keyring (Responses owners) and, on a gateway, what it knows of the
peer sites (``offers``, set by the agent; None on an agent that is not a gateway).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from fabricnode.dataplane import residency, responses
from fabricnode.dataplane.endpoints import RESPONSES, site_of_response
from fabricnode.dataplane.job import Job
from fabricnode.dataplane.request import Rejection, Routed
from fabricnode.dataplane.residency import (
    FORWARD_ELSEWHERE,
    NO_COMMON_SITE,
    NOT_SERVED_THERE,
    SITE_NOT_ALLOWED,
    SITES_HEADER,
    Sites,
    forward_message,
    narrow,
    refusal_message,
)
from fabricnode.dataplane.responses import PinnedNode
from fabricnode.dataplane.routetable import Route
from fabricnode.dataplane.routing import BLOCK_TOKENS_EST, Candidate
from fabricnode.dataplane.sites import (
    HOP_NODE,
    Prompt,
    SiteOffer,
    admitting,
    by_cost,
    choose,
    may_leave,
    may_leave_for,
    pushed,
    quicker,
    quicker_start,
    site_routes,
    taken_in,
)
from fabricnode.mesh.keyring import Keyring


def refused_here(allowed: Sites, site: str) -> Rejection | None:
    """The 403 of a request whose allowed sites (``residency``) exclude ours, ``site``: a
    forward to our node, or a request a peer site's gateway sends us; None when ours is
    allowed. The caller counts it (``FORWARD_ELSEWHERE``)."""
    if taken_in(allowed, site):
        return None
    assert allowed is not None  # every site takes a request of any site
    return Rejection(403, forward_message(site, allowed), SITE_NOT_ALLOWED)


MAX_SESSIONS = 16384  # sessions a gateway remembers the pushed-to site of


class SiteTable(Protocol):
    """What ``Across`` reads of the route table (``routetable.RouteTable``)."""

    def sleeping(self, model: str) -> list[Route] | None: ...

    def gateways(self) -> list[Route]: ...


class Across:
    def __init__(
        self,
        site: str,
        table: SiteTable,
        keyring: Callable[[], Keyring],
        refused: Callable[[str], None],
        declared: Callable[[str], float | None] | None = None,
    ) -> None:
        self.site = site  # ours
        self.table = table
        self.keyring = keyring
        self.refused = refused  # counts a residency refusal by its reason
        self.declared = declared
        # On a gateway, what it knows of the peer sites for a model (``sites.SiteOffer``); None
        # on an agent that is not a gateway.
        self.offers: Callable[[str], list[SiteOffer]] | None = None
        self.turns = 0  # out routes handed out: spreads requests over our site's gateways
        # On a gateway, the peer site each session's last pushed request went to (a
        # conversation's cache is there): its next pushed turn goes there first while that
        # site can admit. Bounded: the oldest is forgotten first.
        self.sessions: dict[str, str] = {}
        self.max_sessions = MAX_SESSIONS
        # On a gateway whose agent runs the site's controller, the seconds it expects a
        # replica of a model to take to serve if started now (``sites`` rule 8; inf: it would
        # start none); None (unset, or the answer): it cannot say, and requests wait here.
        self.start_here: Callable[[str], float | None] | None = None

    # -- a request from a peer site --------------------------------------------------------------

    def taken_in(self, from_site: str, headers: Mapping[bytes, bytes]) -> Sites | Rejection:
        """The allowed sites of a request a peer site's gateway sent us over the link (the link
        authenticated ``from_site``; the client's key stayed at its ingress), or why we refuse
        it: a malformed set (400), or one our site is not in (403, residency at the gateway that
        takes it in)."""
        carried = headers.get(SITES_HEADER)
        try:
            allowed = residency.decode(carried) if carried is not None else None
        except ValueError as exc:
            return Rejection(400, f"bad allowed sites from site {from_site!r}: {exc}", "site")
        refused = refused_here(allowed, self.site)
        if refused is not None:
            self.refused(FORWARD_ELSEWHERE)
            return refused
        return allowed

    # -- a request no node of our site takes ---------------------------------------------------

    def out_routes(self, model: str, sites: Sites) -> list[Route]:
        """Where a request our site cannot serve goes: a gateway sends it to the gateways of
        the peer sites that serve ``model`` at a site ``sites`` allows (``sites.choose``);
        another agent to the gateways of our site, in turn (each asks its peer sites)."""
        offers = self.offers
        if offers is not None:
            return site_routes(choose(offers(model), sites))
        return self._gateways_in_turn()

    def federated(self) -> bool:
        """Whether a request may leave our site at all: we are a gateway, or our site has one."""
        return self.offers is not None or bool(self.table.gateways())

    def push_routes(
        self,
        model: str,
        sites: Sites,
        session: str | None = None,
        prompt: Prompt | None = None,
    ) -> list[Route]:
        """Where a request goes that our site's nodes cannot admit now (two-layer routing,
        ``sites`` rule 5): from a gateway, to the peer sites that can admit it now, the
        quickest first (with the ``prompt``'s prefix, rule 7), the site its ``session`` was
        last pushed to before them (``pushed_to``); from another agent, to our site's gateways,
        in turn (each routes it anywhere, our site first). None of either: [], and it waits
        here for our nodes."""
        offers = self.offers
        if offers is not None:
            found = admitting(offers(model))
            chosen = by_cost(choose(found, sites), found, prompt)
            home = self.sessions.get(session) if session is not None else None
            if home is not None and len(chosen) > 1:
                # the session's site first (its gateways in their order), the others after
                chosen = [c for c in chosen if c[0] == home] + [c for c in chosen if c[0] != home]
            return site_routes(chosen)
        return pushed(self._gateways_in_turn())

    def quicker_routes(
        self,
        model: str,
        sites: Sites,
        session: str | None,
        wait_s: float,
        prompt: Prompt | None = None,
    ) -> list[Route]:
        """Where a request goes that one of our nodes can admit but only after ``wait_s`` (the
        policy's pick's prefill backlog): on a gateway, the peer sites that can admit it now and
        would answer it sooner (``sites`` rule 6, with the ``prompt``'s prefix: rule 7);
        elsewhere, and with none: [] (it goes to the pick). An agent that is not a gateway
        knows no peer site's wait: it pushes only what our nodes cannot admit
        (``push_routes``). A conversation (``session``) is not: its cache is at its pick, and
        it keeps its site and replica while they can admit it."""
        offers = self.offers
        if offers is None or session is not None:
            return []
        if wait_s <= 0.0 and (prompt is None or prompt.here >= prompt.blocks):
            return []  # no site can be quicker than a pick that starts it now, cache and all
        found = quicker(offers(model), wait_s, prompt)
        if not found:
            return []
        chosen = choose(found, sites)  # the allowed ones, each with its gateways
        if not chosen:
            return []
        order = {o.site: i for i, o in enumerate(found)}
        chosen.sort(key=lambda c: order[c[0]])  # stable: each site's gateways keep their order
        return site_routes(chosen)

    def prices(self, job: Job) -> bool:
        """Whether the cross-site cost prices ``job``'s prompt (``sites`` rule 7): on a gateway,
        for a request that may leave (none that came from a peer site)."""
        return self.offers is not None and not job.from_site

    def prompt(
        self,
        job: Job,
        blocks: int,
        ranked: list[Candidate] | None,
        held: Callable[[str], int],
        rate: Callable[[str], float],
    ) -> Prompt | None:
        """``job``'s prompt of ``blocks`` prefix blocks as the cross-site cost prices it
        (``sites`` rule 7; None where it is not priced): the most of them a node of ours holds
        (``held``: the policy's index, per session id), one block's prefill at the pick's
        learned ``rate``."""
        if not blocks or not self.prices(job):
            return None
        pick = ranked[0].node.session_id if ranked else ""
        here = max((held(c.node.session_id) for c in ranked or ()), default=0)
        return Prompt(blocks, here, BLOCK_TOKENS_EST / rate(pick), held)

    def push(
        self,
        job: Job,
        routes: list[Route],
        session: str | None,
        wait_s: float | None,
        prompt: Prompt | None = None,
    ) -> list[Route]:
        """Two-layer routing's answer for a request routed to our site's nodes (``routes``):
        where to push it instead, or [] to keep it here. ``wait_s`` None: none of our nodes can
        admit it now (``push_routes``, rule 5); else the wait the policy's pick shows
        (``quicker_routes``, rule 6). ``prompt``: its prefix blocks, priced on a gateway
        (rule 7)."""
        if wait_s is not None and self.offers is None:
            return []  # not a gateway: no peer site's wait to compare (``quicker_routes``)
        if not self.may_go_out(job, routes):
            return []
        if wait_s is None:
            return self.push_routes(job.model, job.sites, session, prompt)
        return self.quicker_routes(job.model, job.sites, session, wait_s, prompt)

    def without_nodes(
        self,
        routed: Routed,
        out: bool,
        from_site: str,
        hold_s: float | None,
        retry_after_s: int,
    ) -> tuple[list[Route], float | None] | Rejection:
        """Where a request goes that no node of our site can take (``out``: a gateway takes it
        out of our site): the routes of another site and no hold; or, for a declared model
        whose start it may wait for (``hold_s``), none and that hold; or why no site serves it.

        A declared model served elsewhere goes there rather than wait for a start here
        (``instead_of_cold_start``), unless it is a Responses or batch request."""
        model, sites = routed.model, routed.sites
        if hold_s:
            routes = self.waits_elsewhere(routed, from_site)
            return (routes, None) if routes else ([], hold_s)
        if may_leave(from_site, False) and may_leave_for(sites, self.site):
            # never a request that came from another site: one WAN crossing per attempt
            routes = self.out_routes(model, sites)
            if routes:
                return routes, None
        return self.not_served(model, out, sites, retry_after_s)

    def waits_elsewhere(self, routed: Routed, from_site: str) -> list[Route]:
        """Where a request for a declared model no node of our site serves goes rather than
        wait here for a start (``instead_of_cold_start``): never a Responses or batch request
        (their state and their gate are here). Asked on arrival and again while it waits."""
        if routed.kind == RESPONSES or routed.batch:
            return []
        return self.instead_of_cold_start(routed.model, routed.sites, from_site)

    def instead_of_cold_start(self, model: str, sites: Sites, from_site: str) -> list[Route]:
        """Where a request goes for a declared model no node of our site serves now, rather
        than wait here for a replica to start (``hold_requests``): a gateway sends it to the
        peer sites that serve the model now (``out_routes``; a start here takes tens of
        seconds, a site that serves answers in a round trip, and with ``prefer_sites`` our
        controller may start none at all); another agent hands it to a gateway of our site
        (``pushed``: the gateway serves it, sends it out, or waits there for the start). []
        (wait here): it came from a peer site, it may be served at our site only, no peer site
        serves it, or we have no gateway."""
        if not may_leave(from_site, False) or not may_leave_for(sites, self.site):
            return []
        offers = self.offers
        if offers is not None:
            return self.out_routes(model, sites) or self.start_elsewhere(model, sites, offers)
        return pushed(self._gateways_in_turn())

    def start_elsewhere(
        self, model: str, sites: Sites, offers: Callable[[str], list[SiteOffer]]
    ) -> list[Route]:
        """On a gateway, where a request for a declared model no site serves waits for its
        start: the peer sites whose controllers expect to have it serving sooner than ours
        would (``sites`` rule 8), the soonest first; [] (here): ours is the soonest, or our
        controller cannot say how long (it does not act on this gateway)."""
        start_here = self.start_here
        here = start_here(model) if start_here is not None else None
        if here is None:
            return []
        return site_routes(quicker_start(offers(model), here, sites))

    def pushed_to(self, session: str | None, site: str) -> None:
        """A pushed request of ``session`` went to peer site ``site``: its next turns go there
        first (``push_routes``)."""
        if session is None:
            return
        sessions = self.sessions
        if session in sessions:
            del sessions[session]  # to the newest end
        elif len(sessions) >= self.max_sessions:
            del sessions[next(iter(sessions))]
        sessions[session] = site

    def _gateways_in_turn(self) -> list[Route]:
        gateways = self.table.gateways()
        n = len(gateways)
        if n > 1:
            first = self.turns % n  # spread requests over the site's gateways
            self.turns += 1
            gateways = gateways[first:] + gateways[:first]
        return gateways

    def not_served(self, model: str, out: bool, sites: Sites, retry_after_s: int) -> Rejection:
        """No node of our site, nor (``out``) a reachable peer site at a site ``sites``
        allows, serves ``model``."""
        offers = self.offers
        serving = [o for o in offers(model) if o.replicas] if out and offers is not None else []
        if serving and sites is not None and not any(o.site in sites for o in serving):
            self.refused(NOT_SERVED_THERE)
            message = refusal_message(
                model, sites, key_sites=None, header_sites=None, model_sites=None
            )
            return Rejection(403, message, SITE_NOT_ALLOWED)
        if serving:
            return Rejection(
                503,
                f"no reachable site can take a request for model {model!r} now",
                "no_eligible_node",
                [(b"retry-after", b"%d" % retry_after_s)],
            )
        where = "any node" if offers is None else "any node of this site or a peer site"
        return Rejection(404, f"model {model!r} is not served by {where}", "model_not_found")

    # -- residency -----------------------------------------------------------------------------

    def within(
        self, routed: Routed, model_sites: frozenset[str] | None, routes: list[Route] | None
    ) -> tuple[list[Route] | None, bool] | Rejection:
        """Data residency (``residency``): the routes of a request limited to sites, those at
        an allowed site (the awake ones, else the sleeping ones, one of which it wakes: then
        True), or the 403 when no allowed site may serve it: its allowed set is empty, or its
        model has replicas (awake or asleep) but none at an allowed site and is not declared
        (none may start). None, False: no replica anywhere (the 404, or the wait for one of a
        declared model, that every request gets). ``eligible`` filters by the same set again
        at every pick."""
        sites = routed.sites
        assert sites is not None
        model = routed.model
        asleep = self.table.sleeping(model)
        if sites:
            if routes:
                within = [r for r in routes if r.info.site in sites]
                if within:
                    return within, False
            if asleep:
                within = [r for r in asleep if r.info.site in sites]
                if within:
                    return within, True
            if not routes and not asleep:
                return None, False
            if self.declared is not None and self.declared(model):
                return None, False  # scale from zero: a replica may start at an allowed site
            if may_leave_for(sites, self.site) and (self.offers or self.table.gateways()):
                return None, False  # another allowed site may serve it: a gateway checks
            reason = NOT_SERVED_THERE
        else:
            reason = NO_COMMON_SITE
        self.refused(reason)
        key = routed.key
        requirements = routed.requirements
        message = refusal_message(
            model,
            sites,
            key_sites=key.sites if key is not None else None,
            header_sites=requirements.sites if requirements is not None else None,
            model_sites=model_sites,
        )
        return Rejection(403, message, SITE_NOT_ALLOWED)

    def may_go_out(self, job: Job, routes: list[Route]) -> bool:
        """Whether a request routed to our site's nodes may try another site (all of them
        failed, or none can admit it: ``push_routes``): an interactive request for a model,
        not a Responses request, not already leaving (nor come from another site:
        ``sites.may_leave``), allowed elsewhere, not waking a sleeping replica."""
        return (
            may_leave(job.from_site, job.out)
            and may_leave_for(job.sites, self.site)
            and job.slot is None
            and not job.waking
            and job.model != "-"
            and job.kind != RESPONSES
            and bool(routes)
            and routes[0].hop == HOP_NODE
        )

    # -- Responses -----------------------------------------------------------------------------

    def outgoing_response(self, routed: Routed) -> bytes:
        """The body of a ``POST /v1/responses`` that leaves our site: its owner's reference as
        its ``request_id`` (the gateway that takes it in names its node and tags the id)."""
        owner = routed.key.key_id if routed.key is not None else responses.ANONYMOUS
        return responses.carrying_owner(routed.doc, responses.owner_ref(self.keyring(), owner))

    def responses_routes(
        self,
        routed: Routed,
        routes: list[Route] | None,
        from_site: str,
        pinned_node: Callable[[str], PinnedNode],
    ) -> tuple[list[Route] | None, str | None, str] | Rejection:
        """The routes of a ``POST /v1/responses``, for one from a peer site the owner its
        response gets (``responses``, "Across sites"), and the peer site that stores the
        response it continues ("" if none), or why it may go nowhere. One that continues a
        response another site stores goes out to that site alone: (None, None, that site), its
        allowed sites narrowed to that site."""
        doc = routed.doc
        previous = str(doc.get("previous_response_id")) if routed.pinned is not None else ""
        held_at = site_of_response(previous) if previous else ""
        owner = None
        if from_site:
            ref = responses.carried_owner(doc)
            if ref is None:
                return Rejection(
                    400, f"a Responses request from site {from_site!r} names no owner", "site"
                )
            owner = responses.site_owner(from_site, ref)
        if held_at and held_at != self.site:
            if from_site:  # no bounce: the site that sent it should have sent it there
                return responses.not_yours(previous)
            if routed.sites is not None and held_at not in routed.sites:
                self.refused(NOT_SERVED_THERE)
                allowed = ", ".join(sorted(routed.sites)) or "none"
                return Rejection(
                    403,
                    f"response {previous!r} is stored at site {held_at!r}, which this request "
                    f"may not reach (allowed: {allowed})",
                    SITE_NOT_ALLOWED,
                )
            routed.sites = narrow(routed.sites, frozenset((held_at,)))
            return None, None, held_at
        if previous:
            mine = owner if owner is not None else routed.key.key_id if routed.key else None
            if mine is not None and not responses.owned(previous, mine, self.keyring()):
                return responses.not_yours(previous)  # keys on, or another site's: owners
        pinned = responses.pin(routed.model, doc, routed.pinned, routes, pinned_node)
        if isinstance(pinned, Rejection):
            return pinned
        return pinned, owner, ""
