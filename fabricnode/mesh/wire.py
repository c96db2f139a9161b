"""Gossip wire format: versioned msgpack packets, strictly decoded, sealed with the cluster key.

A packet (the plaintext inside one sealed datagram or one stream frame) is::

    [WIRE_VERSION, sender session id, seq, sent_at_ms, [message, ...]]

and each message is an array whose first element is its tag. Several messages share a packet:
a probe carries piggybacked gossip, a sync reply carries the records the peer lacks.

``seq`` is a per-session counter. Together with ``sent_at_ms`` it lets ``ReplayGuard`` drop
packets that are stale (older than the allowed clock skew) or replayed (a seq seen before). A
replay could do no harm to the CRDTs anyway (they ignore what is not newer), but dropping it
early saves the work and keeps probes honest (a replayed ACK cannot fake liveness).

Decoding never raises anything but ``DecodeError``; unknown message tags are skipped (a newer
peer may send kinds this version does not know) and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fabricnode.errors import DecodeError
from fabricnode.mesh import codec
from fabricnode.mesh.assignment import SignedAssignment
from fabricnode.mesh.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    Verifier,
    canonical,
    session_id_for,
)
from fabricnode.mesh.registry import SignedEntry
from fabricnode.mesh.servicedoc import DIGEST_PREFIX, Rank, SignedServices

WIRE_VERSION = 1
ALIVE_DOMAIN = b"fabric/alive/v1"
ACCUSE_DOMAIN = b"fabric/accuse/v1"
MAX_MESSAGES = 4096
MAX_ADDR = 300
SID_LEN = 32


def take_sid(value: Any, what: str = "session id") -> str:
    sid = codec.take_str(value, max_len=SID_LEN, what=what)
    if len(sid) != SID_LEN:
        raise DecodeError(f"{what}: wrong length")
    return sid


# -- probe messages (unsigned; the AEAD proves a cluster member sent them) --------------------


@dataclass(frozen=True)
class Ping:
    TAG = 1
    probe_id: int
    target: str
    suspected: bool = False  # "I suspect you": the target refutes at once

    def to_wire(self) -> list[object]:
        return [self.TAG, self.probe_id, self.target, self.suspected]


@dataclass(frozen=True)
class Ack:
    TAG = 2
    probe_id: int
    target: str  # whose liveness this acknowledges (may be relayed by another member)

    def to_wire(self) -> list[object]:
        return [self.TAG, self.probe_id, self.target]


@dataclass(frozen=True)
class PingReq:
    TAG = 3
    probe_id: int
    target: str
    target_addr: str

    def to_wire(self) -> list[object]:
        return [self.TAG, self.probe_id, self.target, self.target_addr]


# -- replicated records ------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryMsg:
    TAG = 4
    entry: SignedEntry

    def to_wire(self) -> list[object]:
        return [self.TAG, *self.entry.to_wire()]


@dataclass(frozen=True)
class Alive:
    """Owner-signed: "session S is alive at incarnation I and listens for gossip at A"."""

    TAG = 5
    session_id: str
    public_key: bytes
    incarnation: int
    gossip_addr: str
    signature: bytes

    @staticmethod
    def message(session_id: str, incarnation: int, gossip_addr: str) -> bytes:
        return canonical(ALIVE_DOMAIN, session_id, incarnation, gossip_addr)

    @classmethod
    def make(cls, identity: Identity, incarnation: int, gossip_addr: str) -> Alive:
        sig = identity.sign(cls.message(identity.session_id, incarnation, gossip_addr))
        return cls(identity.session_id, identity.public_key, incarnation, gossip_addr, sig)

    def verify(self, verifier: Verifier) -> bool:
        return session_id_for(self.public_key) == self.session_id and verifier.verify(
            self.public_key,
            self.message(self.session_id, self.incarnation, self.gossip_addr),
            self.signature,
        )

    def to_wire(self) -> list[object]:
        return [
            self.TAG,
            self.session_id,
            self.public_key,
            self.incarnation,
            self.gossip_addr,
            self.signature,
        ]


SUSPECT = 0
DEAD = 1


@dataclass(frozen=True)
class Accusation:
    """Accuser-signed: "I (accuser) hold session T suspect/dead at incarnation I".

    A crashed node cannot sign its own death, so its death is an accusation signed by the member
    that confirmed it. Only the accused can overturn it, by signing ``Alive`` with a higher
    incarnation.
    """

    TAG = 6
    kind: int  # SUSPECT or DEAD
    target: str
    incarnation: int
    accuser: str
    accuser_key: bytes
    signature: bytes

    @staticmethod
    def message(kind: int, target: str, incarnation: int, accuser: str) -> bytes:
        return canonical(ACCUSE_DOMAIN, kind, target, incarnation, accuser)

    @classmethod
    def make(cls, identity: Identity, kind: int, target: str, incarnation: int) -> Accusation:
        sig = identity.sign(cls.message(kind, target, incarnation, identity.session_id))
        return cls(kind, target, incarnation, identity.session_id, identity.public_key, sig)

    def verify(self, verifier: Verifier) -> bool:
        return session_id_for(self.accuser_key) == self.accuser and verifier.verify(
            self.accuser_key,
            self.message(self.kind, self.target, self.incarnation, self.accuser),
            self.signature,
        )

    def to_wire(self) -> list[object]:
        return [
            self.TAG,
            self.kind,
            self.target,
            self.incarnation,
            self.accuser,
            self.accuser_key,
            self.signature,
        ]


@dataclass(frozen=True)
class Load:
    """Engine load of one node: frequent, unsigned, protected by the cluster AEAD only."""

    TAG = 7
    session_id: str
    seq: int
    waiting: int
    running: int
    kv_usage: float
    inflight: int
    at: float

    def to_wire(self) -> list[object]:
        return [
            self.TAG,
            self.session_id,
            self.seq,
            self.waiting,
            self.running,
            self.kv_usage,
            self.inflight,
            self.at,
        ]


@dataclass(frozen=True)
class AssignmentMsg:
    """An operator-signed engine assignment (``fabricnode.mesh.assignment``)."""

    TAG = 10
    assignment: SignedAssignment

    def to_wire(self) -> list[object]:
        return [self.TAG, *self.assignment.to_wire()]


@dataclass(frozen=True)
class ServicesMsg:
    """The operator-signed service file (``fabricnode.mesh.servicedoc``)."""

    TAG = 11
    services: SignedServices

    def to_wire(self) -> list[object]:
        return [self.TAG, *self.services.to_wire()]


@dataclass(frozen=True)
class ServicesRank:
    """The rank of the service file the sender holds (None: none); rides sync requests."""

    TAG = 12
    rank: Rank | None

    def to_wire(self) -> list[object]:
        if self.rank is None:
            return [self.TAG]
        return [self.TAG, self.rank[0], self.rank[1]]


@dataclass(frozen=True)
class ServicesWant:
    """ "Your service file is newer than mine: send it"."""

    TAG = 13

    def to_wire(self) -> list[object]:
        return [self.TAG]


# -- anti-entropy ------------------------------------------------------------------------------

# One row per member: [sid, state, version, digest(8), incarnation, liveness code]
SyncRow = tuple[str, int, int, bytes, int, int]


@dataclass(frozen=True)
class SyncRequest:
    TAG = 8
    rows: tuple[SyncRow, ...]

    def to_wire(self) -> list[object]:
        return [self.TAG, self.rows]  # msgpack packs tuples as arrays


@dataclass(frozen=True)
class SyncReply:
    """Sent with the records the requester lacks; ``want`` names what the replier lacks."""

    TAG = 9
    want: tuple[str, ...]

    def to_wire(self) -> list[object]:
        return [self.TAG, list(self.want)]


Message = (
    Ping
    | Ack
    | PingReq
    | EntryMsg
    | Alive
    | Accusation
    | Load
    | SyncRequest
    | SyncReply
    | AssignmentMsg
    | ServicesMsg
    | ServicesRank
    | ServicesWant
)


@dataclass(frozen=True)
class Packet:
    sender: str
    seq: int
    sent_at_ms: int
    messages: tuple[Message, ...]


def encode_packet(packet: Packet) -> bytes:
    return codec.pack(
        [
            WIRE_VERSION,
            packet.sender,
            packet.seq,
            packet.sent_at_ms,
            [m.to_wire() for m in packet.messages],
        ]
    )


def encode_messages(messages: list[Message] | tuple[Message, ...]) -> list[bytes]:
    """Each message's encoded size contributor (used to fill datagrams up to a budget)."""
    return [codec.pack(m.to_wire()) for m in messages]


