"""Membership and dissemination on the pure core, over the seeded discrete-event network.

These drive ``MeshCore`` directly (no trio), so they can afford many nodes and long virtual
spans; tests/shell/mesh/test_service_fakenet.py runs the real trio shell on a fake network.
"""

from __future__ import annotations

import pytest

from fabricnode.mesh.core import MeshConfig
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import RegistryLimits, State
from fabricnode.testing.simnet import SimNetwork, SimNode


def formed_cluster(n: int, **kw: object) -> SimNetwork:
    net = SimNetwork(**kw)  # type: ignore[arg-type]
    first = net.add_node(0)
    for i in range(1, n):
        net.add_node(i, seeds=[first.addr])
    return net


def converged(net: SimNetwork) -> bool:
    live = net.alive_nodes()
    ids = {n.core.self_id for n in live}
    return all(
        set(n.core.registry.session_ids()) >= ids
        and all(n.core.liveness(s) == Liveness.ALIVE for s in ids)
        for n in live
    )


def statuses_of(net: SimNetwork, target: SimNode) -> set[Liveness | None]:
    return {n.core.liveness(target.core.self_id) for n in net.alive_nodes() if n is not target}


def test_cluster_joined_through_one_seed_converges_despite_loss_and_duplicates() -> None:
    net = formed_cluster(40, seed=3, loss=0.1, duplicate=0.05, delay_s=(0.001, 0.05))
    net.run_for(30)
    assert converged(net)


def test_crashed_node_is_seen_dead_by_every_peer_within_seconds() -> None:
    net = formed_cluster(30, seed=4, loss=0.1)
    net.run_for(20)
    victim = list(net.nodes.values())[7]
    net.crash(victim.addr)
    t0 = net.now
    while statuses_of(net, victim) != {Liveness.DEAD} and net.now - t0 < 30:
        net.run_for(0.1)
    assert statuses_of(net, victim) == {Liveness.DEAD}
    assert net.now - t0 < 6.0


@pytest.mark.slow
def test_no_live_node_is_declared_dead_at_ten_percent_loss() -> None:
    net = formed_cluster(60, seed=5, loss=0.1, duplicate=0.01)
    net.run_for(20)
    assert converged(net)
    deaths: list[tuple[str, str]] = []
    for node in net.nodes.values():

        def hook(sid: str, status: Liveness, since: float, me: str = node.addr) -> None:
            if status == Liveness.DEAD:
                deaths.append((me, sid))

        node.core.members.on_status = hook
    net.run_for(300)
    assert deaths == []
    assert converged(net)


def test_graceful_leave_reaches_everyone_and_is_final() -> None:
    net = formed_cluster(20, seed=6, loss=0.05)
    net.run_for(15)
    leaver = list(net.nodes.values())[3]
    leaver.core.leave(net.wall)
    net.poke(leaver)
    net.run_for(3)
    net.crash(leaver.addr)  # the process exits after leaving
    sid = leaver.core.self_id
    for n in net.alive_nodes():
        entry = n.core.registry.get(sid)
        assert entry is not None and entry.body.state == State.LEFT
        assert n.core.liveness(sid) == Liveness.LEFT
    net.run_for(30)
    assert all(n.core.liveness(sid) == Liveness.LEFT for n in net.alive_nodes())


