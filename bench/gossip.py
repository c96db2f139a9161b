"""Gossip at scale: N agents in one process on virtual time, over a lossy simulated network.

Runs the real protocol core (``MeshCore``: signing, AEAD sealing, msgpack encoding, SWIM
failure detection, piggybacked gossip, anti-entropy) for every node inside the seeded
discrete-event network of ``fabricnode.testing.simnet``; only the sockets are simulated.

Prints, for the default 1000 nodes at 10% datagram loss:
  * time until 99.9% (and 100%) of nodes hold a new node's entry, and an updated entry;
  * time until every live peer sees a crashed node dead (several crashes);
  * false positives (live nodes declared dead by anyone) over a steady-state window;
  * bytes per second per node, sent, over that window.

    python bench/gossip.py                    # 1000 nodes, 10% loss, 10 virtual minutes
    python bench/gossip.py --nodes 200 --minutes 1   # quick look
    python bench/gossip.py --nodes 3000 --minutes 0.5   # ~5 min of CPU, 1.75 GB
    python bench/gossip.py --nodes 10000 --minutes 0.5  # ~47 min of CPU, 11 GB

The cluster starts formed (``SimNetwork.add_formed_cluster``): every node adopts one view of
all signed entries and liveness records instead of joining, so memory grows by about 60-80
bytes per (node, member) pair, not by a record each.
"""

from __future__ import annotations

import argparse
import gc
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable

from fabricnode.mesh.core import MeshConfig
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import State
from fabricnode.testing.simnet import SimNetwork, SimNode

# memberlist's DefaultLANConfig: ProbeInterval 1 s, ProbeTimeout 500 ms, IndirectChecks 3,
# SuspicionMult 4, SuspicionMaxTimeoutMult 6, GossipInterval 200 ms, GossipNodes 3,
# RetransmitMult 4, PushPullInterval 30 s. (Our core keeps its confirmation probe.)
PROFILES: dict[str, dict[str, float]] = {
    "fabric": {},
    "memberlist-lan": {
        "probe_interval_s": 1.0,
        "probe_timeout_s": 0.5,
        "indirect_probes": 3,
        "suspicion_mult": 4.0,
        "suspicion_max_factor": 6.0,
        "suspicion_floor_s": 0.0,
        "gossip_interval_s": 0.2,
        "gossip_fanout": 3,
        "retransmit_mult": 4,
        "sync_interval_s": 30.0,
    },
}


class Observer:
    """Counts liveness transitions that every node makes, via the member tables' hook."""

    def __init__(self, net: SimNetwork) -> None:
        self.net = net
        self.false_dead: list[tuple[float, str, str]] = []
        self.suspicions = 0
        self.dead_seen: dict[str, dict[str, float]] = {}
        self.last: dict[tuple[str, str], Liveness] = {}

    def attach(self, node: SimNode) -> None:
        def hook(sid: str, status: Liveness, since: float, observer: str = node.addr) -> None:
            key = (observer, sid)
            if self.last.get(key) == status:
                return
            self.last[key] = status
            if status == Liveness.SUSPECT:
                self.suspicions += 1
            if status == Liveness.DEAD:
                target = self.net.by_sid.get(sid)
                if target is not None and not target.crashed:
                    self.false_dead.append((self.net.now, observer, sid))
                self.dead_seen.setdefault(sid, {}).setdefault(observer, self.net.now)

        node.core.members.on_status = hook


def build(nodes: int, loss: float, seed: int, config: MeshConfig) -> tuple[SimNetwork, Observer]:
    # N tables of N members each (the records are shared, the dicts are not): the cyclic
    # collector would walk those N^2 references again and again; none of them is garbage.
    gc.disable()
    try:
        return _build(nodes, loss, seed, config)
    finally:
        gc.freeze()
        gc.enable()


def _build(nodes: int, loss: float, seed: int, config: MeshConfig) -> tuple[SimNetwork, Observer]:
    net = SimNetwork(seed=seed, loss=loss, duplicate=0.01, config=config)
    all_nodes = net.add_formed_cluster(nodes)  # everyone already knows everyone
    obs = Observer(net)
    for n in all_nodes:
        obs.attach(n)
        net.poke(n)
    return net, obs


def time_to_fraction(
    net: SimNetwork, have: Callable[[SimNode], bool], fractions: list[float], limit_s: float
) -> list[float | None]:
    """Virtual seconds until each fraction of live nodes satisfies ``have(node)``.

    ``have`` only ever turns true for a node (an entry arrives, a crash is seen), so each step
    looks only at the nodes that did not have it yet: O(N) once, not every 10 ms.
    """
    start = net.now
    got: list[float | None] = [None] * len(fractions)
    step = 0.01
    pending = net.alive_nodes()
    total = len(pending)
    while net.now - start < limit_s and got[-1] is None:
        net.run_for(step)
        pending = [n for n in pending if not n.crashed and not have(n)]
        ok = total - len(pending)
        for i, f in enumerate(fractions):
            if got[i] is None and ok >= math.ceil(f * total):
                got[i] = net.now - start
    return got


