"""The WAN between emulated sites: a userspace delaying router on a TUN device (run as a script).

    python wandelay.py        (in the WAN namespace; the configuration is stdin's first line)

Why userspace: this kernel has no ``netem`` qdisc. ``tbf`` and ``htb`` shape bandwidth but
cannot hold a packet back for 150 ms, and nftables has no delay either. So the WAN namespace of
``tests/support/sites.py`` policy-routes every packet it receives from a site's WAN segment into
``tun0`` (``ip rule iif brw<i> lookup 100``, table 100 ``default dev tun0``); this process reads
each IPv4 packet from the TUN device (``IFF_TUN | IFF_NO_PI``: one raw IP packet per read),
decides its fate, and writes it back at its time; the kernel then forwards it by the main
table (it now comes in on ``tun0``, which no rule names) to the destination site's segment.
One place then does delay, jitter, loss, bandwidth and cuts, per pair of sites, changed at run
time with an acknowledgement; a test needs nothing but ``ip`` and Python.

``Wan`` is the model, sans-IO: packets and ``now`` in, packets and release times out, no
sockets and no clock (tests/sites/test_wandelay.py drives it with a hand-held clock). Per
direction of a site pair (``Link``, the same for both directions):

* **loss**: each packet is dropped with probability ``loss`` (a seeded RNG: ``seed``);
* **bandwidth**: a serialiser: a packet of L bytes holds its direction 8·L/bandwidth seconds
  after the one before it is through; a packet that would find more than ``queue_bytes`` ahead
  of it is dropped (drop-tail, as a router's buffer; by default one bandwidth-delay product,
  at least 64 KiB). No bandwidth: no serialiser, no queue;
* **delay**: a packet leaves ``rtt_ms / 2`` ± ``jitter_ms`` (uniform) after its serialisation
  ends, but never before the packet ahead of it on the same direction: no reordering. A real
  WAN path seldom reorders, and reordering would make the jitter setting a TCP throughput
  setting as well. The price: under dense traffic with jitter the delay skews upward (a packet
  waits for a slower one ahead of it); with sparse probes it is the uniform spread set;
* **cut**: dropped, including the packets already on the wire when the cut was made, so once
  ``cut`` is acknowledged no packet crosses between the two sites until ``heal``.

Packets that are not IPv4, or whose source or destination is in no site's segment (/24s given
in the configuration), are dropped and counted as unrouted: the router knows the WAN segments
only, never a site's LAN.

Timing: one thread at a raised priority (nice -10: it is the network of every test that uses
it, and mostly sleeps), ``select.select`` with the time to the next release as its timeout
(microsecond resolution; epoll's timeouts are whole milliseconds, which alone would add up to
2 ms to a round trip), reading up to ``BURST`` packets per wake-up. Packets are released once
their time has come, never early. The RTT measured through the router is what was set plus the
wake-up latency of two releases (docs/benchmarks.md, "Emulated sites").

Control: JSON lines on stdin, one JSON line answered on stdout for each (``{"ok": true, ...}``
or ``{"ok": false, "error": ...}``)::

    {"op": "set", "a": "a", "b": "b", "link": {"rtt_ms": 40, ...}}   replace a link's settings
    {"op": "cut", "a": "a", "b": "b"}  /  {"op": "heal", "a": "a", "b": "b"}
    {"op": "stats"}     -> {"ok": true, "directions": [[src, dst, {counters}], ...], ...}

End of stdin (the harness closed it, or died) ends the process, and so does ``lifetime_s``:
nothing outlives the test that started it by long.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import ipaddress
import json
import os
import random
import select
import struct
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PR_SET_TIMERSLACK = 29
# Packets read per wake-up before releasing what is due: bounds how late a release can be made
# by a burst of arrivals.
BURST = 64
# Packets held at once, all directions together: a runaway sender cannot exhaust memory.
MAX_HELD = 100_000
MIN_QUEUE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Link:
    """One pair of sites, each direction alike. ``rtt_ms`` is the round trip the link adds
    (each direction holds a packet half of it); ``loss`` a probability per packet and
    direction; ``bandwidth_mbit`` per direction (None: unlimited); ``queue_bytes`` the buffer
    before the serialiser (None: one bandwidth-delay product, at least 64 KiB)."""

    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    bandwidth_mbit: float | None = None
    queue_bytes: int | None = None

    def __post_init__(self) -> None:
        if not (self.rtt_ms >= 0 and self.jitter_ms >= 0):
            raise ValueError(f"rtt_ms and jitter_ms must be >= 0: {self}")
        if not 0 <= self.loss <= 1:
            raise ValueError(f"loss must be a probability in [0, 1]: {self}")
        if self.bandwidth_mbit is not None and not self.bandwidth_mbit > 0:
            raise ValueError(f"bandwidth_mbit must be > 0 (or None, unlimited): {self}")
        if self.queue_bytes is not None and self.queue_bytes < 1500:
            raise ValueError(f"queue_bytes must hold at least one packet (1500): {self}")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000

    @property
    def jitter_s(self) -> float:
        return self.jitter_ms / 1000

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.bandwidth_mbit is None else self.bandwidth_mbit * 1e6 / 8

    @property
    def queue_limit_bytes(self) -> int | None:
        rate = self.bytes_per_s
        if rate is None:
            return None
        if self.queue_bytes is not None:
            return self.queue_bytes
        return max(MIN_QUEUE_BYTES, int(rate * max(self.rtt_ms / 1000, 0.02)))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Link:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown link settings: {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class DirectionStatistics:
    """Counters of one direction (``src`` site to ``dst`` site) since the start."""

    passed: int = 0
    passed_bytes: int = 0
    lost: int = 0  # the loss setting
    cut: int = 0  # the link was cut (on arrival or while on the wire)
    overflow: int = 0  # the queue before the serialiser was full, or MAX_HELD reached
    held: int = 0  # on the wire now


@dataclass(frozen=True)
class WanStatistics:
    directions: Mapping[tuple[str, str], DirectionStatistics]
    unrouted: int = 0  # not IPv4, or not between two known sites' segments
    write_errors: int = 0
    # How late packets left, past their release time (the wake-up latency the RTT gains).
    late_s_total: float = 0.0
    late_s_max: float = 0.0

    @property
    def passed(self) -> int:
        return sum(d.passed for d in self.directions.values())

    @property
    def late_s_mean(self) -> float:
        return self.late_s_total / self.passed if self.passed else 0.0

    def direction(self, src: str, dst: str) -> DirectionStatistics:
        return self.directions.get((src, dst), DirectionStatistics())

    def to_json(self) -> dict[str, Any]:
        return {
            "directions": [[s, d, asdict(c)] for (s, d), c in sorted(self.directions.items())],
            "unrouted": self.unrouted,
            "write_errors": self.write_errors,
            "late_s_total": self.late_s_total,
            "late_s_max": self.late_s_max,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WanStatistics:
        return cls(
            directions={(s, d): DirectionStatistics(**c) for s, d, c in data["directions"]},
            unrouted=int(data["unrouted"]),
            write_errors=int(data["write_errors"]),
            late_s_total=float(data["late_s_total"]),
            late_s_max=float(data["late_s_max"]),
        )


@dataclass
class _Direction:
    free_at: float = 0.0  # when the serialiser has sent everything accepted so far
    last_release: float = 0.0  # the latest release time given: none leaves before it
    passed: int = 0
    passed_bytes: int = 0
    lost: int = 0
    cut: int = 0
    overflow: int = 0
    held: int = 0


def _pair(a: str, b: str) -> frozenset[str]:
    if a == b:
        raise ValueError(f"a link joins two different sites, not {a!r} and itself")
    return frozenset((a, b))


@dataclass
class Wan:
    """The WAN's model: which packet leaves when (module docstring). ``sites`` maps a site's
    name to its WAN segment (a /24); ``links`` each pair of sites to its ``Link`` (a pair
    without one is unrouted)."""

    sites: Mapping[str, str]
    links: Mapping[tuple[str, str], Link]
    seed: int = 0
    _by_prefix: dict[bytes, str] = field(init=False, default_factory=dict)
    _links: dict[frozenset[str], Link] = field(init=False, default_factory=dict)
    _cut: set[frozenset[str]] = field(init=False, default_factory=set)
    _directions: dict[tuple[str, str], _Direction] = field(init=False, default_factory=dict)
    _heap: list[tuple[float, int, str, str, bytes]] = field(init=False, default_factory=list)
    _seq: int = field(init=False, default=0)
    _unrouted: int = field(init=False, default=0)
    _write_errors: int = field(init=False, default=0)
    _late_s_total: float = field(init=False, default=0.0)
    _late_s_max: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        for name, segment in self.sites.items():
            net = ipaddress.IPv4Network(segment)
            if net.prefixlen != 24:
                raise ValueError(f"site {name}'s WAN segment must be a /24, not {segment}")
            self._by_prefix[net.network_address.packed[:3]] = name
        for (a, b), link in self.links.items():
            self._check_sites(a, b)
            self._links[_pair(a, b)] = link

    # -- the data path ------------------------------------------------------------------------

    def arrive(self, packet: bytes, now: float) -> None:
        """A packet read from the TUN device at ``now``: dropped, or held for ``release``."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            self._unrouted += 1
            return
        src = self._by_prefix.get(packet[12:15])
        dst = self._by_prefix.get(packet[16:19])
        link = (
            None if src is None or dst is None or src == dst else self._links.get(_pair(src, dst))
        )
        if link is None or src is None or dst is None:
            self._unrouted += 1
            return
        direction = self._direction(src, dst)
        if _pair(src, dst) in self._cut:
            direction.cut += 1
            return
        if link.loss and self._rng.random() < link.loss:
            direction.lost += 1
            return
        sent = now
        rate = link.bytes_per_s
        if rate is not None:
            start = max(now, direction.free_at)
            limit = link.queue_limit_bytes
            if limit is not None and (start - now) * rate + len(packet) > limit:
                direction.overflow += 1
                return
            sent = start + len(packet) / rate
        if len(self._heap) >= MAX_HELD:
            direction.overflow += 1
            return
        if rate is not None:
            direction.free_at = sent
        delay = link.one_way_s
        if link.jitter_s:
            delay = max(0.0, delay + self._rng.uniform(-link.jitter_s, link.jitter_s))
        release = max(sent + delay, direction.last_release)
        direction.last_release = release
        direction.held += 1
        self._seq += 1
        heapq.heappush(self._heap, (release, self._seq, src, dst, packet))

    def next_due(self) -> float | None:
        """When the next held packet is to leave (None: nothing held)."""
        return self._heap[0][0] if self._heap else None

    def release(self, now: float) -> list[bytes]:
        """The held packets whose time has come, in order (those of a cut link are dropped)."""
        out: list[bytes] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            due, _, src, dst, packet = heapq.heappop(heap)
            direction = self._directions[(src, dst)]
            direction.held -= 1
            if _pair(src, dst) in self._cut:
                direction.cut += 1
                continue
            late = now - due
            self._late_s_total += late
            if late > self._late_s_max:
                self._late_s_max = late
            direction.passed += 1
            direction.passed_bytes += len(packet)
            out.append(packet)
        return out

    def write_failed(self) -> None:
        self._write_errors += 1

    # -- control ------------------------------------------------------------------------------

    def set_link(self, a: str, b: str, link: Link) -> None:
        self._check_sites(a, b)
        self._links[_pair(a, b)] = link

    def link(self, a: str, b: str) -> Link | None:
        return self._links.get(_pair(a, b))

    def cut(self, a: str, b: str) -> None:
        self._check_sites(a, b)
        self._cut.add(_pair(a, b))

    def heal(self, a: str, b: str) -> None:
        self._check_sites(a, b)
        self._cut.discard(_pair(a, b))

    def is_cut(self, a: str, b: str) -> bool:
        return _pair(a, b) in self._cut

    def statistics(self) -> WanStatistics:
        return WanStatistics(
            directions={
                key: DirectionStatistics(
                    d.passed, d.passed_bytes, d.lost, d.cut, d.overflow, d.held
                )
                for key, d in self._directions.items()
            },
            unrouted=self._unrouted,
            write_errors=self._write_errors,
            late_s_total=self._late_s_total,
            late_s_max=self._late_s_max,
        )

    def handle(self, command: Mapping[str, Any]) -> dict[str, Any]:
        """One control command (module docstring); the answer to write back."""
        try:
            op = command.get("op")
            if op == "stats":
                return {"ok": True, **self.statistics().to_json()}
            a, b = str(command["a"]), str(command["b"])
            if op == "cut":
                self.cut(a, b)
            elif op == "heal":
                self.heal(a, b)
            elif op == "set":
                self.set_link(a, b, Link.from_json(command["link"]))
            else:
                raise ValueError(f"unknown op {op!r}")
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True}

    def _check_sites(self, *names: str) -> None:
        for name in names:
            if name not in self.sites:
                raise ValueError(f"unknown site {name!r} (sites: {', '.join(self.sites)})")
        _pair(*names)

    def _direction(self, src: str, dst: str) -> _Direction:
        direction = self._directions.get((src, dst))
        if direction is None:
            direction = self._directions[(src, dst)] = _Direction()
        return direction


