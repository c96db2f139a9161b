"""Session identities, canonical signatures, the verifier cache and provider keys."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest

from fabricnode.errors import KeyFileError
from fabricnode.mesh.identity import (
    PUBLIC_KEY_BYTES,
    SESSION_ID_BYTES,
    SIGNATURE_BYTES,
    Identity,
    ProviderCert,
    ProviderKey,
    Verifier,
    canonical,
    key_fingerprint,
    session_id_for,
)
from fabricnode.mesh.wire import Accusation, Alive
from fabricnode.testing.simnet import make_body

T0 = 1_750_000_000.0
ALICE = Identity.from_seed(b"identity-alice")
BOB = Identity.from_seed(b"identity-bob")


# -- session ids --------------------------------------------------------------------------------


def test_session_id_is_derived_from_the_public_key() -> None:
    assert len(ALICE.public_key) == PUBLIC_KEY_BYTES
    assert ALICE.session_id == hashlib.sha256(ALICE.public_key).digest()[:SESSION_ID_BYTES].hex()
    assert ALICE.session_id == session_id_for(ALICE.public_key)
    assert len(ALICE.session_id) == 2 * SESSION_ID_BYTES
    assert ALICE.session_id != BOB.session_id


def test_seeded_identity_is_deterministic_and_generated_ones_are_fresh() -> None:
    again = Identity.from_seed(b"identity-alice")
    assert again.public_key == ALICE.public_key
    assert again.private_bytes() == ALICE.private_bytes()
    assert Identity.generate().session_id != Identity.generate().session_id


def test_restarted_process_gets_a_new_session() -> None:
    # A restart is a new key, so nothing signed before can be confused with what is signed now.
    first, second = Identity.generate(), Identity.generate()
    assert first.session_id != second.session_id


def test_key_fingerprint_is_short_and_stable() -> None:
    fp = key_fingerprint(ALICE.public_key)
    assert fp == hashlib.sha256(ALICE.public_key).hexdigest()[:16]
    assert fp != key_fingerprint(BOB.public_key)


# -- canonical bytes and signatures -------------------------------------------------------------


def test_canonical_bytes_are_a_domain_tagged_msgpack_array() -> None:
    data = canonical(b"fabric/test/v1", "a", 1, [2.5, None], b"\x00")
    assert msgpack.unpackb(data, raw=False) == [b"fabric/test/v1", "a", 1, [2.5, None], b"\x00"]
    assert data == canonical(b"fabric/test/v1", "a", 1, [2.5, None], b"\x00")
    assert data != canonical(b"fabric/other/v1", "a", 1, [2.5, None], b"\x00")


def test_signature_covers_canonical_bytes_of_an_entry() -> None:
    body = make_body(ALICE, "10.0.0.1:7946", T0)
    entry = body.sign(ALICE)
    assert entry.signed_bytes == body.canonical_bytes()
    assert len(entry.signature) == SIGNATURE_BYTES
    v = Verifier()
    assert v.verify(ALICE.public_key, entry.signed_bytes, entry.signature)
    assert entry.verify(v)
    changed = body.canonical_bytes().replace(b"10.0.0.1", b"10.0.0.2")
    assert not v.verify(ALICE.public_key, changed, entry.signature)


def test_signature_for_one_record_kind_does_not_verify_as_another() -> None:
    # Same fields, different domains: an Alive signature is no use as an accusation.
    alive = Alive.make(ALICE, 3, "10.0.0.1:7946")
    v = Verifier()
    assert alive.verify(v)
    as_accusation = Accusation.message(0, ALICE.session_id, 3, ALICE.session_id)
    assert not v.verify(ALICE.public_key, as_accusation, alive.signature)


# -- verifier -----------------------------------------------------------------------------------


def test_verifier_caches_repeated_checks() -> None:
    v = Verifier()
    msg = canonical(b"fabric/test/v1", "hello")
    sig = ALICE.sign(msg)
    assert v.verify(ALICE.public_key, msg, sig)
    assert (v.verified, v.cache_hits) == (1, 0)
    for _ in range(10):
        assert v.verify(ALICE.public_key, msg, sig)
    assert (v.verified, v.cache_hits) == (1, 10)


def test_verifier_caches_negative_results_too() -> None:
    v = Verifier()
    msg = canonical(b"fabric/test/v1", "hello")
    sig = BOB.sign(msg)
    assert not v.verify(ALICE.public_key, msg, sig)
    assert not v.verify(ALICE.public_key, msg, sig)
    assert (v.verified, v.cache_hits) == (1, 1)


def test_verifier_rejects_wrong_key_and_tampered_message_or_signature() -> None:
    v = Verifier()
    msg = canonical(b"fabric/test/v1", "hello")
    sig = ALICE.sign(msg)
    assert not v.verify(BOB.public_key, msg, sig)
    assert not v.verify(ALICE.public_key, msg + b"\x00", sig)
    assert not v.verify(ALICE.public_key, msg[:-1], sig)
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    assert not v.verify(ALICE.public_key, msg, flipped)
    assert v.verify(ALICE.public_key, msg, sig)


@pytest.mark.parametrize(
    ("key_len", "sig_len"), [(31, 64), (33, 64), (0, 64), (32, 63), (32, 65), (32, 0)]
)
def test_verifier_rejects_wrong_length_inputs_without_crypto(key_len: int, sig_len: int) -> None:
    v = Verifier()
    msg = canonical(b"fabric/test/v1", "hello")
    key = (ALICE.public_key * 2)[:key_len]
    sig = (ALICE.sign(msg) * 2)[:sig_len]
    assert not v.verify(key, msg, sig)
    assert v.verified == 0


@pytest.mark.parametrize("key", [b"\xff" * 32, b"\x00" * 32, b"\x01" + b"\x00" * 31])
def test_verifier_rejects_invalid_curve_points_without_raising(key: bytes) -> None:
    assert not Verifier().verify(key, b"message", b"\x00" * 64)


def test_verifier_cache_is_bounded() -> None:
    v = Verifier(cache_size=2)
    msgs = [canonical(b"fabric/test/v1", i) for i in range(3)]
    sigs = [ALICE.sign(m) for m in msgs]
    for m, s in zip(msgs, sigs, strict=True):
        assert v.verify(ALICE.public_key, m, s)
    assert v.verified == 3
    assert v.verify(ALICE.public_key, msgs[2], sigs[2])  # still cached
    assert v.verified == 3
    assert v.verify(ALICE.public_key, msgs[0], sigs[0])  # evicted: checked again
    assert v.verified == 4


# -- provider certificates ----------------------------------------------------------------------


PROVIDER = ProviderKey("physics-lab", Identity.from_seed(b"identity-provider"))


def test_provider_cert_is_valid_for_the_certified_session_until_expiry() -> None:
    cert = PROVIDER.certify(ALICE.public_key, not_after=T0 + 3600)
    v = Verifier()
    assert cert.provider == "physics-lab"
    assert cert.provider_key == PROVIDER.identity.public_key
    assert cert.is_valid_for(ALICE.public_key, T0, v)
    assert cert.is_valid_for(ALICE.public_key, T0 + 3600, v)
    assert not cert.is_valid_for(ALICE.public_key, T0 + 3600.001, v)


def test_provider_cert_does_not_transfer_to_another_session() -> None:
    cert = PROVIDER.certify(ALICE.public_key, not_after=T0 + 3600)
    assert not cert.is_valid_for(BOB.public_key, T0, Verifier())


@pytest.mark.parametrize(
    "change",
    [
        {"provider": "other-lab"},
        {"not_after": T0 + 7200},
        {"provider_key": BOB.public_key},
        {"signature": b"\x00" * 64},
    ],
)
def test_tampered_provider_cert_is_invalid(change: dict[str, object]) -> None:
    cert = PROVIDER.certify(ALICE.public_key, not_after=T0 + 3600)
    tampered = replace(cert, **change)  # type: ignore[arg-type]
    assert not tampered.is_valid_for(ALICE.public_key, T0, Verifier())


def test_entry_with_provider_cert_names_its_verified_provider() -> None:
    cert = PROVIDER.certify(ALICE.public_key, not_after=T0 + 3600)
    body = replace(make_body(ALICE, "10.0.0.1:7946", T0), provider="physics-lab")
    entry = replace(body, provider_cert=cert).sign(ALICE)
    v = Verifier()
    assert entry.verify(v)
    assert entry.verified_provider(T0, v) == PROVIDER.fingerprint
    assert entry.verified_provider(T0 + 3601, v) is None  # certificate expired


def test_entry_claiming_another_provider_name_is_not_certified() -> None:
    cert = PROVIDER.certify(ALICE.public_key, not_after=T0 + 3600)
    body = replace(make_body(ALICE, "10.0.0.1:7946", T0), provider="chemistry-lab")
    entry = replace(body, provider_cert=cert).sign(ALICE)
    assert entry.verified_provider(T0, Verifier()) is None


def test_entry_with_forged_provider_cert_does_not_verify() -> None:
    # A cert lifted from another session: the session signs it, but the cert does not check.
    cert = PROVIDER.certify(BOB.public_key, not_after=T0 + 3600)
    body = replace(make_body(ALICE, "10.0.0.1:7946", T0), provider="physics-lab")
    entry = replace(body, provider_cert=cert).sign(ALICE)
    v = Verifier()
    assert not entry.verify(v)
    assert entry.verified_provider(T0, v) is None


def test_uncertified_entry_has_no_verified_provider() -> None:
    entry = make_body(ALICE, "10.0.0.1:7946", T0).sign(ALICE)
    assert entry.verified_provider(T0, Verifier()) is None


def test_provider_cert_wire_form_is_fixed_order() -> None:
    cert = PROVIDER.certify(ALICE.public_key, not_after=T0)
    assert cert.to_wire() == [cert.provider, cert.provider_key, cert.not_after, cert.signature]
    assert isinstance(cert, ProviderCert)


# -- provider key files -------------------------------------------------------------------------


def test_provider_key_save_load_round_trip(tmp_path: Path) -> None:
    key = ProviderKey.generate("physics-lab")
    path = tmp_path / "keys" / "provider.key"
    key.save(path)
    loaded = ProviderKey.load(path)
    assert loaded.provider == "physics-lab"
    assert loaded.identity.public_key == key.identity.public_key
    assert loaded.fingerprint == key.fingerprint
    cert = loaded.certify(ALICE.public_key, T0)
    assert cert.is_valid_for(ALICE.public_key, T0, Verifier())
    assert not list(path.parent.glob(".*.tmp"))  # atomic write leaves no temporary behind


def test_provider_key_file_is_private_to_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "provider.key"
    old_umask = os.umask(0)  # even with a permissive umask
    try:
        PROVIDER.save(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_provider_key_save_replaces_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "provider.key"
    ProviderKey.generate("old").save(path)
    PROVIDER.save(path)
    assert ProviderKey.load(path).fingerprint == PROVIDER.fingerprint
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not a key at all\n",
        b"\xc1",  # reserved msgpack byte
        b"\x91" * 100_000,  # deeply nested arrays
        msgpack.packb(42),
        msgpack.packb(["fabric-provider-key", 1, "lab"]),
        msgpack.packb(["fabric-provider-key", 2, "lab", b"k" * 32]),
        msgpack.packb(["fabric-cluster-keyring", 1, "lab", b"k" * 32]),
        msgpack.packb(["fabric-provider-key", 1, 7, b"k" * 32]),
        msgpack.packb(["fabric-provider-key", 1, "lab", b"k" * 31]),
        msgpack.packb(["fabric-provider-key", 1, "lab", "k" * 32]),
        msgpack.packb({"a": 1, "b": 2, "c": 3, "d": 4}),
        msgpack.packb(["fabric-provider-key", 1, "lab", b"k" * 32]) + b"trailing",
    ],
)
def test_garbage_provider_key_file_raises_key_file_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "provider.key"
    path.write_bytes(content)
    with pytest.raises(KeyFileError, match=str(path)):
        ProviderKey.load(path)


def test_missing_provider_key_file_raises_key_file_error(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read provider key"):
        ProviderKey.load(tmp_path / "absent.key")
    with pytest.raises(KeyFileError, match="cannot read provider key"):
        ProviderKey.load(tmp_path)  # a directory
