"""The gossip service: drives a ``MeshCore`` with real time and real sockets (trio shell).

One UDP socket carries probes and piggybacked gossip; a TCP listener on the same port number
carries anti-entropy and other reliable messages as one length-prefixed frame per connection
(sealed exactly like a datagram). The transport is a seam: ``UdpTcpTransport`` for real
sockets, ``fabricnode.testing.fakenet`` for a seeded lossy network under trio's MockClock.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from fabricnode.addr import join_hostport, split_hostport
from fabricnode.errors import ConfigError, FabricError
from fabricnode.logs import ThrottledErrors
from fabricnode.mesh.assignment import Offer, SignedAssignment
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import Identity
from fabricnode.mesh.keyring import Keyring, file_signature
from fabricnode.mesh.registry import EntryBody, SignedEntry
from fabricnode.mesh.servicedoc import SignedServices

log = logging.getLogger("fabricnode.mesh.service")

FRAME_HEADER = struct.Struct("!I")


class Transport(Protocol):
    local_addr: str

    async def send(self, addr: str, data: bytes, reliable: bool) -> None:
        """Send one sealed packet; failures are counted, never raised."""

    async def receive(self) -> tuple[bytes, str | None, bool]:
        """Next packet: (data, source address or None, arrived over a stream)."""
        ...


@dataclass(frozen=True)
class TransportStatistics:
    datagrams_in: int
    datagrams_out: int
    streams_in: int
    streams_out: int
    send_errors: int
    oversized: int
    stream_errors: int = 0  # incoming connections that broke mid-frame
    streams_refused: int = 0  # incoming connections over the connection or frame-bytes bounds


class UdpTcpTransport:
    """UDP for datagrams, short-lived TCP connections for reliable frames, one port number."""

    def __init__(
        self,
        udp: trio.socket.SocketType,
        listeners: list[trio.SocketListener],
        advertise_host: str,
        *,
        max_datagram_bytes: int = 65507,
        max_frame_bytes: int = 16 * 1024 * 1024,
        stream_timeout_s: float = 5.0,
        max_inbound_streams: int = 64,
        max_frame_bytes_held: int = 64 * 1024 * 1024,
    ) -> None:
        self._udp = udp
        self._listeners = listeners
        port = udp.getsockname()[1]
        self.local_addr = join_hostport(advertise_host, port)
        self.max_datagram_bytes = max_datagram_bytes
        self.max_frame_bytes = max_frame_bytes
        self.stream_timeout_s = stream_timeout_s
        self._send_in, self._recv_out = trio.open_memory_channel[tuple[bytes, str | None, bool]](
            1024
        )
        self._stream_limit = trio.CapacityLimiter(32)
        # Inbound frames are unauthenticated until the core opens them: bound the connections
        # that may send one, and the bytes of frames being received or waiting to be opened.
        self.max_inbound_streams = max_inbound_streams
        self.max_frame_bytes_held = max_frame_bytes_held
        self._inbound = 0
        self._frame_bytes_held = 0
        self._nursery: trio.Nursery | None = None
        self.datagrams_in = self.datagrams_out = self.streams_in = self.streams_out = 0
        self.send_errors = self.oversized = self.stream_errors = self.streams_refused = 0

    @classmethod
    async def bind(cls, host: str, port: int, advertise_host: str) -> UdpTcpTransport:
        """Bind UDP and TCP on the same port (port 0: find one free for both)."""
        last_error: OSError | None = None
        for _ in range(20):
            udp = trio.socket.socket(
                socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM
            )
            try:
                await udp.bind((host, port))
                bound_port = udp.getsockname()[1]
                listeners = await trio.open_tcp_listeners(bound_port, host=host)
                return cls(udp, listeners, advertise_host)
            except OSError as exc:
                udp.close()
                last_error = exc
                if port != 0:
                    break
        raise ConfigError(f"cannot bind gossip on {join_hostport(host, port)}: {last_error}")

    def statistics(self) -> TransportStatistics:
        return TransportStatistics(
            self.datagrams_in,
            self.datagrams_out,
            self.streams_in,
            self.streams_out,
            self.send_errors,
            self.oversized,
            self.stream_errors,
            self.streams_refused,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._udp_loop)
            nursery.start_soon(trio.serve_listeners, self._handle_stream, self._listeners)
            task_status.started()

    async def _udp_loop(self) -> None:
        while True:
            data, source = await self._udp.recvfrom(65536)
            self.datagrams_in += 1
            try:
                self._send_in.send_nowait((data, join_hostport(source[0], source[1]), False))
            except trio.WouldBlock:
                self.send_errors += 1  # receiver overloaded: dropping is what UDP would do

    async def _handle_stream(self, stream: trio.SocketStream) -> None:
        async with stream:
            if self._inbound >= self.max_inbound_streams:
                self.streams_refused += 1
                return
            self._inbound += 1
            try:
                await self._receive_frame(stream)
            finally:
                self._inbound -= 1

    async def _receive_frame(self, stream: trio.SocketStream) -> None:
        held = 0  # bytes of this frame counted in _frame_bytes_held (until ``receive``)
        queued = False
        try:
            with trio.move_on_after(self.stream_timeout_s):
                try:
                    header = await _receive_exactly(stream, FRAME_HEADER.size)
                    if header is None:
                        return
                    (length,) = FRAME_HEADER.unpack(header)
                    if length > self.max_frame_bytes:
                        self.oversized += 1
                        return
                    if self._frame_bytes_held + length > self.max_frame_bytes_held:
                        self.streams_refused += 1
                        return
                    self._frame_bytes_held += length
                    held = length
                    body = await _receive_exactly(stream, length)
                except trio.BrokenResourceError:
                    # The peer reset the connection: its problem, never the listener's.
                    self.stream_errors += 1
                    return
                if body is None:
                    return
                self.streams_in += 1
                await self._send_in.send((body, None, True))
                queued = True  # ``receive`` gives its bytes back
        finally:
            if held and not queued:
                self._frame_bytes_held -= held

    async def receive(self) -> tuple[bytes, str | None, bool]:
        item = await self._recv_out.receive()
        if item[2]:
            self._frame_bytes_held -= len(item[0])
        return item

    async def send(self, addr: str, data: bytes, reliable: bool) -> None:
        try:
            host, port = split_hostport(addr)
        except ConfigError:
            self.send_errors += 1
            return
        if not reliable:
            if len(data) > self.max_datagram_bytes:
                self.oversized += 1
                return
            try:
                await self._udp.sendto(data, (host, port))
                self.datagrams_out += 1
            except (OSError, UnicodeError):  # UnicodeError: a name no lookup can encode
                self.send_errors += 1
            return
        if self._nursery is None:
            self.send_errors += 1
            return
        self._nursery.start_soon(self._send_stream, host, port, data)

    async def _send_stream(self, host: str, port: int, data: bytes) -> None:
        async with self._stream_limit:
            try:
                with trio.fail_after(self.stream_timeout_s):
                    stream = await trio.open_tcp_stream(host, port)
                    async with stream:
                        await stream.send_all(FRAME_HEADER.pack(len(data)) + data)
                self.streams_out += 1
            except (OSError, UnicodeError, trio.TooSlowError, trio.BrokenResourceError):
                self.send_errors += 1


async def _receive_exactly(stream: trio.SocketStream, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(min(65536, n - len(buf)))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class GossipService:
    """Runs the core's timers, feeds it packets and sends what it asks for."""

    def __init__(
        self,
        core: MeshCore,
        transport: Transport,
        *,
        wall_clock: Callable[[], float] = time.time,
        keyring_path: Path | None = None,
        keyring_poll_s: float = 1.0,
    ) -> None:
        self.core = core
        self.transport = transport
        self.wall_clock = wall_clock
        self.keyring_path = keyring_path
        self.keyring_poll_s = keyring_poll_s
        self._wake = trio.Event()
        self._internal_errors = ThrottledErrors(
            log, "a gossip packet failed on an unexpected error (%d since the last report)"
        )
        self.keyring_reloads = 0
        self.keyring_errors = 0
        # Told after each packet and each run of the core's timers (the view may have changed:
        # a load report, a node joining or going); the agent hands in the ingress's.
        self.on_change: Callable[[], None] | None = None

    def poke(self) -> None:
        """Re-evaluate timers now. The methods below call it themselves; call it directly only
        after changing the core some other way (tests do, with ``core.*`` and a fake clock)."""
        self._wake.set()

    # -- changes to our own entry and what we gossip: each one applied, then sent at once ------
    # (as aioquic's protocol transmits after every call into its connection, callers never
    # need to remember to flush).

    def bootstrap(self, addrs: Iterable[str]) -> None:
        """Ask ``addrs`` (seeds, rendezvous lines) for the cluster's state."""
        self.core.bootstrap(addrs)
        self.poke()

    def update_self(self, **changes: object) -> SignedEntry:
        """Re-sign our entry with ``changes`` (state, models, engine, labels...) and spread it."""
        entry = self.core.update_self(self.wall_clock(), **changes)
        self.poke()
        return entry

    def relabel(self, prefix: str, labels: tuple[tuple[str, str], ...]) -> SignedEntry:
        """Re-sign our entry with its labels under ``prefix`` replaced by ``labels``."""
        kept = [(k, v) for k, v in self.core.self_entry.body.labels if not k.startswith(prefix)]
        return self.update_self(labels=tuple(sorted([*kept, *labels])))

    def publish_load(self, *, waiting: int, running: int, kv_usage: float, inflight: int) -> None:
        now = self.wall_clock()
        self.core.publish_load(
            now, waiting=waiting, running=running, kv_usage=kv_usage, inflight=inflight
        )
        self.poke()

    def publish_assignment(self, item: SignedAssignment) -> Offer:
        """An operator's assignment (from the admin API): accepted ones spread at once."""
        outcome = self.core.publish_assignment(item, self.wall_clock())
        self.poke()
        return outcome

    def publish_services(self, item: SignedServices) -> Offer:
        """An operator's service file (from the admin API): a new one spreads at once."""
        outcome = self.core.publish_services(item, self.wall_clock())
        self.poke()
        return outcome

    def new_session(self, identity: Identity, body: EntryBody) -> None:
        """Retire our session (LEFT) and go on as ``identity`` from ``body`` (a JOIN entry)."""
        self.core.new_session(identity, body, self.wall_clock())
        self.poke()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._receive_loop)
            if self.keyring_path is not None:
                nursery.start_soon(self._watch_keyring, self.keyring_path)
            nursery.start_soon(self._timer_loop)
            task_status.started()

    async def flush(self) -> None:
        for out in self.core.take_outbound():
            await self.transport.send(out.addr, out.data, out.reliable)

    async def _timer_loop(self) -> None:
        while True:
            self.core.tick(self.wall_clock())
            await self.flush()
            if self.on_change is not None:
                self.on_change()
            delay = self.core.next_deadline() - self.wall_clock()
            if delay > 0:
                with trio.move_on_after(delay):
                    await self._wake.wait()
            else:
                await trio.lowlevel.checkpoint()
            self._wake = trio.Event()

    async def _receive_loop(self) -> None:
        while True:
            data, source, stream = await self.transport.receive()
            try:
                self.core.receive(data, self.wall_clock(), source, stream=stream)
            except Exception:
                # The error boundary: the core drops bad input itself, so this is a bug, and
                # one packet that hits it must not end the agent.
                self.core.count_dropped("internal_error")
                self._internal_errors.exception(time.monotonic())
            await self.flush()
            if self.on_change is not None:
                self.on_change()
            self._wake.set()

    async def _watch_keyring(self, path: Path) -> None:
        seen = file_signature(path)
        while True:
            await trio.sleep(self.keyring_poll_s)
            current = file_signature(path)
            if current == seen or current is None:
                continue
            seen = current
            try:
                ring = Keyring.load(path)
            except FabricError as exc:
                self.keyring_errors += 1
                log.warning("keyring %s not reloaded: %s", path, exc)
                continue
            self.core.keyring.replace_with(ring)
            self.keyring_reloads += 1
            log.info(
                "keyring reloaded: keys %s, primary %s",
                ",".join(ring.key_ids()),
                ring.primary.hex(),
            )

    async def leave(self, linger_s: float = 1.0) -> None:
        """Sign LEFT, push it, and keep gossiping it for ``linger_s`` so it spreads."""
        self.core.leave(self.wall_clock())
        await self.flush()
        with trio.move_on_after(linger_s):
            while True:
                self.core.tick(self.wall_clock())
                await self.flush()
                await trio.sleep(self.core.config.gossip_interval_s)
