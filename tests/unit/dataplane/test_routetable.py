"""The ingress's route table over a real ``MeshCore`` (driven by the seeded simulated network)."""

from __future__ import annotations

from dataclasses import replace

from fabricnode.dataplane.routetable import HOP_GATEWAY, CircuitBreaker, RouteTable
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import Addresses, ModelInfo, State
from fabricnode.mesh.schema import parents_labels
from fabricnode.mesh.wire import EntryMsg
from fabricnode.testing.simnet import SimNetwork, make_body


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


def test_phantom_entries_nobody_can_probe_are_never_routed_to() -> None:
    """A key holder can sign SERVING entries under fresh session keys without ever running an
    agent: with no gossip address (or none anyone knows), nobody probes them, so they would
    count as alive for ever. 1,500 of them used to take every failover attempt; now only an
    entry whose owner is a member that SWIM probes is listed and routed to."""
    net = SimNetwork(seed=11)
    ingress = net.add_node(0)
    real = net.add_node(1, seeds=[ingress.addr])
    real.core.update_self(
        net.wall,
        state=State.SERVING,
        models=(ModelInfo("m1", 4096),),
        addresses=Addresses(http="http://10.0.0.2:8080", gossip=real.addr),
    )
    net.poke(real)
    phantoms = []
    for i in range(200):
        liar = Identity.from_seed(b"phantom-%d" % i)
        body = replace(
            make_body(liar, "", net.wall),
            state=State.SERVING,
            models=(ModelInfo("m1", 4096),),
            addresses=Addresses(http=f"http://10.9.0.1:{20000 + i}", gossip=""),
        )
        phantoms.append(EntryMsg(body.sign(liar)))
    ingress.core.ingest(phantoms, net.wall)
    net.run_for(5)
    assert len(ingress.core.registry) >= 202  # stored (they verify), but
    table = RouteTable(ingress.core, lambda: net.wall)
    assert [(m.id, m.nodes) for m in table.listing()] == [("m1", 1)]
    routes = table.routes("m1")
    eligible = table.eligible(
        routes,
        now=0.0,
        wall_now=net.wall,
        inflight={},
        breaker=CircuitBreaker(),
        providers=frozenset(),
        requirements=None,
    )
    assert [c.node.session_id for c in eligible] == [real.core.self_id]


def test_an_adapter_is_listed_with_its_parent_and_routed_like_any_model() -> None:
    net = SimNetwork(seed=5)
    ingress = net.add_node(0)
    server = net.add_node(1, seeds=[ingress.addr])
    models = (ModelInfo("base", 512), ModelInfo("lora", None))
    server.core.update_self(
        net.wall,
        state=State.SERVING,
        models=models,
        labels=parents_labels(models, {"lora": "base"}),
        addresses=Addresses(http="http://10.0.0.2:8080", gossip=server.addr),
    )
    net.poke(server)
    net.run_for(5)
    table = RouteTable(ingress.core, lambda: net.wall)
    assert [(m.id, m.parent, m.nodes) for m in table.listing()] == [
        ("base", None, 1),
        ("lora", "base", 1),
    ]
    routes = table.routes("lora")
    assert routes is not None and [r.info.session_id for r in routes] == [server.core.self_id]


def test_a_route_names_the_site_its_owner_signed() -> None:
    """The site travels with the entry through gossip and reaches the routes (the request log
    names the serving node's site from there)."""
    net = SimNetwork(seed=5)
    ingress = net.add_node(0)
    servers = [net.add_node(i, seeds=[ingress.addr]) for i in (1, 2)]
    for i, (node, site) in enumerate(zip(servers, ("alps", "default"), strict=True), 1):
        node.core.update_self(
            net.wall,
            state=State.SERVING,
            models=(ModelInfo("m1", 4096),),
            addresses=Addresses(http=f"http://10.0.0.{i + 1}:8080", gossip=node.addr),
            site=site,
        )
        net.poke(node)
    net.run_for(5)
    routes = RouteTable(ingress.core, lambda: net.wall).routes("m1") or []
    assert {(r.info.session_id, r.info.site) for r in routes} == {
        (servers[0].core.self_id, "alps"),
        (servers[1].core.self_id, "default"),
    }


def test_a_node_outside_the_allowed_sites_is_never_a_candidate() -> None:
    """Data residency: ``eligible`` drops a node whose signed site is not allowed, even when
    it is the last one left (no fallback, unlike the circuit breaker's), and whatever else
    the request asks."""
    net = SimNetwork(seed=5)
    ingress = net.add_node(0)
    servers = [net.add_node(i, seeds=[ingress.addr]) for i in (1, 2, 3)]
    for i, (node, site) in enumerate(zip(servers, ("A", "B", "C"), strict=True), 1):
        node.core.update_self(
            net.wall,
            state=State.SERVING,
            models=(ModelInfo("m1", 4096),),
            addresses=Addresses(http=f"http://10.0.0.{i + 1}:8080", gossip=node.addr),
            site=site,
        )
        net.poke(node)
    net.run_for(5)
    table = RouteTable(ingress.core, lambda: net.wall)
    routes = table.routes("m1") or []
    by_site = {s.core.self_id: site for s, site in zip(servers, "ABC", strict=True)}
    breaker = CircuitBreaker()

    def sites_of(sites: frozenset[str] | None) -> set[str]:
        found = table.eligible(
            routes,
            now=0.0,
            wall_now=net.wall,
            inflight={},
            breaker=breaker,
            providers=frozenset(),
            requirements=None,
            sites=sites,
        )
        return {by_site[c.node.session_id] for c in found}

    assert sites_of(None) == {"A", "B", "C"}
    assert sites_of(frozenset({"A", "C"})) == {"A", "C"}
    assert sites_of(frozenset({"a"})) == set()  # names are compared exactly
    assert sites_of(frozenset()) == set()
    # a route to a gateway of our site (site A here) is no node that serves: it takes the
    # request out and checks the set against the peer sites it offers (``sites``, rule 4)
    a_node = next(r for r in routes if by_site[r.info.session_id] == "A")
    gateway = replace(a_node, hop=HOP_GATEWAY)
    assert table.eligible(
        [a_node, gateway], now=0.0, wall_now=net.wall, inflight={}, breaker=breaker,
        providers=frozenset(), requirements=None, sites=frozenset({"C"}),
    ) != []  # fmt: skip
    assert table.eligible(
        [a_node], now=0.0, wall_now=net.wall, inflight={}, breaker=breaker,
        providers=frozenset(), requirements=None, sites=frozenset({"C"}),
    ) == []  # fmt: skip
    # the breaker's last resort (every node ejected: try them anyway) stays within the sites
    for sid in by_site:
        breaker.failed(sid, 0.0)
    assert sites_of(frozenset({"B"})) == {"B"}
