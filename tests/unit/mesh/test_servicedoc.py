"""The mesh's service file: signing, decoding, the register's rules, and spreading through the
pure mesh core over the seeded simulated network (loss, a partition, a late joiner)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.errors import DecodeError
from fabricnode.mesh.assignment import Offer
from fabricnode.mesh.core import MeshConfig
from fabricnode.mesh.identity import Identity, OperatorKey, Verifier
from fabricnode.mesh.servicedoc import (
    MAX_SERVICES_TEXT,
    ServicesBody,
    ServicesRegister,
    SignedServices,
)
from fabricnode.mesh.wire import (
    Packet,
    ServicesMsg,
    ServicesRank,
    ServicesWant,
    decode_packet,
    encode_packet,
)
from fabricnode.testing.simnet import SimNetwork

NOW = 1_800_000_000.0
OPERATOR = OperatorKey(Identity.from_seed(b"o" * 32))
INTRUDER = OperatorKey(Identity.from_seed(b"x" * 32))
FILE = '[[model]]\nname = "llama-3.1-8b"\nengine = "sim"\nmin_replicas = 2\n'


def services(
    text: str = FILE, *, key: OperatorKey = OPERATOR, issued: float = NOW
) -> SignedServices:
    return ServicesBody(issued, text, key.public_key).sign(key)


def register(*trusted: OperatorKey) -> ServicesRegister:
    return ServicesRegister([k.fingerprint for k in trusted], Verifier())


def test_signed_services_round_trip_through_wire_and_json() -> None:
    doc = services()
    assert SignedServices.from_wire(doc.to_wire()) == doc
    assert SignedServices.from_json(doc.to_json()) == doc
    packet = Packet("ab" * 16, 1, int(NOW * 1000), (ServicesMsg(doc), ServicesRank(doc.rank),
                    ServicesRank(None), ServicesWant()))  # fmt: skip
    decoded, unknown = decode_packet(encode_packet(packet))
    assert unknown == 0 and decoded.messages == packet.messages
    assert doc.verify(Verifier())


def test_signing_refuses_another_key_and_oversized_files() -> None:
    with pytest.raises(ValueError, match="operator key it names"):
        ServicesBody(NOW, FILE, INTRUDER.public_key).sign(OPERATOR)
    with pytest.raises(ValueError, match="at most"):
        services("#" * (MAX_SERVICES_TEXT + 1))


def test_tampered_file_fails_verification_and_garbage_is_a_decode_error() -> None:
    doc = services()
    forged = SignedServices(
        ServicesBody(NOW, FILE.replace("2", "9"), OPERATOR.public_key),
        ServicesBody(NOW, FILE.replace("2", "9"), OPERATOR.public_key).canonical_bytes(),
        doc.signature,
    )
    reg = register(OPERATOR)
    assert reg.offer(forged, NOW) == Offer.BAD_SIGNATURE and reg.current is None
    with pytest.raises(DecodeError):
        SignedServices.from_json({"signed": "not base64!", "signature": ""})
    with pytest.raises(DecodeError):
        SignedServices.from_wire([b"\x93\x01\x02\x03", b"s" * 64])


@given(st.binary(max_size=512))
@settings(max_examples=200, deadline=None)
def test_decoding_random_bytes_only_raises_decode_error(data: bytes) -> None:
    try:
        SignedServices.from_wire([data, b"s" * 64])
    except DecodeError:
        pass


def test_only_trusted_current_files_are_taken_and_the_newest_wins() -> None:
    reg = register(OPERATOR)
    assert reg.offer(services(key=INTRUDER), NOW) == Offer.UNTRUSTED
    assert reg.offer(services(issued=NOW + 3600), NOW) == Offer.FUTURE
    first = services(issued=NOW)
    newer = services("", issued=NOW + 1)  # an empty file withdraws every model
    assert reg.offer(first, NOW) == Offer.NEW
    assert reg.offer(newer, NOW + 2) == Offer.NEW
    assert reg.offer(first, NOW + 2) == Offer.STALE
    assert reg.current == newer and reg.newer_than(first.rank) and not reg.newer_than(newer.rank)


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["a", "b", "c"])), max_size=8),
       st.randoms(use_true_random=False))  # fmt: skip
@settings(max_examples=100, deadline=None)
def test_replicas_converge_whatever_the_order_of_arrival(
    items: list[tuple[int, str]], rng: object
) -> None:
    offers = [services(f"# {text}\n", issued=NOW + i) for i, text in items]
    shuffled = list(offers)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    one, two = register(OPERATOR), register(OPERATOR)
    for doc in offers:
        one.offer(doc, NOW + 10)
    for doc in shuffled + shuffled:
        two.offer(doc, NOW + 10)
    assert one.current == two.current


# -- through the mesh core -------------------------------------------------------------------------


def mesh_with_operator(n: int, **kw: object) -> SimNetwork:
    config = MeshConfig(trusted_operators=(OPERATOR.fingerprint,))
    net = SimNetwork(config=config, **kw)  # type: ignore[arg-type]
    first = net.add_node(0)
    for i in range(1, n):
        net.add_node(i, seeds=[first.addr])
    net.run_for(10)
    return net


def test_a_service_file_reaches_every_member_despite_loss() -> None:
    net = mesh_with_operator(16, seed=11, loss=0.2)
    nodes = list(net.nodes.values())
    doc = services(issued=net.wall)
    assert nodes[3].core.publish_services(doc, net.wall) == Offer.NEW
    net.poke(nodes[3])
    net.run_for(3)
    assert sum(n.core.services.current == doc for n in nodes) >= 12  # epidemic, before sync
    net.run_for(20)
    assert all(n.core.services.current == doc for n in nodes)


def test_a_file_lost_in_a_partition_and_a_late_joiner_converge_by_anti_entropy() -> None:
    net = mesh_with_operator(8, seed=12)
    nodes = list(net.nodes.values())
    left, right = nodes[:4], nodes[4:]
    net.partition([n.addr for n in left], [n.addr for n in right])
    doc = services(issued=net.wall)
    left[0].core.publish_services(doc, net.wall)
    net.poke(left[0])
    net.run_for(5)
    assert all(n.core.services.current is None for n in right)
    net.heal()
    late = net.add_node(8, seeds=[right[0].addr])
    net.run_for(30)
    assert all(n.core.services.current == doc for n in [*nodes, late])
    # a newer file published on the other side replaces it everywhere
    newer = services("", issued=net.wall)
    right[2].core.publish_services(newer, net.wall)
    net.poke(right[2])
    net.run_for(30)
    assert all(n.core.services.current == newer for n in [*nodes, late])


def test_an_untrusting_node_drops_and_counts_files_and_never_holds_them() -> None:
    net = mesh_with_operator(3, seed=13)
    a_node, b_node, c_node = net.nodes.values()
    b_node.core.services.trusted = frozenset()
    doc = services(issued=net.wall)
    a_node.core.publish_services(doc, net.wall)
    net.poke(a_node)
    net.run_for(20)
    assert b_node.core.services.current is None  # so it never forwards it either
    assert b_node.core.statistics().dropped.get("services_untrusted", 0) >= 1
    assert c_node.core.services.current == doc