def decode_packet(data: bytes, *, max_bytes: int = codec.MAX_PACKET_BYTES) -> tuple[Packet, int]:
    """Decode a packet; returns it and the number of messages skipped as unknown."""
    obj = codec.unpack(data, max_bytes=max_bytes, max_items=65536)
    top = codec.take_list(obj, min_len=5, max_len=5, what="packet")
    version = top[0]
    if isinstance(version, bool) or not isinstance(version, int) or version != WIRE_VERSION:
        raise DecodeError(f"unsupported wire version {version!r}")
    sender = take_sid(top[1], "sender")
    seq = codec.take_int(top[2], what="seq")
    sent_at_ms = codec.take_int(top[3], what="sent_at")
    messages: list[Message] = []
    unknown = 0
    for raw in codec.take_list(top[4], max_len=MAX_MESSAGES, what="messages"):
        msg = _decode_message(raw)
        if msg is None:
            unknown += 1
        else:
            messages.append(msg)
    return Packet(sender, seq, sent_at_ms, tuple(messages)), unknown


def _decode_message(raw: Any) -> Message | None:
    fields = codec.take_list(raw, min_len=1, max_len=65536, what="message")
    tag = codec.take_int(fields[0], hi=255, what="message tag")
    n = len(fields)
    if tag == Ping.TAG and n == 4:
        if not isinstance(fields[3], bool):
            raise DecodeError("ping: suspected flag")
        return Ping(codec.take_int(fields[1], what="probe id"), take_sid(fields[2]), fields[3])
    if tag == Ack.TAG and n == 3:
        return Ack(codec.take_int(fields[1], what="probe id"), take_sid(fields[2]))
    if tag == PingReq.TAG and n == 4:
        return PingReq(
            codec.take_int(fields[1], what="probe id"),
            take_sid(fields[2]),
            codec.take_addr(fields[3], max_len=MAX_ADDR, what="address"),
        )
    if tag == EntryMsg.TAG and n == 3:
        return EntryMsg(SignedEntry.from_wire(fields[1:]))
    if tag == Alive.TAG and n == 6:
        return Alive(
            take_sid(fields[1]),
            codec.take_bytes(fields[2], size=PUBLIC_KEY_BYTES, what="public key"),
            codec.take_int(fields[3], what="incarnation"),
            codec.take_addr(fields[4], max_len=MAX_ADDR, what="address"),
            codec.take_bytes(fields[5], size=SIGNATURE_BYTES, what="signature"),
        )
    if tag == Accusation.TAG and n == 7:
        return Accusation(
            codec.take_int(fields[1], hi=DEAD, what="accusation kind"),
            take_sid(fields[2]),
            codec.take_int(fields[3], what="incarnation"),
            take_sid(fields[4], "accuser"),
            codec.take_bytes(fields[5], size=PUBLIC_KEY_BYTES, what="accuser key"),
            codec.take_bytes(fields[6], size=SIGNATURE_BYTES, what="signature"),
        )
    if tag == Load.TAG and n == 8:
        return Load(
            take_sid(fields[1]),
            codec.take_int(fields[2], what="load seq"),
            codec.take_int(fields[3], hi=2**31, what="waiting"),
            codec.take_int(fields[4], hi=2**31, what="running"),
            codec.take_float(fields[5], hi=1.0, what="kv usage"),
            codec.take_int(fields[6], hi=2**31, what="inflight"),
            codec.take_float(fields[7], what="load time"),
        )
    if tag == SyncRequest.TAG and n == 2:
        return SyncRequest(
            tuple(map(_decode_row, codec.take_list(fields[1], max_len=65536, what="sync rows")))
        )
    if tag == SyncReply.TAG and n == 2:
        want = codec.take_list(fields[1], max_len=65536, what="want")
        return SyncReply(tuple(take_sid(s) for s in want))
    if tag == AssignmentMsg.TAG and n == 3:
        return AssignmentMsg(SignedAssignment.from_wire(fields[1:]))
    if tag == ServicesMsg.TAG and n == 3:
        return ServicesMsg(SignedServices.from_wire(fields[1:]))
    if tag == ServicesRank.TAG and n == 1:
        return ServicesRank(None)
    if tag == ServicesRank.TAG and n == 3:
        issued = codec.take_float(fields[1], what="services issued_at")
        return ServicesRank((issued, codec.take_bytes(fields[2], size=DIGEST_PREFIX, what="rank")))
    if tag == ServicesWant.TAG and n == 1:
        return ServicesWant()
    if tag in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13):
        raise DecodeError(f"message tag {tag} with {n} fields")
    return None


