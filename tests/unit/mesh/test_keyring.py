"""Cluster keyring: AEAD sealing, rotation without downtime, and the keyring file."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest

from fabricnode.errors import CryptoError, KeyFileError
from fabricnode.mesh.keyring import (
    HEADER_BYTES,
    KEY_BYTES,
    NONCE_BYTES,
    SEAL_OVERHEAD,
    Keyring,
    file_signature,
    key_id_of,
    new_cluster_key,
)

OLD = bytes(range(32))
NEW = bytes(range(100, 132))
OTHER = b"\x07" * 32


def ring(*keys: bytes, primary: bytes | None = None) -> Keyring:
    r = Keyring()
    for k in keys:
        r.add(k)
    if primary is not None:
        r.use(key_id_of(primary))
    return r


# -- sealing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("plaintext", [b"", b"x", b"hello gossip" * 100, bytes(range(256)) * 64])
def test_seal_open_round_trip(plaintext: bytes) -> None:
    r = Keyring.with_key(OLD)
    sealed = r.seal(plaintext)
    assert len(sealed) == len(plaintext) + SEAL_OVERHEAD
    assert sealed[:2] == b"FB"
    assert sealed[3:HEADER_BYTES] == key_id_of(OLD)
    assert r.open(sealed) == plaintext


def test_sealing_twice_uses_fresh_nonces() -> None:
    r = Keyring.with_key(OLD)
    a, b = r.seal(b"same"), r.seal(b"same")
    assert a != b
    assert (
        a[HEADER_BYTES : HEADER_BYTES + NONCE_BYTES] != b[HEADER_BYTES : HEADER_BYTES + NONCE_BYTES]
    )


def test_datagram_under_unknown_key_is_refused() -> None:
    sealed = Keyring.with_key(OTHER).seal(b"secret")
    with pytest.raises(CryptoError, match="key id not in the keyring"):
        Keyring.with_key(OLD).open(sealed)


def test_datagram_with_forged_key_id_does_not_authenticate() -> None:
    # An outsider relabels its datagram with our key id: the tag still fails.
    sealed = Keyring.with_key(OTHER).seal(b"secret")
    relabelled = sealed[:3] + key_id_of(OLD) + sealed[HEADER_BYTES:]
    with pytest.raises(CryptoError, match="authentication failed"):
        Keyring.with_key(OLD).open(relabelled)


def test_datagram_under_removed_key_is_refused() -> None:
    sender = Keyring.with_key(OLD)
    receiver = ring(OLD, NEW, primary=NEW)
    sealed = sender.seal(b"secret")
    assert receiver.open(sealed) == b"secret"
    receiver.remove(key_id_of(OLD))
    with pytest.raises(CryptoError):
        receiver.open(sealed)


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]


@pytest.mark.parametrize(
    "index",
    [
        0,  # magic
        2,  # format version
        3,  # key id
        HEADER_BYTES,  # nonce
        HEADER_BYTES + NONCE_BYTES,  # first ciphertext byte
        -17,  # last ciphertext byte
        -1,  # tag
    ],
)
def test_any_tampered_byte_is_refused(index: int) -> None:
    r = Keyring.with_key(OLD)
    sealed = r.seal(b"some plaintext")
    with pytest.raises(CryptoError):
        r.open(_flip(sealed, index % len(sealed)))


def test_every_single_bit_flip_is_refused() -> None:
    r = Keyring.with_key(OLD)
    sealed = r.seal(b"0123456789")
    for i in range(len(sealed)):
        for bit in range(8):
            mutated = sealed[:i] + bytes([sealed[i] ^ (1 << bit)]) + sealed[i + 1 :]
            with pytest.raises(CryptoError):
                r.open(mutated)


@pytest.mark.parametrize("length", [0, 1, HEADER_BYTES, SEAL_OVERHEAD - 1])
def test_short_datagram_is_refused(length: int) -> None:
    r = Keyring.with_key(OLD)
    with pytest.raises(CryptoError, match="too short"):
        r.open(r.seal(b"")[:length])


def test_truncated_or_extended_datagram_is_refused() -> None:
    r = Keyring.with_key(OLD)
    sealed = r.seal(b"some plaintext")
    for bad in (sealed[:-1], sealed + b"\x00", sealed[:SEAL_OVERHEAD]):
        with pytest.raises(CryptoError):
            r.open(bad)


def test_empty_keyring_cannot_seal() -> None:
    with pytest.raises(CryptoError, match="empty"):
        Keyring().seal(b"x")
    with pytest.raises(CryptoError):
        Keyring().open(Keyring.with_key(OLD).seal(b"x"))


# -- management and rotation --------------------------------------------------------------------


def test_first_key_added_becomes_primary() -> None:
    r = Keyring()
    kid = r.add(OLD)
    assert kid == key_id_of(OLD)
    assert r.primary == kid
    r.add(NEW)
    assert r.primary == kid
    assert r.key_ids() == sorted([key_id_of(OLD).hex(), key_id_of(NEW).hex()])


@pytest.mark.parametrize("key", [b"", b"x" * 16, b"x" * 31, b"x" * 33])
def test_key_of_wrong_length_is_refused(key: bytes) -> None:
    with pytest.raises(KeyFileError, match=f"{KEY_BYTES} bytes"):
        Keyring().add(key)


def test_cannot_remove_the_primary_key() -> None:
    r = ring(OLD, NEW)
    with pytest.raises(KeyFileError, match="primary"):
        r.remove(key_id_of(OLD))
    assert r.open(r.seal(b"still works")) == b"still works"


def test_cannot_use_or_remove_an_unknown_key() -> None:
    r = ring(OLD)
    with pytest.raises(KeyFileError, match="no key with id"):
        r.use(key_id_of(NEW))
    with pytest.raises(KeyFileError, match="no key with id"):
        r.remove(key_id_of(NEW))


# The four stages a node goes through in `keys add NEW` -> `keys use NEW` -> `keys remove OLD`.
STAGES = {
    "old-only": lambda: ring(OLD),
    "both-old-primary": lambda: ring(OLD, NEW),
    "both-new-primary": lambda: ring(OLD, NEW, primary=NEW),
    "new-only": lambda: ring(NEW),
}
ORDER = list(STAGES)


@pytest.mark.parametrize("a", ORDER)
@pytest.mark.parametrize("b", ORDER)
def test_rotation_stages_interoperate_with_their_neighbours(a: str, b: str) -> None:
    sender, receiver = STAGES[a](), STAGES[b]()
    gap = abs(ORDER.index(a) - ORDER.index(b))
    sealed = sender.seal(b"gossip")
    # Only the sender's primary key matters; the receiver opens anything in its ring.
    receiver_has_key = sender.primary in receiver.keys
    if gap <= 1:
        # Any two nodes at most one step apart (some re-read the file, some not yet) talk.
        assert receiver_has_key
    if receiver_has_key:
        assert receiver.open(sealed) == b"gossip"
    else:
        with pytest.raises(CryptoError):
            receiver.open(sealed)


def test_skipping_a_rotation_step_cuts_nodes_off() -> None:
    # `use NEW` before every node has added it: an old-only node cannot read the new seals.
    with pytest.raises(CryptoError):
        ring(OLD).open(ring(OLD, NEW, primary=NEW).seal(b"x"))
    with pytest.raises(CryptoError):
        ring(NEW).open(ring(OLD).seal(b"x"))


def test_live_reload_keeps_ring_identity() -> None:
    live = ring(OLD)
    held_by_service = live
    live.replace_with(ring(OLD, NEW, primary=NEW))
    assert held_by_service.primary == key_id_of(NEW)
    assert ring(NEW).open(held_by_service.seal(b"x")) == b"x"


def test_new_cluster_keys_are_random_and_sized() -> None:
    a, b = new_cluster_key(), new_cluster_key()
    assert len(a) == KEY_BYTES and a != b


# -- keyring file -------------------------------------------------------------------------------


def test_keyring_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "home" / "cluster.key"
    original = ring(OLD, NEW, primary=NEW)
    original.save(path)
    loaded = Keyring.load(path)
    assert loaded.keys == original.keys
    assert loaded.primary == key_id_of(NEW)
    assert loaded.open(original.seal(b"x")) == b"x"
    assert original.open(loaded.seal(b"y")) == b"y"


def test_keyring_file_is_private_to_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    old_umask = os.umask(0)
    try:
        ring(OLD).save(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_file_signature_notices_edits(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    assert file_signature(path) is None
    ring(OLD).save(path)
    first = file_signature(path)
    ring(OLD, NEW).save(path)
    assert first is not None and file_signature(path) != first


def _doc(**changes: object) -> str:
    doc: dict[str, object] = json.loads(ring(OLD, NEW).to_json())
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        "[]",
        "42",
        '"fabric-cluster-keyring"',
        "[" * 100_000,  # nesting deep enough to exhaust the JSON parser's recursion
        _doc(format="something-else"),
        _doc(version=2),
        _doc(keys=None),
        _doc(keys=["a", "b"]),
        _doc(keys={key_id_of(OLD).hex(): "!!! not base64 !!!"}),
        _doc(keys={key_id_of(OLD).hex(): 12345}),
        _doc(keys={"00000000": base64.b64encode(OLD).decode()}),  # key id mismatch
        _doc(keys={key_id_of(OLD).hex(): base64.b64encode(b"short").decode()}),
        _doc(primary="zz"),
        _doc(primary=7),
        _doc(primary=key_id_of(OTHER).hex()),
        _doc(keys={}, primary=""),
        '{"format": "fabric-cluster-keyring", "version": 1}',
    ],
)
def test_malformed_keyring_file_raises_key_file_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "cluster.key"
    path.write_text(text)
    with pytest.raises(KeyFileError):
        Keyring.load(path)


def test_malformed_keyring_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    path.write_text("not json")
    with pytest.raises(KeyFileError, match=f"{path} is not a valid fabric cluster keyring"):
        Keyring.load(path)


def test_empty_keyring_file_says_it_holds_no_keys(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    path.write_text(_doc(keys={}, primary=""))
    with pytest.raises(KeyFileError, match="holds no keys"):
        Keyring.load(path)


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", bytes(range(256))])
def test_binary_garbage_keyring_file_raises_key_file_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "cluster.key"
    path.write_bytes(content)
    with pytest.raises(KeyFileError, match="not a valid fabric cluster keyring"):
        Keyring.load(path)


def test_missing_keyring_file_explains_how_to_create_one(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="fabric keys new-cluster"):
        Keyring.load(tmp_path / "absent.key")


def test_unreadable_keyring_path_raises_key_file_error(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read cluster key file"):
        Keyring.load(tmp_path)  # a directory
