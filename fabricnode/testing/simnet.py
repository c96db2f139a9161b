"""A seeded discrete-event network of ``MeshCore`` nodes on virtual time.

Every datagram may be dropped, duplicated or delayed (seeded RNG); streams (``reliable``
outbounds, TCP in the real shell) are delayed but never dropped, except across a partition,
where nothing passes. Crashed nodes neither send nor receive nor run timers. Virtual time is
wall-clock-like (``EPOCH + t``) because registry entries carry wall-clock leases.

This drives the pure core directly, so thousands of nodes fit in one process; the trio-level
fake network in ``fakenet`` exercises the real gossip shell instead.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from fabricnode.mesh.core import MeshConfig, MeshCore
from fabricnode.mesh.identity import Identity, Verifier
from fabricnode.mesh.keyring import Keyring
from fabricnode.mesh.registry import Addresses, EngineInfo, EntryBody, Hardware, State

EPOCH = 1_750_000_000.0


def make_body(
    identity: Identity, addr: str, now: float, ttl_s: float = 3600.0, **kw: object
) -> EntryBody:
    fields: dict[str, object] = dict(
        session_id=identity.session_id,
        public_key=identity.public_key,
        state=State.JOIN,
        version=1,
        provider="sim",
        addresses=Addresses(http="", gossip=addr),
        hardware=Hardware("", 0, 0.0, addr.split(":")[0]),
        engine=EngineInfo(),
        models=(),
        labels=(),
        started_at=now,
        updated_at=now,
        expires_at=now + ttl_s,
    )
    fields.update(kw)
    return EntryBody(**fields)  # type: ignore[arg-type]


@dataclass
class SimNode:
    addr: str
    core: MeshCore
    crashed: bool = False
    scheduled_at: float = float("inf")


@dataclass
class SimNetwork:
    seed: int = 0
    loss: float = 0.0
    duplicate: float = 0.0
    delay_s: tuple[float, float] = (0.0005, 0.005)
    stream_delay_s: tuple[float, float] = (0.001, 0.01)
    config: MeshConfig = field(default_factory=MeshConfig)
    keyring: Keyring = field(default_factory=lambda: Keyring.with_key(b"k" * 32))
    verifier: Verifier = field(default_factory=lambda: Verifier(cache_size=1 << 20))
    now: float = 0.0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.nodes: dict[str, SimNode] = {}
        self.by_sid: dict[str, SimNode] = {}
        # t, seq, kind, dst, (data, sender's address for a datagram)
        self._heap: list[tuple[float, int, str, str, tuple[bytes | None, str | None]]] = []
        self._seq = 0
        self._groups: dict[str, int] | None = None
        self.delivered = 0
        self.dropped = 0

    @property
    def wall(self) -> float:
        return EPOCH + self.now

    # -- topology -----------------------------------------------------------------------------

    def add_node(self, index: int, *, seeds: Iterable[str] = (), start: bool = True) -> SimNode:
        addr = f"10.0.{index // 250}.{index % 250 + 1}:7946"
        identity = Identity.from_seed(f"sim-{self.seed}-{index}".encode())
        core = MeshCore(
            identity,
            self.keyring,
            make_body(identity, addr, self.wall, self.config.entry_ttl_s),
            self.wall,
            self.config,
            rng=random.Random(self.rng.getrandbits(64)),
            verifier=self.verifier,
        )
        core.bootstrap(seeds)
        node = SimNode(addr, core)
        self.nodes[addr] = node
        self.by_sid[identity.session_id] = node
        if start:
            self._flush(node)
        return node

    def add_formed_cluster(self, count: int) -> list[SimNode]:
        """``count`` nodes that already know one another, as after they joined and converged.

        Without a packet: one extra core outside the network ingests every node's signed entry
        and liveness record (each signature checked once), and every node adopts its view
        (``MeshCore.adopt``): entries and member records are shared, not held N² times. Call
        ``poke`` on each node to start it.
        """
        first = len(self.nodes)
        nodes = [self.add_node(first + i, start=False) for i in range(count)]
        identity = Identity.from_seed(f"sim-{self.seed}-formed".encode())
        source = MeshCore(
            identity,
            self.keyring,
            make_body(identity, "", self.wall, self.config.entry_ttl_s),
            self.wall,
            self.config,
            rng=random.Random(0),
            verifier=self.verifier,
        )
        source.ingest([r for n in nodes for r in n.core.own_records()], self.wall)
        for n in nodes:
            n.core.adopt(source, self.wall)
        return nodes

    def crash(self, addr: str) -> None:
        self.nodes[addr].crashed = True

    def partition(self, *groups: Iterable[str]) -> None:
        self._groups = {a: i for i, g in enumerate(groups) for a in g}

    def heal(self) -> None:
        self._groups = None

    def _connected(self, a: str, b: str) -> bool:
        if self._groups is None:
            return True
        return self._groups.get(a, -1) == self._groups.get(b, -2)

    # -- event loop ---------------------------------------------------------------------------

    def _push(
        self, t: float, kind: str, addr: str, data: bytes | None = None, src: str | None = None
    ) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, addr, (data, src)))

    def _flush(self, node: SimNode) -> None:
        for out in node.core.take_outbound():
            self._transmit(node.addr, out.addr, out.data, out.reliable)
        deadline = node.core.next_deadline() - EPOCH
        if deadline < node.scheduled_at:
            node.scheduled_at = max(deadline, self.now)
            self._push(node.scheduled_at, "tick", node.addr)

    def _transmit(self, src: str, dst: str, data: bytes, reliable: bool) -> None:
        if not self._connected(src, dst) or dst not in self.nodes:
            self.dropped += 1
            return
        if reliable:
            self._push(self.now + self.rng.uniform(*self.stream_delay_s), "stream", dst, data)
            return
        if self.rng.random() < self.loss:
            self.dropped += 1
            return
        self._push(self.now + self.rng.uniform(*self.delay_s), "recv", dst, data, src)
        if self.duplicate and self.rng.random() < self.duplicate:
            self._push(self.now + self.rng.uniform(*self.delay_s), "recv", dst, data, src)

    def run_until(self, t: float) -> None:
        """Advance virtual time to ``t``, delivering packets and running timers on the way."""
        while self._heap and self._heap[0][0] <= t:
            when, _, kind, addr, (data, src) = heapq.heappop(self._heap)
            self.now = when
            node = self.nodes.get(addr)
            if node is None or node.crashed:
                continue
            if kind == "tick":
                if when != node.scheduled_at:
                    continue
                node.scheduled_at = float("inf")
                node.core.tick(self.wall)
            else:
                assert data is not None
                self.delivered += 1
                # As on real sockets: a datagram shows its sender's address, a stream does not.
                node.core.receive(data, self.wall, src, stream=kind == "stream")
            self._flush(node)
        self.now = max(self.now, t)

    def run_for(self, seconds: float) -> None:
        self.run_until(self.now + seconds)

    # -- helpers for tests --------------------------------------------------------------------

    def alive_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if not n.crashed]

    def poke(self, node: SimNode) -> None:
        """Send what a node queued outside tick/receive (e.g. after update_self or leave)."""
        self._flush(node)
