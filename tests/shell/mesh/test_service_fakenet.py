"""The real gossip shell (``GossipService`` + ``MeshCore``) on a seeded lossy fake network.

Every test runs under trio's ``MockClock(autojump_threshold=0)``: virtual time jumps whenever
all nodes are idle, so minutes of protocol time take seconds of real time. The services get a
virtual wall clock (``EPOCH + trio.current_time()``), the same one their cores were built with.

Liveness is observed through the member tables' ``on_status`` hook, so every transition that
any node makes is seen, however briefly it lasted (a periodic sampler could miss a suspicion
refuted within one sampling period).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from fabricnode.mesh.core import MeshConfig, MeshCore
from fabricnode.mesh.identity import Identity, Verifier
from fabricnode.mesh.keyring import Keyring, key_id_of
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import RegistryLimits, State
from fabricnode.mesh.service import GossipService
from fabricnode.testing.fakenet import FakeNetwork, FakeTransport
from fabricnode.testing.simnet import EPOCH, make_body

OLD_KEY = b"o" * 32
NEW_KEY = b"n" * 32


def wall() -> float:
    return EPOCH + trio.current_time()


@dataclass
class Node:
    index: int
    addr: str
    core: MeshCore
    service: GossipService
    transport: FakeTransport
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    stopped: bool = False

    @property
    def sid(self) -> str:
        return self.core.self_id


@dataclass
class Transition:
    at: float  # virtual seconds (trio.current_time())
    observer: str  # session id of the node that changed its view
    target: str
    status: Liveness


class Cluster:
    """Nodes, their services and a record of every liveness transition any of them made."""

    def __init__(
        self,
        net: FakeNetwork,
        nursery: trio.Nursery,
        *,
        config: MeshConfig | None = None,
        seed: int = 0,
    ) -> None:
        self.net = net
        self.nursery = nursery
        self.config = config or MeshConfig()
        self.seed = seed
        self.verifier = Verifier(cache_size=1 << 16)
        self.nodes: list[Node] = []
        self.by_sid: dict[str, Node] = {}
        self.transitions: list[Transition] = []
        self._last: dict[tuple[str, str], Liveness] = {}

    # -- nodes --------------------------------------------------------------------------------

    def make_node(self, keyring: Keyring | None = None) -> Node:
        index = len(self.nodes)
        addr = f"10.0.{index // 250}.{index % 250 + 1}:7946"
        identity = Identity.from_seed(f"fakenet-{self.seed}-{index}".encode())
        now = wall()
        core = MeshCore(
            identity,
            keyring or Keyring.with_key(OLD_KEY),
            make_body(identity, addr, now, self.config.entry_ttl_s),
            now,
            self.config,
            rng=random.Random(self.seed * 100_003 + index),
            verifier=self.verifier,
        )
        transport = self.net.endpoint(addr)
        node = Node(index, addr, core, GossipService(core, transport, wall_clock=wall), transport)
        core.members.on_status = self._hook(node.sid)
        self.nodes.append(node)
        self.by_sid[node.sid] = node
        return node

    async def start(self, node: Node, seeds: list[str]) -> None:
        node.core.bootstrap(seeds)
        await self.nursery.start(self._run, node)

    async def _run(self, node: Node, *, task_status: trio.TaskStatus[None]) -> None:
        with node.scope:
            await node.service.run(task_status=task_status)

    async def add_nodes(self, n: int) -> list[Node]:
        """``n`` new nodes, all bootstrapping from node 0 (which has no seed)."""
        new = [self.make_node() for _ in range(n)]
        for node in new:
            seeds = [] if node.index == 0 else [self.nodes[0].addr]
            await self.start(node, seeds)
        return new

    def stop(self, node: Node) -> None:
        """The process is gone: its tasks stop and its endpoint goes silent."""
        node.stopped = True
        node.scope.cancel()
        self.net.crash(node.addr)

    def running(self) -> list[Node]:
        return [n for n in self.nodes if not n.stopped]

    # -- observation --------------------------------------------------------------------------

    def _hook(self, observer: str) -> Callable[[str, Liveness, float], None]:
        def on_status(sid: str, status: Liveness, since: float) -> None:
            key = (observer, sid)
            if self._last.get(key) == status:
                return
            self._last[key] = status
            self.transitions.append(Transition(trio.current_time(), observer, sid, status))

        return on_status

    def since(self, t: float) -> Iterator[Transition]:
        return (tr for tr in self.transitions if tr.at >= t)

    def first_seen(self, target: str, status: Liveness, after: float) -> dict[str, float]:
        """Observer -> first time it saw ``target`` in ``status`` at or after ``after``."""
        seen: dict[str, float] = {}
        for tr in self.since(after):
            if tr.target == target and tr.status == status:
                seen.setdefault(tr.observer, tr.at)
        return seen

    def sees_all_alive(self, nodes: list[Node] | None = None) -> bool:
        """Every running node holds every running node's entry and sees it ALIVE."""
        group = nodes if nodes is not None else self.running()
        for n in group:
            for other in group:
                if other is n:
                    continue
                if other.sid not in n.core.registry:
                    return False
                if n.core.liveness(other.sid) != Liveness.ALIVE:
                    return False
        return True


