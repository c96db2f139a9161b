"""Responses pinning: where a request about a stored response may go, or why it may not.

vLLM keeps a Responses API response in the store of the engine that made it, and the ids this
mesh hands out name that node (``endpoints.response_id``: ``resp_<session id><16 hex>``). So:

* a ``POST /v1/responses`` that continues one (``previous_response_id``) may go only to the
  node that stored it (``pin``), and is a 404 ``response_node_gone`` once that node no longer
  takes its model's requests;
* ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to that node, with no
  policy and no failover (no other node holds the response; ``follow_up``): a 404
  ``response_not_found`` for an id that names no node, ``response_node_gone`` for a node that
  cannot take it.

With API keys on, a stored response belongs to the key that created it, across ingresses, as
files and batches do: its id carries an owner tag (``owner_tag``: HMAC-SHA256 with the
cluster key over the node, the id's nonce and the key's id, 8 bytes), so any ingress can check
that the caller's key made it (``owned``) with nothing shared but the cluster key, and no key
holder can make an id that another key would pass. A caller whose key did not create it gets
the 404 of an unknown id (``not_yours``): whether another key's response exists is not
said. With keys off there are no owners, as before.

Across sites (``docs/federation.md``, "Cross-site requests"): a response is stored at the site
whose node made it, and its owner is checked there. The client's key never leaves its ingress,
so the ingress sends an opaque reference to it instead (``owner_ref``: an HMAC with its cluster
key over the key's id, or ``ANONYMOUS`` with keys off) as the ``request_id`` of the request it
sends out (``carrying_owner``; the body is signed in the forward to its gateway and crosses the
authenticated link). The gateway of the site that takes it in reads it (``carried_owner``),
makes the owner ``site:<their site>/<reference>`` (``site_owner``) and tags the id with it, its
own site named in the id (``endpoints.response_id``). A follow-up at the client's site goes out
to that site alone (``endpoints.site_of_response``), whose gateway checks the owner as it checks
a key: a follow-up from another site, or for another key, is the 404 of an unknown id.

The refusal says why, from what the shell knows of the node (``PinnedNode``: the mesh's
``schema.standing`` verdict with the registry state behind it): it left, it is down, it does
not serve, it is dead, it does not serve that model, or the caller's key or ``X-Fabric-*``
headers exclude it.

Pure: no I/O, no clock, no trio; the shell hands in its route table's answers.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable
from typing import Any

import orjson

from fabricnode.dataplane.endpoints import (
    OWNER_TAG_BYTES,
    node_of_response,
    parse_response_id,
    response_id,
)
from fabricnode.dataplane.request import Rejection
from fabricnode.dataplane.request import pinned_node as pinned_node
from fabricnode.dataplane.routetable import Route
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import State
from fabricnode.mesh.schema import Standing


class PinnedNode:
    """What the shell knows of a node that stored a response, for the refusal's reason: the
    mesh's verdict on it (``schema.standing``) and the finer facts the message needs (which
    registry state made it GONE or LEAVING; whether the route table still has it)."""

    __slots__ = ("routable", "standing", "state")

    def __init__(self, state: State, standing: Standing, routable: bool) -> None:
        self.state = state  # its registry state (LEFT when the registry forgot it)
        self.standing = standing  # schema.standing of that state under this node's liveness view
        self.routable = routable  # the route table has it (for some model)


def pin(
    model: str,
    doc: dict[str, Any],
    sid: str | None,
    routes: list[Route] | None,
    node_facts: Callable[[str], PinnedNode],
) -> list[Route] | Rejection | None:
    """The routes of a ``POST /v1/responses``: if it continues a stored response (on node
    ``sid``, the decoder's ``Routed.pinned``), only the node that stored it, 404 once that node
    is gone; else ``routes`` as they are."""
    if sid is None:
        return routes
    pinned = [r for r in routes if r.info.session_id == sid] if routes else []
    if pinned:
        return pinned
    why = gone_message(str(doc.get("previous_response_id")), sid, model, node_facts(sid))
    return Rejection(404, why, "response_node_gone")


def follow_up(
    rid: str,
    node: Callable[[str], Route | None],
    eligible: Callable[[Route], bool],
    node_facts: Callable[[str], PinnedNode],
) -> Route | Rejection:
    """The route of ``GET /v1/responses/{rid}`` or its cancel: the node its id names, if the
    route table has it and the caller may use it (``eligible``: the same filters as a routed
    request), else why not."""
    sid = node_of_response(rid)
    if sid is None:
        return Rejection(
            404,
            f"response {rid!r} was not created through this mesh: its id names no node "
            "(ids the mesh hands out are resp_<node session id> and 32 hex digits)",
            "response_not_found",
        )
    route = node(sid)
    if route is None or not eligible(route):
        return Rejection(404, gone_message(rid, sid, None, node_facts(sid)), "response_node_gone")
    return route


def gone_message(rid: str, sid: str, model: str | None, node: PinnedNode) -> str:
    """Why the node that stored response ``rid`` cannot take its follow-up. The registry
    state comes first (DOWN and LEFT say more than the verdict's GONE and LEAVING); a SERVING
    node whose verdict is GONE is one whose owner the mesh holds dead."""
    state = node.state
    if state == State.LEFT:
        why = "has left the mesh: its stored responses went with it"
    elif state == State.DOWN:
        why = "is down (its engine stopped): its stored responses went with it"
    elif state != State.SERVING:
        why = "does not serve"
    elif node.standing is Standing.GONE:
        why = "is dead (it stopped answering the mesh)"
    elif model is not None and node.routable:
        why = f"does not serve {model!r}"
    else:
        why = "cannot take requests from you (your key or X-Fabric-* headers exclude it)"
    return f"response {rid!r} was stored by node {sid[:8]}, which {why}"


OWNER_DOMAIN = b"fabric/response-owner/v1"
ANONYMOUS = "-"  # the owner of a response created with keys off


def owner_tag(key: bytes, sid: str, nonce: bytes, owner: str) -> bytes:
    """The tag in a response id that says the key ``owner`` (its key id) created it."""
    msg = b"|".join((OWNER_DOMAIN, sid.encode(), nonce, owner.encode()))
    return hmac.new(key, msg, hashlib.sha256).digest()[:OWNER_TAG_BYTES]


def owned(rid: str, owner: str, keyring: Keyring) -> bool:
    """Whether the key ``owner`` created response ``rid``: its tag verifies under a key of the
    keyring (any of them: ids made before a rotation keep their owner). An id without a tag
    (from before responses had owners) is nobody's with keys on."""
    parsed = parse_response_id(rid)
    if parsed is None:
        return False
    sid, nonce, tag = parsed
    if tag is None:
        return False
    return any(
        hmac.compare_digest(owner_tag(key, sid, nonce, owner), tag) for key in keyring.keys.values()
    )


def not_yours(rid: str) -> Rejection:
    """The answer to a caller whose key did not create response ``rid``: the same as for an
    id that does not exist, so that a key learns nothing of another's responses."""
    return Rejection(404, f"response {rid!r} not found", "response_not_found")


def held_elsewhere(rid: str, site: str) -> Rejection:
    """The answer to ``GET /v1/responses/{rid}`` or its cancel at a site other than the one
    that stores it: follow-ups by ``previous_response_id`` go there from any site, but a read
    or a cancel names no model, and the gateways route by model (``docs/federation.md``)."""
    return Rejection(
        404,
        f"response {rid!r} is stored at site {site!r}: read or cancel it through an ingress "
        "of that site (a POST /v1/responses with it as previous_response_id is routed there "
        "from any site)",
        "response_not_found",
    )


def tagged(
    doc: dict[str, Any], sid: str, nonce: bytes, keyring: Keyring, owner: str, site: str = ""
) -> tuple[bytes, str]:
    """The body of a ``POST /v1/responses`` about to go to node ``sid``, and the response id
    it names: its ``request_id`` (which vLLM makes the response's id, and its store's key)
    names that node and the key that creates it (``endpoints.response_id``; ``nonce``: the
    id's 8 random bytes; ``owner``: the caller's key id, ``ANONYMOUS`` with keys off, or
    ``site_owner`` for a client of another site; ``site``: our site, named in the id of a
    response made for another site)."""
    key = keyring.keys[keyring.primary]
    rid = response_id(sid, nonce, owner_tag(key, sid, nonce, owner), site)
    body = dict(doc)
    body["request_id"] = rid
    return orjson.dumps(body), rid


OWNER_REF_DOMAIN = b"fabric/response-owner-ref/v1"
OWNER_REF_HEX = 16
_OWNER_REF = re.compile(r"[0-9a-f]{16}")


def owner_ref(keyring: Keyring, owner: str) -> str:
    """What a request sent to another site carries of its owner (``owner``: the caller's key
    id, ``ANONYMOUS`` with keys off): an opaque reference, the same for one key at every
    ingress of our site, from which no other site learns the key's id."""
    if owner == ANONYMOUS:
        return ANONYMOUS
    key = keyring.keys[keyring.primary]
    msg = OWNER_REF_DOMAIN + b"|" + owner.encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:OWNER_REF_HEX]


def carrying_owner(doc: dict[str, Any], ref: str) -> bytes:
    """The body of a ``POST /v1/responses`` sent out of our site: as it came, its
    ``request_id`` the owner's reference (the site that takes it in replaces it with the id it
    hands out)."""
    body = dict(doc)
    body["request_id"] = ref
    return orjson.dumps(body)


def carried_owner(doc: dict[str, Any] | None) -> str | None:
    """The owner's reference a request from another site carries (``carrying_owner``), None
    when it carries none that is well formed."""
    ref = doc.get("request_id") if doc is not None else None
    if ref == ANONYMOUS or (isinstance(ref, str) and _OWNER_REF.fullmatch(ref)):
        return ref
    return None


def site_owner(from_site: str, ref: str) -> str:
    """The owner of a response made for a client of site ``from_site`` (``ref``: its
    reference): distinct from every key id of ours, and from every other site's owners."""
    return f"site:{from_site}/{ref}"
