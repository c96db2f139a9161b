"""Responses pinning (``fabricnode.dataplane.responses``): where a request about a stored
response may go, and the reason a client gets when it may not. No sockets, no mesh."""

from __future__ import annotations

import math

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.dataplane.endpoints import node_of_response, response_id, site_of_response
from fabricnode.dataplane.request import Rejection
from fabricnode.dataplane.responses import (
    ANONYMOUS,
    PinnedNode,
    carried_owner,
    carrying_owner,
    follow_up,
    gone_message,
    held_elsewhere,
    not_yours,
    owned,
    owner_ref,
    pin,
    pinned_node,
    site_owner,
    tagged,
)
from fabricnode.dataplane.routetable import Route
from fabricnode.dataplane.routing import NodeInfo
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import State
from fabricnode.mesh.schema import standing

A = "a" * 32
B = "b" * 32


def route(sid: str) -> Route:
    info = NodeInfo(sid, f"http://{sid[:4]}", "p", None, None, "L4", 1, 4096, None)
    return Route(info, ("127.0.0.1", 1), math.inf, False)


def node(state: State, liveness: Liveness | None, routable: bool) -> PinnedNode:
    """A node's facts as the ingress builds them: its state and the mesh's verdict on it."""
    return PinnedNode(state, standing(state, liveness, probed=True), routable)


def serving(sid: str) -> PinnedNode:
    return node(State.SERVING, Liveness.ALIVE, True)


STORED = response_id(B, b"\x00" * 8, b"\x01" * 8)


def test_a_response_id_names_the_node_that_stored_it() -> None:
    assert pinned_node({"previous_response_id": STORED}) == B
    assert pinned_node({"previous_response_id": "resp_nothex"}) is None
    assert pinned_node({"input": "x"}) is None
    assert pinned_node(None) is None


def test_a_request_that_continues_no_response_keeps_its_routes() -> None:
    routes = [route(A), route(B)]
    assert pin("m1", {"input": "x"}, None, routes, serving) is routes
    assert pin("m1", {"input": "x"}, None, None, serving) is None


def test_a_continuation_goes_only_to_the_node_that_stored_the_response() -> None:
    pinned = pin(
        "m1",
        {"previous_response_id": STORED},
        pinned_node({"previous_response_id": STORED}),
        [route(A), route(B)],
        serving,
    )
    assert isinstance(pinned, list) and [r.info.session_id for r in pinned] == [B]


@pytest.mark.parametrize(
    ("facts", "why"),
    [
        (node(State.LEFT, None, False), "has left the mesh: its stored responses went"),
        (node(State.LEFT, Liveness.DEAD, False), "has left the mesh: its stored responses went"),
        (node(State.DOWN, Liveness.ALIVE, False), "is down (its engine stopped)"),
        (node(State.DOWN, Liveness.DEAD, False), "is down (its engine stopped)"),
        (node(State.JOIN, Liveness.ALIVE, False), "does not serve"),
        (node(State.SERVING, Liveness.DEAD, True), "is dead (it stopped answering the mesh)"),
        (node(State.SERVING, Liveness.ALIVE, True), "does not serve 'm1'"),
        (node(State.SERVING, Liveness.LEFT, True), "does not serve 'm1'"),
        (node(State.SERVING, None, True), "does not serve 'm1'"),
        (node(State.SERVING, Liveness.ALIVE, False), "your key or X-Fabric-* headers exclude it"),
    ],
    ids=[
        "left",
        "left-dead",
        "down",
        "down-dead",
        "joining",
        "dead",
        "other-model",
        "member-leaving",
        "unvouched",
        "excluded",
    ],
)
def test_a_continuation_whose_node_is_gone_is_a_404_that_says_why(
    facts: PinnedNode, why: str
) -> None:
    refused = pin(
        "m1",
        {"previous_response_id": STORED},
        pinned_node({"previous_response_id": STORED}),
        [route(A)],
        lambda sid: facts,
    )
    assert isinstance(refused, Rejection)
    assert (refused.status, refused.code) == (404, "response_node_gone")
    assert refused.message.startswith(f"response {STORED!r} was stored by node {B[:8]}, which ")
    assert why in refused.message


def test_a_follow_up_goes_to_the_node_its_id_names() -> None:
    routes = {B: route(B)}
    got = follow_up(STORED, routes.get, lambda r: True, serving)
    assert isinstance(got, Route) and got.info.session_id == B


def test_a_follow_up_whose_id_names_no_node_is_response_not_found() -> None:
    got = follow_up("resp_123", {}.get, lambda r: True, serving)
    assert isinstance(got, Rejection)
    assert (got.status, got.code) == (404, "response_not_found")
    assert "its id names no node" in got.message


