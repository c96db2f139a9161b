"""What the mesh's operator-signed records share (engine assignments, the service file).

Each is a frozen dataclass derived from ``OperatorSigned[Body]``: its parsed ``body`` (which
carries the operator's public key), the ``signed_bytes`` the signature covers, the
``signature`` and their ``digest``. The base gives them the same fingerprint, verification,
wire form and HTTP form, and parses both forms with the record's own bound (``MAX_BYTES``),
name (``WHAT``) and body parser (``parse_signed_body``). The mesh checks who signed, never what
a record means: that is each record's own module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from fabricnode.mesh import codec
from fabricnode.mesh.identity import SIGNATURE_BYTES, Verifier, key_fingerprint, record_digest


class _OperatorBody(Protocol):
    @property
    def operator_key(self) -> bytes: ...


B = TypeVar("B", bound=_OperatorBody)


@dataclass(frozen=True)
class OperatorSigned(Generic[B]):
    body: B
    signed_bytes: bytes
    signature: bytes
    digest: bytes = field(init=False, repr=False, compare=False)

    MAX_BYTES: ClassVar[int]  # the bound on the signed bytes from the network
    WHAT: ClassVar[str]  # the record's name in decoding errors and its HTTP form

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", record_digest(self.signed_bytes, self.signature))

    @classmethod
    def parse_signed_body(cls, signed_bytes: bytes) -> B:
        """The record's body from its signed bytes; DecodeError if malformed."""
        raise NotImplementedError

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        """Parse (not verify) a record from the network; DecodeError if malformed."""
        signed, signature = take_signed(obj, cls.MAX_BYTES, cls.WHAT)
        return cls(cls.parse_signed_body(signed), signed, signature)

    @classmethod
    def from_json(cls, doc: Any) -> Self:
        return cls.from_wire(codec.signed_from_json(doc, cls.WHAT))

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