def test_partition_heals_without_resurrecting_a_node_that_left() -> None:
    config = MeshConfig(registry=RegistryLimits(terminal_hold_s=20.0))
    net = formed_cluster(16, seed=7, loss=0.05, config=config)
    net.run_for(15)
    assert converged(net)
    nodes = list(net.nodes.values())
    side_a, side_b = nodes[:8], nodes[8:]
    net.partition([n.addr for n in side_a], [n.addr for n in side_b])
    net.run_for(20)
    # Each side holds the other dead (a false positive the partition forced).
    assert statuses_of(net, side_b[0]) - {Liveness.ALIVE} == {Liveness.DEAD}
    leaver = side_a[2]
    leaver.core.leave(net.wall)
    net.poke(leaver)
    net.run_for(2)
    net.crash(leaver.addr)
    net.run_for(25)  # past the terminal hold: side A garbage-collects the LEFT entry
    sid = leaver.core.self_id
    assert all(sid not in n.core.registry for n in side_a if n is not leaver)
    net.heal()
    net.run_for(40)
    survivors = [n for n in net.alive_nodes()]
    ids = {n.core.self_id for n in survivors}
    for n in survivors:
        assert all(n.core.liveness(s) == Liveness.ALIVE for s in ids), "sides did not rejoin"
        entry = n.core.registry.get(sid)
        assert entry is None or entry.body.state == State.LEFT, "left node resurrected"
        assert n.core.liveness(sid) in (None, Liveness.LEFT)


def test_entry_update_spreads_by_gossip_and_anti_entropy_repairs_the_tail() -> None:
    net = formed_cluster(50, seed=8, loss=0.1)
    net.run_for(20)
    updater = list(net.nodes.values())[10]
    entry = updater.core.update_self(net.wall, state=State.SERVING)
    net.poke(updater)

    def holders() -> int:
        return sum(
            1
            for n in net.alive_nodes()
            if (got := n.core.registry.get(entry.session_id)) is not None and got.rank == entry.rank
        )

    net.run_for(1.0)
    assert holders() >= 49  # epidemic gossip: all but the unlucky tail within a second
    net.run_for(net.config.sync_interval_s * 2.5)
    assert holders() == 50  # push-pull anti-entropy repairs whatever gossip lost


def test_load_reports_reach_peers_without_touching_signed_entries() -> None:
    net = formed_cluster(10, seed=9)
    net.run_for(10)
    node = list(net.nodes.values())[2]
    before = {n.addr: n.core.registry.get(node.core.self_id) for n in net.alive_nodes()}
    node.core.publish_load(net.wall, waiting=3, running=7, kv_usage=0.5, inflight=2)
    net.poke(node)
    net.run_for(2)
    for n in net.alive_nodes():
        load = n.core.loads.get(node.core.self_id)
        assert load is not None and (load.waiting, load.running, load.inflight) == (3, 7, 2)
        assert n.core.registry.get(node.core.self_id) == before[n.addr]


def test_new_session_retires_the_old_one_as_left_without_a_false_death() -> None:
    from fabricnode.mesh.identity import Identity
    from fabricnode.testing.simnet import make_body

    net = formed_cluster(12, seed=10, loss=0.05)
    net.run_for(15)
    node = list(net.nodes.values())[4]
    old = node.core.self_id
    fresh = Identity.from_seed(b"restarted engine")
    node.core.new_session(fresh, make_body(fresh, node.addr, net.wall), net.wall)
    net.poke(node)
    deaths: list[str] = []
    for n in net.nodes.values():
        n.core.members.on_status = lambda sid, st, since: (
            deaths.append(sid) if st == Liveness.DEAD else None
        )
    net.run_for(20)
    for n in net.alive_nodes():
        if n is node:
            continue
        old_entry = n.core.registry.get(old)
        assert old_entry is not None and old_entry.body.state == State.LEFT
        assert n.core.liveness(old) == Liveness.LEFT
        assert n.core.liveness(fresh.session_id) == Liveness.ALIVE
    assert deaths == [], (old, fresh.session_id, deaths)


def test_a_newcomer_to_a_mesh_larger_than_one_packet_receives_the_whole_state() -> None:
    """Regression: a seed answers a newcomer's sync with about two records per member. Past
    ~2,000 members that is more messages than one packet may hold (wire.MAX_MESSAGES), and the
    newcomer used to drop the whole reply and stay isolated, its own entry never spread."""
    members = 2100
    net = SimNetwork(seed=11)
    nodes = [net.add_node(i, start=False) for i in range(members)]
    seed = nodes[0]
    # Only the seed holds the formed mesh's state (the others stay silent): what the newcomer
    # learns, it learns from the seed's reply.
    seed.core.ingest([r for n in nodes for r in n.core.own_records()], net.wall)
    seed.core.take_outbound()
    for n in nodes[1:]:
        del net.nodes[n.addr]
    newcomer = net.add_node(members, seeds=[seed.addr])
    net.run_for(3)
    assert newcomer.core.stats_dropped.get("DecodeError", 0) == 0, newcomer.core.stats_dropped
    assert len(newcomer.core.registry.session_ids()) == members + 1
    assert newcomer.core.liveness(seed.core.self_id) == Liveness.ALIVE
    assert newcomer.core.self_id in seed.core.registry.session_ids()


