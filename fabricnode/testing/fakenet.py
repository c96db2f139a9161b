"""A seeded fake network for the real trio gossip shell (``service.Transport``), on virtual time.

Use it under ``trio.testing.MockClock(autojump_threshold=0)`` (pytest-trio's
``autojump_clock`` fixture): every delay is a ``trio`` sleep in one delivery task, so virtual
minutes pass in real milliseconds when all nodes are idle::

    net = FakeNetwork(seed=1, loss=0.1, duplicate=0.05)
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)              # the delivery task
        transport = net.endpoint("10.0.0.1:7946")  # one per node; a service.Transport
        ...
        net.partition(group_a, group_b); net.heal(); net.crash(addr)

Semantics (the same as ``simnet``, which drives the pure cores without trio):

* Datagrams (``reliable=False``) are dropped with probability ``loss``, duplicated with
  probability ``duplicate`` and each copy delayed by ``uniform(*delay_s)``; they arrive with
  the sender's address as source, like UDP from the gossip port.
* Reliable frames are delayed by ``uniform(*stream_delay_s)`` and never dropped, except when
  nothing could carry them: the receiver is unknown or crashed, or on the other side of a
  partition. They arrive with source ``None`` (an ephemeral TCP port), like ``UdpTcpTransport``.
* ``partition(*groups)``: only endpoints in the same group can talk; an address in no group is
  cut off from everyone. Checked when a packet is sent and again when it would be delivered.
* ``crash(addr)``: the endpoint neither sends nor receives from then on (packets in flight to
  it are lost). Stopping the node's tasks is the caller's business.

Determinism: every random decision for a packet (loss, duplication, delays) is drawn
synchronously in ``send`` from an RNG private to the *sending* endpoint and seeded from
``(seed, address)``, so one node's draws do not depend on how trio interleaves the others.
Deliveries due at the same instant happen in send order. trio itself randomises the order of
tasks made runnable at the same instant, so two runs can still diverge when events collide
exactly; with continuous random delays that is rare, and tests must not rely on it anyway.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

import trio

Packet = tuple[bytes, str | None, bool]  # data, source address, arrived over a stream


@dataclass(frozen=True)
class FakeNetworkStatistics:
    sent: int  # send() calls by live endpoints
    delivered: int  # packets handed to a receiver (duplicates count twice)
    dropped: int  # lost: random loss, partitions, crashed or unknown receivers, oversize
    duplicated: int  # extra copies created
    in_flight: int
    dropped_loss: int
    dropped_oversize: int  # datagrams larger than ``max_datagram_bytes``
    dropped_partition: int
    dropped_unreachable: int  # receiver unknown or crashed, or sender crashed


@dataclass(frozen=True)
class EndpointStatistics:
    sent: int
    received: int
    crashed: bool


class FakeTransport:
    """One node's end of a ``FakeNetwork``; implements ``fabricnode.mesh.service.Transport``."""

    def __init__(self, network: FakeNetwork, addr: str, rng: random.Random) -> None:
        self.network = network
        self.local_addr = addr
        self.rng = rng
        self.crashed = False
        self.sent = 0
        self.received = 0
        self._in, self._out = trio.open_memory_channel[Packet](math.inf)

    async def send(self, addr: str, data: bytes, reliable: bool) -> None:
        self.network._transmit(self, addr, data, reliable)
        await trio.lowlevel.checkpoint()

    async def receive(self) -> Packet:
        while self.crashed:
            await trio.sleep_forever()
        return await self._out.receive()

    def statistics(self) -> EndpointStatistics:
        return EndpointStatistics(self.sent, self.received, self.crashed)

    def _deliver(self, packet: Packet) -> None:
        self.received += 1
        self._in.send_nowait(packet)


