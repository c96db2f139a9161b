"""What a hostile or broken peer can and cannot do to a node, through ``MeshCore.receive``.

The threat model: an insider holds the cluster key (it can seal any datagram and claim any
sender id) but not other sessions' signing keys; an outsider holds neither. Nothing either sends
may raise out of ``receive``, and nothing but an owner's signature may change what the registry
says about a session.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import msgpack
import pytest

from fabricnode.mesh import codec
from fabricnode.mesh.core import MeshConfig, MeshCore, Outbound
from fabricnode.mesh.identity import Identity, Verifier
from fabricnode.mesh.keyring import HEADER_BYTES, Keyring, key_id_of
from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import ModelInfo, SignedEntry, State
from fabricnode.mesh.wire import (
    DEAD,
    SUSPECT,
    Accusation,
    Alive,
    EntryMsg,
    Load,
    Message,
    Packet,
    Ping,
    PingReq,
    decode_packet,
    encode_packet,
)
from fabricnode.testing.simnet import make_body

T0 = 1_750_000_000.0
CLUSTER_KEY = b"c" * 32


class Node:
    """A MeshCore plus what a test needs to address it."""

    def __init__(self, index: int, ring: Keyring, now: float = T0) -> None:
        self.identity = Identity.from_seed(f"security-{index}".encode())
        self.addr = f"10.0.0.{index}:7946"
        self.core = MeshCore(
            self.identity,
            ring,
            make_body(self.identity, self.addr, now),
            now,
            MeshConfig(),
            rng=random.Random(index),
            verifier=Verifier(),
        )

    @property
    def sid(self) -> str:
        return self.core.self_id


class Forger:
    """Seals arbitrary packets under a cluster key, claiming any sender: an insider's power."""

    def __init__(self, ring: Keyring, seqs: Counter[str] | None = None) -> None:
        self.ring = ring
        self.seqs: Counter[str] = Counter() if seqs is None else seqs

    def datagram(
        self, sender: str, messages: Iterable[Message], now: float, *, seq: int | None = None
    ) -> bytes:
        self.seqs[sender] += 1
        packet = Packet(
            sender, self.seqs[sender] if seq is None else seq, int(now * 1000), tuple(messages)
        )
        return self.ring.seal(encode_packet(packet))

    def send(self, sender: Node, to: Node, messages: Iterable[Message], now: float) -> None:
        to.core.receive(self.datagram(sender.sid, messages, now), now, sender.addr)


def snapshot(core: MeshCore) -> tuple[object, ...]:
    members = {
        sid: (m.status, m.incarnation, m.addr, m.alive_record, m.accusation)
        for sid, m in core.members.members.items()
    }
    return core.registry.digest(), members


def drops(core: MeshCore) -> Counter[str]:
    return Counter(core.statistics().dropped)


def deliver(outbound: list[Outbound], nodes: dict[str, Node], now: float) -> int:
    count = 0
    for out in outbound:
        if out.addr in nodes:
            nodes[out.addr].core.receive(out.data, now, None, stream=out.reliable)
            count += 1
    return count


@pytest.fixture
def cluster() -> tuple[Forger, Node, Node, Node]:
    """X (the node under attack), A and B, all knowing each other; shared cluster key."""
    ring = Keyring.with_key(CLUSTER_KEY)
    x, a, b = Node(1, ring), Node(2, ring), Node(3, ring)
    forger = Forger(ring)
    for src in (x, a, b):
        for dst in (x, a, b):
            if src is not dst:
                forger.send(src, dst, src.core.own_records(), T0)
    for n in (x, a, b):
        n.core.take_outbound()
        assert len(n.core.registry) == 3
    return forger, x, a, b


def entry_forged_by(signer: Identity, entry: SignedEntry, **changes: Any) -> SignedEntry:
    body = replace(entry.body, **changes)
    data = body.canonical_bytes()
    return SignedEntry(body, data, signer.sign(data))


# -- (1) forged registry entries ------------------------------------------------------------


def test_forged_entry_from_other_key_is_rejected(cluster: tuple[Forger, Node, Node, Node]) -> None:
    forger, x, a, b = cluster
    before = x.core.registry.get(a.sid)
    forged = entry_forged_by(
        b.identity, a.core.self_entry, state=State.SERVING, version=50, provider="evil"
    )
    forger.send(b, x, [EntryMsg(forged)], T0 + 1)
    assert x.core.registry.get(a.sid) == before
    assert drops(x.core)["entry_invalid"] == 1