def test_formed_cluster_built_from_one_view_behaves_like_one_that_joined() -> None:
    net = SimNetwork(seed=12, loss=0.1)
    nodes = net.add_formed_cluster(30)
    for node in nodes:
        net.poke(node)
    ids = {n.core.self_id for n in nodes}
    for node in nodes:
        assert set(node.core.registry.session_ids()) == ids  # not the view's own entry
        assert node.core.self_id not in node.core.members.members
    assert converged(net)
    net.run_for(10)
    assert converged(net)
    victim = nodes[7]
    net.crash(victim.addr)
    t0 = net.now
    while statuses_of(net, victim) != {Liveness.DEAD} and net.now - t0 < 30:
        net.run_for(0.1)
    assert net.now - t0 < 6.0
    newcomer = net.add_node(30, seeds=[nodes[0].addr])
    net.run_for(5)
    assert all(n.core.registry.get(newcomer.core.self_id) for n in net.alive_nodes())


@pytest.mark.slow
def test_reconnects_to_a_dead_member_slow_down_with_cluster_size_like_syncs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 64 members: anti-entropy is scaled x2, so a reconnect (a full digest to a member believed
    # dead) every ~20 s per node instead of every 10 s.
    net = SimNetwork(seed=13, loss=0.05)
    nodes = net.add_formed_cluster(64)
    for node in nodes:
        net.poke(node)
    net.run_for(5)
    victim = nodes[9]
    net.crash(victim.addr)
    net.run_for(10)
    assert statuses_of(net, victim) == {Liveness.DEAD}
    streams: list[str] = []
    transmit = net._transmit

    def counting(src: str, dst: str, data: bytes, reliable: bool) -> None:
        if dst == victim.addr and reliable:
            streams.append(src)
        transmit(src, dst, data, reliable)

    monkeypatch.setattr(net, "_transmit", counting)
    window_s = 100.0
    net.run_for(window_s)
    per_node = len(streams) / (len(nodes) - 1)
    interval = MeshConfig().reconnect_interval_s * 2
    assert window_s / interval * 0.6 <= per_node <= window_s / interval * 1.4


@pytest.mark.slow
def test_halves_of_a_large_cluster_find_each_other_soon_after_the_cut_heals() -> None:
    # 80 live members on each side: a node tries a member it believes dead only every ~30 s
    # (reconnects scale x3 like syncs), but with 80 nodes trying on each side at random
    # phases the first contact comes within a second of the heal, and the refutations cascade
    # from there. Measured (seeds 14, 15): everyone sees everyone alive 14-17 s after the heal
    # (7.5 s when every node tried every 10 s).
    net = SimNetwork(seed=14, loss=0.05)
    nodes = net.add_formed_cluster(160)
    for node in nodes:
        net.poke(node)
    side_a, side_b = nodes[:80], nodes[80:]
    net.partition([n.addr for n in side_a], [n.addr for n in side_b])
    net.run_for(15)
    assert statuses_of(net, side_b[0]) - {Liveness.ALIVE} == {Liveness.DEAD}
    assert statuses_of(net, side_a[0]) - {Liveness.ALIVE} == {Liveness.DEAD}
    net.heal()
    t0 = net.now
    while not converged(net) and net.now - t0 < 60:
        net.run_for(0.5)
    assert converged(net)
    assert net.now - t0 <= 3 * MeshConfig().reconnect_interval_s  # one scaled interval
