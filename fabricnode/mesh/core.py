"""MeshCore: one node's whole gossip protocol, sans I/O.

It owns the registry replica, the member table, the load table and the broadcast queues, and
speaks the wire format. The shell (``service.GossipService`` for real sockets, the simulators in
``fabricnode.testing`` and ``bench/gossip.py`` for virtual ones) feeds it sealed packets and the
time, and sends what it asks::

    core.receive(data, now, source)   # a sealed datagram or stream frame arrived
    core.tick(now)                    # timers; call again no later than core.next_deadline()
    for out in core.take_outbound():  # then send these
        send(out.addr, out.data, reliable=out.reliable)

Protocol summary (parameters in ``MeshConfig``):

* Failure detection: SWIM probes every ``probe_interval_s`` (randomised round robin), a second
  direct ping plus ``indirect_probes`` ping-reqs after ``probe_timeout_s``, Lifeguard suspicion,
  and a confirmation probe before an obituary (see ``membership``).
* Dissemination: registry entries, liveness records and load reports are piggybacked on probes
  and sent to ``gossip_fanout`` random members every ``gossip_interval_s`` while there is news,
  each retired after ``retransmit_mult * ceil(log10(N+1))`` transmissions.
* Anti-entropy: every ``sync_interval_s`` (scaled up with log2 of the cluster size) a push-pull
  exchange of (rank, liveness) rows with one random member over a reliable stream, which repairs
  anything gossip lost; every ``reconnect_interval_s`` (scaled the same way) one with a member
  believed dead, so two sides of a healed partition find each other again.
* Load: a small, frequent, unsigned (AEAD-only) channel, separate from the signed registry.

Why one ~1,100-line module (over the ~900 the others keep to): it is one state machine. Its
handlers read and write the same member table, registry, probe set and queues in a single step
(an ack settles a probe, refreshes a member and piggybacks news), so splitting it by message
type would spread one protocol step over several files and make them share private state. The
parts that stand on their own are already their own modules (``membership``, ``registry``,
``broadcast``, ``assignment``, ``servicedoc``, ``wire``), as in aioquic, whose
``QuicConnection`` is likewise one module. What grew it past 900, the operator-signed records
(assignments and the service file), is the same shape: a handler offers the record to its own
module's table and spreads what is new through this core's members and sends. What would come
out cleanly (``MeshConfig``, ``Outbound``, ``MeshStatistics``: ~80 lines of records) would not
change that.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from fabricnode.errors import WireError
from fabricnode.mesh.assignment import AssignmentTable, Offer, SignedAssignment
from fabricnode.mesh.broadcast import BroadcastQueue
from fabricnode.mesh.identity import Identity, Verifier
from fabricnode.mesh.keyring import HEADER_BYTES, NONCE_BYTES, SEAL_OVERHEAD, Keyring
from fabricnode.mesh.membership import (
    NO_RECORD,
    Change,
    Liveness,
    Member,
    MemberTable,
    SuspicionTiming,
)
from fabricnode.mesh.registry import (
    EntryBody,
    MergeOutcome,
    Registry,
    RegistryLimits,
    SignedEntry,
    State,
)
from fabricnode.mesh.schema import JOB_END_LABEL, Standing, standing
from fabricnode.mesh.servicedoc import ServicesRegister, SignedServices
from fabricnode.mesh.wire import (
    DEAD,
    MAX_MESSAGES,
    SUSPECT,
    Accusation,
    Ack,
    Alive,
    AssignmentMsg,
    EntryMsg,
    Load,
    Message,
    Packet,
    Ping,
    PingReq,
    ReplayGuard,
    ServicesMsg,
    ServicesRank,
    ServicesWant,
    SyncReply,
    SyncRequest,
    SyncRow,
    decode_packet,
    encode_messages,
    encode_packet,
)

PACKET_ENVELOPE_BYTES = 64  # version, sender id, seq, timestamp and array headers
# Messages in one reliable frame: half the decoder's per-packet limit (wire.MAX_MESSAGES), so a
# frame stays well inside it and inside the stream byte limit (records are at most ~1 KiB).
MAX_FRAME_MESSAGES = MAX_MESSAGES // 2


@dataclass(frozen=True)
class MeshConfig:
    probe_interval_s: float = 0.4
    probe_timeout_s: float = 0.2
    indirect_probes: int = 6
    suspicion_mult: float = 0.75
    suspicion_floor_s: float = 1.0
    suspicion_max_factor: float = 4.0
    expected_confirmations: int = 3
    gossip_interval_s: float = 0.1
    gossip_fanout: int = 3
    retransmit_mult: int = 4
    load_retransmit_mult: int = 2
    load_direct_max_members: int = 32
    load_refresh_s: float = 10.0
    sync_interval_s: float = 5.0
    reconnect_interval_s: float = 10.0
    seed_retry_s: float = 2.0
    max_datagram_bytes: int = 1400
    max_stream_bytes: int = 16 * 1024 * 1024
    entry_ttl_s: float = 3600.0
    relay_timeout_s: float = 1.0
    # Indirect probes we make for others, per probe interval: from one requester, and in all.
    # A requester asks one relay at most once per failed probe, so honest peers stay far below;
    # a key holder cannot turn one packet of PingReqs into a flood of probes.
    relay_per_sender: int = 3
    relay_per_interval: int = 32
    registry: RegistryLimits = field(default_factory=RegistryLimits)
    max_clock_skew_s: float = 60.0
    # Fingerprints of operator keys whose engine assignments this node accepts and relays.
    trusted_operators: tuple[str, ...] = ()
    max_assignments: int = 4096

    @property
    def suspicion(self) -> SuspicionTiming:
        return SuspicionTiming(
            self.probe_interval_s,
            self.suspicion_mult,
            self.suspicion_max_factor,
            self.expected_confirmations,
            self.suspicion_floor_s,
        )


@dataclass(frozen=True)
class Outbound:
    addr: str
    data: bytes
    reliable: bool = False  # True: send over a stream (large, must arrive)


@dataclass
class _Probe:
    probe_id: int
    target: str
    addr: str
    confirm: bool
    direct_deadline: float
    end: float
    acked: bool = False
    indirect_sent: bool = False


@dataclass(frozen=True)
class MeshStatistics:
    members: dict[str, int]
    registry_entries: int
    tombstones: int
    packets_in: int
    packets_out: int
    bytes_in: int
    bytes_out: int
    dropped: dict[str, int]
    broadcast_queue: int
    load_queue: int
    incarnation: int
    merges: dict[str, int]
    assignments: int = 0


class MeshCore:
    def __init__(
        self,
        identity: Identity,
        keyring: Keyring,
        body: EntryBody,
        now: float,
        config: MeshConfig | None = None,
        *,
        rng: random.Random | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        self.config = cfg = config or MeshConfig()
        self.identity = identity
        self.keyring = keyring
        self.self_id = identity.session_id
        self.rng = rng or random.Random()
        self.verifier = verifier or Verifier()
        self.registry = Registry(self.verifier, cfg.registry)
        self.assignments = AssignmentTable(
            cfg.trusted_operators,
            self.verifier,
            max_items=cfg.max_assignments,
            max_clock_skew_s=cfg.max_clock_skew_s,
        )
        self.services = ServicesRegister(
            cfg.trusted_operators, self.verifier, max_clock_skew_s=cfg.max_clock_skew_s
        )
        self.members = MemberTable(self.self_id, cfg.suspicion, self.rng)
        self.loads: dict[str, Load] = {}
        self.replay = ReplayGuard(max_skew_s=cfg.max_clock_skew_s)
        self.broadcasts = BroadcastQueue()
        self.load_broadcasts = BroadcastQueue()
        self.gossip_addr = body.addresses.gossip
        self.incarnation = 0
        self.alive = Alive.make(identity, 0, self.gossip_addr)
        self.left = False
        self._seq = 0
        self._probe_seq = 0
        self._probes: dict[int, _Probe] = {}
        self._relays: dict[
            int, tuple[str, int, str, float]
        ] = {}  # id -> requester, id, target, end
        self._relay_window_end = now  # relay_per_* counts are per probe interval
        self._relayed: dict[str, int] = {}  # requester -> indirect probes made this window
        self._relayed_total = 0
        self._out: list[Outbound] = []
        self._seeds: list[str] = []
        self._next_seed_at = now
        self._next_probe_at = now + self.rng.uniform(0, cfg.probe_interval_s)
        self._next_gossip_at = now
        # Jittered so that agents started together (a Slurm job array) do not sync in lockstep.
        self._next_sync_at = now + self._sync_interval() * self.rng.uniform(0.5, 1.0)
        self._next_reconnect_at = now + cfg.reconnect_interval_s * self.rng.uniform(0.5, 1.0)
        self._next_gc_at = now + 1.0
        self._next_member_sweep_at = now + 10.0
        self._load_seq = 0
        self._my_load: Load | None = None
        self._next_load_at = now + cfg.load_refresh_s
        self.stats_dropped: dict[str, int] = {}
        self._spread = True
        self._sender = ""  # the session that sent the packet being handled
        self.packets_in = self.packets_out = self.bytes_in = self.bytes_out = 0
        self.self_entry = body.sign(identity)
        self.registry.merge(self.self_entry, now, own=True)
        self._refresh_at = self._refresh_time(now)
        self._queue_self(now)

    # == public API ==============================================================================

    def bootstrap(self, addrs: Iterable[str]) -> None:
        """Gossip addresses to ask for the cluster's state until some member answers."""
        for addr in addrs:
            if addr and addr != self.gossip_addr and addr not in self._seeds:
                self._seeds.append(addr)

    def update_self(self, now: float, **changes: object) -> SignedEntry:
        """Re-sign our entry with ``changes`` (and a renewed lease) and spread it."""
        body = self.self_entry.body
        labels = changes.get("labels", body.labels)
        expires = min(now + self.config.entry_ttl_s, _lease_cap(labels))  # type: ignore[arg-type]
        new_body = body.successor(updated_at=now, expires_at=expires, **changes)
        self.self_entry = new_body.sign(self.identity)
        self.registry.merge(self.self_entry, now, own=True)
        self._refresh_at = self._refresh_time(now)
        self._queue_self(now)
        return self.self_entry

    def leave(self, now: float) -> None:
        """Sign LEFT and push it to several members directly, on top of gossip."""
        if self.left:
            return
        self.update_self(now, state=State.LEFT)
        self.left = True
        msg = EntryMsg(self.self_entry)
        targets = self.members.random_reachable(2 * self.config.gossip_fanout + 2)
        for m in targets:
            self._send(m.addr, [msg], now, reliable=False)
            self._send(m.addr, [msg], now, reliable=True)

    def new_session(self, identity: Identity, body: EntryBody, now: float) -> None:
        """Retire our session (signed LEFT) and continue as a new one on the same sockets.

        A restarted engine is a new session: a new key, a new entry from JOIN. The old
        session's LEFT is final for everyone, so no peer probes it or mistakes its silence for
        a crash; its entry is collected like any other LEFT entry.
        """
        if body.session_id != identity.session_id:
            raise ValueError("the new entry must belong to the new identity")
        old = self.self_id
        if not self.left:
            self.update_self(now, state=State.LEFT)
        self.broadcasts.put(("entry", old), EntryMsg(self.self_entry))
        self.loads.pop(old, None)
        self.identity = identity
        self.self_id = identity.session_id
        self.members.self_id = identity.session_id
        self.incarnation = 0
        self.alive = Alive.make(identity, 0, self.gossip_addr)
        self.left = False
        self._my_load = None
        self.self_entry = body.sign(identity)
        self.registry.merge(self.self_entry, now, own=True)
        self._refresh_at = self._refresh_time(now)
        self._queue_self(now)

    def publish_load(
        self, now: float, *, waiting: int, running: int, kv_usage: float, inflight: int
    ) -> None:
        prev = self._my_load
        self._load_seq += 1
        load = Load(self.self_id, self._load_seq, waiting, running, kv_usage, inflight, now)
        self._my_load = load
        self.loads[self.self_id] = load
        changed = (
            prev is None
            or (prev.waiting, prev.running, prev.inflight) != (waiting, running, inflight)
            or abs(prev.kv_usage - kv_usage) >= 0.02
        )
        if not changed and now < self._next_load_at:
            return
        self._next_load_at = now + self.config.load_refresh_s
        if self._load_direct():
            # Small mesh: one small datagram to every member beats epidemic spread on both
            # freshness (one hop) and bytes (no redundant copies).
            for m in self.members.reachable():
                self._send(m.addr, [load], now)
        else:
            self.load_broadcasts.put(("load", self.self_id), load)

    def publish_assignment(self, item: SignedAssignment, now: float) -> Offer:
        """Accept an operator's assignment (from the admin API) and spread it.

        Besides gossip, it goes straight to its target over a reliable stream when we know the
        target's address: the common case then takes one hop.
        """
        outcome = self._on_assignment(item, now)
        if outcome == Offer.NEW and item.target != self.self_id:
            target = self.members.get(item.target)
            if target is not None and target.addr:
                self._send(target.addr, [AssignmentMsg(item)], now, reliable=True)
        return outcome

    def publish_services(self, item: SignedServices, now: float) -> Offer:
        """Accept an operator's service file (from the admin API) and spread it."""
        return self._on_services(item, now)

    def _on_services(self, item: SignedServices, now: float) -> Offer:
        outcome = self.services.offer(item, now)
        if not outcome.accepted:
            self._drop(f"services_{outcome.value}")
        elif outcome == Offer.NEW:
            # Each member forwards a new file once, to a few peers over streams: epidemic
            # spread in O(log N) hops; anti-entropy (ServicesRank) catches whoever it missed.
            fanout = self.config.gossip_fanout
            for m in self.members.random_reachable(fanout, exclude=(self._sender,)):
                self._send(m.addr, [ServicesMsg(item)], now, reliable=True)
        return outcome

    def _on_services_rank(self, sender: str, msg: ServicesRank, now: float) -> None:
        addr = self._reply_addr(sender, None)
        if not addr:
            return
        if self.services.newer_than(msg.rank):
            assert self.services.current is not None
            self._send(addr, [ServicesMsg(self.services.current)], now, reliable=True)
        elif msg.rank is not None and (self.services.rank is None or msg.rank > self.services.rank):
            self._send(addr, [ServicesWant()], now, reliable=True)

    def _on_services_want(self, sender: str, now: float) -> None:
        addr = self._reply_addr(sender, None)
        if addr and self.services.current is not None:
            self._send(addr, [ServicesMsg(self.services.current)], now, reliable=True)

    def _load_direct(self) -> bool:
        return self.members.live_count() <= self.config.load_direct_max_members

    def ingest(self, messages: Iterable[Message], now: float) -> None:
        """Apply records as if they arrived by anti-entropy (not re-gossiped).

        Used to pre-load state in simulations and tests without a network exchange.
        """
        self._spread = False
        self._sender = self.self_id
        self._handle_packet(Packet(self.self_id, 0, int(now * 1000), tuple(messages)), now, None)
        self._spread = True

    def adopt(self, source: MeshCore, now: float) -> None:
        """Start from what another core in this process knows, as if one anti-entropy
        exchange had taught it to us (nothing is re-gossiped): its registry but its own entry,
        its member view but ourselves. Loads and assignments are not taken.

        For simulations of a formed cluster: N cores adopting one core that ingested
        everyone's records share the entries (verified once, by that core) and the member
        records (copied on first write), instead of each holding and checking N of each.
        """
        self.registry.adopt(source.registry, exclude=(source.self_id,))
        self.members.adopt(source.members)
        # Our timers are set for the cluster we now know, at a random phase as in a cluster
        # that has been running a while, not for the empty table we were built with (whose
        # first sync comes early, as a joining node's must).
        self._next_sync_at = now + self._sync_interval() * self.rng.uniform(0.05, 1.0)
        self._next_reconnect_at = now + self._reconnect_interval() * self.rng.uniform(0.05, 1.0)

    def own_records(self) -> list[Message]:
        """Our signed entry and liveness record, as a peer would receive them."""
        return [EntryMsg(self.self_entry), self.alive]

    def liveness(self, sid: str) -> Liveness | None:
        if sid == self.self_id:
            return Liveness.LEFT if self.left else Liveness.ALIVE
        return self.members.status(sid)

    def standing(self, sid: str, state: State) -> Standing:
        """The standing (``schema.standing``) of session ``sid`` whose entry is in ``state``,
        by this node's liveness view. Our own session counts as a probed member, alive until
        we leave; another is probed while it is a member with a gossip address."""
        if sid == self.self_id:
            return standing(state, Liveness.LEFT if self.left else Liveness.ALIVE, probed=True)
        m = self.members.get(sid)
        if m is None:
            return standing(state, None, probed=False)
        return standing(state, m.status, probed=bool(m.addr))

    def standing_of(self, entry: SignedEntry) -> Standing:
        return self.standing(entry.session_id, entry.body.state)

    def entries(self, at_least: Standing) -> Iterator[SignedEntry]:
        """The registry's entries whose standing is ``at_least`` or higher, in its order."""
        for entry in self.registry:
            if self.standing(entry.session_id, entry.body.state) >= at_least:
                yield entry

    def take_outbound(self) -> list[Outbound]:
        out, self._out = self._out, []
        return out

    def next_deadline(self) -> float:
        if self.left:
            # tick() only runs gossip rounds once we left; the other timers are frozen in the
            # past and would make the shell spin.
            return self._next_gossip_at
        t = min(
            self._next_probe_at,
            self._next_sync_at,
            self._next_gc_at,
            self._refresh_at,
            self._next_reconnect_at,
        )
        if (len(self.broadcasts) or len(self.load_broadcasts)) and self._next_gossip_at < t:
            t = self._next_gossip_at
        for p in self._probes.values():
            due = p.end if p.indirect_sent or p.acked else p.direct_deadline
            if due < t:
                t = due
        s = self.members.next_suspicion_deadline()
        if s is not None and s < t:
            t = s
        if self._seeds and self._next_seed_at < t and self._isolated():
            t = self._next_seed_at
        return t

    def statistics(self) -> MeshStatistics:
        counts = {lv.label: 0 for lv in Liveness}
        for m in self.members.members.values():
            counts[m.status.label] += 1
        rs = self.registry.statistics()
        return MeshStatistics(
            members=counts,
            registry_entries=rs.entries,
            tombstones=rs.tombstones,
            packets_in=self.packets_in,
            packets_out=self.packets_out,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            dropped=dict(self.stats_dropped),
            broadcast_queue=len(self.broadcasts),
            load_queue=len(self.load_broadcasts),
            incarnation=self.incarnation,
            merges=rs.merges,
            assignments=len(self.assignments),
        )

    # == receiving ===============================================================================

    def receive(
        self, data: bytes, now: float, source: str | None = None, *, stream: bool = False
    ) -> None:
        """Handle one sealed packet. Never raises on bad input: it is dropped and counted.

        ``stream``: it came over a reliable stream (anti-entropy). What it teaches us for the
        first time is not re-gossiped (the peer had it, so gossip spread it before; re-gossiping
        a whole state transfer is what makes bootstrap storms). What it *changes* about a
        record we already held is re-gossiped: that is how news crosses a healed partition.
        """
        self.packets_in += 1
        self.bytes_in += len(data)
        try:
            plaintext = self.keyring.open(data)
            packet, unknown = decode_packet(plaintext, max_bytes=self.config.max_stream_bytes)
        except WireError as exc:
            self._drop(type(exc).__name__)
            return
        if unknown:
            self._drop("unknown_message", unknown)
        if packet.sender == self.self_id:
            self._drop("own_packet")
            return
        nonce = data[HEADER_BYTES : HEADER_BYTES + NONCE_BYTES]
        why = self.replay.accept(nonce, packet.sent_at_ms, now)
        if why is not None:
            self._drop(why)
            return
        self._spread = not stream
        self._sender = packet.sender
        self._handle_packet(packet, now, source)

    def _handle_packet(self, packet: Packet, now: float, source: str | None) -> None:
        # Records first, so that probes and sync logic see the newest view of the sender.
        for msg in packet.messages:
            if isinstance(msg, EntryMsg):
                self._on_entry(msg.entry, now)
            elif isinstance(msg, Alive):
                self._on_alive(msg, now)
            elif isinstance(msg, Accusation):
                self._on_accusation(msg, now)
            elif isinstance(msg, Load):
                self._on_load(msg, now)
            elif isinstance(msg, AssignmentMsg):
                self._on_assignment(msg.assignment, now)
            elif isinstance(msg, ServicesMsg):
                self._on_services(msg.services, now)
        for msg in packet.messages:
            if isinstance(msg, Ping):
                self._on_ping(packet.sender, msg, now, source)
            elif isinstance(msg, Ack):
                self._on_ack(packet.sender, msg, now)
            elif isinstance(msg, PingReq):
                self._on_ping_req(packet.sender, msg, now)
            elif isinstance(msg, SyncRequest):
                self._on_sync_request(packet.sender, msg, now)
            elif isinstance(msg, SyncReply):
                self._on_sync_reply(packet.sender, msg, now)
            elif isinstance(msg, ServicesRank):
                self._on_services_rank(packet.sender, msg, now)
            elif isinstance(msg, ServicesWant):
                self._on_services_want(packet.sender, now)

    def _on_entry(self, entry: SignedEntry, now: float) -> None:
        sid = entry.session_id
        if sid == self.self_id:
            if entry.rank > self.self_entry.rank:
                self._drop("foreign_self_entry")  # a valid signature would need our key
            return
        outcome = self.registry.merge(entry, now)
        if outcome == MergeOutcome.COLLECTED:
            self._forget(sid)
            return
        if outcome in (MergeOutcome.INVALID, MergeOutcome.EXPIRED):
            self._drop(f"entry_{outcome.value}")
            return
        if not outcome.changed:
            return
        # Over a stream, a record learned for the first time is not re-gossiped (module
        # docstring) unless its owner sent it: a joining node's bootstrap sync carries its own
        # entry, which the seed is the first to hear and must pass on.
        if self._spread or outcome == MergeOutcome.UPDATED or sid == self._sender:
            self.broadcasts.put(("entry", sid), EntryMsg(entry))
        if entry.body.state == State.LEFT:
            self.members.mark_left(sid, now)
            self.loads.pop(sid, None)
        else:
            self.members.learn_address(sid, entry.body.addresses.gossip, now)

    def _on_assignment(self, item: SignedAssignment, now: float) -> Offer:
        outcome = self.assignments.offer(item, now)
        if not outcome.accepted:
            self._drop(f"assignment_{outcome.value}")
        elif outcome == Offer.NEW and self._spread:
            self.broadcasts.put(("assign", item.target), AssignmentMsg(item))
            self._next_gossip_at = min(self._next_gossip_at, now)
        return outcome

    def _pending_assignments(self) -> list[Message]:
        """Assignments whose target has not started serving: carried by every sync exchange,
        so one that gossip lost still reaches its target (they are few and small)."""
        out: list[Message] = []
        for item in self.assignments:
            entry = self.registry.get(item.target)
            if entry is None or entry.body.state == State.JOIN:
                out.append(AssignmentMsg(item))
        return out

    def _assignment_gone(self, target: str) -> bool:
        entry = self.registry.get(target)
        if entry is None:
            return self.registry.is_tombstoned(target)
        return entry.body.state >= State.DOWN

    def _on_alive(self, rec: Alive, now: float) -> None:
        if rec.session_id == self.self_id:
            return
        m = self.members.get(rec.session_id)
        if m is not None and m.alive_record is not None and rec.incarnation <= m.incarnation:
            return  # old news: skip the signature check
        if self.registry.is_tombstoned(rec.session_id) or self._has_left(rec.session_id):
            return  # a session that left never comes back, whatever liveness news arrives
        if not rec.verify(self.verifier):
            self._drop("bad_signature")
            return
        spread = self._spread or _has_liveness_record(m)
        if self.members.apply_alive(rec, now) == Change.UPDATED and spread:
            self.broadcasts.put(("live", rec.session_id), rec)

    def _on_accusation(self, rec: Accusation, now: float) -> None:
        m = self.members.get(rec.target)
        # Only the accused signs incarnations, so an accusation may only name one we have seen
        # it sign: otherwise any member could pin a node dead at an incarnation it can never
        # refute (e.g. 2**63 - 1).
        signed_inc = (
            self.incarnation
            if rec.target == self.self_id
            else (m.alive_record.incarnation if m is not None and m.alive_record is not None else 0)
        )
        if rec.incarnation > signed_inc:
            self._drop("accusation_unknown_incarnation")
            return
        if rec.target != self.self_id:
            if self.registry.is_tombstoned(rec.target) or self._has_left(rec.target):
                return
            if m is not None and (rec.incarnation < m.incarnation or m.status == Liveness.LEFT):
                return
            if (
                m is not None
                and rec.incarnation == m.incarnation
                and (
                    m.status == Liveness.DEAD
                    or (
                        m.status == Liveness.SUSPECT
                        and rec.kind == SUSPECT
                        and rec.accuser in m.accusers
                    )
                )
            ):
                return
        elif rec.incarnation < self.incarnation:
            return
        if not rec.verify(self.verifier):
            self._drop("bad_signature")
            return
        entry = self.registry.get(rec.target)
        hint = entry.body.addresses.gossip if entry else ""
        spread = self._spread or _has_liveness_record(m)
        change = self.members.apply_accusation(rec, now, hint)
        if change == Change.REFUTE:
            self._refute(rec.incarnation, now)
            accuser = self.members.get(rec.accuser)
            if accuser is not None and accuser.addr:
                # Straight to the accuser: across a healing partition our gossip targets
                # (members we believe alive) may not include anyone on its side.
                self._send(accuser.addr, [self.alive], now)
        elif change == Change.UPDATED and spread:
            self.broadcasts.put(("live", rec.target), rec)
        elif change == Change.CONFIRMED and self._spread:
            target = self.members.get(rec.target)
            if target is not None and len(target.accusers) <= self.config.expected_confirmations:
                self.broadcasts.put(("suspect", rec.target, rec.accuser), rec)

    def _on_load(self, rec: Load, now: float) -> None:
        if rec.session_id == self.self_id:
            return
        current = self.loads.get(rec.session_id)
        if current is not None and rec.seq <= current.seq:
            return
        entry = self.registry.get(rec.session_id)
        if entry is None or entry.body.state == State.LEFT:
            return  # load only for members we know
        self.loads[rec.session_id] = rec
        if self._spread and not self._load_direct():
            self.load_broadcasts.put(("load", rec.session_id), rec)

    def _has_left(self, sid: str) -> bool:
        entry = self.registry.get(sid)
        return entry is not None and entry.body.state == State.LEFT

    def _refute(self, accused_incarnation: int, now: float) -> None:
        if self.left:
            return
        self.incarnation = max(self.incarnation, accused_incarnation) + 1
        self.alive = Alive.make(self.identity, self.incarnation, self.gossip_addr)
        self.broadcasts.put(("live", self.self_id), self.alive)

    # -- probes -------------------------------------------------------------------------------

    def _reply_addr(self, sender: str, source: str | None) -> str | None:
        m = self.members.get(sender)
        if m is not None and m.addr:
            return m.addr
        return source

    def _on_ping(self, sender: str, msg: Ping, now: float, source: str | None) -> None:
        if msg.target != self.self_id:
            self._drop("ping_for_other")
            return
        if msg.suspected:
            self._refute(self.incarnation, now)
        addr = self._reply_addr(sender, source)
        if addr:
            self._send(addr, [Ack(msg.probe_id, self.self_id), self.alive], now, piggyback=True)

    def _on_ack(self, sender: str, msg: Ack, now: float) -> None:
        probe = self._probes.get(msg.probe_id)
        if probe is not None and probe.target == msg.target:
            probe.acked = True
            if probe.confirm:
                self.members.clear_suspicion(probe.target, now)
            return
        relay = self._relays.pop(msg.probe_id, None)
        if relay is not None and relay[2] == msg.target:
            requester, orig_id, target, _ = relay
            addr = self._reply_addr(requester, None)
            if addr:
                self._send(addr, [Ack(orig_id, target)], now)

    def _on_ping_req(self, sender: str, msg: PingReq, now: float) -> None:
        if msg.target == self.self_id:
            return
        # Probed only for members, at the address we know for the target (not the one the
        # request names): nobody can make us send probes to an address of their choosing.
        requester, target = self.members.get(sender), self.members.get(msg.target)
        if requester is None or target is None or not target.addr:
            self._drop("ping_req_not_member")
            return
        cfg = self.config
        if now >= self._relay_window_end:
            self._relayed.clear()
            self._relayed_total = 0
            self._relay_window_end = now + cfg.probe_interval_s
        made = self._relayed.get(sender, 0)
        if made >= cfg.relay_per_sender or self._relayed_total >= cfg.relay_per_interval:
            self._drop("ping_req_limited")
            return
        self._relayed[sender] = made + 1
        self._relayed_total += 1
        self._probe_seq += 1
        self._relays[self._probe_seq] = (
            sender,
            msg.probe_id,
            msg.target,
            now + cfg.relay_timeout_s,
        )
        self._send(target.addr, [Ping(self._probe_seq, msg.target)], now)

    def _start_probe(self, target: str, addr: str, now: float, *, confirm: bool) -> None:
        cfg = self.config
        self._probe_seq += 1
        pid = self._probe_seq
        suspected = self.members.status(target) == Liveness.SUSPECT
        self._probes[pid] = _Probe(
            pid, target, addr, confirm, now + cfg.probe_timeout_s, now + cfg.probe_interval_s
        )
        self._send(addr, [Ping(pid, target, suspected)], now, piggyback=True)

    def _probe_timers(self, now: float) -> None:
        cfg = self.config
        for pid, p in list(self._probes.items()):
            if p.acked:
                del self._probes[pid]
                continue
            if not p.indirect_sent and now >= p.direct_deadline:
                p.indirect_sent = True
                suspected = self.members.status(p.target) == Liveness.SUSPECT
                self._send(p.addr, [Ping(pid, p.target, suspected)], now)
                for relay in self.members.random_reachable(
                    cfg.indirect_probes, exclude=(p.target,)
                ):
                    self._send(relay.addr, [PingReq(pid, p.target, p.addr)], now)
            if now >= p.end:
                del self._probes[pid]
                self._probe_failed(p, now)
        for rid in [r for r, v in self._relays.items() if now >= v[3]]:
            del self._relays[rid]

    def _probe_failed(self, p: _Probe, now: float) -> None:
        m = self.members.get(p.target)
        if m is None or m.status in (Liveness.DEAD, Liveness.LEFT):
            return
        if p.confirm:
            if m.status == Liveness.SUSPECT:
                self._accuse(DEAD, m.session_id, m.incarnation, now)
            return
        if self.self_id in m.accusers:
            return
        self._accuse(SUSPECT, m.session_id, m.incarnation, now)

    def _accuse(self, kind: int, target: str, incarnation: int, now: float) -> None:
        rec = Accusation.make(self.identity, kind, target, incarnation)
        change = self.members.apply_accusation(rec, now)
        if change == Change.NONE:
            return
        key: tuple[str, ...] = (
            ("live", target) if change == Change.UPDATED else ("suspect", target, self.self_id)
        )
        self.broadcasts.put(key, rec)
        m = self.members.get(target)
        if kind == SUSPECT and m is not None and m.addr:
            # Tell the suspect at once so it can refute before timers run out.
            self._send(m.addr, [rec], now)

    # -- anti-entropy -------------------------------------------------------------------------

    def _rows(self) -> list[SyncRow]:
        """One row per session we know of: entry rank (or zeros) and liveness order key."""
        members = self.members.members
        rows: list[SyncRow] = []
        append = rows.append
        matched = 0
        alive, codes = Liveness.ALIVE, _STATUS_SYNC_CODE  # as Member.sync_code, inlined
        for entries in (self.registry.tombstones(), self.registry):
            for e in entries:
                sid = e.session_id
                state, version, digest = e.rank
                m = members.get(sid)
                if m is None:
                    append((sid, state, version, digest, 0, NO_RECORD))
                    continue
                matched += 1
                status = m.status
                code = NO_RECORD if status == alive and m.alive_record is None else codes[status]
                append((sid, state, version, digest, m.incarnation, code))
        if matched < len(members):  # members known only from liveness records
            registry = self.registry
            for sid, m in members.items():
                if sid not in registry and not registry.is_tombstoned(sid):
                    append((sid, 0, 0, b"", m.incarnation, m.sync_code))
        for i, row in enumerate(rows):
            if row[0] == self.self_id:
                rows[i] = (*row[:4], self.incarnation, 0)
                break
        else:
            rows.append((self.self_id, 0, 0, b"", self.incarnation, 0))
        return rows

    def _records_for(self, sid: str) -> list[Message]:
        out: list[Message] = []
        entry = self.registry.get(sid) or self.registry.tombstone(sid)
        if entry is not None:
            out.append(EntryMsg(entry))
        if sid == self.self_id:
            out.append(self.alive)
        else:
            m = self.members.get(sid)
            if m is not None:
                if m.alive_record is not None and m.status != Liveness.ALIVE:
                    out.append(m.alive_record)  # carries the address
                rec = m.liveness_record()
                if rec is not None:
                    out.append(rec)
        load = self.loads.get(sid)
        if load is not None:
            out.append(load)
        return out

    def _start_sync(self, addr: str, now: float) -> None:
        self._send(
            addr,
            [
                EntryMsg(self.self_entry),
                self.alive,
                *self._pending_assignments(),
                ServicesRank(self.services.rank),
                SyncRequest(tuple(self._rows())),
            ],
            now,
            reliable=True,
        )

    def _on_sync_request(self, sender: str, msg: SyncRequest, now: float) -> None:
        addr = self._reply_addr(sender, None)
        if not addr:
            self._drop("sync_from_unknown")
            return
        theirs = {r[0]: r for r in msg.rows}
        records: list[Message] = []
        want: list[str] = []
        for row in self._rows():
            sid = row[0]
            other = theirs.pop(sid, None)
            if other == row:
                continue  # the common case: both sides agree
            if other is None:
                records.extend(self._records_for(sid))
                continue
            mine_rank, their_rank = row[1:4], other[1:4]
            mine_live, their_live = _live_key(row), _live_key(other)
            if mine_rank > their_rank or mine_live > their_live:
                records.extend(self._records_for(sid))
            if their_rank > mine_rank or their_live > mine_live:
                want.append(sid)
        for sid, _ in theirs.items():
            if not self.registry.is_tombstoned(sid):
                want.append(sid)
        records.extend(self._pending_assignments())
        self._send(addr, [*records, SyncReply(tuple(want))], now, reliable=True)

    def _on_sync_reply(self, sender: str, msg: SyncReply, now: float) -> None:
        addr = self._reply_addr(sender, None)
        if not addr or not msg.want:
            return
        records: list[Message] = []
        for sid in msg.want:
            records.extend(self._records_for(sid))
        if records:
            self._send(addr, records, now, reliable=True)

    def _sync_scale(self) -> float:
        """How much anti-entropy slows down with the cluster size N: a digest is one row per
        member, so 1 up to 32 members, then ceil(log2(N/32)) + 1 (10 at N = 10,000)."""
        n = self.members.live_count()
        return max(1.0, math.ceil(math.log2(n / 32)) + 1) if n > 32 else 1.0

    def _sync_interval(self) -> float:
        return self.config.sync_interval_s * self._sync_scale()

    def _reconnect_interval(self) -> float:
        # A reconnect carries the same full digest as a sync, so it scales the same way: a
        # healed partition is still found quickly, as N nodes each try a random dead member.
        return self.config.reconnect_interval_s * self._sync_scale()

    # == timers ==================================================================================

    def tick(self, now: float) -> None:
        cfg = self.config
        if self.left:
            self._gossip_round(now) if now >= self._next_gossip_at else None
            return
        self._probe_timers(now)
        for suspect in self.members.expired_suspicions(now):
            # Without an address we cannot confirm: wait for an obituary.
            m = self.members.start_confirming(suspect)
            if m.addr:
                self._start_probe(m.session_id, m.addr, now, confirm=True)
        if now >= self._next_probe_at:
            self._next_probe_at = max(self._next_probe_at + cfg.probe_interval_s, now)
            target = self.members.next_probe_target()
            if target is not None:
                self._start_probe(target.session_id, target.addr, now, confirm=False)
        if now >= self._next_gossip_at:
            self._gossip_round(now)
        if now >= self._next_sync_at:
            self._next_sync_at = now + self._sync_interval() * self.rng.uniform(0.75, 1.25)
            peers = self.members.random_reachable(1)
            if peers:
                self._start_sync(peers[0].addr, now)
        if now >= self._next_reconnect_at:
            dead = self.members.dead_members()
            # One attempt per interval while some member is believed dead. Until then, look
            # again at a random point of the next interval: agents started together (a job
            # array) then spread their attempts over it from the first, and a healed cut is
            # found at the cluster's full rate of attempts (N per interval), not in a clump.
            jitter = self.rng.uniform(0.75, 1.25) if dead else self.rng.uniform(0.05, 1.0)
            self._next_reconnect_at = now + self._reconnect_interval() * jitter
            if dead:
                self._start_sync(self.rng.choice(dead).addr, now)
        if self._seeds and self._isolated() and now >= self._next_seed_at:
            self._next_seed_at = now + cfg.seed_retry_s
            for addr in self._seeds:
                self._start_sync(addr, now)
        if now >= self._refresh_at:
            self.update_self(now)
        if self._my_load is not None and now >= self._next_load_at:
            mine = self._my_load
            self.publish_load(
                now,
                waiting=mine.waiting,
                running=mine.running,
                kv_usage=mine.kv_usage,
                inflight=mine.inflight,
            )
        if now >= self._next_gc_at:
            self._gc(now)

    def _gossip_round(self, now: float) -> None:
        self._next_gossip_at = now + self.config.gossip_interval_s
        if not len(self.broadcasts) and not len(self.load_broadcasts):
            return
        targets = self.members.random_reachable(self.config.gossip_fanout)
        for m in targets:
            self._send(m.addr, [], now, piggyback=True)

    def _forget(self, sid: str) -> None:
        self.members.remove(sid)
        self.loads.pop(sid, None)
        self.broadcasts.discard(("entry", sid))
        self.broadcasts.discard(("live", sid))

    def _gc(self, now: float) -> None:
        for sid in self.registry.gc(now):
            self._forget(sid)
        for target in self.assignments.collect(now, self._assignment_gone):
            self.broadcasts.discard(("assign", target))
        hold = self.config.registry.terminal_hold_s
        if now >= self._next_member_sweep_at:
            # Members known only from liveness records (no entry ever arrived) and long dead.
            self._next_member_sweep_at = now + 10.0
            for m in self.members.down_members():
                if m.session_id not in self.registry and now - m.since > hold:
                    self.members.remove(m.session_id)
        due = self.registry.next_gc_at()
        self._next_gc_at = min(now + 10.0, max(now + 0.1, due if due is not None else now + 10.0))

    def _isolated(self) -> bool:
        return not self.members.has_reachable()

    def _refresh_time(self, now: float) -> float:
        body = self.self_entry.body
        return now + max(1.0, (body.expires_at - now) / 2)

    def _queue_self(self, now: float) -> None:
        self.broadcasts.put(("entry", self.self_id), EntryMsg(self.self_entry))
        self.broadcasts.put(("live", self.self_id), self.alive)
        self._next_gossip_at = min(self._next_gossip_at, now)

    # == sending =================================================================================

    def _send(
        self,
        addr: str,
        messages: list[Message],
        now: float,
        *,
        reliable: bool = False,
        piggyback: bool = False,
    ) -> None:
        if reliable and len(messages) > MAX_FRAME_MESSAGES:
            # A state transfer to a newcomer holds about two records per member: split it into
            # frames the receiver's decoder accepts (wire.MAX_MESSAGES per packet). Order across
            # frames does not matter: every record is a CRDT merge, the want list is a request.
            for i in range(0, len(messages), MAX_FRAME_MESSAGES):
                self._send(addr, messages[i : i + MAX_FRAME_MESSAGES], now, reliable=True)
            return
        msgs = list(messages)
        if piggyback:
            used = sum(len(b) for b in encode_messages(msgs))
            budget = self.config.max_datagram_bytes - SEAL_OVERHEAD - PACKET_ENVELOPE_BYTES - used
            extra, extra_bytes = self.broadcasts.take(
                budget, self._transmit_limit(self.config.retransmit_mult)
            )
            loads, _ = self.load_broadcasts.take(
                budget - extra_bytes, self._transmit_limit(self.config.load_retransmit_mult)
            )
            msgs.extend(extra)
            msgs.extend(loads)
            if not msgs:
                return
        self._seq += 1
        packet = Packet(self.self_id, self._seq, int(now * 1000), tuple(msgs))
        data = self.keyring.seal(encode_packet(packet))
        self.packets_out += 1
        self.bytes_out += len(data)
        self._out.append(Outbound(addr, data, reliable))

    def _transmit_limit(self, mult: int) -> int:
        """Transmissions before a record retires: ``mult * ceil(log10(N + 1))``."""
        return mult * max(1, math.ceil(math.log10(self.members.live_count() + 1)))

    def _drop(self, reason: str, count: int = 1) -> None:
        self.stats_dropped[reason] = self.stats_dropped.get(reason, 0) + count

    def count_dropped(self, reason: str) -> None:
        """Count an input the shell dropped (``fabric_gossip_dropped_total{reason}``)."""
        self._drop(reason)


def _has_liveness_record(m: Member | None) -> bool:
    """Whether we held a liveness record for ``m`` (not just an address from its entry)."""
    return m is not None and (m.alive_record is not None or m.accusation is not None)


_STATUS_SYNC_CODE = (0, 1, 2, 2)  # ALIVE, SUSPECT, DEAD, LEFT (as Member.sync_code)


def _live_key(row: SyncRow) -> tuple[int, int]:
    inc, code = row[4], row[5]
    return (-1, 0) if code == 3 else (inc, code)


def _lease_cap(labels: tuple[tuple[str, str], ...]) -> float:
    """The end of the Slurm job an entry belongs to (its lease never goes past it)."""
    cap = dict(labels).get(JOB_END_LABEL)
    try:
        return float(cap) if cap else math.inf
    except ValueError:
        return math.inf
