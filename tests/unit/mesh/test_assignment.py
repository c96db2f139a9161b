"""Engine assignments: signing, decoding, the replicated table's rules, and spreading through
the pure mesh core over the seeded simulated network (loss, partitions)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.errors import DecodeError
from fabricnode.mesh.assignment import (
    AssignmentBody,
    AssignmentTable,
    Offer,
    SignedAssignment,
)
from fabricnode.mesh.core import MeshConfig
from fabricnode.mesh.identity import Identity, OperatorKey, Verifier
from fabricnode.mesh.registry import State
from fabricnode.mesh.wire import AssignmentMsg, Packet, decode_packet, encode_packet
from fabricnode.testing.simnet import SimNetwork

NOW = 1_800_000_000.0
OPERATOR = OperatorKey(Identity.from_seed(b"o" * 32))
INTRUDER = OperatorKey(Identity.from_seed(b"x" * 32))
TARGET = "ab" * 16


def assignment(
    *,
    key: OperatorKey = OPERATOR,
    target: str = TARGET,
    issued: float = NOW,
    ttl: float = 600.0,
    model: str = "llama-2-13b",
    tp: int = 2,
    dp: int = 1,
    plan: str = "p1",
) -> SignedAssignment:
    return AssignmentBody(target, plan, issued, issued + ttl, model, tp, dp, key.public_key).sign(
        key
    )


def table(*trusted: OperatorKey, cap: int = 4096) -> AssignmentTable:
    return AssignmentTable([k.fingerprint for k in trusted], Verifier(), max_items=cap)


# -- the record ----------------------------------------------------------------------------------


def test_signed_assignment_round_trips_through_wire_and_json() -> None:
    a = assignment()
    assert SignedAssignment.from_wire(a.to_wire()) == a
    assert SignedAssignment.from_json(a.to_json()) == a
    packet = Packet("cd" * 16, 1, 0, (AssignmentMsg(a),))
    decoded, unknown = decode_packet(encode_packet(packet))
    assert unknown == 0 and decoded.messages == (AssignmentMsg(a),)
    assert a.verify(Verifier()) and a.body.gpus == 2 and a.operator == OPERATOR.fingerprint


def test_a_key_cannot_sign_an_assignment_naming_another_operator() -> None:
    body = dataclasses.replace(assignment().body, operator_key=INTRUDER.public_key)
    with pytest.raises(ValueError, match="operator key it names"):
        body.sign(OPERATOR)


@pytest.mark.parametrize(
    "change",
    [{"tp": 0}, {"dp": 5000}, {"plan_id": ""}, {"model": ""}, {"target": "short"}],
)
def test_nonsense_is_refused_at_signing(change: dict[str, object]) -> None:
    body = dataclasses.replace(assignment().body, **change)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        body.sign(OPERATOR)


def test_tampered_assignment_fails_verification() -> None:
    a = assignment()
    forged = SignedAssignment(
        dataclasses.replace(a.body, model="evil"),
        dataclasses.replace(a.body, model="evil").canonical_bytes(),
        a.signature,
    )
    t = table(OPERATOR)
    assert t.offer(forged, NOW) == Offer.BAD_SIGNATURE
    assert t.get(TARGET) is None


@given(st.binary(max_size=600))
@settings(max_examples=300, deadline=None)
def test_decoding_random_bytes_only_raises_decode_error(data: bytes) -> None:
    for obj in ([data, b"s" * 64], {"signed": data.hex(), "signature": "x"}):
        try:
            if isinstance(obj, list):
                SignedAssignment.from_wire(obj)
            else:
                SignedAssignment.from_json(obj)
        except DecodeError:
            pass


def test_json_form_refuses_non_base64_and_wrong_shapes() -> None:
    for doc in ([], {"signed": "!!", "signature": "AA=="}, {"signed": "AA=="}):
        with pytest.raises(DecodeError):
            SignedAssignment.from_json(doc)


# -- the table -----------------------------------------------------------------------------------


def test_only_trusted_unexpired_current_assignments_are_taken() -> None:
    t = table(OPERATOR)
    assert t.offer(assignment(key=INTRUDER), NOW) == Offer.UNTRUSTED
    assert t.offer(assignment(issued=NOW - 700), NOW) == Offer.EXPIRED
    assert t.offer(assignment(issued=NOW + 3600), NOW) == Offer.FUTURE
    assert len(t) == 0
    assert table().offer(assignment(), NOW) == Offer.UNTRUSTED  # trusting nobody: refuse all


def test_newest_assignment_per_target_wins_and_old_ones_are_stale() -> None:
    t = table(OPERATOR)
    old, new = assignment(plan="p1"), assignment(plan="p2", issued=NOW + 1)
    assert t.offer(new, NOW) == Offer.NEW
    assert t.offer(old, NOW) == Offer.STALE
    assert t.offer(new, NOW) == Offer.STALE
    assert t.get(TARGET) == new


def test_table_cap_refuses_new_targets_but_still_updates_known_ones() -> None:
    t = table(OPERATOR, cap=2)
    assert t.offer(assignment(target="01" * 16), NOW) == Offer.NEW
    assert t.offer(assignment(target="02" * 16), NOW) == Offer.NEW
    assert t.offer(assignment(target="03" * 16), NOW) == Offer.FULL
    assert t.offer(assignment(target="01" * 16, issued=NOW + 1), NOW) == Offer.NEW


def test_collect_drops_expired_and_gone_targets() -> None:
    t = table(OPERATOR)
    t.offer(assignment(target="01" * 16, ttl=10), NOW)
    t.offer(assignment(target="02" * 16), NOW)
    t.offer(assignment(target="03" * 16), NOW)
    dropped = t.collect(NOW + 11, gone=lambda target: target == "02" * 16)
    assert sorted(dropped) == ["01" * 16, "02" * 16]
    assert [a.target for a in t] == ["03" * 16]


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 5), st.sampled_from(["a", "b"])), max_size=12
    ),
    st.randoms(use_true_random=False),
)
@settings(max_examples=100, deadline=None)
def test_replicas_converge_whatever_the_order_of_arrival(
    items: list[tuple[int, int, str]], rng: object
) -> None:
    offers = [
        assignment(target=f"{t:02d}" * 16, issued=NOW + i, plan=p, model=f"m-{p}")
        for t, i, p in items
    ]
    shuffled = list(offers)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    one, two = table(OPERATOR), table(OPERATOR)
    for a in offers:
        one.offer(a, NOW)
    for a in shuffled + shuffled:  # duplicates too
        two.offer(a, NOW)
    assert {a.target: a for a in one} == {a.target: a for a in two}


# -- through the mesh core -------------------------------------------------------------------------


def mesh_with_operator(n: int, **kw: object) -> SimNetwork:
    config = MeshConfig(trusted_operators=(OPERATOR.fingerprint,))
    net = SimNetwork(config=config, **kw)  # type: ignore[arg-type]
    first = net.add_node(0)
    for i in range(1, n):
        net.add_node(i, seeds=[first.addr])
    net.run_for(10)
    return net


def test_assignment_reaches_its_target_through_gossip_despite_loss() -> None:
    net = mesh_with_operator(12, seed=5, loss=0.2)
    nodes = list(net.nodes.values())
    source, target = nodes[0], nodes[9]
    a = assignment(target=target.core.self_id, issued=net.wall)
    assert source.core.publish_assignment(a, net.wall) == Offer.NEW
    net.poke(source)
    net.run_for(3)
    assert target.core.assignments.get(target.core.self_id) == a
    assert sum(n.core.assignments.get(a.target) == a for n in nodes) >= 10


def test_assignment_lost_in_a_partition_arrives_by_anti_entropy_after_it_heals() -> None:
    net = mesh_with_operator(8, seed=6)
    nodes = list(net.nodes.values())
    left, right = nodes[:4], nodes[4:]
    net.partition([n.addr for n in left], [n.addr for n in right])
    target = right[1]
    a = assignment(target=target.core.self_id, issued=net.wall)
    left[0].core.publish_assignment(a, net.wall)
    net.poke(left[0])
    net.run_for(5)
    assert target.core.assignments.get(target.core.self_id) is None
    net.heal()
    net.run_for(30)
    assert target.core.assignments.get(target.core.self_id) == a


def test_an_untrusting_node_drops_and_counts_assignments_and_never_relays_them() -> None:
    net = mesh_with_operator(3, seed=7)
    a_node, b_node, c_node = net.nodes.values()
    b_node.core.assignments.trusted = frozenset()
    net.partition([a_node.addr, b_node.addr], [c_node.addr])  # b is a's only way out
    a = assignment(target=c_node.core.self_id, issued=net.wall)
    a_node.core.publish_assignment(a, net.wall)
    net.poke(a_node)
    net.run_for(3)
    assert b_node.core.assignments.get(a.target) is None
    assert b_node.core.statistics().dropped.get("assignment_untrusted", 0) >= 1
    intruder = assignment(key=INTRUDER, target=c_node.core.self_id, issued=net.wall)
    assert a_node.core.publish_assignment(intruder, net.wall) == Offer.UNTRUSTED


def test_assignment_for_a_target_that_left_is_collected() -> None:
    net = mesh_with_operator(4, seed=8)
    nodes = list(net.nodes.values())
    target = nodes[2]
    a = assignment(target=target.core.self_id, issued=net.wall)
    nodes[0].core.publish_assignment(a, net.wall)
    net.poke(nodes[0])
    net.run_for(2)
    assert nodes[1].core.assignments.get(a.target) == a
    target.core.leave(net.wall)
    net.poke(target)
    net.run_for(15)
    assert nodes[1].core.registry.get(a.target) is None or (
        nodes[1].core.registry.get(a.target).body.state == State.LEFT  # type: ignore[union-attr]
    )
    assert nodes[1].core.assignments.get(a.target) is None