_MAX_INT = 2**63 - 1


def _decode_row(r: Any) -> SyncRow:
    # A digest holds a row per member, so the checks that codec.take_* make are inlined here
    # for the well-formed case (the same checks: exact types, no bools, the same bounds).
    if type(r) is list and len(r) == 6:
        sid, state, version, digest, inc, live = r
        if (
            type(sid) is str
            and len(sid) == SID_LEN
            and type(state) is int
            and 0 <= state <= 3
            and type(version) is int
            and 0 <= version <= _MAX_INT
            and type(digest) is bytes
            and len(digest) <= 8
            and type(inc) is int
            and 0 <= inc <= _MAX_INT
            and type(live) is int
            and 0 <= live <= 3
        ):
            return (sid, state, version, digest, inc, live)
    # Malformed: the field checks say exactly what is wrong (they raise DecodeError).
    sid, state, version, digest, inc, live = codec.take_list(
        r, min_len=6, max_len=6, what="sync row"
    )
    return (
        take_sid(sid),
        codec.take_int(state, hi=3, what="state"),
        codec.take_int(version, what="version"),
        codec.take_bytes(digest, max_len=8, what="digest"),
        codec.take_int(inc, what="incarnation"),
        codec.take_int(live, hi=3, what="liveness"),
    )


