"""Cross-site requests as the data plane sees them: the routes that leave the site. Pure.

A request for a model no node of our site can take leaves the site through a gateway
(``docs/federation.md``, "Cross-site requests"), in at most two hops of this data plane:

* ``HOP_GATEWAY``: an ingress that is not a gateway sends it to a gateway of its own site (an
  agent whose entry carries ``GATEWAY_LABEL``), as an agent-to-agent forward whose signed
  target is the gateway's session id plus ``OUT_SUFFIX``: only a holder of the cluster key can
  ask a gateway to take a request out of the site, and a forward made for a node never passes
  for one made to leave (nor the reverse).
* ``HOP_SITE``: a gateway sends it over the federation port (TLS, ALPN ``fabric-http/1``) to a
  gateway of the chosen peer site. Its origin is a *site origin* (``site_origin``): not a
  host, but the site and the gateway's federation address, which the upstream pool dials
  through the gateway's link (``upstream.UpstreamPool.dialer``).

The receiving gateway serves a request that came over the link with its own data plane, routed
inside its site only. The frontdoor marks each request read from such a connection with
``FROM_SITE_HEADER`` (the peer site the TLS handshake authenticated) and strips that header from
every other client's request, so the mark cannot be forged from outside. The rules:

1. **No bounce** (``may_leave``): a request that arrived from another site, or that a gateway
   is already taking out (``out``), is never sent out again; so every attempt crosses the WAN
   at most once, and a request never travels between sites in a loop.
2. **Chooser** (``choose``): among the peer sites whose summary serves the model and that are
   routable, those with a replica that can admit a request now come first, then by measured
   round trip (unknown last), then by fewer waiting requests, then by name (one answer for
   every gateway); within a site its gateways in the summary's order (the summary lists the
   signing gateway first). Every gateway of every chosen site is a route: failover before the
   first byte goes to the next gateway of the same site, then to the next site.
3. **Credentials never cross**: the request a gateway sends carries none of the client's
   headers but those ``relay.FORWARDED_REQUEST_HEADERS`` lets through (no ``Authorization``,
   no ``x-api-key``); the receiving gateway trusts the authenticated link instead.
4. **Residency** (``residency``; docs/federation.md, "Data residency"). A request limited to
   sites leaves its site only if its allowed set names another site (``may_leave_for``). The
   set travels with it: in the forward's MAC to a gateway of its site, which checks the forward,
   narrows the set by its own service file and offers only the allowed peer sites
   (``choose(offers, allowed)``; none: 403 ``site_not_allowed``); over the authenticated link
   to the peer site's gateway, which refuses it (403) unless its own site is in the set
   (``taken_in``) and routes it inside its site with the same filter as any request. Each
   hop may only narrow the set. A peer site is trusted with the set it forwards, as with the
   requests it sends at all: its gateways hold a site key we pinned.
5. **Two-layer routing** (SkyLB's, issue 41): a request is served inside our site while one of
   our nodes can admit it (the pending-aware policy ranks one); when none can, it is pushed:
   an ingress that is not a gateway hands it to a gateway of our site (``HOP_PUSH``, a forward
   signed for ``PUSH_SUFFIX``), and a gateway sends it to a peer site that can admit it now
   (``admitting``: a replica with no request waiting, on a summary fresh enough to say so,
   ``SiteOffer.fresh``; chosen as in rule 2) or, when none can,
   holds it for our site's nodes as any ingress does. A pushed request is sent out at most
   once (rule 1): the gateway that takes it in routes it inside its site.
6. **The quicker site** (GORGO's cost, issue 41): a request one of our nodes can admit is
   still pushed, from a gateway, when the wait the policy's pick shows (its prefill backlog on
   this ingress's clock, which a late first token moves forward: the node's queue as this
   ingress sees it) is longer than a peer site's expected wait, ``expected_wait_s``: the
   measured round trip to it plus the prefill backlog its summary reports (``backlog_s``,
   less the summary's age). Only sites that can admit now, on a fresh summary, are priced
   (``quicker``); among them the cheapest first. A conversation's turn (a session key) is
   never pushed by this rule: its cache is at its pick, and it keeps its site and replica
   while they can admit it. The prompt's own prefill is the same term
   at every site of one model's replicas and cancels, except for the part some site holds
   cached: rule 7.
7. **Prefix locality across sites** (SkyLB's regional snapshot, §3.2). A gateway's prefix
   index (``routing.PrefixPolicy``) records every request it routes, the ones it sends to a
   peer site's gateway included: that gateway is a target in the index like a node of ours,
   so the index holds, per peer site, the prefixes we sent there (``Prompt.held``). It is an
   approximation of what that site has cached, the one SkyLB measured as enough: requests
   from different regions share 2.5% of their prefixes, so what a site caches of *our*
   clients' prompts is what we sent it. The cost of rules 5 and 6 then counts the prompt's
   uncached blocks at each place (``Prompt``: the blocks not held there, at the pick's
   learned prefill rate): ours is the pick's wait plus what no node of ours holds, a peer
   site's is its expected wait plus what we did not send it. Sites are compared by what they
   hold, not by where the policy would send the request inside each (a weak match there goes
   to the least loaded node, at either site): only a prefix no node of ours holds, and that
   we sent a peer site, draws a prompt there. So a prompt whose long prefix
   we sent to site B goes on to B while B can admit it and that is quicker than computing
   the prefix here, and one our pick holds is not pushed by rule 6 unless the peer site is
   quicker by more than the prefill the cache saves. Without a prefix index, or a prompt of
   fewer than one block, every term is 0 and rules 5 and 6 are as above.
8. **Scale from zero at the quickest site.** A declared model no site serves waits for a
   replica to start (``hold_requests``), at the site whose controller would have it serving
   first: each site's summary says, per model its acting controller would start now, the
   seconds it expects that to take (``start_s``: its learned start-up time; no value while
   its Slurm refuses the model or keeps its jobs pending). A gateway whose own controller
   expects ``here_s`` sends the request to a peer site whose round trip plus ``start_s`` is
   less (``quicker_start``); that site's gateway holds it, which is the demand its controller
   starts a replica for, and our controller, whose site holds no request, starts none. The
   rule is asked again while the request waits: if our Slurm refuses the start, the waiting
   requests go to the next site. A site whose controller does not run on its gateway says no
   start (its gateway cannot see one), and a gateway that knows no expected start of its own
   keeps its requests: starts go where the controllers can say how long they take.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fabricnode.dataplane import residency, routetable
from fabricnode.dataplane.routetable import Origin, Route
from fabricnode.dataplane.routing import NodeInfo

# The label a gateway's entry carries (its federation address): ``federation.summary``'s
# ``GATEWAY_LABEL``, named again in ``routetable`` so the data plane needs nothing of the
# federation.
GATEWAY_LABEL = routetable.GATEWAY_LABEL
# Set by the frontdoor on each request that came over the federation port: the peer site.
FROM_SITE_HEADER = b"x-fabric-from-site"
# A forward asking a gateway of our site to take the request out of the site.
OUT_HEADER = b"x-fabric-out"
OUT_SUFFIX = "/out"
# A forward asking a gateway of our site to route the request anywhere, our site first: our
# site's nodes cannot admit it now (``push_routes``, two-layer routing).
PUSH_HEADER = b"x-fabric-push"
PUSH_SUFFIX = "/push"
# Response header naming the site whose node served (cross-site answers only).
SITE_HEADER = b"x-fabric-site"
# What a route leads to (``Route.hop``).
HOP_NODE = routetable.HOP_NODE  # a node of our site (or our own engine)
HOP_GATEWAY = routetable.HOP_GATEWAY  # a gateway of our site, which takes the request out
HOP_SITE = routetable.HOP_SITE  # a gateway of a peer site, over the federation link
HOP_PUSH = routetable.HOP_PUSH  # a gateway of our site, to route it anywhere, our site first
# The host part of a site origin: ``site:<site>/<gateway address>``; the port is 0.
SITE_ORIGIN_PREFIX = "site:"


@dataclass(frozen=True, slots=True)
class SiteOffer:
    """What a gateway knows of one peer site for one model (its summary and the link)."""

    site: str
    gateways: tuple[str, ...]  # federation addresses, as the summary lists them
    routable: bool
    rtt_s: float | None
    replicas: int
    admitting: int
    waiting: int
    # Its summary is recent enough to say what it can admit now (``view.fresh``): only such a
    # site is pushed to (rule 5).
    fresh: bool = True
    # The prefill backlog its summary reports, seconds, less the summary's age (rule 6).
    backlog_s: float = 0.0
    # Seconds until a replica its controller would start now serves (rule 8); None: none.
    start_s: float | None = None


def may_leave(from_site: str, out: bool) -> bool:
    """Whether a request may be sent to another site: not if it came from one (``from_site``)
    nor if it is already on its way out (``out``: a gateway took it to send it out)."""
    return not from_site and not out


def may_leave_for(allowed: residency.Sites, site: str) -> bool:
    """Whether a request whose allowed set is ``allowed`` may be served at some site other
    than ours (``site``): any site, or a set that names another (rule 4)."""
    return allowed is None or any(s != site for s in allowed)


def taken_in(allowed: residency.Sites, site: str) -> bool:
    """Whether the gateway of ``site`` may take in a request a peer site sent with the
    allowed set ``allowed`` (rule 4)."""
    return residency.allows(allowed, site)


def choose(offers: list[SiteOffer], allowed: residency.Sites = None) -> list[tuple[str, str]]:
    """``(site, gateway address)`` pairs to try, best first (rule 2 of the module docstring),
    at the sites ``allowed`` (rule 4; None: any)."""
    usable = [
        o
        for o in offers
        if o.routable and o.replicas > 0 and o.gateways and residency.allows(allowed, o.site)
    ]
    usable.sort(
        key=lambda o: (
            o.admitting <= 0,
            o.rtt_s is None,
            o.rtt_s if o.rtt_s is not None else 0.0,
            o.waiting,
            o.site,
        )
    )
    out: list[tuple[str, str]] = []
    for offer in usable:
        for addr in offer.gateways:
            out.append((offer.site, addr))
    return out


def site_origin(site: str, addr: str) -> Origin:
    """The origin of a peer site's gateway (module docstring)."""
    return (SITE_ORIGIN_PREFIX + site + "/" + addr, 0)


