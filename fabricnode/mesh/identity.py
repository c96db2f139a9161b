"""Who signed what: per-process session keys, provider keys, and signature checks.

Every agent process makes a fresh Ed25519 key when it starts. Its *session id* is derived from
the public key (first 16 bytes of SHA-256, hex), so an id is self-certifying: whoever presents a
record for session S must also present a public key hashing to S and a signature under it. A
restarted agent or engine is a new session with a new key, so nothing it signed before can be
confused with what it signs now.

Signatures always cover canonical bytes: a msgpack array whose first element is a domain tag
(e.g. ``b"fabric/entry/v1"``) followed by fields in a fixed order. Maps are never signed, so
there is exactly one byte string per logical record, and a signature for one kind of record can
never be replayed as another kind.

An optional long-lived *provider key* (kept by a researcher or site, see ``fabric keys
new-provider``) certifies session keys: a ``ProviderCert`` says "session key K speaks for
provider P until T". Routing by trusted provider relies on that certificate, not on the
free-text provider name.

Verification is the dominant CPU cost of gossip, and the same record reaches a node many
times, so ``Verifier`` caches results keyed by the digest of (key, message, signature).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fabricnode.errors import KeyFileError

SESSION_ID_BYTES = 16
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
PROVIDER_CERT_DOMAIN = b"fabric/provider-cert/v1"


def canonical(domain: bytes, *fields: object) -> bytes:
    """The one byte string a signature covers: ``[domain, *fields]`` as msgpack."""
    data: bytes = msgpack.packb([domain, *fields], use_bin_type=True)
    return data


def record_digest(signed_bytes: bytes, signature: bytes) -> bytes:
    """8-byte digest of a signed record: the tie-breaker of its CRDT rank and its sync id."""
    return hashlib.blake2b(signed_bytes + signature, digest_size=8).digest()


def session_id_for(public_key: bytes) -> str:
    """Self-certifying session id of a public key."""
    return hashlib.sha256(public_key).digest()[:SESSION_ID_BYTES].hex()


def key_fingerprint(public_key: bytes) -> str:
    """Short printable name of a provider (or any) public key."""
    return hashlib.sha256(public_key).hexdigest()[:16]


class Identity:
    """A private Ed25519 key and the session id it speaks for."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.session_id: str = session_id_for(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity for tests and simulations (seed: 32 bytes)."""
        return cls(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest()))

    def sign(self, message: bytes) -> bytes:
        return self._private_key.sign(message)

    def private_bytes(self) -> bytes:
        return self._private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )


class Verifier:
    """Ed25519 verification with a bounded cache of results (positive and negative)."""

    def __init__(self, cache_size: int = 16384) -> None:
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._cache_size = cache_size
        self.verified = 0
        self.cache_hits = 0

    def verify(self, public_key: bytes, message: bytes, signature: bytes) -> bool:
        if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            return False
        key = hashlib.blake2b(public_key + signature + message, digest_size=16).digest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return cached
        try:
            Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
            ok = True
        except (InvalidSignature, ValueError):
            ok = False
        self.verified += 1
        self._cache[key] = ok
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ok


@dataclass(frozen=True)
class ProviderCert:
    """A provider key's statement that a session key speaks for ``provider`` until ``not_after``."""

    provider: str
    provider_key: bytes
    not_after: float
    signature: bytes

    def message(self, session_public_key: bytes) -> bytes:
        return canonical(
            PROVIDER_CERT_DOMAIN,
            self.provider,
            self.provider_key,
            session_public_key,
            self.not_after,
        )

    def to_wire(self) -> list[object]:
        return [self.provider, self.provider_key, self.not_after, self.signature]

    def is_valid_for(self, session_public_key: bytes, now: float, verifier: Verifier) -> bool:
        if now > self.not_after:
            return False
        return verifier.verify(self.provider_key, self.message(session_public_key), self.signature)


class ProviderKey:
    """A long-lived provider key that certifies session keys."""

    def __init__(self, provider: str, identity: Identity) -> None:
        self.provider = provider
        self.identity = identity

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.identity.public_key)

    def certify(self, session_public_key: bytes, not_after: float) -> ProviderCert:
        unsigned = ProviderCert(self.provider, self.identity.public_key, not_after, b"")
        signature = self.identity.sign(unsigned.message(session_public_key))
        return ProviderCert(self.provider, self.identity.public_key, not_after, signature)

    @classmethod
    def generate(cls, provider: str) -> ProviderKey:
        return cls(provider, Identity.generate())

    def save(self, path: Path) -> None:
        body = msgpack.packb(
            ["fabric-provider-key", 1, self.provider, self.identity.private_bytes()],
            use_bin_type=True,
        )
        write_private(path, body)

    @classmethod
    def load(cls, path: Path) -> ProviderKey:
        try:
            raw = path.read_bytes()
            tag, version, provider, private = msgpack.unpackb(raw, raw=False)
        except OSError as exc:
            raise KeyFileError(f"cannot read provider key {path}: {exc.strerror}") from exc
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise KeyFileError(f"{path} is not a fabric provider key") from exc
        if tag != "fabric-provider-key" or version != 1 or not isinstance(provider, str):
            raise KeyFileError(f"{path} is not a fabric provider key")
        if not isinstance(private, bytes) or len(private) != 32:
            raise KeyFileError(f"{path} holds a malformed provider key")
        return cls(provider, Identity(Ed25519PrivateKey.from_private_bytes(private)))


class OperatorKey:
    """A long-lived operator key: signs engine assignments (``fabric plan --apply``).

    Agents act on an assignment only if they trust the key's fingerprint
    (``--trust-operator``); see ``fabricnode.mesh.assignment``.
    """

    FILE_TAG = "fabric-operator-key"

    def __init__(self, identity: Identity) -> None:
        self.identity = identity

    @property
    def public_key(self) -> bytes:
        return self.identity.public_key

    @property
    def fingerprint(self) -> str:
        return key_fingerprint(self.identity.public_key)

    @classmethod
    def generate(cls) -> OperatorKey:
        return cls(Identity.generate())

    def save(self, path: Path) -> None:
        body = msgpack.packb([self.FILE_TAG, 1, self.identity.private_bytes()], use_bin_type=True)
        write_private(path, body)

    @classmethod
    def load(cls, path: Path) -> OperatorKey:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise KeyFileError(
                f"cannot read operator key {path}: {exc.strerror} "
                "(create one with `fabric keys new-operator`)"
            ) from exc
        try:
            tag, version, private = msgpack.unpackb(raw, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise KeyFileError(f"{path} is not a fabric operator key") from exc
        if tag != cls.FILE_TAG or version != 1:
            raise KeyFileError(f"{path} is not a fabric operator key")
        if not isinstance(private, bytes) or len(private) != 32:
            raise KeyFileError(f"{path} holds a malformed operator key")
        return cls(Identity(Ed25519PrivateKey.from_private_bytes(private)))


def write_private(path: Path, body: bytes) -> None:
    """Write a secret file readable by its owner only (atomic replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