def test_entry_claiming_another_session_with_own_key_is_rejected(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    before = x.core.registry.get(a.sid)
    # B's own (valid) public key and signature, but A's session id: the id does not match.
    forged = entry_forged_by(
        b.identity, b.core.self_entry, session_id=a.sid, state=State.LEFT, version=99
    )
    forger.send(b, x, [EntryMsg(forged)], T0 + 1)
    assert x.core.registry.get(a.sid) == before
    assert x.core.liveness(a.sid) is Liveness.ALIVE
    assert drops(x.core)["entry_invalid"] == 1


def test_forged_entry_about_the_receiver_itself_is_ignored(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, _, b = cluster
    own = x.core.self_entry
    forged = entry_forged_by(b.identity, own, state=State.LEFT, version=own.body.version + 1)
    forger.send(b, x, [EntryMsg(forged)], T0 + 1)
    assert x.core.self_entry == own
    assert x.core.registry.get(x.sid) == own
    assert not x.core.left


# -- (2) replays and (3) rollbacks ----------------------------------------------------------


def test_replayed_older_entry_does_not_change_state(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    v1 = a.core.self_entry
    v2 = a.core.update_self(T0 + 5, state=State.SERVING, models=(ModelInfo("llama-8b"),))
    forger.send(a, x, [EntryMsg(v2)], T0 + 5)
    assert x.core.registry.get(a.sid) == v2
    # Anyone (here B) re-sends the older, genuinely signed version in a fresh packet.
    forger.send(b, x, [EntryMsg(v1)], T0 + 6)
    assert x.core.registry.get(a.sid) == v2
    assert x.core.registry.query(model="llama-8b") == [v2]


def test_replayed_datagram_is_dropped_before_processing(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, _ = cluster
    v2 = a.core.update_self(T0 + 5, state=State.SERVING)
    datagram = forger.datagram(a.sid, [EntryMsg(v2)], T0 + 5)
    x.core.receive(datagram, T0 + 5)
    merges = x.core.statistics().merges
    x.core.receive(datagram, T0 + 6)
    assert drops(x.core)["replay"] == 1
    assert x.core.statistics().merges == merges  # never reached the registry


def test_datagram_replayed_after_clock_skew_is_dropped_as_stale(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, _ = cluster
    v2 = a.core.update_self(T0 + 5, state=State.SERVING)
    datagram = forger.datagram(a.sid, [EntryMsg(v2)], T0 + 5)
    x.core.receive(datagram, T0 + 5 + 61)
    assert drops(x.core)["stale"] == 1
    assert x.core.registry.get(a.sid).body.state is State.JOIN  # type: ignore[union-attr]


def test_state_rollback_does_not_change_state(cluster: tuple[Forger, Node, Node, Node]) -> None:
    forger, x, a, _ = cluster
    a.core.leave(T0 + 5)
    left = a.core.self_entry
    forger.send(a, x, [EntryMsg(left)], T0 + 5)
    assert x.core.registry.get(a.sid) == left
    assert x.core.liveness(a.sid) is Liveness.LEFT
    # The owner itself signs a higher version with an earlier lifecycle state.
    rollback = entry_forged_by(
        a.identity, left, state=State.SERVING, version=left.body.version + 10
    )
    assert rollback.verify(Verifier())
    forger.send(a, x, [EntryMsg(rollback)], T0 + 6)
    assert x.core.registry.get(a.sid) == left
    assert x.core.liveness(a.sid) is Liveness.LEFT


# -- (4) cluster keys --------------------------------------------------------------------------


def test_packet_under_wrong_cluster_key_is_dropped_and_changes_nothing(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    _, x, a, _ = cluster
    outsider = Forger(Keyring.with_key(b"o" * 32))
    before = snapshot(x.core)
    v2 = a.core.update_self(T0 + 5, state=State.SERVING)
    x.core.receive(outsider.datagram(a.sid, [EntryMsg(v2), a.core.alive], T0 + 5), T0 + 5)
    assert drops(x.core)["CryptoError"] == 1
    assert snapshot(x.core) == before


def test_packet_under_removed_key_is_dropped_and_changes_nothing() -> None:
    old, new = b"o" * 32, b"n" * 32
    receiver_ring = Keyring.with_key(old)
    receiver_ring.add(new)
    x = Node(1, receiver_ring)
    a = Node(2, Keyring.with_key(old))
    old_only = Forger(Keyring.with_key(old))
    old_only.send(a, x, a.core.own_records(), T0)
    assert a.sid in x.core.registry  # old key still accepted during rotation

    receiver_ring.use(key_id_of(new))
    receiver_ring.remove(key_id_of(old))
    before = snapshot(x.core)
    v2 = a.core.update_self(T0 + 5, state=State.SERVING)
    old_only.send(a, x, [EntryMsg(v2)], T0 + 5)
    assert drops(x.core)["CryptoError"] == 1
    assert snapshot(x.core) == before
    # Once the sender re-reads the ring it gets through again.
    Forger(Keyring.with_key(new), old_only.seqs).send(a, x, [EntryMsg(v2)], T0 + 6)
    assert x.core.registry.get(a.sid) == v2


def test_unsealed_and_tampered_datagrams_are_dropped_and_counted(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, _ = cluster
    before = snapshot(x.core)
    v2 = a.core.update_self(T0 + 5, state=State.SERVING)
    plaintext = encode_packet(Packet(a.sid, 99, int((T0 + 5) * 1000), (EntryMsg(v2),)))
    sealed = forger.datagram(a.sid, [EntryMsg(v2)], T0 + 5)
    for bad in (
        plaintext,
        sealed[:-1],
        sealed[: HEADER_BYTES + 5],
        sealed[:HEADER_BYTES] + bytes([sealed[HEADER_BYTES] ^ 1]) + sealed[HEADER_BYTES + 1 :],
        b"",
    ):
        x.core.receive(bad, T0 + 5)
    assert drops(x.core)["CryptoError"] == 5
    assert snapshot(x.core) == before


# -- (5) liveness records ----------------------------------------------------------------------


def test_alive_with_bad_signature_is_dropped(cluster: tuple[Forger, Node, Node, Node]) -> None:
    forger, x, a, b = cluster
    before = snapshot(x.core)
    genuine = Alive.make(a.identity, 5, a.addr)
    forged = [
        replace(genuine, signature=b"\x00" * 64),
        replace(genuine, gossip_addr="10.6.6.6:7946"),  # redirect A's traffic
        replace(genuine, incarnation=6),
        # B signs for A's id with its own key: the key does not hash to A's id.
        Alive(
            a.sid,
            b.identity.public_key,
            5,
            a.addr,
            b.identity.sign(Alive.message(a.sid, 5, a.addr)),
        ),
    ]
    for rec in forged:
        forger.send(b, x, [rec], T0 + 1)
    assert drops(x.core)["bad_signature"] == len(forged)
    assert snapshot(x.core) == before


def test_accusation_at_an_incarnation_its_target_never_signed_is_dropped(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    before = snapshot(x.core)
    forger.send(b, x, [Accusation.make(b.identity, DEAD, a.sid, 3)], T0 + 1)
    assert drops(x.core)["accusation_unknown_incarnation"] == 1
    assert snapshot(x.core) == before


def test_accusation_with_bad_signature_is_dropped(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    before = snapshot(x.core)
    genuine = Accusation.make(b.identity, DEAD, a.sid, 0)
    forged = [
        replace(genuine, signature=b"\x00" * 64),
        replace(genuine, kind=SUSPECT),
        replace(genuine, target=x.sid),
        replace(genuine, accuser=a.sid),  # B's key does not hash to A's id
        # B signs in A's name with its own key (a valid signature, but not A's key).
        replace(
            genuine,
            accuser=a.sid,
            signature=b.identity.sign(Accusation.message(DEAD, a.sid, 0, a.sid)),
        ),
    ]
    for rec in forged:
        forger.send(b, x, [rec], T0 + 1)
    assert drops(x.core)["bad_signature"] == len(forged)
    assert snapshot(x.core) == before
    assert x.core.statistics().incarnation == 0


def test_accused_node_refutes_and_peers_see_it_alive(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    nodes = {n.addr: n for n in (x, a, b)}
    accusation = Accusation.make(b.identity, SUSPECT, x.sid, 0)
    forger.send(b, a, [accusation], T0 + 1)
    assert a.core.liveness(x.sid) is Liveness.SUSPECT

    forger.send(b, x, [accusation], T0 + 1)
    assert x.core.incarnation == 1
    assert x.core.alive.incarnation == 1 and x.core.alive.verify(Verifier())

    x.core.tick(T0 + 1.1)  # gossip round: the refutation goes out
    assert deliver(x.core.take_outbound(), nodes, T0 + 1.2) > 0
    member = a.core.members.get(x.sid)
    assert member is not None
    assert (member.status, member.incarnation) == (Liveness.ALIVE, 1)
    # The old accusation, replayed, cannot bring the suspicion back.
    forger.send(b, a, [accusation], T0 + 2)
    assert a.core.liveness(x.sid) is Liveness.ALIVE


def test_only_the_owner_can_raise_its_incarnation(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    forger.send(a, x, [Alive.make(a.identity, 1, a.addr)], T0 + 1)
    assert x.core.members.get(a.sid).incarnation == 1  # type: ignore[union-attr]
    forged_higher = [
        replace(Alive.make(a.identity, 1, a.addr), incarnation=9),
        Alive(
            a.sid,
            b.identity.public_key,
            9,
            a.addr,
            b.identity.sign(Alive.message(a.sid, 9, a.addr)),
        ),
        Alive(
            a.sid,
            a.identity.public_key,
            9,
            a.addr,
            b.identity.sign(Alive.message(a.sid, 9, a.addr)),
        ),
    ]
    for rec in forged_higher:
        forger.send(b, x, [rec], T0 + 2)
    member = x.core.members.get(a.sid)
    assert member is not None and member.incarnation == 1
    assert member.alive_record is not None and member.alive_record.incarnation == 1
    forger.send(a, x, [Alive.make(a.identity, 2, a.addr)], T0 + 3)
    assert x.core.members.get(a.sid).incarnation == 2  # type: ignore[union-attr]


def test_accusation_against_a_third_node_is_refuted_by_its_owner_alone(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    forger.send(b, x, [Accusation.make(b.identity, DEAD, a.sid, 0)], T0 + 1)
    assert x.core.liveness(a.sid) is Liveness.DEAD
    # B cannot undo it on A's behalf; A's own higher-incarnation Alive can.
    impostor = Alive(
        a.sid, b.identity.public_key, 1, a.addr, b.identity.sign(Alive.message(a.sid, 1, a.addr))
    )
    forger.send(b, x, [impostor], T0 + 2)
    assert x.core.liveness(a.sid) is Liveness.DEAD
    forger.send(a, x, [Alive.make(a.identity, 1, a.addr)], T0 + 3)
    assert x.core.liveness(a.sid) is Liveness.ALIVE


def test_accusation_at_absurd_incarnation_cannot_silence_its_target(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    nodes = {n.addr: n for n in (x, a, b)}
    obituary = Accusation.make(b.identity, DEAD, a.sid, 2**63 - 1)
    forger.send(b, x, [obituary], T0 + 1)
    forger.send(b, a, [obituary], T0 + 1)
    # Neither the bystander nor the target accepts an incarnation the target never signed.
    assert x.core.liveness(a.sid) is Liveness.ALIVE
    assert a.core.incarnation == 0
    a.core.tick(T0 + 1.1)
    deliver(a.core.take_outbound(), nodes, T0 + 1.2)
    assert drops(x.core).get("DecodeError", 0) == 0
    assert x.core.liveness(a.sid) is Liveness.ALIVE


def test_member_cannot_silence_another_by_spoofing_its_sequence_numbers(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, _ = cluster
    x.core.receive(forger.datagram(a.sid, [], T0 + 1, seq=2**62), T0 + 1)  # sent by B
    v2 = a.core.update_self(T0 + 2, state=State.SERVING)
    x.core.receive(forger.datagram(a.sid, [EntryMsg(v2)], T0 + 2, seq=2), T0 + 2)
    assert x.core.registry.get(a.sid) == v2


# -- (6) fuzzing MeshCore.receive -----------------------------------------------------------------


FUZZ_DATAGRAMS = 100_000


class Cluster:
    """Four cores on a lossless in-memory network; the fourth crashes midway."""

    def __init__(self) -> None:
        self.ring = Keyring.with_key(CLUSTER_KEY)
        self.nodes = [Node(i, self.ring) for i in range(1, 5)]
        self.by_addr = {n.addr: n for n in self.nodes}
        self.victim = self.nodes[0]
        self.crashed: set[str] = set()
        self.to_victim: list[bytes] = []
        for n in self.nodes[1:]:
            n.core.bootstrap([self.victim.addr])
        self.now = T0

    def run(self, seconds: float, step: float = 0.02) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now += step
            queue: list[tuple[Node, Outbound]] = []
            for n in self.nodes:
                if n.addr not in self.crashed:
                    n.core.tick(self.now)
                    queue.extend((n, o) for o in n.core.take_outbound())
            hops = 0
            while queue and hops < 10_000:
                hops += 1
                src, out = queue.pop(0)
                dst = self.by_addr.get(out.addr)
                if dst is None or dst.addr in self.crashed:
                    continue
                if dst is self.victim:
                    self.to_victim.append(out.data)
                dst.core.receive(out.data, self.now, src.addr, stream=out.reliable)
                queue.extend((dst, o) for o in dst.core.take_outbound())


def random_scalar(rng: random.Random) -> Any:
    r = rng.randrange(12)
    if r == 0:
        return None
    if r == 1:
        return rng.random() < 0.5
    if r == 2:
        return rng.choice([0, 1, -1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)])
    if r == 3:
        return rng.randrange(-1000, 1000)
    if r == 4:
        return rng.choice([0.0, -0.0, 1.5, -1.0, 1e300, float("nan"), float("inf"), -float("inf")])
    if r == 5:
        return "".join(rng.choice("0123456789abcdef") for _ in range(32))
    if r == 6:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(0, 40)))
    if r == 7:
        return "x" * rng.choice([255, 256, 300, 301, 5000])
    if r == 8:
        return rng.randbytes(rng.choice([0, 8, 9, 31, 32, 33, 63, 64, 65]))
    if r == 9:
        return rng.randbytes(rng.randrange(0, 100))
    if r == 10:
        return rng.randrange(0, 12)  # a plausible tag
    return rng.random() * 1e12


def random_obj(rng: random.Random, depth: int = 0) -> Any:
    if depth >= 4 or rng.random() < 0.45:
        return random_scalar(rng)
    if rng.random() < 0.1:
        return {str(rng.randrange(5)): random_obj(rng, depth + 1) for _ in range(rng.randrange(3))}
    return [random_obj(rng, depth + 1) for _ in range(rng.randrange(0, 8))]


def pack(obj: Any) -> bytes:
    return codec.pack(obj)


HUGE_PREFIXES = [
    b"\xdd\xff\xff\xff\xff",  # array32, 4G items
    b"\xdc\xff\xff",  # array16, 64K items
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32, 4 GB
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xc9\xff\xff\xff\xff\x05",  # ext32
    b"\xc7\xff\x05",  # ext8
]


class Mutator:
    """Turns a corpus of valid packets (as plain msgpack trees) into hostile variants."""

    def __init__(self, rng: random.Random, corpus: list[list[Any]], now_ms: int) -> None:
        self.rng = rng
        self.corpus = corpus
        self.now_ms = now_ms
        self.seq = itertools.count(10**9)

    def fresh(self, *, throwaway_sender: bool = False) -> list[Any]:
        packet = copy.deepcopy(self.rng.choice(self.corpus))
        packet[2] = next(self.seq)  # fresh seq and timestamp: get past the replay guard
        packet[3] = self.now_ms
        if throwaway_sender:
            # (Mutations may hit the seq: harmless, replays are detected by nonce.)
            packet[1] = self.rng.randbytes(16).hex()
        return packet

    def containers(self, tree: Any) -> list[list[Any]]:
        out: list[list[Any]] = []
        stack = [tree]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                out.append(node)
                stack.extend(node)
        return out

    def mutate_value(self, value: Any) -> Any:
        rng = self.rng
        if isinstance(value, bytes) and value and rng.random() < 0.6:
            if rng.random() < 0.5 and value[:1] in (b"\x9e", b"\x9f", b"\xdc"):
                return self.mutate_signed_body(value)
            i = rng.randrange(len(value))
            return value[:i] + bytes([value[i] ^ (1 << rng.randrange(8))]) + value[i + 1 :]
        if isinstance(value, str) and value and rng.random() < 0.6:
            i = rng.randrange(len(value))
            return value[:i] + rng.choice("0123456789abcdefg") + value[i + 1 :]
        if isinstance(value, bool):
            return not value
        if isinstance(value, int) and rng.random() < 0.6:
            return rng.choice([value + 1, value - 1, value ^ (1 << rng.randrange(63)), 0])
        return random_scalar(rng)

    def mutate_signed_body(self, signed: bytes) -> bytes:
        """Re-encode an entry body with one field changed (the signature no longer covers it)."""
        try:
            fields = msgpack.unpackb(signed, raw=False)
        except Exception:
            return signed
        if isinstance(fields, list) and fields:
            self.mutate_tree(fields, rounds=1)
        try:
            return pack(fields)
        except (OverflowError, ValueError, TypeError):
            return signed

    def mutate_tree(self, tree: list[Any], rounds: int) -> None:
        rng = self.rng
        for _ in range(rounds):
            node = rng.choice(self.containers(tree))
            op = rng.randrange(6)
            if not node or op == 0:
                node.append(random_obj(rng))
            elif op == 1:
                i = rng.randrange(len(node))
                node[i] = self.mutate_value(node[i])
            elif op == 2:
                i, j = rng.randrange(len(node)), rng.randrange(len(node))
                node[i], node[j] = node[j], node[i]
            elif op == 3:
                del node[rng.randrange(len(node)) :]
            elif op == 4:
                i = rng.randrange(len(node))
                node[i] = copy.deepcopy(rng.choice(self.containers(rng.choice(self.corpus))))
            else:
                node.insert(rng.randrange(len(node) + 1), copy.deepcopy(rng.choice(node)))

    def tweak(self, value: Any) -> Any:
        """A small change that keeps the value's type, so the packet still decodes."""
        rng = self.rng
        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return rng.choice(
                [value + 1, max(0, value - 1), value ^ (1 << rng.randrange(16)), rng.randrange(99)]
            )
        if isinstance(value, float):
            return rng.choice([value + 1.0, value * 0.5, 0.0, min(1.0, value + 0.01)])
        if isinstance(value, bytes) and value:
            i = rng.randrange(len(value))
            return value[:i] + bytes([value[i] ^ (1 << rng.randrange(8))]) + value[i + 1 :]
        if isinstance(value, str) and value:
            i = rng.randrange(len(value))
            c = rng.choice([ch for ch in "0123456789abcdef" if ch != value[i]])
            return value[:i] + c + value[i + 1 :]
        if isinstance(value, list) and value:
            copied = list(value)
            i = rng.randrange(len(copied))
            copied[i] = self.tweak(copied[i])
            return copied
        return value

    def tweak_body(self, signed: bytes) -> bytes:
        try:
            fields = msgpack.unpackb(signed, raw=False)
        except ValueError:
            return bytes(self.tweak(signed))  # already tweaked as raw bytes in an earlier round
        i = self.rng.randrange(1, len(fields))
        fields[i] = self.tweak(fields[i])
        return pack(fields)

    def semantic(self) -> bytes:
        """Change one or two fields of well-formed messages: decodes, then must fail checks."""
        rng = self.rng
        packet = self.fresh()
        messages = packet[4]
        for _ in range(rng.randrange(1, 3)):
            if not messages:
                break
            msg = rng.choice(messages)
            if len(msg) < 2:
                continue
            i = rng.randrange(1, len(msg))
            same_kind = [m for p in self.corpus for m in p[4] if m[0] == msg[0] and m is not msg]
            if msg[0] == EntryMsg.TAG and i == 1 and rng.random() < 0.8:
                msg[1] = self.tweak_body(msg[1])
            elif same_kind and rng.random() < 0.25:
                msg[i] = copy.deepcopy(rng.choice(same_kind)[i])  # field swapped in
            else:
                msg[i] = self.tweak(msg[i])
        return pack(packet)

    def structured(self) -> bytes:
        packet = self.fresh(throwaway_sender=True)
        self.mutate_tree(packet, rounds=self.rng.randrange(1, 4))
        try:
            return pack(packet)
        except (OverflowError, ValueError, TypeError):
            return pack(self.fresh(throwaway_sender=True))

    def byte_level(self) -> bytes:
        rng = self.rng
        data = bytearray(pack(self.fresh(throwaway_sender=True)))
        op = rng.randrange(4)
        if op == 0:
            for _ in range(rng.randrange(1, 4)):
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            del data[rng.randrange(len(data)) :]
        elif op == 2:
            i = rng.randrange(len(data))
            data[i:i] = rng.randbytes(rng.randrange(1, 8))
        else:
            i = rng.randrange(len(data))
            data[i : i + rng.randrange(1, 6)] = rng.choice(HUGE_PREFIXES)
        return bytes(data)

    def garbage_packet(self) -> bytes:
        rng = self.rng
        if rng.random() < 0.5:
            return pack(random_obj(rng))
        msgs = []
        for _ in range(rng.randrange(0, 5)):
            rest = random_obj(rng, 3)
            msgs.append([rng.randrange(0, 12), *(rest if isinstance(rest, list) else [rest])])
        sender = rng.choice([random_scalar(rng), rng.choice(self.corpus)[1]])
        return pack([1, sender, next(self.seq), self.now_ms, msgs])

    def huge(self) -> bytes:
        rng = self.rng
        prefix = rng.choice(HUGE_PREFIXES)
        if rng.random() < 0.5:
            return b"\x95\x01" + prefix + rng.randbytes(rng.randrange(0, 30))
        if rng.random() < 0.5:
            return b"\x91" * rng.randrange(100, 5000) + b"\xc0"
        return prefix + rng.randbytes(rng.randrange(0, 30))


def registry_is_authentic(core: MeshCore) -> bool:
    v = Verifier()
    return all(e.verify(v) and e.signed_bytes == e.body.canonical_bytes() for e in core.registry)


@pytest.mark.slow
def test_fuzzed_datagrams_never_raise_and_change_nothing() -> None:
    rng = random.Random(20251122)
    net = Cluster()
    net.run(4.0)
    net.nodes[1].core.update_self(net.now, state=State.SERVING, models=(ModelInfo("m"),))
    net.nodes[2].core.publish_load(net.now, waiting=1, running=2, kv_usage=0.5, inflight=3)
    net.run(4.0)
    net.crashed.add(net.nodes[3].addr)  # D dies silently: suspicion, probes, obituaries
    net.run(30.0)
    victim = net.victim.core
    dead = net.nodes[3].sid
    assert victim.liveness(dead) is Liveness.DEAD
    assert all(victim.liveness(n.sid) is Liveness.ALIVE for n in net.nodes[1:3])

    ring = net.ring
    corpus = [msgpack.unpackb(ring.open(d), raw=False) for d in net.to_victim]
    kinds = Counter(
        type(m).__name__ for d in net.to_victim for m in decode_packet(ring.open(d))[0].messages
    )
    assert {"Ping", "Ack", "EntryMsg", "Alive", "Accusation", "Load"} <= set(kinds)
    assert {"SyncRequest", "SyncReply"} & set(kinds)

    now = net.now
    mutator = Mutator(rng, corpus, int(now * 1000))
    outsider = Keyring.with_key(b"o" * 32)
    before = snapshot(victim)
    stats_before = victim.statistics()
    sealed_samples = [ring.seal(pack(p)) for p in corpus[:50]]

    # (name, make a datagram, weight, fraction that must be dropped and counted)
    categories: list[tuple[str, Callable[[], bytes], int, float]] = [
        ("random bytes", lambda: rng.randbytes(rng.randrange(0, 1500)), 1, 1.0),
        (
            "random bytes with our header",
            lambda: b"FB\x01" + key_id_of(CLUSTER_KEY) + rng.randbytes(rng.randrange(0, 200)),
            1,
            1.0,
        ),
        ("wrong cluster key", lambda: outsider.seal(pack(mutator.fresh())), 1, 1.0),
        ("tampered sealed datagram", lambda: _tamper(rng, rng.choice(sealed_samples)), 1, 1.0),
        ("sealed random msgpack", lambda: ring.seal(mutator.garbage_packet()), 2, 0.9),
        ("sealed huge length prefix", lambda: ring.seal(mutator.huge()), 1, 1.0),
        # Most tweaks of unsigned probe fields are harmless no-ops (an ack for no probe, a
        # ping for someone else is counted, a stale entry is not), so no fraction is required.
        ("sealed packet, fields tweaked", lambda: ring.seal(mutator.semantic()), 5, 0.0),
        ("sealed packet, structure mutated", lambda: ring.seal(mutator.structured()), 2, 0.8),
        ("sealed packet, bytes mutated", lambda: ring.seal(mutator.byte_level()), 2, 0.8),
    ]
    weights = [c[2] for c in categories]
    sent: Counter[str] = Counter()
    dropped_any: Counter[str] = Counter()
    for i in range(FUZZ_DATAGRAMS):
        name, make, _, _ = rng.choices(categories, weights)[0]
        data = make()
        sent[name] += 1
        total = sum(victim.stats_dropped.values())
        victim.receive(data, now, "10.9.9.9:7946", stream=rng.random() < 0.1)
        if sum(victim.stats_dropped.values()) > total:
            dropped_any[name] += 1
        if i % 1000 == 0:
            _check_outbound(ring, victim.take_outbound())
    _check_outbound(ring, victim.take_outbound())

    stats = victim.statistics()
    assert stats.packets_in - stats_before.packets_in == FUZZ_DATAGRAMS
    assert snapshot(victim) == before
    assert registry_is_authentic(victim)
    crypto_drops = stats.dropped.get("CryptoError", 0) - stats_before.dropped.get("CryptoError", 0)
    assert crypto_drops == sum(sent[c[0]] for c in categories[:4])
    for name, _, _, must_drop in categories:
        assert sent[name] > 2000, name
        assert dropped_any[name] >= must_drop * sent[name], (name, dropped_any[name], sent[name])
    # The tweaks got past decoding to the signature checks, many times over.
    assert stats.dropped.get("entry_invalid", 0) > 200
    assert stats.dropped.get("bad_signature", 0) > 1000
    assert stats.merges["stale"] > 1000


def _tamper(rng: random.Random, sealed: bytes) -> bytes:
    i = rng.randrange(len(sealed))
    if rng.random() < 0.3:
        return sealed[:i]
    return sealed[:i] + bytes([sealed[i] ^ (1 << rng.randrange(8))]) + sealed[i + 1 :]


def _check_outbound(ring: Keyring, outbound: list[Outbound]) -> None:
    """Whatever the fuzz provoked the node to send is itself well formed."""
    for out in outbound:
        decode_packet(ring.open(out.data))


def test_load_from_unknown_session_is_ignored(cluster: tuple[Forger, Node, Node, Node]) -> None:
    forger, x, _, b = cluster
    stranger = Identity.from_seed(b"stranger").session_id
    forger.send(b, x, [Load(stranger, 1, 5, 5, 0.5, 1, T0)], T0 + 1)
    assert stranger not in x.core.loads


# -- indirect probes: no reflection ------------------------------------------------------------


def pings_sent(outbound: list[Outbound]) -> Counter[str]:
    """Addresses our node sent a Ping to, and how many."""
    sent: Counter[str] = Counter()
    for out in outbound:
        packet, _ = decode_packet(Keyring.with_key(CLUSTER_KEY).open(out.data))
        sent[out.addr] += sum(isinstance(m, Ping) for m in packet.messages)
    return sent


def test_a_packet_of_400_ping_reqs_makes_at_most_a_few_probes(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    """One sealed datagram of 400 PingReqs made the node send 400 probes; now a requester gets
    ``relay_per_sender`` per probe interval, and the rest are dropped and counted."""
    forger, x, a, b = cluster
    now = T0 + 0.01
    reqs = [PingReq(i, b.sid, b.addr) for i in range(400)]
    forger.send(a, x, reqs, now)
    sent = pings_sent(x.core.take_outbound())
    limit = x.core.config.relay_per_sender
    assert sent == Counter({b.addr: limit})
    assert drops(x.core)["ping_req_limited"] == 400 - limit
    # The next probe interval, the requester gets its share again.
    forger.send(a, x, reqs[:1], now + x.core.config.probe_interval_s)
    assert pings_sent(x.core.take_outbound()) == Counter({b.addr: 1})


def test_a_ping_req_is_probed_at_the_known_address_never_the_named_one(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    victim = "192.0.2.7:53"  # an address of the requester's choosing
    forger.send(a, x, [PingReq(1, b.sid, victim)], T0 + 0.01)
    assert pings_sent(x.core.take_outbound()) == Counter({b.addr: 1})


def test_ping_reqs_from_or_about_strangers_are_dropped(
    cluster: tuple[Forger, Node, Node, Node],
) -> None:
    forger, x, a, b = cluster
    stranger = Identity.from_seed(b"stranger")
    forger.send(a, x, [PingReq(1, stranger.session_id, "192.0.2.7:53")], T0 + 0.01)
    x.core.receive(
        forger.datagram(stranger.session_id, [PingReq(2, b.sid, b.addr)], T0 + 0.02),
        T0 + 0.02,
        "192.0.2.7:53",
    )
    assert pings_sent(x.core.take_outbound()) == Counter()
    assert drops(x.core)["ping_req_not_member"] == 2