async def wait_until(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> float:
    """Virtual seconds until ``pred()`` holds (checked every ``step_s``); fails after timeout."""
    start = trio.current_time()
    with trio.fail_after(timeout_s):
        while not pred():
            await trio.sleep(step_s)
    return trio.current_time() - start


def report(label: str, **values: object) -> None:
    print(f"[{label}] " + " ".join(f"{k}={v}" for k, v in values.items()))


def detection_bound_s(cfg: MeshConfig, n: int) -> float:
    """A generous upper bound on the time until every member sees a crashed node DEAD.

    The first failed probe: each of the n-1 members probes one member per probe interval in a
    randomised round robin, so *somebody* probes the crashed node within a few intervals (with
    n-1 probers the chance nobody does in one interval is (1 - 1/(n-1))^(n-1) ~ 1/e); allow
    4 intervals. The probe itself ends after one interval. Then the longest Lifeguard suspicion
    timeout (no confirmations), one confirmation probe (one interval), and the dissemination of
    the obituary (a few gossip rounds per log(n) hops, plus loss); allow 2 s for that.
    """
    _, suspicion_max = cfg.suspicion.bounds(n)
    first_probe = 4 * cfg.probe_interval_s + cfg.probe_interval_s
    return first_probe + suspicion_max + cfg.probe_interval_s + 2.0


async def form_cluster(cluster: Cluster, n: int, timeout_s: float = 30.0) -> float:
    """Start ``n`` nodes that join through node 0; virtual seconds until all see all alive."""
    await cluster.add_nodes(n)
    return await wait_until(
        lambda: all(len(x.core.registry) == n for x in cluster.nodes) and cluster.sees_all_alive(),
        timeout_s=timeout_s,
    )


def dead_reports(cluster: Cluster, after: float = 0.0) -> list[Transition]:
    """Transitions to DEAD of a node that was running (not stopped) when it happened."""
    return [
        tr
        for tr in cluster.since(after)
        if tr.status == Liveness.DEAD and not cluster.by_sid[tr.target].stopped
    ]


# == scenarios (seeded; the tests below run them and assert) ===================================


async def scenario_crash_detection(seed: int, n: int, crashes: int, loss: float) -> list[float]:
    """Virtual seconds until every running node sees each of ``crashes`` crashed nodes DEAD."""
    net = FakeNetwork(seed=seed, loss=loss, duplicate=0.02, delay_s=(0.001, 0.01))
    times: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        cluster = Cluster(net, nursery, seed=seed)
        await form_cluster(cluster, n)
        await trio.sleep(5)
        rng = random.Random(seed)
        for _ in range(crashes):
            victim = rng.choice(cluster.running()[1:])
            t0 = trio.current_time()
            cluster.stop(victim)
            others = cluster.running()

            def all_see_dead(v: Node = victim, o: list[Node] = others) -> bool:
                return all(x.core.liveness(v.sid) == Liveness.DEAD for x in o)

            await wait_until(all_see_dead, timeout_s=60, step_s=0.01)
            seen = cluster.first_seen(victim.sid, Liveness.DEAD, t0)
            times.append(max(seen[x.sid] for x in others) - t0)
            await trio.sleep(5)
        assert not dead_reports(cluster), "a running node was declared dead"
        nursery.cancel_scope.cancel()
    return times


@dataclass
class SteadyState:
    virtual_s: float
    false_deaths: list[Transition]
    suspicions: int  # transitions to SUSPECT (any observer, any target)
    cleared: int  # suspicions that ended in ALIVE again (refuted or cleared by a probe)
    delivered: int
    dropped: int


async def scenario_steady_state(seed: int, n: int, loss: float, minutes: float) -> SteadyState:
    net = FakeNetwork(seed=seed, loss=loss, duplicate=0.05, delay_s=(0.001, 0.02))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        cluster = Cluster(net, nursery, seed=seed)
        await form_cluster(cluster, n, timeout_s=60)
        await trio.sleep(minutes * 60)
        suspected: set[tuple[str, str]] = set()
        cleared = 0
        for tr in cluster.transitions:
            key = (tr.observer, tr.target)
            if tr.status == Liveness.SUSPECT:
                suspected.add(key)
            elif tr.status == Liveness.ALIVE and key in suspected:
                suspected.discard(key)
                cleared += 1
        stats = net.statistics()
        result = SteadyState(
            virtual_s=trio.current_time(),
            false_deaths=dead_reports(cluster),
            suspicions=sum(1 for tr in cluster.transitions if tr.status == Liveness.SUSPECT),
            cleared=cleared,
            delivered=stats.delivered,
            dropped=stats.dropped,
        )
        nursery.cancel_scope.cancel()
    return result


@dataclass
class PartitionRun:
    detect_s: float  # partition -> every node sees every node across the cut DEAD
    left_spread_s: float  # leave -> every node of its side sees it LEFT
    reconnect_s: float  # heal -> every running node sees every running node ALIVE
    left_known_s: float  # heal -> every node holds the LEFT entry (or has collected it)
    gc_s: float  # leave -> the LEFT entry collected everywhere
    resurrections: list[str] = field(default_factory=list)
    suspicions_after_heal: int = 0


async def scenario_partition_heal(
    seed: int, n: int, loss: float, partition_s: float = 30.0, hold_s: float = 60.0
) -> PartitionRun:
    """Cut the cluster in two halves for ``partition_s``; a node of side A leaves meanwhile.

    If the cut outlasts ``terminal_hold_s``, side A has collected the LEFT entry before side B
    could hear of it: B must still forget the leaver after the heal (not keep a dead JOIN entry
    until its lease runs out), and nobody may bring it back.
    """
    config = MeshConfig(registry=RegistryLimits(terminal_hold_s=hold_s))
    net = FakeNetwork(seed=seed, loss=loss, duplicate=0.02, delay_s=(0.001, 0.01))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        cluster = Cluster(net, nursery, config=config, seed=seed)
        await form_cluster(cluster, n)
        side_a, side_b = cluster.nodes[: n // 2], cluster.nodes[n // 2 :]
        leaver = side_a[-1]

        # Watch the leaver from every node: once a node holds its LEFT entry, the entry must stay
        # LEFT (or be collected), and the node must never see it alive again.
        resurrections: list[str] = []
        saw_left: set[str] = set()

        async def watch_leaver() -> None:
            while True:
                for x in cluster.running():
                    entry = x.core.registry.get(leaver.sid)
                    status = x.core.liveness(leaver.sid)
                    if entry is not None and entry.body.state == State.LEFT:
                        saw_left.add(x.sid)
                    elif x.sid in saw_left and entry is not None:
                        resurrections.append(f"{x.addr}: entry {entry.body.state.label}")
                    if x.sid in saw_left and status in (Liveness.ALIVE, Liveness.SUSPECT):
                        resurrections.append(f"{x.addr}: liveness {status.label}")
                await trio.sleep(0.05)

        nursery.start_soon(watch_leaver)

        t_cut = trio.current_time()
        net.partition([x.addr for x in side_a], [x.addr for x in side_b])
        await trio.sleep(2)
        t_leave = trio.current_time()
        await leaver.service.leave()
        cluster.stop(leaver)
        a_rest = [x for x in side_a if x is not leaver]
        await wait_until(
            lambda: all(x.core.liveness(leaver.sid) == Liveness.LEFT for x in a_rest), 20
        )
        left_spread = trio.current_time() - t_leave

        def cut_seen_dead() -> bool:
            for mine, theirs in ((a_rest, side_b), (side_b, a_rest)):
                for x in mine:
                    for y in theirs:
                        if x.core.liveness(y.sid) != Liveness.DEAD:
                            return False
            return True

        await wait_until(cut_seen_dead, 30)
        detect = trio.current_time() - t_cut
        await trio.sleep(max(0.0, t_cut + partition_s - trio.current_time()))

        t_heal = trio.current_time()
        net.heal()
        reconnect = await wait_until(cluster.sees_all_alive, 60)

        def collected() -> bool:
            return all(
                leaver.sid not in x.core.registry and x.core.members.get(leaver.sid) is None
                for x in cluster.running()
            )

        def left_everywhere() -> bool:
            if trio.current_time() >= t_leave + hold_s:
                return collected()
            for x in cluster.running():
                entry = x.core.registry.get(leaver.sid)
                if entry is None or entry.body.state != State.LEFT:
                    return False
            return True

        await wait_until(left_everywhere, 60)
        left_known = trio.current_time() - t_heal
        suspicions_after_heal = sum(
            1 for tr in cluster.since(t_heal) if tr.status == Liveness.SUSPECT
        )
        await wait_until(collected, hold_s + 30)
        gc = trio.current_time() - t_leave
        await trio.sleep(30)  # anti-entropy keeps running: the collected entry stays gone
        assert collected()
        assert cluster.sees_all_alive()
        # The same from the member tables' own record: LEFT is the last status anyone gave it.
        left_at: dict[str, float] = {}
        for tr in cluster.transitions:
            if tr.target != leaver.sid:
                continue
            if tr.status == Liveness.LEFT:
                left_at.setdefault(tr.observer, tr.at)
            elif tr.observer in left_at:
                resurrections.append(f"{tr.observer[:8]}: {tr.status.label} at {tr.at:.2f}")
        assert set(left_at) >= {x.sid for x in a_rest}
        if partition_s < hold_s:
            assert set(left_at) == {x.sid for x in cluster.running()}
        result = PartitionRun(
            detect_s=detect,
            left_spread_s=left_spread,
            reconnect_s=reconnect,
            left_known_s=left_known,
            gc_s=gc,
            resurrections=resurrections,
            suspicions_after_heal=suspicions_after_heal,
        )
        nursery.cancel_scope.cancel()
    return result


async def scenario_graceful_leave(seed: int, n: int, loss: float) -> float:
    """Virtual seconds from ``leave()`` until every other node holds the leaver's LEFT entry."""
    net = FakeNetwork(seed=seed, loss=loss, duplicate=0.02, delay_s=(0.001, 0.02))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        cluster = Cluster(net, nursery, seed=seed)
        await form_cluster(cluster, n)
        leaver = cluster.nodes[n // 2]
        async with trio.open_nursery() as leaving:
            leaving.start_soon(leaver.service.leave)
            await trio.sleep(0)
            others = [x for x in cluster.nodes if x is not leaver]
            seen_left = await wait_until(
                lambda: all(x.core.liveness(leaver.sid) == Liveness.LEFT for x in others),
                timeout_s=30,
                step_s=0.01,
            )
        cluster.stop(leaver)  # the process exits once leave() returns
        await trio.sleep(20)
        for x in others:
            entry = x.core.registry.get(leaver.sid)
            assert entry is not None and entry.body.state == State.LEFT
            assert x.core.liveness(leaver.sid) == Liveness.LEFT
        assert not dead_reports(cluster)
        nursery.cancel_scope.cancel()
    return seen_left


def rotation_rings() -> tuple[Keyring, Keyring, Keyring]:
    """The three keyrings of a rotation: old+new sealing with old, then with new, then new."""
    both_old = Keyring.with_key(OLD_KEY)
    both_old.add(NEW_KEY)
    both_new = Keyring.with_key(OLD_KEY)
    both_new.add(NEW_KEY)
    both_new.use(key_id_of(NEW_KEY))
    return both_old, both_new, Keyring.with_key(NEW_KEY)


def crypto_drops(node: Node) -> int:
    return node.core.stats_dropped.get("CryptoError", 0)


async def scenario_key_rotation(seed: int, n: int, loss: float) -> dict[str, float]:
    net = FakeNetwork(seed=seed, loss=loss, duplicate=0.02, delay_s=(0.001, 0.02))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        cluster = Cluster(net, nursery, seed=seed)
        await form_cluster(cluster, n)
        t0 = trio.current_time()
        rng = random.Random(seed)
        for ring in rotation_rings():
            # Roll each step out node by node, in random order, as agents notice the file change
            # (GossipService polls the keyring file): mixed rings coexist during every step.
            for node in rng.sample(cluster.nodes, len(cluster.nodes)):
                await trio.sleep(rng.uniform(0, 0.5))
                node.core.keyring.replace_with(ring)
                node.service.poke()
            await trio.sleep(5)
        rotated_s = trio.current_time() - t0
        assert all(x.core.keyring.key_ids() == [key_id_of(NEW_KEY).hex()] for x in cluster.nodes)
        assert sum(crypto_drops(x) for x in cluster.nodes) == 0, "a packet was sealed too soon"
        assert not dead_reports(cluster)
        assert cluster.sees_all_alive()

        # Still a working mesh under the new key: an update spreads to everyone.
        updater = cluster.nodes[1]
        entry = updater.core.update_self(wall(), state=State.SERVING)
        updater.service.poke()
        update_s = await wait_until(
            lambda: all(
                (e := x.core.registry.get(updater.sid)) is not None and e.rank >= entry.rank
                for x in cluster.nodes
            ),
            timeout_s=10,
            step_s=0.01,
        )

        # And the old key is really gone: an agent still holding only it cannot join.
        straggler = cluster.make_node(Keyring.with_key(OLD_KEY))
        await cluster.start(straggler, [cluster.nodes[0].addr])
        before = crypto_drops(cluster.nodes[0])
        await trio.sleep(10)
        assert crypto_drops(cluster.nodes[0]) > before
        assert all(straggler.sid not in x.core.registry for x in cluster.nodes[:n])
        assert len(straggler.core.registry) == 1
        nursery.cancel_scope.cancel()
    return {"rotation_s": rotated_s, "update_s": update_s}


# == tests =====================================================================================


async def test_fake_network_drops_duplicates_and_delays_datagrams_by_seed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def run(seed: int) -> tuple[list[tuple[bytes, float]], int, int]:
        net = FakeNetwork(seed=seed, loss=0.2, duplicate=0.1, delay_s=(0.01, 0.05))
        got: list[tuple[bytes, float]] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(net.run)
            a, b = net.endpoint("a:1"), net.endpoint("b:1")
            t0 = trio.current_time()
            for i in range(500):
                await a.send("b:1", b"%d" % i, False)
            with trio.move_on_after(1):
                while True:
                    data, source, stream = await b.receive()
                    assert (source, stream) == ("a:1", False)
                    got.append((data, round(trio.current_time() - t0, 9)))
            nursery.cancel_scope.cancel()
        stats = net.statistics()
        assert stats.delivered == len(got) == 500 - stats.dropped_loss + stats.duplicated
        return got, stats.dropped_loss, stats.duplicated

    got, lost, dups = await run(7)
    assert 60 <= lost <= 140 and 20 <= dups <= 80  # 20% and 10% of 500, give or take
    assert all(0.01 <= at <= 0.05 for _, at in got)
    assert len({data for data, _ in got}) < len(got)  # some arrived twice
    assert [data for data, _ in got] != sorted((d for d, _ in got), key=int)  # reordered
    assert (await run(7))[0] == got  # the same seed, the same fate for every packet
    assert (await run(8))[0] != got


async def test_fake_network_reliable_frames_are_delayed_but_never_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = FakeNetwork(seed=1, loss=0.9, duplicate=0.9, stream_delay_s=(0.1, 0.2))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        a, b = net.endpoint("a:1"), net.endpoint("b:1")
        for i in range(100):
            await a.send("b:1", b"%d" % i, True)
        t0 = trio.current_time()
        frames = [await b.receive() for _ in range(100)]
        assert 0.1 <= trio.current_time() - t0 <= 0.2
        assert sorted(int(d) for d, _, _ in frames) == list(range(100))
        assert all(source is None and stream for _, source, stream in frames)
        assert net.statistics().dropped == 0
        nursery.cancel_scope.cancel()


async def test_fake_network_partition_and_crash_stop_traffic(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = FakeNetwork(seed=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        a, b, c = (net.endpoint(x) for x in ("a:1", "b:1", "c:1"))

        async def reaches(src: FakeTransport, dst: FakeTransport, reliable: bool) -> bool:
            await src.send(dst.local_addr, b"x", reliable)
            with trio.move_on_after(1):
                await dst.receive()
                return True
            return False

        net.partition(["a:1", "b:1"], ["c:1"])
        assert await reaches(a, b, False)
        assert not await reaches(a, c, False)
        assert not await reaches(c, b, True)  # a partition stops streams too
        net.heal()
        assert await reaches(c, b, True)
        await a.send("b:1", b"in flight", False)
        net.crash("b:1")  # packets in flight to a crashed endpoint are lost
        assert not await reaches(a, b, True)
        assert not await reaches(b, a, False)
        stats = net.statistics()
        assert stats.dropped_partition == 2 and stats.dropped_unreachable == 3
        nursery.cancel_scope.cancel()


async def test_nodes_joining_through_one_seed_converge_despite_loss_duplicates_and_delay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    n = 20
    net = FakeNetwork(seed=1, loss=0.05, duplicate=0.05, delay_s=(0.001, 0.03))
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        cluster = Cluster(net, nursery, seed=1)
        took = await form_cluster(cluster, n)  # all 20 start at once, each knowing only node 0
        stats = net.statistics()
        report("convergence", nodes=n, virtual_s=round(took, 2), **vars(stats))
        # An isolated node asks its seed for the state at once (and every seed_retry_s); what
        # gossip misses while the views are still small, anti-entropy (a push-pull with one
        # random member every sync_interval_s) repairs. Measured over 10 seeds: 0.4-5.1 s for
        # 10 and 20 nodes (5.05 s: the first anti-entropy round), up to 10.7 s for 30 nodes.
        assert took <= 3 * cluster.config.sync_interval_s
        assert stats.dropped_loss > 0 and stats.duplicated > 0
        assert not dead_reports(cluster)
        nursery.cancel_scope.cancel()


async def test_crashed_node_is_declared_dead_by_every_other_node_within_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    n, cfg = 20, MeshConfig()
    times = await scenario_crash_detection(seed=3, n=n, crashes=3, loss=0.05)
    bound = detection_bound_s(cfg, n)
    report("crash detection", nodes=n, times_s=[round(t, 2) for t in times], bound_s=bound)
    # Measured over 10 seeds x 3 crashes each (20 nodes): mean 2.6 s, max 4.5 s at 1% loss and
    # max 3.7 s at 10% loss; bound (see detection_bound_s) 7.6 s with the default config.
    assert max(times) <= bound


@pytest.mark.slow
async def test_no_live_node_is_declared_dead_over_five_minutes_at_ten_percent_loss(
    autojump_clock: trio.testing.MockClock,
) -> None:
    result = await scenario_steady_state(seed=8, n=20, loss=0.10, minutes=5)
    report(
        "false positives",
        virtual_s=round(result.virtual_s),
        false_deaths=len(result.false_deaths),
        suspicions=result.suspicions,
        cleared=result.cleared,
        delivered=result.delivered,
        dropped=result.dropped,
    )
    # Suspicions are allowed (at 10% loss a probe and all its indirect probes do fail now and
    # then); each must be refuted or cleared, and nobody may ever sign a live node's obituary.
    # Seed 8 raises suspicions (20 seeds: 0-36 per run, every one cleared, no death).
    assert result.false_deaths == []
    assert result.cleared == result.suspicions


async def test_partition_heal_reconnects_both_sides_and_left_node_never_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = MeshConfig()
    result = await scenario_partition_heal(seed=4, n=12, loss=0.02)
    report(
        "partition",
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in vars(result).items()},
    )
    assert result.resurrections == []
    # Each side declares the other dead like any crash (the cut is ~6 nodes wide).
    assert result.detect_s <= detection_bound_s(cfg, 12) + 2
    # Healing needs one side to contact the other: every node syncs with a random member it
    # believes dead every reconnect_interval_s; the accused refute, the refutations spread.
    # Measured over 14 runs: 1.5-14.4 s; allow two reconnect rounds plus one sync interval.
    assert result.reconnect_s <= 2 * cfg.reconnect_interval_s + cfg.sync_interval_s
    assert result.left_known_s <= result.reconnect_s + cfg.sync_interval_s
    # The LEFT entry goes exactly terminal_hold_s after it was signed (60 s in this scenario).
    assert 60 <= result.gc_s <= 62


async def test_partition_longer_than_terminal_hold_heals_and_far_side_forgets_left_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = MeshConfig()
    result = await scenario_partition_heal(seed=4, n=12, loss=0.02, partition_s=90, hold_s=60)
    report(
        "long partition",
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in vars(result).items()},
    )
    assert result.resurrections == []
    assert result.reconnect_s <= 2 * cfg.reconnect_interval_s + cfg.sync_interval_s
    # Side B never held the LEFT entry; it learns that the session is over from side A's
    # tombstone by anti-entropy, instead of keeping a dead JOIN entry for its whole lease.
    assert result.left_known_s <= result.reconnect_s + cfg.sync_interval_s


async def test_graceful_leave_reaches_every_node_within_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    took = await scenario_graceful_leave(seed=2, n=20, loss=0.05)
    report("graceful leave", nodes=20, virtual_s=round(took, 3))
    # leave() pushes the signed LEFT entry straight to 2 * fanout + 2 members (datagram and
    # stream) and keeps gossiping it for its 1 s linger. Measured over 8 seeds: 0.06-0.19 s.
    assert took <= 1.0


def test_core_that_left_never_asks_to_be_ticked_in_the_past() -> None:
    # Regression: after leave() the probe/sync timers froze in the past, next_deadline() stayed
    # behind the clock and GossipService's timer loop spun without sleeping (100% CPU for the
    # whole linger; under MockClock virtual time never advanced and the test hung).
    now = EPOCH
    cores = []
    for i in range(2):
        identity = Identity.from_seed(b"left-%d" % i)
        addr = f"10.0.0.{i + 1}:7946"
        cores.append(
            MeshCore(identity, Keyring.with_key(OLD_KEY), make_body(identity, addr, now), now)
        )
    a, b = cores
    a.ingest(b.own_records(), now)
    a.tick(now + 5)
    a.leave(now + 5)
    for step in range(1, 30):
        t = now + 5 + step * 0.05
        a.tick(t)
        assert a.next_deadline() > t


async def test_cluster_key_rotation_through_mixed_keyrings_keeps_every_node_connected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    result = await scenario_key_rotation(seed=5, n=12, loss=0.02)
    report("key rotation", **{k: round(v, 2) for k, v in result.items()})


async def test_a_packet_that_makes_the_core_raise_is_counted_and_the_service_goes_on(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-packet error boundary: the core drops bad input itself, so an exception from it
    is a bug; one packet that hits such a bug must not end the agent."""
    net = FakeNetwork(seed=3)
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        cluster = Cluster(net, nursery, seed=3)
        a, b = await cluster.add_nodes(2)
        real_receive = b.core.receive
        calls = 0

        def fails_once(*args: object, **kwargs: object) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug reached by one packet")
            real_receive(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(b.core, "receive", fails_once)
        await trio.sleep(30)  # the two nodes keep probing and syncing each other
        assert calls > 10
        assert b.core.stats_dropped.get("internal_error") == 1
        assert b.core.members.status(a.sid) is Liveness.ALIVE
        assert a.core.members.status(b.sid) is Liveness.ALIVE
        nursery.cancel_scope.cancel()