def wan_from_config(config: Mapping[str, Any]) -> Wan:
    """The ``Wan`` of stdin's first line: ``{"sites": {name: segment}, "links": [[a, b,
    {Link}], ...], "seed": int}``."""
    links = {(str(a), str(b)): Link.from_json(spec) for a, b, spec in config["links"]}
    return Wan(dict(config["sites"]), links, seed=int(config.get("seed", 0)))


def config_json(
    sites: Mapping[str, str], links: Iterable[tuple[str, str, Link]], *, seed: int, tun: str
) -> str:
    """The configuration line the harness writes first (``wan_from_config`` reads it)."""
    return json.dumps(
        {
            "tun": tun,
            "sites": dict(sites),
            "links": [[a, b, link.to_json()] for a, b, link in links],
            "seed": seed,
        }
    )


# -------------------------------------------------------------------------------------------
# The process


def open_tun(name: str) -> int:
    """Attach to TUN device ``name`` (created persistent by the harness): a non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class _Lines:
    """Lines from a raw fd (stdin), without Python's buffering, so that select sees them."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""
        self.closed = False

    def read(self) -> list[bytes]:
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.closed = True
            return []
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return lines

    def first(self) -> bytes:
        while b"\n" not in self._buffer:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise SystemExit("wandelay: stdin closed before the configuration line")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line


