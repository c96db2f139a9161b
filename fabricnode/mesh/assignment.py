"""Engine assignments: an operator's signed instruction "node S, serve model M with TP x DP".

``fabric plan --apply`` turns a placement into one assignment per JOIN-only node, signs each
with the operator key (``fabric keys new-operator``) and hands them to any agent, which spreads
them through the mesh like registry entries (gossip, then anti-entropy while the target has not
acted). The target node, if it was started with an engine template and trusts the operator key
(``--trust-operator FINGERPRINT``), launches its engine from the template and goes SERVING.

Rules
-----
1. An assignment is signed canonical bytes (domain ``fabric/assignment/v1``) carrying the
   operator's public key; it is accepted only if the signature holds *and* the key's
   fingerprint is one the agent trusts. Agents that trust no operator refuse every assignment,
   so a member holding only the cluster key cannot make nodes run arbitrary models.
2. The table is a CRDT map ``target session -> assignment``: merge keeps the greater
   ``(issued_at, digest)``, so replicas converge whatever the order of arrival.
3. Every assignment expires (``expires_at``); expired ones and those whose target has left are
   collected. One dated further in the future than the clock skew allows is refused.
4. A node acts on an assignment only while it runs no engine: a newer plan does not replace a
   running engine (the operator drains such nodes with ``scancel``; SERVING GPUs are counted as
   already placed when the next plan is applied).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from fabricnode.errors import DecodeError
from fabricnode.mesh import codec
from fabricnode.mesh.identity import (
    PUBLIC_KEY_BYTES,
    OperatorKey,
    Verifier,
    canonical,
)
from fabricnode.mesh.signed import OperatorSigned

ASSIGNMENT_DOMAIN = b"fabric/assignment/v1"
MAX_ASSIGNMENT_BYTES = 1024
MAX_PLAN_ID = 32
MAX_MODEL_ID = 256
MAX_PARALLEL = 1024
DEFAULT_ASSIGNMENT_TTL_S = 1800.0
# Where an agent takes assignments over HTTP (their ``to_json`` form; ``fabric plan --apply``).
ASSIGNMENTS_PATH = "/fabric/v1/assignments"


@dataclass(frozen=True)
class AssignmentBody:
    target: str  # session id of the node that should act
    plan_id: str
    issued_at: float
    expires_at: float
    model: str
    tp: int
    dp: int  # replicas on this node (each of tp GPUs)
    operator_key: bytes

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    def canonical_bytes(self) -> bytes:
        return canonical(
            ASSIGNMENT_DOMAIN,
            self.target,
            self.plan_id,
            self.issued_at,
            self.expires_at,
            self.model,
            self.tp,
            self.dp,
            self.operator_key,
        )

    def sign(self, key: OperatorKey) -> SignedAssignment:
        if key.identity.public_key != self.operator_key:
            raise ValueError("an assignment must be signed by the operator key it names")
        _check_body(self)
        data = self.canonical_bytes()
        return SignedAssignment(self, data, key.identity.sign(data))


def _check_body(body: AssignmentBody) -> None:
    if len(body.target) != 32:
        raise ValueError("assignment target: not a session id")
    if not body.plan_id or len(body.plan_id) > MAX_PLAN_ID:
        raise ValueError(f"plan id must be 1..{MAX_PLAN_ID} characters")
    if not body.model or len(body.model) > MAX_MODEL_ID:
        raise ValueError(f"model id must be 1..{MAX_MODEL_ID} characters")
    if not (1 <= body.tp <= MAX_PARALLEL and 1 <= body.dp <= MAX_PARALLEL):
        raise ValueError(f"tp and dp must be 1..{MAX_PARALLEL}")
    if not body.expires_at > body.issued_at:
        raise ValueError("an assignment must expire after it was issued")


@dataclass(frozen=True)
class SignedAssignment(OperatorSigned[AssignmentBody]):
    MAX_BYTES = MAX_ASSIGNMENT_BYTES
    WHAT = "assignment"

    @classmethod
    def parse_signed_body(cls, signed_bytes: bytes) -> AssignmentBody:
        return parse_body(signed_bytes)

    @property
    def target(self) -> str:
        return self.body.target

    @property
    def rank(self) -> tuple[float, bytes]:
        return (self.body.issued_at, self.digest)

    def describe(self) -> dict[str, object]:
        b = self.body
        return {
            "target": b.target,
            "plan_id": b.plan_id,
            "model": b.model,
            "tp": b.tp,
            "dp": b.dp,
            "issued_at": b.issued_at,
            "expires_at": b.expires_at,
            "operator": self.operator,
        }


def parse_body(signed_bytes: bytes) -> AssignmentBody:
    f = codec.take_list(
        codec.unpack(signed_bytes, max_bytes=MAX_ASSIGNMENT_BYTES, max_items=32),
        min_len=9,
        max_len=9,
        what="assignment body",
    )
    if f[0] != ASSIGNMENT_DOMAIN:
        raise DecodeError("assignment body: wrong domain tag")
    target = codec.take_str(f[1], max_len=32, what="target", empty=False)
    if len(target) != 32:
        raise DecodeError("assignment target: wrong length")
    body = AssignmentBody(
        target=target,
        plan_id=codec.take_str(f[2], max_len=MAX_PLAN_ID, what="plan id", empty=False),
        issued_at=codec.take_float(f[3], what="issued_at"),
        expires_at=codec.take_float(f[4], what="expires_at"),
        model=codec.take_str(f[5], max_len=MAX_MODEL_ID, what="model", empty=False),
        tp=codec.take_int(f[6], lo=1, hi=MAX_PARALLEL, what="tp"),
        dp=codec.take_int(f[7], lo=1, hi=MAX_PARALLEL, what="dp"),
        operator_key=codec.take_bytes(f[8], size=PUBLIC_KEY_BYTES, what="operator key"),
    )
    if not body.expires_at > body.issued_at:
        raise DecodeError("assignment: expires before it was issued")
    return body


class Offer(enum.Enum):
    NEW = "new"  # stored (first for its target, or newer than what we held)
    STALE = "stale"  # we hold this one or a newer one
    UNTRUSTED = "untrusted"  # signed by a key we do not trust
    BAD_SIGNATURE = "bad_signature"
    EXPIRED = "expired"
    FUTURE = "future"  # issued further ahead of our clock than the skew allows
    FULL = "full"  # the table is at its cap

    @property
    def accepted(self) -> bool:
        return self in (Offer.NEW, Offer.STALE)


class AssignmentTable:
    """The replicated map target -> assignment (see the module docstring)."""

    def __init__(
        self,
        trusted_operators: Iterable[str],
        verifier: Verifier,
        *,
        max_items: int = 4096,
        max_clock_skew_s: float = 60.0,
    ) -> None:
        self.trusted = frozenset(trusted_operators)
        self.verifier = verifier
        self.max_items = max_items
        self.max_clock_skew_s = max_clock_skew_s
        self._by_target: dict[str, SignedAssignment] = {}

    def __len__(self) -> int:
        return len(self._by_target)

    def __iter__(self) -> Iterator[SignedAssignment]:
        return iter(list(self._by_target.values()))

    def get(self, target: str) -> SignedAssignment | None:
        return self._by_target.get(target)

    def offer(self, item: SignedAssignment, now: float) -> Offer:
        """Merge one received (or locally published) assignment."""
        body = item.body
        if now > body.expires_at:
            return Offer.EXPIRED
        if body.issued_at > now + self.max_clock_skew_s:
            return Offer.FUTURE
        if item.operator not in self.trusted:
            return Offer.UNTRUSTED
        held = self._by_target.get(body.target)
        if held is not None and held.rank >= item.rank:
            return Offer.STALE
        if held is None and len(self._by_target) >= self.max_items:
            return Offer.FULL
        # Verify last: it is the expensive step, and the checks above drop most junk.
        if not item.verify(self.verifier):
            return Offer.BAD_SIGNATURE
        self._by_target[body.target] = item
        return Offer.NEW

    def collect(self, now: float, gone: Callable[[str], bool]) -> list[str]:
        """Drop expired assignments and those whose target is gone; returns their targets."""
        dropped = [t for t, a in self._by_target.items() if now > a.body.expires_at or gone(t)]
        for t in dropped:
            del self._by_target[t]
        return dropped
