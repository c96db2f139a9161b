"""Cluster keys: AEAD on every gossip datagram, with a keyring for rotation without restart.

A cluster key is 32 random bytes; its *key id* is the first 4 bytes of its SHA-256. The keyring
file (JSON, mode 0600, default ``$FABRIC_HOME/cluster.key``) holds one or more keys and names
the *primary* one, used to seal what we send. Anything sealed under any key in the ring opens.

Sealed datagram layout (all integers big-endian)::

    b"FB" | format version (1 byte) | key id (4 bytes) | nonce (12 bytes) | ChaCha20-Poly1305(
        plaintext, aad = the 7 header bytes)

Rotation with no downtime, run against the shared keyring file that agents re-read when it
changes (``fabric keys add`` → every agent can open both → ``fabric keys use NEW`` → every agent
seals with the new key → ``fabric keys remove OLD``). Because every agent accepts every key in
its ring, agents that have and have not yet re-read the file keep talking throughout.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from fabricnode.errors import CryptoError, KeyFileError
from fabricnode.mesh.identity import write_private

MAGIC = b"FB"
FORMAT_VERSION = 1
KEY_BYTES = 32
KEY_ID_BYTES = 4
NONCE_BYTES = 12
HEADER_BYTES = len(MAGIC) + 1 + KEY_ID_BYTES
SEAL_OVERHEAD = HEADER_BYTES + NONCE_BYTES + 16  # header, nonce, Poly1305 tag
FILE_FORMAT = "fabric-cluster-keyring"


def key_id_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()[:KEY_ID_BYTES]


def new_cluster_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


@dataclass
class Keyring:
    """The cluster keys a node accepts, and the one it seals with."""

    keys: dict[bytes, bytes] = field(default_factory=dict)  # key id -> key
    primary: bytes = b""  # key id
    _aeads: dict[bytes, ChaCha20Poly1305] = field(default_factory=dict, repr=False)

    @classmethod
    def with_key(cls, key: bytes) -> Keyring:
        ring = cls()
        ring.add(key)
        ring.use(key_id_of(key))
        return ring

    # -- management -------------------------------------------------------------------------

    def add(self, key: bytes) -> bytes:
        if len(key) != KEY_BYTES:
            raise KeyFileError(f"a cluster key must be {KEY_BYTES} bytes, got {len(key)}")
        kid = key_id_of(key)
        self.keys[kid] = key
        self._aeads[kid] = ChaCha20Poly1305(key)
        if not self.primary:
            self.primary = kid
        return kid

    def use(self, kid: bytes) -> None:
        if kid not in self.keys:
            raise KeyFileError(f"no key with id {kid.hex()} in the keyring")
        self.primary = kid

    def remove(self, kid: bytes) -> None:
        if kid not in self.keys:
            raise KeyFileError(f"no key with id {kid.hex()} in the keyring")
        if kid == self.primary:
            raise KeyFileError(
                f"key {kid.hex()} is the primary key; `fabric keys use` another one first"
            )
        del self.keys[kid]
        del self._aeads[kid]

    def key_ids(self) -> list[str]:
        return sorted(kid.hex() for kid in self.keys)

    def replace_with(self, other: Keyring) -> None:
        """Adopt another ring's keys in place (live reload keeps object identity)."""
        self.keys = dict(other.keys)
        self._aeads = dict(other._aeads)
        self.primary = other.primary

    # -- AEAD -------------------------------------------------------------------------------

    def seal(self, plaintext: bytes) -> bytes:
        if not self.primary:
            raise CryptoError("the keyring is empty")
        header = MAGIC + bytes([FORMAT_VERSION]) + self.primary
        nonce = secrets.token_bytes(NONCE_BYTES)
        return header + nonce + self._aeads[self.primary].encrypt(nonce, plaintext, header)

    def open(self, datagram: bytes) -> bytes:
        if len(datagram) < SEAL_OVERHEAD:
            raise CryptoError("datagram too short")
        header = datagram[:HEADER_BYTES]
        if header[:2] != MAGIC or header[2] != FORMAT_VERSION:
            raise CryptoError("not a fabric datagram")
        aead = self._aeads.get(header[3:HEADER_BYTES])
        if aead is None:
            raise CryptoError("sealed under a key id not in the keyring")
        nonce = datagram[HEADER_BYTES : HEADER_BYTES + NONCE_BYTES]
        try:
            return aead.decrypt(nonce, datagram[HEADER_BYTES + NONCE_BYTES :], header)
        except InvalidTag as exc:
            raise CryptoError("authentication failed") from exc

    # -- file -------------------------------------------------------------------------------

    def to_json(self) -> str:
        doc = {
            "format": FILE_FORMAT,
            "version": 1,
            "primary": self.primary.hex(),
            "keys": {
                kid.hex(): base64.b64encode(key).decode() for kid, key in sorted(self.keys.items())
            },
        }
        return json.dumps(doc, indent=2) + "\n"

    def save(self, path: Path) -> None:
        write_private(path, self.to_json().encode())

    @classmethod
    def load(cls, path: Path) -> Keyring:
        try:
            text = path.read_text()
        except FileNotFoundError as exc:
            raise KeyFileError(
                f"cluster key file {path} does not exist (create one with "
                f"`fabric keys new-cluster {path}`)"
            ) from exc
        except OSError as exc:
            raise KeyFileError(f"cannot read cluster key file {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise KeyFileError(f"{path} is not a valid fabric cluster keyring") from exc
        return cls.from_json(text, source=str(path))

    @classmethod
    def from_json(cls, text: str, source: str = "keyring") -> Keyring:
        try:
            doc = json.loads(text)
            if doc.get("format") != FILE_FORMAT or doc.get("version") != 1:
                raise ValueError("format")
            ring = cls()
            for kid_hex, b64 in doc["keys"].items():
                kid = ring.add(base64.b64decode(b64, validate=True))
                if kid.hex() != kid_hex:
                    raise ValueError("key id mismatch")
            if not ring.keys:
                raise KeyFileError(f"{source} holds no keys")
            ring.use(bytes.fromhex(doc["primary"]))
        except KeyFileError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise KeyFileError(f"{source} is not a valid fabric cluster keyring") from exc
        return ring


def file_signature(path: Path) -> tuple[int, int] | None:
    """(mtime_ns, size) of a key file, to notice edits cheaply; None when absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)
