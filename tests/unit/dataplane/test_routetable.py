"""The ingress's route table over a real ``MeshCore`` (driven by the seeded simulated network)."""

from __future__ import annotations

from fabricnode.dataplane.routetable import RouteTable
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import Addresses, ModelInfo, State
from fabricnode.testing.simnet import SimNetwork


def test_model_listing_counts_only_nodes_not_known_dead() -> None:
    net = SimNetwork(seed=7)
    ingress = net.add_node(0)
    servers = [net.add_node(i, seeds=[ingress.addr]) for i in (1, 2)]
    for i, node in enumerate(servers, 1):
        node.core.update_self(
            net.wall,
            state=State.SERVING,
            models=(ModelInfo("m1", 4096),),
            addresses=Addresses(http=f"http://10.0.0.{i + 1}:8080", gossip=node.addr),
        )
        net.poke(node)
    net.run_for(5)
    table = RouteTable(ingress.core, lambda: net.wall)
    assert [(m.id, m.nodes) for m in table.listing()] == [("m1", 2)]

    victim = servers[1]
    net.crash(victim.addr)
    t0 = net.now
    while ingress.core.liveness(victim.core.self_id) != Liveness.DEAD and net.now - t0 < 30:
        net.run_for(0.1)
    assert ingress.core.liveness(victim.core.self_id) == Liveness.DEAD
    # The dead node's entry still says SERVING (it cannot sign its own death) until it expires.
    assert ingress.core.registry.get(victim.core.self_id).body.state == State.SERVING
    assert [(m.id, m.nodes) for m in table.listing()] == [("m1", 1)]
