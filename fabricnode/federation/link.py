"""The gateways' link: the federation port, mutual TLS, and the summaries over it (trio shell).

A ``Gateway`` is what ``fabric start --gateway`` adds to an agent. ``Gateway.load`` reads the
site key and the pinned peer certificates (before any socket exists, so a bad file is one clear
line at start); ``run`` then, in its own nursery:

* listens on the federation port (TCP) and takes TLS 1.3 connections from peer sites;
* dials every pinned peer site at the addresses ``--federation-peer`` gave and those its latest
  summary lists, keeping one connection of its own to each, reconnecting with bounded
  exponential backoff (jittered);
* once the agent has joined its site's mesh, rebuilds our site's summary from the registry
  every ``summary_period_s`` and signs a new one (new ``seq``) when it changed and at least
  every ``keepalive_s``;
* over each connection, sends the latest summary (only over one connection per peer gateway:
  the oldest up; every gateway of a peer site keeps its own view), pings every
  ``ping_interval_s``, and feeds what it receives into the ``FederationView``: summaries
  (``view.accept``) and round trips (``view.observe_rtt``).

TLS: both sides present their site certificate and require the other's; the trust store is
exactly the pinned peer certificates (self-signed, loaded as CA data; no name check: the
certificate's key is what is pinned), and after the handshake the peer's certificate key maps
the connection to its site (by fingerprint), or the connection is closed. The protocol on the
port is chosen by ALPN: ``protocol.ALPN_LINK`` is this framed link; ``protocol.ALPN_HTTP``
carries cross-site requests (HTTP/1.1) on the same port, so one port opened in a firewall
carries both.

Cross-site requests (docs/federation.md): the link only carries their bytes; the data plane
speaks HTTP. A connection that negotiates ``ALPN_HTTP`` from a peer site is bridged to one end
of a socket pair whose other end the agent hands its data plane (``http_handler``: served as a
client connection marked as arrived from that site). The other way, ``dial_http`` opens a TLS
connection with ``ALPN_HTTP`` to a peer site's gateway and returns the data plane's end of such
a pair (the upstream pool's ``dialer``). Each bridge copies at most ``BRIDGE_CHUNK`` bytes at a
time each way and holds nothing more; at most ``max_http_connections`` each way at once.

Bounds: incoming connections at most ``max_connections`` at once; a frame at most
``protocol.MAX_FRAME_BYTES`` and nothing buffered past one frame; one summary slot per
connection (the latest wins, nothing queues); a handshake, a HELLO and every send under a
timeout; a peer silent for ``idle_timeout_s`` is dropped. A peer that sends garbage, an
oversized frame or a wrong HELLO is disconnected and counted (``statistics``); nothing it sends
propagates into the agent's nursery.
"""

from __future__ import annotations

import itertools
import logging
import random
import socket
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from fabricnode.addr import split_hostport
from fabricnode.errors import ConfigError, DecodeError, KeyFileError
from fabricnode.federation.protocol import (
    ALPN_HTTP,
    ALPN_LINK,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameReader,
    Hello,
    Message,
    Ping,
    Pong,
    Summary,
    encode,
)
from fabricnode.federation.settings import FederationConfig
from fabricnode.federation.sitekey import PeerSites, SiteCert, SiteKey
from fabricnode.federation.summary import (
    SiteSummary,
    body_of,
    capacity_of,
    gateways_of,
    next_seq,
)
from fabricnode.federation.view import FederationView, ViewConfig
from fabricnode.mesh.core import MeshCore

log = logging.getLogger("fabricnode.federation.link")

RECEIVE_CHUNK = 64 * 1024
BRIDGE_CHUNK = 64 * 1024
MAX_PINGS_OUTSTANDING = 8
# Why a connection ended or never began, as counted (``fabric_federation_connections_closed``).
CLOSE_REASONS = (
    "tls",  # the handshake failed: a certificate not pinned, no certificate, not TLS
    "alpn",  # no protocol of ours negotiated
    "hello",  # the first frame was not a HELLO of the certificate's site and our version
    "bad_frame",  # undecodable or oversized
    "idle",  # silent past idle_timeout_s
    "slow",  # took no bytes for send_timeout_s
    "closed",  # the peer closed it, or the network broke it
    "too_many",  # over max_connections incoming at once
    "no_ingress",  # a request connection our data plane did not take
)