def _answer(reply: Mapping[str, Any]) -> None:
    os.write(1, json.dumps(reply).encode() + b"\n")


def serve(wan: Wan, tun_fd: int, control: _Lines, *, lifetime_s: float) -> None:
    """Move packets until stdin closes or ``lifetime_s`` has passed."""
    clock = time.monotonic
    end = clock() + lifetime_s
    watched = [tun_fd, control.fd]
    while not control.closed:
        now = clock()
        if now >= end:
            return
        due = wan.next_due()
        timeout = end - now if due is None else min(end - now, max(0.0, due - now))
        readable, _, _ = select.select(watched, [], [], timeout)
        if readable:
            now = clock()
            if tun_fd in readable:
                for _ in range(BURST):
                    try:
                        packet = os.read(tun_fd, 65536)
                    except BlockingIOError:
                        break
                    wan.arrive(packet, now)
            if control.fd in readable:
                for line in control.read():
                    if line.strip():
                        try:
                            command = json.loads(line)
                        except ValueError as exc:
                            _answer({"ok": False, "error": f"not JSON: {exc}"})
                            continue
                        _answer(wan.handle(command))
        for packet in wan.release(clock()):
            try:
                os.write(tun_fd, packet)
            except OSError:
                wan.write_failed()


def main() -> int:
    # The WAN is every emulated packet's path: ahead of the tests' CPU load on a shared machine
    # (it sleeps between packets; root may raise it, anyone else keeps the default).
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    # Wake-ups on time: the kernel may otherwise fire a sleep's timer up to 50 us late (its
    # default timer slack), which every held packet would add to its delay.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    control = _Lines(0)
    config = json.loads(control.first())
    wan = wan_from_config(config)
    tun_fd = open_tun(str(config.get("tun", "tun0")))
    _answer({"ok": True, "ready": True, "pid": os.getpid()})
    serve(wan, tun_fd, control, lifetime_s=float(config.get("lifetime_s", 3600)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
