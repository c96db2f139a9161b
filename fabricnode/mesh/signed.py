"""What the mesh's operator-signed records share (engine assignments, the service file).

Each is a frozen dataclass with its parsed ``body`` (which carries the operator's public key),
the ``signed_bytes`` the signature covers and the ``signature``; this mixin gives them the same
fingerprint, verification, wire form and HTTP form. The mesh checks who signed, never what a
record means: that is each record's own module.
"""

from __future__ import annotations

from typing import Any, Protocol

from fabricnode.mesh import codec
from fabricnode.mesh.identity import SIGNATURE_BYTES, Verifier, key_fingerprint


class _OperatorBody(Protocol):
    @property
    def operator_key(self) -> bytes: ...


class OperatorSigned:
    body: Any  # an _OperatorBody
    signed_bytes: bytes
    signature: bytes

    @property
    def operator(self) -> str:
        """Fingerprint of the operator key that signed it."""
        return key_fingerprint(self.body.operator_key)

    def verify(self, verifier: Verifier) -> bool:
        return verifier.verify(self.body.operator_key, self.signed_bytes, self.signature)

    def to_wire(self) -> list[bytes]:
        return [self.signed_bytes, self.signature]

    def to_json(self) -> dict[str, str]:
        """The HTTP form (what ``fabric plan --apply`` and ``fabric services apply`` post):
        the signed bytes and the signature, base64."""
        return codec.signed_json(self.signed_bytes, self.signature)


def take_signed(obj: Any, max_bytes: int, what: str) -> tuple[bytes, bytes]:
    """``[signed bytes, signature]`` from the network, bounded (not parsed or verified)."""
    signed, signature = codec.take_list(obj, min_len=2, max_len=2, what=what)
    signed = codec.take_bytes(signed, max_len=max_bytes, what=what)
    return signed, codec.take_bytes(signature, size=SIGNATURE_BYTES, what="signature")
