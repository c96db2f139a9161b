"""Wire format: round trips of every message, strict bounded decoding, and the replay guard."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabricnode.addr import split_hostport
from fabricnode.errors import DecodeError
from fabricnode.mesh import codec
from fabricnode.mesh.identity import Identity, ProviderKey, Verifier
from fabricnode.mesh.registry import (
    ENTRY_DOMAIN,
    MAX_LABELS,
    Addresses,
    EngineInfo,
    EntryBody,
    Hardware,
    ModelInfo,
    State,
    parse_body,
)
from fabricnode.mesh.sites import DEFAULT_SITE, MAX_SITE_CHARS, SITE_LABEL, site_problem
from fabricnode.mesh.wire import (
    DEAD,
    MAX_MESSAGES,
    SUSPECT,
    WIRE_VERSION,
    Accusation,
    Ack,
    Alive,
    EntryMsg,
    Load,
    Message,
    Packet,
    Ping,
    PingReq,
    ReplayGuard,
    SyncReply,
    SyncRequest,
    decode_packet,
    encode_messages,
    encode_packet,
)

OWNER = Identity.from_seed(b"wire-owner")
SID = OWNER.session_id
OTHER_SID = Identity.from_seed(b"wire-other").session_id
T0 = 1_750_000_000.0

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ---------------------------------------------------------------------------------

sids = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)
u63 = st.integers(0, 2**63 - 1)
# Addresses as agents advertise them: an IP (v4 or bracketed v6) or a host name, and a port.
hosts = (
    st.ip_addresses(v=4).map(str)
    | st.ip_addresses(v=6).map(lambda ip: f"[{ip}]")
    | st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?(\.[a-z0-9]{1,10}){0,3}", fullmatch=True)
)
addrs = st.builds(
    lambda h, p: f"{h}:{p}",
    hosts.filter(lambda h: h not in ("0.0.0.0", "[::]")),
    st.integers(0, 65535),
)
urls = st.builds(lambda a: f"http://{a}", addrs)
keys32 = st.binary(min_size=32, max_size=32)
sigs64 = st.binary(min_size=64, max_size=64)
times = st.floats(min_value=0.0, max_value=1e18, allow_nan=False, allow_infinity=False)
counts = st.integers(0, 2**31)

pings = st.builds(Ping, u63, sids, st.booleans())
acks = st.builds(Ack, u63, sids)
ping_reqs = st.builds(PingReq, u63, sids, addrs)
alives = st.builds(Alive, sids, keys32, u63, addrs, sigs64)
accusations = st.builds(
    Accusation, st.sampled_from([SUSPECT, DEAD]), sids, u63, sids, keys32, sigs64
)
loads = st.builds(
    Load,
    sids,
    u63,
    counts,
    counts,
    st.floats(min_value=0.0, max_value=1.0),
    counts,
    times,
)
sync_rows = st.tuples(sids, st.integers(0, 3), u63, st.binary(max_size=8), u63, st.integers(0, 3))
sync_requests = st.builds(SyncRequest, st.lists(sync_rows, max_size=20).map(tuple))
sync_replies = st.builds(SyncReply, st.lists(sids, max_size=20).map(tuple))

# A model id is printable (every peer refuses one that is not: ``codec.take_printable``).
model_ids = st.text(min_size=1, max_size=256).filter(str.isprintable)
models = st.builds(
    ModelInfo,
    model_ids,
    st.none() | st.integers(0, 2**40),
    st.none() | st.text(max_size=64),
)
labels = st.tuples(
    st.text(min_size=1, max_size=64).filter(lambda k: k != SITE_LABEL), st.text(max_size=256)
)
# Site names as ``sites`` allows them (the default one most often: it costs no bytes).
site_names = st.just(DEFAULT_SITE) | st.from_regex(
    rf"[A-Za-z0-9]([A-Za-z0-9_-]{{0,{MAX_SITE_CHARS - 2}}}[A-Za-z0-9])?", fullmatch=True
)
PROVIDER_IDENTITY = Identity.from_seed(b"wire-provider")
certs = st.builds(
    lambda name, not_after: ProviderKey(name, PROVIDER_IDENTITY).certify(
        OWNER.public_key, not_after
    ),
    st.text(max_size=64),
    times,
)


@st.composite
def entry_bodies(draw: st.DrawFn) -> EntryBody:
    started = draw(times)
    updated = draw(st.floats(min_value=started, max_value=1e18))
    return EntryBody(
        session_id=SID,
        public_key=OWNER.public_key,
        state=draw(st.sampled_from(State)),
        version=draw(u63),
        provider=draw(st.text(max_size=64)),
        addresses=Addresses(draw(st.just("") | urls), draw(st.just("") | addrs)),
        hardware=Hardware(
            draw(st.text(max_size=64)),
            draw(st.integers(0, 4096)),
            draw(st.floats(min_value=0.0, max_value=1e6)),
            draw(st.text(max_size=255)),
        ),
        engine=EngineInfo(
            draw(st.text(max_size=64)), draw(st.text(max_size=64)), draw(st.just("") | urls)
        ),
        models=tuple(draw(st.lists(models, max_size=4))),
        labels=tuple(draw(st.lists(labels, max_size=4))),
        started_at=started,
        updated_at=updated,
        expires_at=draw(st.floats(min_value=updated, max_value=1e18)),
        provider_cert=draw(st.none() | certs),
        site=draw(site_names),
    )


entry_msgs = entry_bodies().map(lambda body: EntryMsg(body.sign(OWNER)))
messages: st.SearchStrategy[Message] = st.one_of(
    pings,
    acks,
    ping_reqs,
    alives,
    accusations,
    loads,
    sync_requests,
    sync_replies,
    entry_msgs,
)
packets = st.builds(Packet, sids, u63, u63, st.lists(messages, max_size=6).map(tuple))


def round_trip(msg: Message) -> Message:
    packet, unknown = decode_packet(encode_packet(Packet(SID, 1, 1000, (msg,))))
    assert unknown == 0
    assert packet.sender == SID and packet.seq == 1 and packet.sent_at_ms == 1000
    (decoded,) = packet.messages
    return decoded


# -- round trips --------------------------------------------------------------------------------


@FAST
@given(pings)
def test_ping_round_trips(msg: Ping) -> None:
    assert round_trip(msg) == msg


@FAST
@given(acks)
def test_ack_round_trips(msg: Ack) -> None:
    assert round_trip(msg) == msg


@FAST
@given(ping_reqs)
def test_ping_req_round_trips(msg: PingReq) -> None:
    assert round_trip(msg) == msg


@FAST
@given(alives)
def test_alive_round_trips(msg: Alive) -> None:
    assert round_trip(msg) == msg


@FAST
@given(accusations)
def test_accusation_round_trips(msg: Accusation) -> None:
    assert round_trip(msg) == msg


@FAST
@given(loads)
def test_load_round_trips(msg: Load) -> None:
    assert round_trip(msg) == msg


@FAST
@given(sync_requests)
def test_sync_request_round_trips(msg: SyncRequest) -> None:
    assert round_trip(msg) == msg


@FAST
@given(sync_replies)
def test_sync_reply_round_trips(msg: SyncReply) -> None:
    assert round_trip(msg) == msg


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry_bodies())
def test_signed_entry_round_trips_and_still_verifies(body: EntryBody) -> None:
    entry = body.sign(OWNER)
    decoded = round_trip(EntryMsg(entry))
    assert isinstance(decoded, EntryMsg)
    assert decoded.entry == entry
    assert decoded.entry.body == body
    assert decoded.entry.rank == entry.rank
    assert decoded.entry.verify(Verifier())


@FAST
@given(packets)
def test_packet_of_mixed_messages_round_trips(packet: Packet) -> None:
    decoded, unknown = decode_packet(encode_packet(packet))
    assert unknown == 0
    assert decoded == packet


def test_signed_records_round_trip_and_verify() -> None:
    v = Verifier()
    alive = Alive.make(OWNER, 5, "10.0.0.1:7946")
    accusation = Accusation.make(OWNER, DEAD, OTHER_SID, 3)
    decoded_alive = round_trip(alive)
    assert isinstance(decoded_alive, Alive)
    assert decoded_alive == alive and decoded_alive.verify(v)
    decoded = round_trip(accusation)
    assert isinstance(decoded, Accusation)
    assert decoded == accusation and decoded.verify(v)


def test_encode_messages_sizes_each_message() -> None:
    msgs: list[Message] = [Ping(1, SID), Ack(2, SID)]
    assert encode_messages(msgs) == [codec.pack(m.to_wire()) for m in msgs]


# -- strict bounds ------------------------------------------------------------------------------


def raw_packet(
    messages: list[Any], *, version: Any = WIRE_VERSION, sender: Any = SID, seq: Any = 1
) -> bytes:
    return codec.pack([version, sender, seq, 1000, messages])


def valid_entry_wire(site: str = DEFAULT_SITE) -> list[Any]:
    entry = EntryBody.sign(
        EntryBody(
            SID,
            OWNER.public_key,
            State.JOIN,
            1,
            "",
            Addresses(),
            Hardware(),
            EngineInfo(),
            (),
            (),
            T0,
            T0,
            T0 + 60,
            site=site,
        ),
        OWNER,
    )
    return [EntryMsg.TAG, *entry.to_wire()]


def signed_bytes_with(index: int, value: Any, site: str = DEFAULT_SITE) -> list[Any]:
    """A (badly signed) entry message whose body field ``index`` is replaced by ``value``."""
    tag, signed_bytes, sig = valid_entry_wire(site)
    fields = msgpack.unpackb(signed_bytes, raw=False)
    fields[index] = value
    return [tag, msgpack.packb(fields, use_bin_type=True), sig]


BAD_PACKETS = {
    # envelope
    "version 2": raw_packet([], version=2),
    "version 0": raw_packet([], version=0),
    "version as bool": raw_packet([], version=True),
    "version as float": raw_packet([], version=1.0),
    "version as string": raw_packet([], version="1"),
    "sender too long": raw_packet([], sender=SID + "0"),
    "sender too short": raw_packet([], sender=SID[:-1]),
    "sender as bytes": raw_packet([], sender=SID.encode()),
    "seq as bool": raw_packet([], seq=True),
    "seq negative": raw_packet([], seq=-1),
    "seq as float": raw_packet([], seq=1.0),
    "seq beyond int63": raw_packet([], seq=2**63),
    "messages not a list": raw_packet({"a": 1}),  # type: ignore[arg-type]
    "too many messages": raw_packet([[200]] * (MAX_MESSAGES + 1)),
    "four fields": msgpack.packb([1, SID, 1, 1000]),
    "six fields": msgpack.packb([1, SID, 1, 1000, [], None]),
    "a map": msgpack.packb({"v": 1}),
    "a string": msgpack.packb("packet"),
    "nil": msgpack.packb(None),
    "trailing bytes": raw_packet([]) + b"\x00",
    "truncated": raw_packet([[Ping.TAG, 1, SID, False]])[:-3],
    "deep nesting": b"\x95\x01" + b"\x91" * 5000,
    "deep nesting complete": b"\x91" * 100_000 + b"\xc0",
    "reserved byte": b"\xc1",
    "ext type": b"\x95\x01" + msgpack.packb(msgpack.ExtType(5, b"x")),
    "invalid utf-8": b"\x95\x01\xa2\xff\xfe\x01\x01\x90",
    "empty": b"",
    # messages
    "empty message": raw_packet([[]]),
    "message not a list": raw_packet([7]),
    "tag as bool": raw_packet([[True, 1, SID, False]]),
    "tag negative": raw_packet([[-1]]),
    "tag beyond a byte": raw_packet([[256]]),
    "ping with wrong arity": raw_packet([[Ping.TAG, 1, SID]]),
    "ping flag as int": raw_packet([[Ping.TAG, 1, SID, 1]]),
    "ping probe id as bool": raw_packet([[Ping.TAG, True, SID, False]]),
    "ping probe id as string": raw_packet([[Ping.TAG, "1", SID, False]]),
    "ack target too long": raw_packet([[Ack.TAG, 1, SID * 2]]),
    "ping-req address too long": raw_packet([[PingReq.TAG, 1, SID, "a" * 301]]),
    "ping-req address empty": raw_packet([[PingReq.TAG, 1, SID, ""]]),
    "alive short key": raw_packet([[Alive.TAG, SID, b"k" * 31, 1, "a:1", b"s" * 64]]),
    "alive key as str": raw_packet([[Alive.TAG, SID, "k" * 32, 1, "a:1", b"s" * 64]]),
    "alive long signature": raw_packet([[Alive.TAG, SID, b"k" * 32, 1, "a:1", b"s" * 65]]),
    "alive incarnation as bool": raw_packet([[Alive.TAG, SID, b"k" * 32, True, "a:1", b"s" * 64]]),
    "alive incarnation as float": raw_packet([[Alive.TAG, SID, b"k" * 32, 1.5, "a:1", b"s" * 64]]),
    "accusation kind 2": raw_packet([[Accusation.TAG, 2, SID, 1, SID, b"k" * 32, b"s" * 64]]),
    "accusation kind bool": raw_packet(
        [[Accusation.TAG, False, SID, 1, SID, b"k" * 32, b"s" * 64]]
    ),
    "load kv usage above one": raw_packet([[Load.TAG, SID, 1, 0, 0, 1.5, 0, T0]]),
    "load kv usage NaN": raw_packet([[Load.TAG, SID, 1, 0, 0, math.nan, 0, T0]]),
    "load time infinite": raw_packet([[Load.TAG, SID, 1, 0, 0, 0.5, 0, math.inf]]),
    "load time negative infinite": raw_packet([[Load.TAG, SID, 1, 0, 0, 0.5, 0, -math.inf]]),
    "load time negative": raw_packet([[Load.TAG, SID, 1, 0, 0, 0.5, 0, -1.0]]),
    "load waiting as bool": raw_packet([[Load.TAG, SID, 1, True, 0, 0.5, 0, T0]]),
    "load kv usage as bool": raw_packet([[Load.TAG, SID, 1, 0, 0, False, 0, T0]]),
    "load running too large": raw_packet([[Load.TAG, SID, 1, 0, 2**31 + 1, 0.5, 0, T0]]),
    "sync row too short": raw_packet([[SyncRequest.TAG, [[SID, 0, 1, b"", 0]]]]),
    "sync row state 4": raw_packet([[SyncRequest.TAG, [[SID, 4, 1, b"", 0, 0]]]]),
    "sync row long digest": raw_packet([[SyncRequest.TAG, [[SID, 0, 1, b"d" * 9, 0, 0]]]]),
    "sync rows not a list": raw_packet([[SyncRequest.TAG, "rows"]]),
    "sync reply bad id": raw_packet([[SyncReply.TAG, ["nope"]]]),
    # registry entries (decoded before any signature check)
    "entry missing signature": raw_packet([valid_entry_wire()[:2]]),
    "entry short signature": raw_packet([[*valid_entry_wire()[:2], b"s" * 63]]),
    "entry body not msgpack": raw_packet([[EntryMsg.TAG, b"\xc1", b"s" * 64]]),
    "entry body as str": raw_packet([[EntryMsg.TAG, "body", b"s" * 64]]),
    "entry body oversized": raw_packet([[EntryMsg.TAG, b"\x90" * 20000, b"s" * 64]]),
    "entry wrong domain": raw_packet([signed_bytes_with(0, b"fabric/alive/v1")]),
    "entry domain as str": raw_packet([signed_bytes_with(0, ENTRY_DOMAIN.decode())]),
    "entry state 4": raw_packet([signed_bytes_with(3, 4)]),
    "entry state as bool": raw_packet([signed_bytes_with(3, True)]),
    "entry version negative": raw_packet([signed_bytes_with(4, -1)]),
    "entry provider too long": raw_packet([signed_bytes_with(5, "p" * 65)]),
    "entry gpu count too large": raw_packet([signed_bytes_with(7, ["", 4097, 0.0, ""])]),
    "entry gpu memory NaN": raw_packet([signed_bytes_with(7, ["", 1, math.nan, ""])]),
    "entry too many models": raw_packet([signed_bytes_with(9, [["m", None, None]] * 65)]),
    "entry empty model id": raw_packet([signed_bytes_with(9, [["", None, None]])]),
    "entry label as map": raw_packet([signed_bytes_with(10, [{"k": "v"}])]),
    "entry site empty": raw_packet([signed_bytes_with(10, [[SITE_LABEL, ""]])]),
    "entry site too long": raw_packet([signed_bytes_with(10, [[SITE_LABEL, "s" * 33]])]),
    "entry site with a space": raw_packet([signed_bytes_with(10, [[SITE_LABEL, "a b"]])]),
    "entry site with a dot": raw_packet([signed_bytes_with(10, [[SITE_LABEL, "a.b"]])]),
    "entry site ends with a hyphen": raw_packet([signed_bytes_with(10, [[SITE_LABEL, "a-"]])]),
    "entry site not ASCII": raw_packet([signed_bytes_with(10, [[SITE_LABEL, "zürich"]])]),
    "entry site twice": raw_packet(
        [signed_bytes_with(10, [[SITE_LABEL, "a"], ["k", "v"], [SITE_LABEL, "a"]])]
    ),
    "entry expiry infinite": raw_packet([signed_bytes_with(13, math.inf)]),
    "entry short session id": raw_packet([signed_bytes_with(1, SID[:-1])]),
    "entry cert too short": raw_packet([signed_bytes_with(14, ["p", b"k" * 32, 1.0])]),
}


@pytest.mark.parametrize("data", list(BAD_PACKETS.values()), ids=list(BAD_PACKETS))
def test_malformed_packet_raises_decode_error_only(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_packet(data)


def test_oversized_packet_is_refused_before_decoding() -> None:
    data = raw_packet([[Ack.TAG, 1, SID]] * 50)
    decode_packet(data, max_bytes=len(data))
    with pytest.raises(DecodeError, match="exceeds"):
        decode_packet(data, max_bytes=len(data) - 1)


@pytest.mark.parametrize(
    "prefix",
    [
        b"\xdd\xff\xff\xff\xff",  # array32 of 4G items
        b"\xdf\xff\xff\xff\xff",  # map32
        b"\xdb\xff\xff\xff\xff",  # str32 of 4 GB
        b"\xc6\xff\xff\xff\xff",  # bin32
        b"\xc9\xff\xff\xff\xff\x01",  # ext32
        b"\x95\x01\xda\xff\xff",  # str16 sender claiming 64 KiB
    ],
)
def test_huge_length_prefix_is_refused_without_allocating(prefix: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_packet(prefix + b"\x00" * 16)


def test_unknown_message_tags_are_skipped_and_counted() -> None:
    ping = [Ping.TAG, 7, SID, False]
    packet, unknown = decode_packet(raw_packet([[200, "future"], ping, [255], [42, 1, 2, 3]]))
    assert unknown == 3
    assert packet.messages == (Ping(7, SID, False),)


def test_many_unknown_messages_within_limit_are_skipped() -> None:
    packet, unknown = decode_packet(raw_packet([[200]] * MAX_MESSAGES))
    assert unknown == MAX_MESSAGES and packet.messages == ()


def test_entry_body_decoding_keeps_what_the_owner_signed() -> None:
    tag, signed_bytes, sig = valid_entry_wire()
    (msg,) = decode_packet(raw_packet([[tag, signed_bytes, sig]]))[0].messages
    assert isinstance(msg, EntryMsg)
    assert msg.entry.signed_bytes == signed_bytes
    assert msg.entry.signature == sig


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=80),
    lambda children: st.lists(children, max_size=8),
    max_leaves=15,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        json_like,
        st.tuples(st.just(WIRE_VERSION), sids | json_like, json_like, json_like, json_like).map(
            list
        ),
        st.tuples(
            st.just(WIRE_VERSION),
            sids,
            u63,
            u63,
            st.lists(
                st.lists(json_like, max_size=8).flatmap(
                    lambda rest: st.integers(0, 12).map(lambda tag: [tag, *rest])
                ),
                max_size=6,
            ),
        ).map(list),
    )
)
def test_arbitrary_msgpack_decodes_or_raises_decode_error(obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    try:
        packet, unknown = decode_packet(data)
    except DecodeError:
        return
    assert isinstance(packet, Packet) and unknown >= 0


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_arbitrary_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    try:
        decode_packet(data)
    except DecodeError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packets, st.data())
def test_mutated_valid_packets_decode_or_raise_decode_error(
    packet: Packet, data: st.DataObject
) -> None:
    encoded = bytearray(encode_packet(packet))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(encoded) - 1))
        encoded[i] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(0, len(encoded)))
    try:
        decode_packet(bytes(encoded[:cut]))
    except DecodeError:
        pass


# -- replay guard -------------------------------------------------------------------------------

NOW = T0
NOW_MS = int(NOW * 1000)


N1, N2 = b"\x01" * 12, b"\x02" * 12


def test_fresh_packets_are_accepted_and_replays_refused() -> None:
    guard = ReplayGuard()
    assert guard.accept(N1, NOW_MS, NOW) is None
    assert guard.accept(N2, NOW_MS, NOW) is None
    assert guard.accept(N2, NOW_MS, NOW) == "replay"
    assert guard.accept(N1, NOW_MS, NOW + 1) == "replay"


@pytest.mark.parametrize(
    ("sent_offset_ms", "verdict"),
    [(0, None), (60_000, None), (-60_000, None), (60_001, "stale"), (-60_001, "stale")],
)
def test_packets_outside_clock_skew_are_stale(sent_offset_ms: int, verdict: str | None) -> None:
    guard = ReplayGuard(max_skew_s=60.0)
    assert guard.accept(N1, NOW_MS + sent_offset_ms, NOW) == verdict


def test_stale_packet_is_not_remembered() -> None:
    guard = ReplayGuard()
    assert guard.accept(N1, NOW_MS - 3_600_000, NOW) == "stale"
    assert len(guard) == 0


def test_replay_is_refused_for_as_long_as_it_could_be_fresh() -> None:
    guard = ReplayGuard(max_skew_s=60.0)
    sent_ms = NOW_MS + 60_000  # a sender whose clock runs a minute ahead
    assert guard.accept(N1, sent_ms, NOW) is None
    for later in (NOW + 30, NOW + 90, NOW + 119):
        assert guard.accept(N1, sent_ms, later) == "replay"
    assert guard.accept(N1, sent_ms, NOW + 121) == "stale"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(min_size=12, max_size=12), max_size=200))
def test_each_packet_is_accepted_at_most_once(nonces: list[bytes]) -> None:
    guard = ReplayGuard()
    accepted: set[bytes] = set()
    for nonce in nonces:
        verdict = guard.accept(nonce, NOW_MS, NOW)
        assert (verdict is None) == (nonce not in accepted)
        accepted.add(nonce)


def test_replay_guard_memory_stays_bounded() -> None:
    guard = ReplayGuard(capacity=100)
    nonces = [i.to_bytes(12, "big") for i in range(10_000)]
    for n in nonces:
        assert guard.accept(n, NOW_MS, NOW) is None
    assert len(guard) == 100
    # The newest are remembered; the oldest were forgotten (only freshness protects those).
    assert all(guard.accept(n, NOW_MS, NOW) == "replay" for n in nonces[-99:])
    assert guard.accept(nonces[0], NOW_MS, NOW) is None


def test_one_member_cannot_block_another_members_packets() -> None:
    guard = ReplayGuard()
    assert guard.accept(N1, NOW_MS, NOW) is None  # an insider's packet, whatever it claims
    assert guard.accept(N2, NOW_MS, NOW) is None  # the genuine sender's next packet


# -- addresses: a host no lookup can encode must never get past decoding ------------------------

BAD_ADDRS = [
    "0.0.0.0:7946",
    "a..b:1",
    "-x:7946",
    "x" * 64 + ":1",
    "ü.example:1",
    "host:99999",
    "host:",
    ":1",
]


@pytest.mark.parametrize("addr", BAD_ADDRS)
def test_a_ping_req_or_alive_with_a_bad_address_is_refused(addr: str) -> None:
    """A PingReq is probed at its target address and an Alive's address is gossiped to: a
    name like ``a..b`` made the agent that probed it exit (UnicodeError from the lookup)."""
    for msg in ([PingReq.TAG, 1, SID, addr], [Alive.TAG, SID, b"k" * 32, 1, addr, b"s" * 64]):
        with pytest.raises(DecodeError, match="address"):
            decode_packet(raw_packet([msg]))


@pytest.mark.parametrize(
    ("http", "gossip", "url"),
    [
        ("http://a..b:80", "", ""),
        ("ftp://10.0.0.1:21", "", ""),
        ("10.0.0.1:80", "", ""),
        ("", "a..b:7946", ""),
        ("", "", "http://a..b:8000/v1"),
    ],
)
def test_an_entry_with_a_bad_address_is_refused(http: str, gossip: str, url: str) -> None:
    """A SERVING entry whose HTTP address was ``http://a..b:80`` made every ingress that
    routed to it exit; it is now refused where the entry is decoded."""
    body = EntryBody(
        SID,
        OWNER.public_key,
        State.SERVING,
        1,
        "",
        Addresses(http, gossip),
        Hardware(),
        EngineInfo("vllm", "1", url),
        (),
        (),
        T0,
        T0,
        T0 + 60,
    )
    with pytest.raises(DecodeError, match=r"address|url"):
        decode_packet(encode_packet(Packet(SID, 1, 1000, (EntryMsg(body.sign(OWNER)),))))


@FAST
@given(st.text(max_size=80))
def test_any_address_text_decodes_to_a_resolvable_form_or_is_refused(addr: str) -> None:
    try:
        packet, _ = decode_packet(raw_packet([[PingReq.TAG, 1, SID, addr]]))
    except DecodeError:
        return
    (msg,) = packet.messages
    assert isinstance(msg, PingReq)
    host, _ = split_hostport(msg.target_addr)
    host.encode("idna")  # what the lookup does first: never a UnicodeError


# -- sites --------------------------------------------------------------------------------------


def test_an_entry_of_the_default_site_is_the_bytes_of_an_entry_before_sites() -> None:
    """No wire cost for a mesh of one site: the entry signs exactly the 15 fields agents that
    predate sites sign and decode, and such an old entry decodes as the default site."""
    tag, signed_bytes, sig = valid_entry_wire()
    fields = msgpack.unpackb(signed_bytes, raw=False)
    assert len(fields) == 15 and fields[10] == []
    (msg,) = decode_packet(raw_packet([[tag, signed_bytes, sig]]))[0].messages
    assert isinstance(msg, EntryMsg)
    assert msg.entry.body.site == DEFAULT_SITE and msg.entry.verify(Verifier())


def test_an_entry_of_another_site_carries_it_as_one_signed_label() -> None:
    """What an agent that predates sites decodes (and relays) unchanged: a label."""
    _, signed_bytes, _ = valid_entry_wire("alps")
    _, default_bytes, _ = valid_entry_wire()
    fields = msgpack.unpackb(signed_bytes, raw=False)
    assert len(fields) == 15 and fields[10] == [[SITE_LABEL, "alps"]]
    assert len(signed_bytes) - len(default_bytes) == len(SITE_LABEL) + len("alps") + 3
    body = parse_body(signed_bytes)
    assert (body.site, body.labels) == ("alps", ())


def test_the_site_label_decodes_wherever_it_sits_among_the_labels() -> None:
    tag, _, sig = signed_bytes_with(10, [["a", "1"], [SITE_LABEL, "C-2"], ["b", "2"]])
    (msg,) = decode_packet(raw_packet([[tag, _, sig]]))[0].messages
    assert isinstance(msg, EntryMsg)
    assert msg.entry.body.site == "C-2"
    assert msg.entry.body.labels == (("a", "1"), ("b", "2"))


def test_a_forged_site_fails_the_owners_signature() -> None:
    """The site is signed: moving another node's entry to a site breaks its signature."""
    tag, signed_bytes, sig = valid_entry_wire("alps")
    fields = msgpack.unpackb(signed_bytes, raw=False)
    fields[10] = [[SITE_LABEL, "elsewhere"]]
    forged = msgpack.packb(fields, use_bin_type=True)
    (msg,) = decode_packet(raw_packet([[tag, forged, sig]]))[0].messages
    assert isinstance(msg, EntryMsg)
    assert msg.entry.body.site == "elsewhere" and not msg.entry.verify(Verifier())


@pytest.mark.parametrize(
    ("site", "labels", "match"),
    [
        ("", (), "empty"),
        ("a" * (MAX_SITE_CHARS + 1), (), "at most"),
        ("-a", (), "beginning"),
        ("a/b", (), "letters"),
        (DEFAULT_SITE, ((SITE_LABEL, "alps"),), "the site's"),
        ("alps", tuple((f"k{i}", "v") for i in range(MAX_LABELS)), "labels"),
    ],
)
def test_an_entry_peers_would_refuse_for_its_site_is_never_signed(
    site: str, labels: tuple[tuple[str, str], ...], match: str
) -> None:
    _, signed_bytes, _ = valid_entry_wire()
    body = parse_body(signed_bytes)
    with pytest.raises(ValueError, match=match):
        replace(body, site=site, labels=labels).sign(OWNER)


@FAST
@given(st.text(max_size=40))
def test_site_names_are_short_ascii_tokens(name: str) -> None:
    ok = not site_problem(name)
    token = (
        0 < len(name) <= MAX_SITE_CHARS
        and name.isascii()
        and name[0].isalnum()
        and name[-1].isalnum()
        and all(c.isalnum() or c in "-_" for c in name)
    )
    assert ok == token