def test_a_follow_up_to_a_node_the_caller_may_not_use_or_that_went_is_response_node_gone() -> None:
    routes = {B: route(B)}
    excluded = follow_up(STORED, routes.get, lambda r: False, serving)
    assert isinstance(excluded, Rejection) and excluded.code == "response_node_gone"
    # A follow-up names no model: a routable node that is excluded is the caller's filters.
    assert "exclude it" in excluded.message
    gone = node(State.LEFT, None, False)
    left = follow_up(STORED, {}.get, lambda r: True, lambda sid: gone)
    assert isinstance(left, Rejection) and "has left the mesh" in left.message


def test_the_reason_names_the_model_only_for_a_continuation() -> None:
    facts = serving(B)
    assert "does not serve 'm1'" in gone_message("r", B, "m1", facts)
    assert "exclude it" in gone_message("r", B, None, facts)


RING = Keyring.with_key(b"k" * 32)


def test_a_stored_response_belongs_to_the_key_that_created_it_under_any_ingress() -> None:
    """The id's tag says which key created it; any ingress with the cluster key checks it, a
    rotated keyring still does, and no other key, and no key holder without the cluster key,
    can pass for the owner."""
    body, rid = tagged({"model": "m", "input": "hi"}, B, b"\x07" * 8, RING, "key-alice")
    assert orjson.loads(body)["request_id"] == rid and node_of_response(rid) == B
    assert owned(rid, "key-alice", RING)
    assert not owned(rid, "key-bob", RING)
    assert not owned(rid, ANONYMOUS, RING)
    rotated = Keyring.with_key(b"n" * 32)
    rotated.keys.update(RING.keys)  # the old key stays to open what was made with it
    assert owned(rid, "key-alice", rotated)
    assert not owned(rid, "key-alice", Keyring.with_key(b"x" * 32))
    # An id from before owners, or one no ingress made, is nobody's (with keys on).
    assert not owned(rid[:53], "key-alice", RING)
    assert not owned("resp_" + "0" * 32, "key-alice", RING)
    refused = not_yours(rid)
    assert (refused.status, refused.code) == (404, "response_not_found")
    assert "alice" not in refused.message


@given(st.binary(min_size=8, max_size=8), st.text(max_size=20), st.text(max_size=20))
def test_a_tag_verifies_for_its_owner_only(nonce: bytes, owner: str, other: str) -> None:
    _, rid = tagged({}, B, nonce, RING, owner)
    assert owned(rid, owner, RING)
    assert owned(rid, other, RING) == (other == owner)


# == across sites ==============================================================================


def test_a_response_made_for_another_site_names_our_site_and_that_sites_owner() -> None:
    """The gateway that takes in a request from site A tags the id with A's owner reference
    and names its own site; the owner is neither any key of ours nor another site's."""
    owner = site_owner("A", "0123456789abcdef")
    body, rid = tagged({"model": "m"}, B, b"\x07" * 8, RING, owner, "C")
    assert orjson.loads(body)["request_id"] == rid
    assert rid.endswith("_C") and site_of_response(rid) == "C" and node_of_response(rid) == B
    assert owned(rid, owner, RING)
    assert not owned(rid, site_owner("B", "0123456789abcdef"), RING)  # another site
    assert not owned(rid, site_owner("A", "fedcba9876543210"), RING)  # another key of A
    assert not owned(rid, "0123456789abcdef", RING)  # a key id of ours that looks alike
    # a response made for our own clients names no site
    assert site_of_response(STORED) == "" and site_of_response("resp_other") == ""


def test_an_owner_reference_hides_the_key_and_is_the_same_for_one_key_at_every_ingress() -> None:
    ref = owner_ref(RING, "key-alice")
    assert len(ref) == 16 and "alice" not in ref
    assert ref == owner_ref(Keyring.with_key(b"k" * 32), "key-alice")  # another ingress
    assert ref != owner_ref(RING, "key-bob")
    assert ref != owner_ref(Keyring.with_key(b"x" * 32), "key-alice")  # another site's key
    assert owner_ref(RING, ANONYMOUS) == ANONYMOUS  # keys off: nobody's, as at home
    body = carrying_owner({"model": "m", "request_id": "client's own"}, ref)
    assert carried_owner(orjson.loads(body)) == ref


@pytest.mark.parametrize(
    "value", [None, "", "x" * 16, "0123456789ABCDEF", "0123456789abcde", 7, ["-"], "--"]
)
def test_a_malformed_owner_reference_from_a_peer_site_is_none(value: object) -> None:
    doc = {} if value is None else {"request_id": value}
    assert carried_owner(doc) is None
    assert carried_owner(None) is None


def test_reading_a_response_another_site_stores_says_where_it_is() -> None:
    refused = held_elsewhere("resp_x_C", "C")
    assert (refused.status, refused.code) == (404, "response_not_found")
    assert "site 'C'" in refused.message and "previous_response_id" in refused.message
