"""Data residency: the sites a request may be served at, and how a forward carries them.

Rules
-----
1. Three things may limit where a request is served, each naming sites (``mesh.sites``'
   names, compared exactly): its API key (``sites`` in the key's record), the request itself
   (``X-Fabric-Require: site=A|B``) and its model in the mesh's service file (``sites = [...]``
   on a ``[[model]]``). Each one absent means any site. The **allowed set** is their
   intersection (``narrow``): None = any site, an empty set = no site at all.
2. A node is a candidate only if the site its owner signed into its entry
   (``registry.EntryBody.site``) is in the allowed set. That filter is in one place,
   ``routetable.RouteTable.eligible``, through which every pick of a node goes: the first
   attempt, failover and retries, a broken stream's resume, the pending-aware hold, the batch
   gate, the wait for a replica and the Responses follow-ups. A node outside the set is never
   sent the request, not even as a last resort.
3. What a client gets when nothing allowed can serve (the ingress, ``Ingress._route``): an
   empty allowed set, or a model whose replicas (awake or asleep) are all outside it, is 403
   ``site_not_allowed`` naming the allowed sites (``refusal_message``); a model no node serves
   anywhere is the 404 ``model_not_found`` it always was; a declared model (scale from zero)
   without a replica in the allowed set waits for one like a model without any.
4. A forward to another agent carries the allowed set in ``SITES_HEADER`` (``encode``: the
   names sorted, comma-separated; absent = any site), bound into the forward's MAC
   (``forward_auth``): the agent that takes it checks it again and refuses (403
   ``site_not_allowed``) a forward whose set excludes its own site. A hop may only narrow the
   set it was given, never widen it; the client's credentials never travel with it (the
   forward carries the set, not the key).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from fabricnode.mesh.sites import site_problem

SITES_HEADER = b"x-fabric-sites"
SITE_NOT_ALLOWED = "site_not_allowed"
MAX_SITES = 32  # names in one list: a key's, a header's, a model's, a forward's

# Why a request was refused for residency (the metric's ``reason`` label).
NO_COMMON_SITE = "no_common_site"  # the key, the header and the model allow no site together
NOT_SERVED_THERE = "not_served_in_allowed_sites"  # replicas exist, none at an allowed site
FORWARD_ELSEWHERE = "forward_outside_site"  # a forward whose set excludes this agent's site
REASONS = (NO_COMMON_SITE, NOT_SERVED_THERE, FORWARD_ELSEWHERE)

Sites = frozenset[str] | None  # None: any site


def narrow(a: Sites, b: Sites) -> Sites:
    """The sites both allow (None: each allows any, so any)."""
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def allows(sites: Sites, site: str) -> bool:
    """Whether ``site`` is in the allowed set ``sites``."""
    return sites is None or site in sites


def check_sites(names: Iterable[str], what: str) -> frozenset[str]:
    """A set of site names, each checked (``mesh.sites.site_problem``); ``ValueError`` (one
    line naming ``what``) for an empty list, a bad name or more than ``MAX_SITES``."""
    found = tuple(names)
    if not found:
        raise ValueError(f"{what}: no site named (omit it to allow any site)")
    if len(found) > MAX_SITES:
        raise ValueError(f"{what}: more than {MAX_SITES} sites")
    for name in found:
        problem = site_problem(name)
        if problem:
            raise ValueError(f"{what}: site {name[:40]!r}: {problem}")
    return frozenset(found)


def parse_alternatives(value: str, what: str) -> frozenset[str]:
    """``A|B`` -> {"A", "B"} (``X-Fabric-Require``'s ``site=`` term); ``ValueError`` if an
    alternative is empty or no site name."""
    return check_sites((part.strip() for part in value.split("|")), what)


def encode(sites: frozenset[str]) -> bytes:
    """The value of ``SITES_HEADER`` for an allowed set: the names sorted, comma-separated
    (an empty set is the empty value: no site)."""
    return ",".join(sorted(sites)).encode("ascii")


def decode(raw: bytes) -> frozenset[str]:
    """The allowed set a forward carries; ``ValueError`` if malformed. The empty value is the
    empty set (no site), which every agent refuses."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{SITES_HEADER.decode()}: not ASCII") from None
    if not text:
        return frozenset()
    return check_sites(text.split(","), SITES_HEADER.decode())


def shown(sites: frozenset[str]) -> str:
    """``A, B`` (sorted), or ``none``."""
    return ", ".join(sorted(sites)) if sites else "none"


def refusal_message(
    model: str,
    allowed: frozenset[str],
    *,
    key_sites: Sites,
    header_sites: Sites,
    model_sites: Sites,
) -> str:
    """The 403's message: the model, the sites each limit allows, the allowed set."""
    if allowed:
        return (
            f"model {model!r} is not served at any site this request may use "
            f"(allowed sites: {shown(allowed)})"
        )
    limits = []
    if key_sites is not None:
        limits.append(f"the API key allows {shown(key_sites)}")
    if header_sites is not None:
        limits.append(f"X-Fabric-Require allows {shown(header_sites)}")
    if model_sites is not None:
        limits.append(f"the service file allows {model!r} at {shown(model_sites)}")
    return f"no site may serve this request: {'; '.join(limits)}"


def forward_message(own: str, carried: frozenset[str]) -> str:
    """The 403's message of a forward whose allowed set excludes this agent's site."""
    return (
        f"this node is at site {own!r}, which the request may not use "
        f"(allowed sites: {shown(carried)})"
    )