class ReplayGuard:
    """Drops stale and replayed packets.

    A packet is *stale* when its ``sent_at`` is further than ``max_skew_s`` from our clock, and
    a *replay* when its AEAD nonce (12 random bytes, authenticated with the packet) was seen
    before. Keying on the nonce rather than on the (unauthenticated) sender id and seq means
    one member cannot poison the window of another. A nonce need only be remembered for
    ``2 * max_skew_s``: past that, any copy of its packet is stale. Memory is bounded by
    ``capacity`` (oldest forgotten first); a forgotten packet that is replayed still has to be
    fresh, and the CRDTs make a repeated record harmless anyway.
    """

    def __init__(self, max_skew_s: float = 60.0, capacity: int = 1 << 16) -> None:
        self.max_skew_ms = int(max_skew_s * 1000)
        self.remember_s = 2 * max_skew_s
        self.capacity = capacity
        self._seen: dict[bytes, float] = {}  # nonce -> forget at (insertion order = time order)

    def __len__(self) -> int:
        return len(self._seen)

    def accept(self, packet_id: bytes, sent_at_ms: int, now: float) -> str | None:
        """None if the packet is fresh; otherwise why it must be dropped ("stale"/"replay")."""
        if abs(sent_at_ms - int(now * 1000)) > self.max_skew_ms:
            return "stale"
        seen = self._seen
        while seen:
            oldest = next(iter(seen))
            if seen[oldest] > now and len(seen) < self.capacity:
                break
            del seen[oldest]
        if packet_id in seen:
            return "replay"
        seen[packet_id] = now + self.remember_s
        return None