class _Closed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class LinkStatistics:
    links_up: dict[str, int]  # per peer site, connections up (both directions)
    connections: dict[str, int]  # established, by direction (in, out)
    closed: dict[str, int]  # by reason (CLOSE_REASONS)
    dials: int
    summaries_sent: int
    summaries_signed: int
    accepted: int
    refused: dict[str, int]  # summaries refused by the view, by reason
    rtt_s: dict[str, float]  # per site with a measurement
    routable: dict[str, bool]
    http_connections: dict[str, int] = field(default_factory=dict)  # open now, in and out
    http_dials: int = 0  # request connections opened to peer sites (ALPN_HTTP)
    http_dial_failures: int = 0


@dataclass(eq=False)
class _Conn:
    site: str
    direction: str
    stream: trio.SSLStream[trio.SocketStream]
    opened_at: float
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    sent_seq: int = 0
    last_rx: float = 0.0
    pings: dict[int, float] = field(default_factory=dict)
    peer_gateway: str = ""
    reader: FrameReader = field(default_factory=FrameReader)
    close_reason: str = ""


class Gateway:
    """One gateway's federation port, links and view (module docstring)."""

    def __init__(
        self,
        config: FederationConfig,
        site_key: SiteKey,
        peers: PeerSites,
        *,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.site_key = site_key
        self.peers = peers
        self.wall_clock = wall_clock
        self.rng = rng or random.Random()
        self.view = FederationView(
            peers,
            ViewConfig(
                stale_floor_s=config.stale_floor_s,
                rtt_factor=config.rtt_factor,
                summary_period_s=config.keepalive_s,
            ),
        )
        self.server_context = _context(site_key, peers, server=True)
        self.client_context = _context(site_key, peers, server=False)
        self.http_context = _context(site_key, peers, server=False, alpn=ALPN_HTTP)
        # Cross-site requests (module docstring): who serves those that come in (the agent's
        # data plane: ``Ingress.serve_remote``), and the nursery the bridges run in.
        self.http_handler: Callable[[socket.socket, str], bool] | None = None
        self._nursery: trio.Nursery | None = None
        self.http_open: Counter[str] = Counter()
        self.http_dials = 0
        self.http_dial_failures = 0
        self.listen_addr: str | None = None
        self._conns: list[_Conn] = []
        self._incoming = 0
        self._handshaking = 0  # incoming connections in their TLS handshake now
        self._current: SiteSummary | None = None
        # The models our site's acting controller would start now, and in how many seconds
        # it expects each to serve (``summary.ModelCapacity.start_s``): set by the agent when
        # the controller runs here; None: our summary says no start.
        self.starts: Callable[[], Mapping[str, float]] | None = None
        self._changed = trio.Event()
        self._nonces = itertools.count(1)
        self.connections: Counter[str] = Counter()
        self.closed: Counter[str] = Counter()
        self.dials = 0
        self.summaries_sent = 0
        self.summaries_signed = 0

    @property
    def site(self) -> str:
        return self.site_key.site

    @classmethod
    def load(cls, config: FederationConfig, **kw: Any) -> Gateway:
        """Read the site key and the peer certificates; ``KeyFileError`` / ``ConfigError``
        with one line for what is wrong."""
        key = SiteKey.load(config.site_key_path)
        if config.site is not None and config.site != key.site:
            raise KeyFileError(
                f"{key.cert_path} is the key of site {key.site!r}, not of this agent's site "
                f"{config.site!r} (give the gateway --site {key.site})"
            )
        peers = PeerSites.load(config.peer_sites_dir, own=key.cert)
        for site, addr in config.peers:
            if peers.get(site) is None:
                raise ConfigError(
                    f"--federation-peer {site}={addr}: no certificate for site {site!r} in "
                    f"{config.peer_sites_dir} (copy its site.pem there)"
                )
        return cls(config, key, peers, **kw)

    # -- running -----------------------------------------------------------------------------

    async def run(
        self,
        core: MeshCore,
        joined: Callable[[], bool] = lambda: True,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the federation port, dial the peers and publish our summary until cancelled;
        reports the bound ``HOST:PORT`` when listening. No summary is signed before
        ``joined()``: a gateway that has not joined its site's mesh yet would say its site
        serves nothing."""
        cfg = self.config
        listeners = await trio.open_tcp_listeners(cfg.listen_port, host=cfg.listen_host)
        sockname = listeners[0].socket.getsockname()
        self.listen_addr = f"{cfg.listen_host}:{sockname[1]}"
        log.info(
            "gateway of site %s (key %s) at %s, listening on %s; peer sites: %s",
            self.site,
            self.site_key.fingerprint,
            cfg.gateway,
            self.listen_addr,
            ", ".join(self.peers.sites) or "none",
        )
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(trio.serve_listeners, self._incoming_connection, listeners)
            nursery.start_soon(self._publish, core, joined)
            for site in self.peers.sites:
                nursery.start_soon(self._dial_site, site)
            task_status.started(self.listen_addr)

    async def _publish(self, core: MeshCore, joined: Callable[[], bool]) -> None:
        """Our site's summary: rebuilt every period, signed anew when it changed or is due."""
        cfg = self.config
        last_content: object = None
        last_signed = -1e18
        seq = 0
        while not joined():
            await trio.sleep(cfg.summary_period_s)
        while True:
            now = self.wall_clock()
            gateways = gateways_of(core, self.site, cfg.gateway)
            starts = self.starts() if self.starts is not None else None
            models = capacity_of(core, self.site, now, starts=starts)
            content = (gateways, models)
            if content != last_content or trio.current_time() - last_signed >= cfg.keepalive_s:
                seq = next_seq(seq, now)
                self._current = SiteSummary.sign(
                    body_of(self.site, seq, now, gateways, models), self.site_key
                )
                self.summaries_signed += 1
                last_content, last_signed = content, trio.current_time()
                self._wake()
            await trio.sleep(cfg.summary_period_s)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- connections -------------------------------------------------------------------------

    async def _incoming_connection(self, stream: trio.SocketStream) -> None:
        if self._handshaking >= self.config.max_connections:
            self.closed["too_many"] += 1
            await trio.aclose_forcefully(stream)
            return
        tls = trio.SSLStream(stream, self.server_context, server_side=True)
        self._handshaking += 1
        try:
            cert, alpn = await self._handshake(tls)
        except _Closed as exc:
            self.closed[exc.reason] += 1
            await trio.aclose_forcefully(tls)
            return
        except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError, OSError):
            self.closed["tls"] += 1
            await trio.aclose_forcefully(tls)
            return
        finally:
            self._handshaking -= 1
        if alpn == ALPN_HTTP:
            await self._incoming_http(tls, cert.site)
            return
        if self._incoming >= self.config.max_connections:
            self.closed["too_many"] += 1
            await trio.aclose_forcefully(tls)
            return
        self._incoming += 1
        try:
            await self._connection(tls, "in", expected_site=None, cert=cert)
        finally:
            self._incoming -= 1

    # -- cross-site requests (ALPN_HTTP) -------------------------------------------------------

    async def _incoming_http(self, tls: trio.SSLStream[trio.SocketStream], site: str) -> None:
        """A peer site's gateway sends us requests: bridge them to our data plane."""
        handler = self.http_handler
        if handler is None or self.http_open["in"] >= self.config.max_http_connections:
            self.closed["no_ingress" if handler is None else "too_many"] += 1
            await trio.aclose_forcefully(tls)
            return
        ours, theirs = socket.socketpair()
        if not handler(theirs, site):
            theirs.close()
            ours.close()
            self.closed["no_ingress"] += 1
            await trio.aclose_forcefully(tls)
            return
        await self._bridge(tls, ours, "in")

    async def dial_http(self, origin: tuple[str, int]) -> socket.socket:
        """A connection to a peer site's gateway for requests (``sites.site_origin``): TLS with
        ``ALPN_HTTP``, bridged; the data plane's end (non-blocking), or ``OSError``."""
        host = origin[0]
        site, _, addr = host[len("site:") :].partition("/")
        nursery = self._nursery
        if nursery is None or self.peers.get(site) is None:
            raise OSError(f"no link to site {site!r}")
        if self.http_open["out"] >= self.config.max_http_connections:
            raise OSError(f"{self.config.max_http_connections} request connections open")
        self.http_dials += 1
        tls: trio.SSLStream[trio.SocketStream] | None = None
        try:
            h, port = split_hostport(addr)
            with trio.fail_after(self.config.dial_timeout_s):
                stream = await trio.open_tcp_stream(h, port)
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tls = trio.SSLStream(stream, self.http_context, server_side=False)
                cert, _ = await self._handshake(tls, alpn=ALPN_HTTP)
            if cert.site != site:
                raise OSError(f"{addr} is a gateway of site {cert.site!r}, not {site!r}")
        except (trio.TooSlowError, trio.BrokenResourceError, ssl.SSLError, ConfigError) as exc:
            self.http_dial_failures += 1
            if tls is not None:
                await trio.aclose_forcefully(tls)
            raise OSError(f"site {site} gateway {addr}: {exc or 'timed out'}") from None
        except (OSError, _Closed):
            self.http_dial_failures += 1
            if tls is not None:
                await trio.aclose_forcefully(tls)
            raise OSError(f"site {site} gateway {addr}: cannot connect") from None
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        nursery.start_soon(self._bridge, tls, ours, "out")
        return theirs

    async def _bridge(
        self, tls: trio.SSLStream[trio.SocketStream], sock: socket.socket, direction: str
    ) -> None:
        """Copy bytes both ways between ``tls`` and our end of a socket pair until either side
        closes; then close both."""
        self.http_open[direction] += 1
        local = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, tls, local, nursery.cancel_scope)
                nursery.start_soon(_pump, local, tls, nursery.cancel_scope)
        finally:
            self.http_open[direction] -= 1
            await trio.aclose_forcefully(local)
            await trio.aclose_forcefully(tls)

    async def _dial_site(self, site: str) -> None:
        """Keep one connection of our own to ``site``; back off while none can be made."""
        cfg = self.config
        backoff = cfg.backoff_min_s
        tried = 0
        while True:
            addrs = self._addresses_of(site)
            if addrs:
                addr = addrs[tried % len(addrs)]
                tried += 1
                started = trio.current_time()
                await self._dial(site, addr)
                if trio.current_time() - started > 4 * cfg.keepalive_s:
                    backoff = cfg.backoff_min_s  # it was up a while: retry soon
            await trio.sleep(backoff * (0.5 + self.rng.random()))
            backoff = min(cfg.backoff_max_s, backoff * 2)

    def _addresses_of(self, site: str) -> list[str]:
        addrs = [addr for s, addr in self.config.peers if s == site]
        held = self.view.summary(site)
        if held is not None:
            addrs += [a for a in held.body.gateways if a not in addrs]
        return addrs

    async def _dial(self, site: str, addr: str) -> None:
        cfg = self.config
        self.dials += 1
        try:
            host, port = split_hostport(addr)
            with trio.fail_after(cfg.dial_timeout_s):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError, ConfigError) as exc:
            log.debug("dialing site %s at %s: %s", site, addr, exc)
            return
        tls = trio.SSLStream(stream, self.client_context, server_side=False)
        await self._connection(tls, "out", expected_site=site)

    async def _connection(
        self,
        tls: trio.SSLStream[trio.SocketStream],
        direction: str,
        expected_site: str | None,
        cert: SiteCert | None = None,
    ) -> None:
        """Handshake (unless done: ``cert``), HELLO, then the link until it ends; every way it
        ends is counted."""
        conn: _Conn | None = None
        try:
            if cert is None:
                try:
                    cert, _ = await self._handshake(tls, alpn=ALPN_LINK)
                except (
                    trio.BrokenResourceError,
                    trio.TooSlowError,
                    ssl.SSLError,
                    OSError,
                ) as exc:
                    raise _Closed("tls") from exc
            if expected_site is not None and cert.site != expected_site:
                raise _Closed("hello")
            conn = _Conn(cert.site, direction, tls, trio.current_time())
            conn.last_rx = trio.current_time()
            await self._hello(conn)
            self._conns.append(conn)
            self.connections[direction] += 1
            log.info("link %s site %s up (%s)", direction, conn.site, conn.peer_gateway or "-")
            self._wake()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._guarded, self._reader, conn, nursery.cancel_scope)
                nursery.start_soon(self._guarded, self._writer, conn, nursery.cancel_scope)
            raise _Closed(conn.close_reason or "closed")
        except _Closed as exc:
            self.closed[exc.reason] += 1
            site = conn.site if conn is not None else expected_site or "?"
            log.info("link %s site %s closed: %s", direction, site, exc.reason)
        finally:
            if conn is not None and conn in self._conns:
                self._conns.remove(conn)
                self._wake()  # another connection to the site may carry summaries now
            await trio.aclose_forcefully(tls)

    async def _handshake(
        self, tls: trio.SSLStream[trio.SocketStream], alpn: str | None = None
    ) -> tuple[SiteCert, str]:
        """The pinned certificate of the peer and the protocol negotiated (``alpn``, or either
        of ours when None: a connection taken on the port)."""
        with trio.fail_after(self.config.handshake_timeout_s):
            await tls.do_handshake()
        selected = tls.selected_alpn_protocol()
        if selected not in ((ALPN_LINK, ALPN_HTTP) if alpn is None else (alpn,)):
            raise _Closed("alpn")
        der = tls.getpeercert(binary_form=True)
        if not der:
            raise _Closed("tls")
        try:
            presented = SiteCert.from_der(der, "peer certificate")
        except KeyFileError:
            raise _Closed("tls") from None
        pinned = self.peers.by_fingerprint(presented.fingerprint)
        if pinned is None or pinned.site != presented.site:
            raise _Closed("tls")
        return pinned, str(selected)

    async def _hello(self, conn: _Conn) -> None:
        cfg = self.config
        await self._send(conn, Hello(PROTOCOL_VERSION, self.site, cfg.gateway))
        reader = conn.reader
        with trio.move_on_after(cfg.handshake_timeout_s):
            while True:
                data = await _receive(conn)
                try:
                    messages = reader.feed(data)
                except DecodeError:
                    raise _Closed("bad_frame") from None
                if not messages:
                    continue
                first = messages[0]
                if (
                    not isinstance(first, Hello)
                    or first.site != conn.site
                    or first.version != PROTOCOL_VERSION
                ):
                    raise _Closed("hello")
                conn.peer_gateway = first.gateway
                for message in messages[1:]:
                    await self._handle(conn, message)
                return
        raise _Closed("idle")

    @staticmethod
    async def _guarded(
        task: Callable[[_Conn], Awaitable[None]], conn: _Conn, scope: trio.CancelScope
    ) -> None:
        """Run one side of a link; the first to end (and why) ends the other."""
        try:
            await task(conn)
        except _Closed as exc:
            conn.close_reason = conn.close_reason or exc.reason
        finally:
            scope.cancel()

    async def _reader(self, conn: _Conn) -> None:
        while True:
            data = await _receive(conn)
            try:
                messages = conn.reader.feed(data)
            except DecodeError:
                raise _Closed("bad_frame") from None
            for message in messages:
                await self._handle(conn, message)

    async def _handle(self, conn: _Conn, message: Message) -> None:
        now_mono = trio.current_time()
        conn.last_rx = now_mono
        if isinstance(message, Summary):
            outcome = self.view.accept(message.data, conn.site, self.wall_clock())
            if outcome != "accepted":
                log.debug("summary from site %s refused: %s", conn.site, outcome)
        elif isinstance(message, Ping):
            await self._send(conn, Pong(message.nonce))
        elif isinstance(message, Pong):
            sent = conn.pings.pop(message.nonce, None)
            if sent is not None:
                self.view.observe_rtt(conn.site, now_mono - sent)
        else:
            raise _Closed("hello")  # a second HELLO

    async def _writer(self, conn: _Conn) -> None:
        cfg = self.config
        next_ping = trio.current_time()
        while True:
            changed = self._changed
            summary = self._current
            if summary is not None and summary.seq != conn.sent_seq and self._carries(conn):
                await self._send(conn, Summary(summary.encode()))
                conn.sent_seq = summary.seq
                self.summaries_sent += 1
            now = trio.current_time()
            if now - conn.last_rx > cfg.idle_timeout_s:
                raise _Closed("idle")
            if now >= next_ping:
                nonce = next(self._nonces)
                if len(conn.pings) >= MAX_PINGS_OUTSTANDING:
                    conn.pings.pop(next(iter(conn.pings)))
                conn.pings[nonce] = now
                await self._send(conn, Ping(nonce))
                next_ping = now + cfg.ping_interval_s
            with trio.move_on_at(next_ping):
                await changed.wait()

    def _carries(self, conn: _Conn) -> bool:
        """Whether our summaries go to the peer gateway at the other end of ``conn`` over it:
        the oldest connection up with that gateway (named by its HELLO; one that takes no
        connections names none, and each of its connections counts alone). Per gateway, not
        per site: every gateway of a peer site keeps its own view, and one of two gateways of
        a site that heard our summary over the other's connection only never had it (seen
        over the emulated WAN: a site's second gateway never saw a peer site routable)."""
        if not conn.peer_gateway:
            return True
        for other in self._conns:
            if other.site == conn.site and other.peer_gateway == conn.peer_gateway:
                return other is conn
        return False

    async def _send(self, conn: _Conn, message: Message) -> None:
        frame = encode(message)
        try:
            async with conn.send_lock:
                with trio.fail_after(self.config.send_timeout_s):
                    await conn.stream.send_all(frame)
        except trio.TooSlowError:
            raise _Closed("slow") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise _Closed("closed") from None

    # -- reading -----------------------------------------------------------------------------

    def statistics(self) -> LinkStatistics:
        now = self.wall_clock()
        up: Counter[str] = Counter(c.site for c in self._conns)
        view = self.view.statistics(now)
        return LinkStatistics(
            links_up={site: up.get(site, 0) for site in self.peers.sites},
            connections={d: self.connections.get(d, 0) for d in ("in", "out")},
            closed={reason: self.closed.get(reason, 0) for reason in CLOSE_REASONS},
            dials=self.dials,
            summaries_sent=self.summaries_sent,
            summaries_signed=self.summaries_signed,
            accepted=view.accepted,
            refused=dict(view.refused),
            rtt_s={s.site: s.rtt_s for s in view.sites if s.rtt_s is not None},
            routable={s.site: s.routable for s in view.sites},
            http_connections={d: self.http_open.get(d, 0) for d in ("in", "out")},
            http_dials=self.http_dials,
            http_dial_failures=self.http_dial_failures,
        )

    def sites_doc(self) -> dict[str, Any]:
        """``GET /fabric/v1/sites``: this gateway's site, and per peer site its summary's age,
        routable or not, the RTT, its models and the links up."""
        now = self.wall_clock()
        up: Counter[str] = Counter(c.site for c in self._conns)
        peers = self.view.as_json(now)
        for row in peers:
            row["links_up"] = up.get(row["site"], 0)
        current = self._current
        return {
            "site": self.site,
            "fingerprint": self.site_key.fingerprint,
            "gateway": self.config.gateway,
            "seq": None if current is None else current.seq,
            "sites": peers,
        }


