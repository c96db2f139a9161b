"""The mesh's service file: one operator-signed document, replicated to every agent.

``fabric services apply FILE`` signs the operator's service file (which models the fabric keeps
served, and how; ``fabricnode.elastic.servicefile``) and hands it to any agent; the mesh carries
it to every other. The mesh treats the file as opaque text: it checks who signed it, never what
it says (the controller and the ingress parse it).

Rules
-----
1. A document is signed canonical bytes (domain ``fabric/services/v1``) carrying the operator's
   public key, the issue time and the file's UTF-8 text (at most ``MAX_SERVICES_TEXT`` bytes).
   It is accepted only if the signature holds *and* the key's fingerprint is one the agent
   trusts (``--trust-operator``), as engine assignments are.
2. The mesh holds one document: a last-writer-wins register ordered by ``(issued_at,
   digest)``, so replicas converge whatever the order of arrival. An operator replaces the file
   by applying a new one; an empty text is a valid file that declares nothing (it withdraws
   every declared model).
3. One dated further in the future than the clock skew allows is refused, so a wrong clock on
   the operator's machine cannot pin a file for ever.
4. Spreading: a new document goes to a few peers at once over reliable streams, and every
   anti-entropy exchange carries the holder's rank (``ServicesRank``): the side with the newer
   document sends it, the other asks for it, so a member that missed it converges at the next
   exchange with anybody who has it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fabricnode.errors import DecodeError
from fabricnode.mesh import codec
from fabricnode.mesh.assignment import Offer
from fabricnode.mesh.identity import (
    PUBLIC_KEY_BYTES,
    OperatorKey,
    Verifier,
    canonical,
)
from fabricnode.mesh.signed import OperatorSigned

SERVICES_DOMAIN = b"fabric/services/v1"
MAX_SERVICES_TEXT = 64 * 1024
MAX_SERVICES_BYTES = MAX_SERVICES_TEXT + 256
DIGEST_PREFIX = 8  # bytes of the digest a rank carries
# Where an agent takes the service file over HTTP (its ``to_json`` form; ``fabric services``).
SERVICES_PATH = "/fabric/v1/services"

Rank = tuple[float, bytes]  # (issued_at, digest prefix)


@dataclass(frozen=True)
class ServicesBody:
    issued_at: float
    text: str  # the service file as the operator wrote it
    operator_key: bytes

    def canonical_bytes(self) -> bytes:
        return canonical(SERVICES_DOMAIN, self.issued_at, self.text, self.operator_key)

    def sign(self, key: OperatorKey) -> SignedServices:
        if key.identity.public_key != self.operator_key:
            raise ValueError("a service file must be signed by the operator key it names")
        if len(self.text.encode()) > MAX_SERVICES_TEXT:
            raise ValueError(f"a service file is at most {MAX_SERVICES_TEXT} bytes")
        data = self.canonical_bytes()
        return SignedServices(self, data, key.identity.sign(data))


@dataclass(frozen=True)
class SignedServices(OperatorSigned[ServicesBody]):
    MAX_BYTES = MAX_SERVICES_BYTES
    WHAT = "services"

    @classmethod
    def parse_signed_body(cls, signed_bytes: bytes) -> ServicesBody:
        return parse_body(signed_bytes)

    @property
    def rank(self) -> Rank:
        return (self.body.issued_at, self.digest[:DIGEST_PREFIX])

    def describe(self) -> dict[str, object]:
        return {
            "issued_at": self.body.issued_at,
            "operator": self.operator,
            "digest": self.digest.hex()[:16],
            "bytes": len(self.body.text.encode()),
        }


def parse_body(signed_bytes: bytes) -> ServicesBody:
    f = codec.take_list(
        codec.unpack(signed_bytes, max_bytes=MAX_SERVICES_BYTES, max_items=16),
        min_len=4,
        max_len=4,
        what="services body",
    )
    if f[0] != SERVICES_DOMAIN:
        raise DecodeError("services body: wrong domain tag")
    return ServicesBody(
        issued_at=codec.take_float(f[1], what="issued_at"),
        text=codec.take_str(f[2], max_len=MAX_SERVICES_TEXT, what="service file"),
        operator_key=codec.take_bytes(f[3], size=PUBLIC_KEY_BYTES, what="operator key"),
    )


class ServicesRegister:
    """The replicated service file (see the module docstring)."""

    def __init__(
        self,
        trusted_operators: Iterable[str],
        verifier: Verifier,
        *,
        max_clock_skew_s: float = 60.0,
    ) -> None:
        self.trusted = frozenset(trusted_operators)
        self.verifier = verifier
        self.max_clock_skew_s = max_clock_skew_s
        self.current: SignedServices | None = None

    @property
    def rank(self) -> Rank | None:
        return None if self.current is None else self.current.rank

    def newer_than(self, rank: Rank | None) -> bool:
        """Whether the document held is newer than one of ``rank`` (None: no document)."""
        return self.current is not None and (rank is None or self.current.rank > rank)

    def offer(self, item: SignedServices, now: float) -> Offer:
        """Merge one received (or locally published) document."""
        if item.body.issued_at > now + self.max_clock_skew_s:
            return Offer.FUTURE
        if item.operator not in self.trusted:
            return Offer.UNTRUSTED
        if self.current is not None and self.current.rank >= item.rank:
            return Offer.STALE
        if not item.verify(self.verifier):  # last: the expensive check
            return Offer.BAD_SIGNATURE
        self.current = item
        return Offer.NEW