class FakeNetwork:
    """Seeded lossy network of ``FakeTransport`` endpoints; ``run`` must be started first."""

    def __init__(
        self,
        seed: int = 0,
        loss: float = 0.0,
        duplicate: float = 0.0,
        delay_s: tuple[float, float] = (0.0005, 0.005),
        stream_delay_s: tuple[float, float] = (0.001, 0.01),
        *,
        max_datagram_bytes: int = 65507,
    ) -> None:
        self.seed = seed
        self.loss = loss
        self.duplicate = duplicate
        self.delay_s = delay_s
        self.stream_delay_s = stream_delay_s
        self.max_datagram_bytes = max_datagram_bytes
        self.endpoints: dict[str, FakeTransport] = {}
        self._groups: dict[str, int] | None = None
        self._heap: list[tuple[float, int, str, str, Packet]] = []  # due, seq, src, dst, packet
        self._seq = 0
        self._wake = trio.Event()
        self._running = False
        self.sent = self.delivered = self.duplicated = 0
        self.dropped_loss = self.dropped_partition = self.dropped_unreachable = 0
        self.dropped_oversize = 0

    # -- topology -----------------------------------------------------------------------------

    def endpoint(self, addr: str) -> FakeTransport:
        """The transport for ``addr`` (created on first use; the same object afterwards)."""
        ep = self.endpoints.get(addr)
        if ep is None:
            ep = FakeTransport(self, addr, random.Random(f"fakenet/{self.seed}/{addr}"))
            self.endpoints[addr] = ep
        return ep

    def partition(self, *groups: Iterable[str]) -> None:
        self._groups = {a: i for i, g in enumerate(groups) for a in g}

    def heal(self) -> None:
        self._groups = None

    def crash(self, addr: str) -> None:
        self.endpoint(addr).crashed = True

    def connected(self, a: str, b: str) -> bool:
        if self._groups is None:
            return True
        return self._groups.get(a, -1) == self._groups.get(b, -2)

    def statistics(self) -> FakeNetworkStatistics:
        return FakeNetworkStatistics(
            sent=self.sent,
            delivered=self.delivered,
            dropped=self.dropped,
            duplicated=self.duplicated,
            in_flight=len(self._heap),
            dropped_loss=self.dropped_loss,
            dropped_oversize=self.dropped_oversize,
            dropped_partition=self.dropped_partition,
            dropped_unreachable=self.dropped_unreachable,
        )

    @property
    def dropped(self) -> int:
        return (
            self.dropped_loss
            + self.dropped_oversize
            + self.dropped_partition
            + self.dropped_unreachable
        )

    # -- delivery -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver packets when they are due; runs until cancelled."""
        if self._running:
            raise RuntimeError("FakeNetwork.run is already running")
        self._running = True
        try:
            task_status.started()
            while True:
                now = trio.current_time()
                while self._heap and self._heap[0][0] <= now:
                    _, _, src, dst, packet = heapq.heappop(self._heap)
                    self._arrive(src, dst, packet)
                self._wake = trio.Event()
                due = self._heap[0][0] if self._heap else math.inf
                with trio.move_on_at(due):
                    await self._wake.wait()
        finally:
            self._running = False

    def _transmit(self, ep: FakeTransport, dst: str, data: bytes, reliable: bool) -> None:
        if not self._running:
            raise RuntimeError("FakeNetwork.run is not running: start it in a nursery first")
        if ep.crashed:
            self.dropped_unreachable += 1
            return
        ep.sent += 1
        self.sent += 1
        rng = ep.rng
        now = trio.current_time()
        # Draw every decision first, so the sender's RNG stream does not depend on topology.
        if reliable:
            delays = [rng.uniform(*self.stream_delay_s)]
        else:
            lost = rng.random() < self.loss
            dup = rng.random() < self.duplicate
            delays = [rng.uniform(*self.delay_s) for _ in range(2 if dup else 1)]
            if len(data) > self.max_datagram_bytes:
                self.dropped_oversize += 1
                return
            if lost:
                self.dropped_loss += 1
                return
            if dup:
                self.duplicated += 1
        if not self.connected(ep.local_addr, dst):
            self.dropped_partition += len(delays)
            return
        target = self.endpoints.get(dst)
        if target is None or target.crashed:
            self.dropped_unreachable += len(delays)
            return
        packet: Packet = (data, None if reliable else ep.local_addr, reliable)
        for delay in delays:
            self._seq += 1
            heapq.heappush(self._heap, (now + delay, self._seq, ep.local_addr, dst, packet))
        self._wake.set()

    def _arrive(self, src: str, dst: str, packet: Packet) -> None:
        if not self.connected(src, dst):
            self.dropped_partition += 1
            return
        target = self.endpoints.get(dst)
        if target is None or target.crashed:
            self.dropped_unreachable += 1
            return
        self.delivered += 1
        target._deliver(packet)