async def _pump(
    source: trio.abc.ReceiveStream, sink: trio.abc.SendStream, scope: trio.CancelScope
) -> None:
    """One direction of a bridge: until ``source`` ends or either side breaks; then both
    directions end (``scope``)."""
    try:
        while True:
            data = await source.receive_some(BRIDGE_CHUNK)
            if not data:
                break
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
        pass
    finally:
        scope.cancel()


async def _receive(conn: _Conn) -> bytes:
    try:
        data = await conn.stream.receive_some(RECEIVE_CHUNK)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        raise _Closed("closed") from None
    if not data:
        raise _Closed("closed")
    return bytes(data)


def _context(
    site_key: SiteKey, peers: PeerSites, *, server: bool, alpn: str = ALPN_LINK
) -> ssl.SSLContext:
    """TLS 1.3, our certificate, and exactly the pinned peers trusted (module docstring)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # the pinned key is the identity, not a host name
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(site_key.cert_path, site_key.key_path)
    except (ssl.SSLError, OSError) as exc:
        raise KeyFileError(f"TLS cannot use the site key {site_key.key_path}: {exc}") from None
    if peers.sites:
        ctx.load_verify_locations(cadata=peers.ca_data())
    # a pinned certificate is its own trust anchor (self-signed, not a CA)
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    # A server offers both uses of the port; a client asks for the one it dials for.
    ctx.set_alpn_protocols([ALPN_LINK, ALPN_HTTP] if server else [alpn])
    return ctx


__all__ = ["CLOSE_REASONS", "MAX_FRAME_BYTES", "Gateway", "LinkStatistics"]