def parse_site_origin(origin: Origin) -> tuple[str, str] | None:
    """``(site, gateway address)`` of a site origin, None for an ordinary one."""
    host = origin[0]
    if not host.startswith(SITE_ORIGIN_PREFIX):
        return None
    site, sep, addr = host[len(SITE_ORIGIN_PREFIX) :].partition("/")
    if not sep or not site or not addr:
        return None
    return site, addr


def admitting(offers: list[SiteOffer]) -> list[SiteOffer]:
    """The peer sites that can admit a request now: a replica with no request waiting, on a
    summary recent enough to say so (rule 5, two-layer routing)."""
    return [o for o in offers if o.admitting > 0 and o.fresh]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt's prefill as the cross-site cost prices it (rule 7): its whole prefix blocks
    (``routing.prompt_blocks``), the most of them a node of our site holds (``here``: the
    site's cache, as a peer site's is the most any of its nodes holds), the prefill time of
    one block at the pick's learned rate, and how many blocks our prefix index holds at a
    route (``held(session id)``: a peer site's gateway holds what we sent it)."""

    blocks: int
    here: int
    block_s: float
    held: Callable[[str], int]

    def here_s(self) -> float:
        """The prefill of the blocks the pick does not hold."""
        return max(0, self.blocks - self.here) * self.block_s

    def at_s(self, offer: SiteOffer) -> float:
        """The prefill of the blocks we did not send to ``offer``'s site (any of its
        gateways: they route inside the one site)."""
        held = max((self.held(site_sid(offer.site, a)) for a in offer.gateways), default=0)
        return max(0, self.blocks - held) * self.block_s


def expected_wait_s(offer: SiteOffer, prompt: Prompt | None = None) -> float:
    """How long a request pushed to ``offer``'s site waits for its first token there, as far
    as sites differ (rules 6 and 7): the round trip to it (unknown: infinite), the backlog its
    summary reports, and the prefill of what of the ``prompt`` it does not hold."""
    if offer.rtt_s is None:
        return float("inf")
    uncached = prompt.at_s(offer) if prompt is not None else 0.0
    return offer.rtt_s + max(0.0, offer.backlog_s) + uncached


def quicker(
    offers: list[SiteOffer], wait_s: float, prompt: Prompt | None = None
) -> list[SiteOffer]:
    """The peer sites that can admit a request now (``admitting``) and would answer it
    sooner than our pick, which starts it ``wait_s`` from now (and computes what of the
    ``prompt`` it does not hold), the quickest first (rules 6 and 7; ties by name)."""
    here = wait_s + (prompt.here_s() if prompt is not None else 0.0)
    priced = [(expected_wait_s(o, prompt), o.site, o) for o in admitting(offers)]
    return [o for cost, _, o in sorted(priced, key=lambda t: (t[0], t[1])) if cost < here]


def quicker_start(
    offers: list[SiteOffer], here_s: float, allowed: residency.Sites = None
) -> list[tuple[str, str]]:
    """``(site, gateway address)`` pairs of the peer sites that would serve a model no site
    serves sooner than our site would start it (``here_s``; infinite: we would start none),
    by the round trip and the start their summary expects, the soonest first (rule 8; ties
    by name), at the sites ``allowed``. Only a routable site, on a fresh summary."""
    priced = [
        (o.rtt_s + o.start_s, o.site, o)
        for o in offers
        if o.start_s is not None
        and o.rtt_s is not None
        and o.routable
        and o.fresh
        and o.gateways
        and residency.allows(allowed, o.site)
    ]
    out: list[tuple[str, str]] = []
    for cost, _, offer in sorted(priced, key=lambda t: (t[0], t[1])):
        if cost < here_s:
            out.extend((offer.site, addr) for addr in offer.gateways)
    return out


def by_cost(
    chosen: list[tuple[str, str]], offers: list[SiteOffer], prompt: Prompt | None
) -> list[tuple[str, str]]:
    """``choose``'s pairs with the sites in order of ``expected_wait_s`` (rules 5 and 7),
    each site's gateways in their order; ties keep ``choose``'s order."""
    if prompt is None or len(chosen) < 2:
        return chosen
    cost = {o.site: expected_wait_s(o, prompt) for o in offers}
    return sorted(chosen, key=lambda c: cost.get(c[0], float("inf")))


def site_sid(site: str, addr: str) -> str:
    """The session id of a route to a peer site's gateway: a name for the breaker, the
    request log and the prefix index (rule 7)."""
    return "site:" + site + "/" + addr


def pushed(gateways: list[Route]) -> list[Route]:
    """Our site's gateways as routes that ask each to route the request anywhere, our site
    first (``HOP_PUSH``)."""
    return [replace(r, hop=HOP_PUSH) for r in gateways]


def site_routes(pairs: list[tuple[str, str]]) -> list[Route]:
    """The routes to peer sites' gateways (``choose``'s pairs, in order)."""
    routes: list[Route] = []
    for site, addr in pairs:
        sid = site_sid(site, addr)
        info = NodeInfo(
            session_id=sid,
            url="fabric-http://" + addr,
            provider="site:" + site,
            verified_provider=None,
            certified_name=None,
            gpu_type="",
            gpu_count=0,
            max_model_len=None,
            quantization=None,
            site=site,
        )
        routes.append(Route(info, site_origin(site, addr), float("inf"), False, False, HOP_SITE))
    return routes