def fmt(x: float | None) -> str:
    return "n/a (not reached)" if x is None else f"{x:.2f} s"


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--loss", type=float, default=0.10)
    ap.add_argument("--minutes", type=float, default=10.0, help="steady-state window, virtual")
    ap.add_argument("--crashes", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--profile",
        choices=["fabric", "memberlist-lan"],
        default="fabric",
        help="fabric: our defaults; memberlist-lan: memberlist's DefaultLANConfig timings",
    )
    ap.add_argument("--probe-interval", type=float, help="override MeshConfig.probe_interval_s")
    ap.add_argument("--suspicion-mult", type=float, help="override MeshConfig.suspicion_mult")
    args = ap.parse_args()

    cpu0 = time.process_time()
    overrides: dict[str, float] = dict(PROFILES[args.profile])
    if args.probe_interval is not None:
        overrides["probe_interval_s"] = args.probe_interval
    if args.suspicion_mult is not None:
        overrides["suspicion_mult"] = args.suspicion_mult
    config = MeshConfig(**overrides)  # type: ignore[arg-type]
    net, obs = build(args.nodes, args.loss, args.seed, config)
    print(
        f"# profile {args.profile}: {args.nodes} nodes, loss {args.loss:.0%}, duplicates 1%, "
        f"seed {args.seed}"
    )
    print(
        f"# probe {config.probe_interval_s}s timeout {config.probe_timeout_s}s "
        f"indirect {config.indirect_probes}; gossip {config.gossip_interval_s}s "
        f"fanout {config.gossip_fanout} retransmit x{config.retransmit_mult}; "
        f"suspicion {config.suspicion.bounds(args.nodes)[0]:.2f}-"
        f"{config.suspicion.bounds(args.nodes)[1]:.2f}s"
    )
    net.run_for(5.0)  # settle timers

    # Steady state: false positives and bandwidth.
    b0 = sum(n.core.bytes_out for n in net.nodes.values())
    t0 = net.now
    net.run_for(args.minutes * 60)
    elapsed = net.now - t0
    sent = sum(n.core.bytes_out for n in net.nodes.values()) - b0
    per_node = sent / elapsed / args.nodes
    print(f"steady state: {elapsed:.0f} virtual s")
    print(f"  false positives (live node declared dead): {len(obs.false_dead)}")
    print(f"  suspicions raised (refuted or not): {obs.suspicions}")
    print(f"  bytes/s per node sent: {per_node / 1000:.2f} KB/s (same received on average)")

    # Dissemination of a new node's entry.
    seed_node = next(iter(net.nodes.values()))
    newcomer = net.add_node(args.nodes, seeds=[seed_node.addr], start=False)
    obs.attach(newcomer)
    net.poke(newcomer)
    sid = newcomer.core.self_id
    t_new = time_to_fraction(net, lambda n: n.core.registry.get(sid) is not None, [0.999, 1.0], 30)
    print(f"new entry (a node joins): 99.9% in {fmt(t_new[0])}, 100% in {fmt(t_new[1])}")

    # Dissemination of an update (a node starts serving a model).
    updater = list(net.nodes.values())[args.nodes // 3]
    entry = updater.core.update_self(net.wall, state=State.SERVING)
    net.poke(updater)
    usid, rank = entry.session_id, entry.rank

    def has_update(n: SimNode) -> bool:
        e = n.core.registry.get(usid)
        return e is not None and e.rank >= rank

    t_upd = time_to_fraction(net, has_update, [0.999, 1.0], 30)
    print(f"entry update (JOIN -> SERVING): 99.9% in {fmt(t_upd[0])}, 100% in {fmt(t_upd[1])}")

    # Crash detection.
    times: list[float] = []
    rng = net.rng
    for _ in range(args.crashes):
        victim = rng.choice([n for n in net.alive_nodes() if n is not newcomer])
        vsid = victim.core.self_id
        net.crash(victim.addr)

        def sees_dead(n: SimNode, vsid: str = vsid) -> bool:
            return n.core.liveness(vsid) in (Liveness.DEAD, None)

        t = time_to_fraction(net, sees_dead, [1.0], 60)[0]
        print(f"crash of {vsid[:8]}: every live peer sees it dead after {fmt(t)}")
        if t is not None:
            times.append(t)
        net.run_for(10.0)
    if times:
        print(
            f"crash detection: mean {statistics.mean(times):.2f} s, max {max(times):.2f} s "
            f"over {len(times)} crashes"
        )
    print(f"false positives in the whole run: {len(obs.false_dead)}")
    for when, observer, sid in obs.false_dead[:5]:
        print(f"  at {when:.2f} s {observer} declared {sid[:8]} dead")
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
    print(
        f"# CPU {time.process_time() - cpu0:.0f} s for {net.now:.0f} virtual s, "
        f"peak RSS {peak_gb:.2f} GB"
    )


if __name__ == "__main__":
    main()
