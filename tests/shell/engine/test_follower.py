"""The assignment follower of a JOIN-only agent, in process under trio's MockClock: it waits
for an assignment to this node, reports what it can't carry out as labels on our entry and
keeps waiting, and returns the rendered engine command of the first one it can."""

from __future__ import annotations

import time

import trio
import trio.testing

from fabricnode.engine.follower import AssignmentFollower
from fabricnode.engine.template import parse_template
from fabricnode.mesh.assignment import AssignmentBody, Offer
from fabricnode.mesh.core import MeshConfig, MeshCore
from fabricnode.mesh.identity import Identity, OperatorKey
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import Hardware
from fabricnode.mesh.service import GossipService
from fabricnode.testing.simnet import make_body
from tests.support.notransport import NoTransport

OPERATOR = OperatorKey(Identity.from_seed(b"o" * 32))


def gossip_of_join_only_node() -> GossipService:
    me = Identity.from_seed(b"join-only")
    now = time.time()
    config = MeshConfig(trusted_operators=(OPERATOR.fingerprint,))
    core = MeshCore(
        me, Keyring.with_key(b"k" * 32), make_body(me, NoTransport.local_addr, now), now, config
    )
    return GossipService(core, NoTransport())


def assign(gossip: GossipService, plan: str, gpus: int = 1) -> None:
    core = gossip.core
    now = time.time()
    body = AssignmentBody(
        core.self_id, plan, now, now + 600, "llama-3-8b", gpus, 1, OPERATOR.public_key
    )
    item = body.sign(OPERATOR)
    assert gossip.publish_assignment(item) == Offer.NEW


def labels(gossip: GossipService) -> dict[str, str]:
    return dict(gossip.core.self_entry.body.labels)


async def test_the_first_assignment_that_fits_becomes_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gossip = gossip_of_join_only_node()
    template = parse_template("vllm serve {model} --tensor-parallel-size {tp} --port {port}")
    follower = AssignmentFollower(gossip, template, Hardware("A100-80G", 2))
    assign(gossip, "too-big", gpus=4)
    async with trio.open_nursery() as nursery:

        async def later() -> None:
            await trio.sleep(5)
            assert labels(gossip)["fabric.plan_status"] == "needs 4 GPUs"
            assign(gossip, "fits", gpus=2)

        nursery.start_soon(later)
        command = await follower.next_engine()
    assert command.argv[:3] == ("vllm", "serve", "llama-3-8b")
    assert "2" in command.argv
    assert labels(gossip)["fabric.plan"] == "fits"
    assert labels(gossip)["fabric.plan_status"] == "launching"
    assert follower.labels == (("fabric.plan", "fits"), ("fabric.plan_status", "launching"))


async def test_without_a_template_the_assignment_is_reported_not_carried_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gossip = gossip_of_join_only_node()
    follower = AssignmentFollower(gossip, None, Hardware("A100-80G", 1))
    assign(gossip, "p1")
    with trio.move_on_after(10) as waited:
        await follower.next_engine()
    assert waited.cancelled_caught, "it keeps waiting for one it can carry out"
    assert labels(gossip)["fabric.plan_status"] == "no engine template"
