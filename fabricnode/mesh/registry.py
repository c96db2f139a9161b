"""The node registry: a state-based CRDT of owner-signed entries.

Rules
-----
1. The registry is a map ``session_id -> SignedEntry``. Only the owner of a session (the holder
   of the private key whose public key hashes to the session id) can produce a valid entry for
   it. Entries that fail verification never enter the map.
2. An entry's *rank* is ``(state, version, digest)``. ``state`` follows the lifecycle
   JOIN < SERVING < DOWN < LEFT; ``version`` is the owner's counter, incremented on every
   re-signing (metadata change, expiry refresh, state change); ``digest`` (a hash of the signed
   bytes) only breaks ties between two different entries an owner signed with the same state and
   version, which an honest owner never does.
3. Merge keeps the entry of greater rank. Rank is a total order per session, so merge is a join
   on a lattice: commutative, associative, idempotent and inflationary. Because state is the most
   significant component, no entry can move a session backwards in its lifecycle, whatever its
   version (a "state rollback" loses).
4. Every entry carries ``expires_at`` (the owner's lease, at most ``max_entry_ttl_s`` past its
   ``updated_at``; in a Slurm job also never past the job's end). DOWN and LEFT entries are kept
   only ``terminal_hold_s`` after they were signed. Past that point (``gc_at``) the entry is
   removed and a tombstone remembering its rank is kept until every older version of the session
   has certainly expired (``updated_at + max_entry_ttl_s`` + clock skew). An arriving copy of
   rank <= the tombstone is dropped, and any copy whose own ``gc_at`` has passed is dropped, so a
   collected entry cannot come back through anti-entropy from a replica that still holds it.
5. Wall-clock times are the owner's; receivers tolerate ``max_clock_skew_s`` and refuse entries
   dated further in the future.
6. An entry names its owner's site (``EntryBody.site``, ``sites``): signed with the rest, so only
   the owner says where a node is. Entries without one (signed before sites) are of the default.

Theory of operation
-------------------
The registry is pure: every method that needs time takes ``now`` (wall-clock seconds). Gossip
feeds it entries received from peers (``merge``); the owner produces its own entry with
``EntryBody.sign`` and merges it locally like any other. Liveness (alive / suspect / dead) is
*not* part of the entry: a crashed owner cannot sign its own death. It is a local view kept by
``membership`` and joined with the registry only when presenting or routing.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from fabricnode.errors import DecodeError
from fabricnode.mesh import codec
from fabricnode.mesh.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    ProviderCert,
    Verifier,
    canonical,
    key_fingerprint,
    record_digest,
    session_id_for,
)
from fabricnode.mesh.sites import DEFAULT_SITE, SITE_LABEL, site_labels, site_problem, split_site

ENTRY_DOMAIN = b"fabric/entry/v1"
MAX_ENTRY_BYTES = 16 * 1024
MAX_MODELS = 64
MAX_MODEL_ID = 256  # characters, as every peer decodes a model id
MAX_LABELS = 64
MAX_LABEL_KEY = 64
MAX_LABEL_VALUE = 256  # characters; what every peer decodes (a longer one drops the entry)


class State(enum.IntEnum):
    JOIN = 0
    SERVING = 1
    DOWN = 2
    LEFT = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> State:
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown state {text!r} (join|serving|down|left)") from None


@dataclass(frozen=True)
class Addresses:
    http: str = ""
    gossip: str = ""


@dataclass(frozen=True)
class Hardware:
    gpu_type: str = ""
    gpu_count: int = 0
    gpu_memory_gb: float = 0.0
    host: str = ""


@dataclass(frozen=True)
class EngineInfo:
    kind: str = ""
    version: str = ""
    url: str = ""


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int | None = None
    quantization: str | None = None


@dataclass(frozen=True)
class EntryBody:
    """What an owner says about its session. Signed as canonical bytes, never as a map."""

    session_id: str
    public_key: bytes
    state: State
    version: int
    provider: str
    addresses: Addresses
    hardware: Hardware
    engine: EngineInfo
    models: tuple[ModelInfo, ...]
    labels: tuple[tuple[str, str], ...]
    started_at: float
    updated_at: float
    expires_at: float
    provider_cert: ProviderCert | None = None
    # The site (``sites``): signed as a label of its own, appended to ``labels`` on the wire
    # (none for the default site, so such an entry is what it was before sites existed).
    site: str = DEFAULT_SITE

    def fields(self) -> list[object]:
        return [
            self.session_id,
            self.public_key,
            int(self.state),
            self.version,
            self.provider,
            [self.addresses.http, self.addresses.gossip],
            [
                self.hardware.gpu_type,
                self.hardware.gpu_count,
                self.hardware.gpu_memory_gb,
                self.hardware.host,
            ],
            [self.engine.kind, self.engine.version, self.engine.url],
            [[m.id, m.max_model_len, m.quantization] for m in self.models],
            [[k, v] for k, v in self.labels] + site_labels(self.site),
            self.started_at,
            self.updated_at,
            self.expires_at,
            None if self.provider_cert is None else self.provider_cert.to_wire(),
        ]

    def canonical_bytes(self) -> bytes:
        return canonical(ENTRY_DOMAIN, *self.fields())

    def sign(self, identity: Identity) -> SignedEntry:
        if identity.session_id != self.session_id or identity.public_key != self.public_key:
            raise ValueError("an entry can only be signed by its own session key")
        for key, value in self.labels:  # what peers would refuse must not be signed
            if len(key) > MAX_LABEL_KEY or len(value) > MAX_LABEL_VALUE:
                raise ValueError(f"label {key[:64]!r}: key or value too long for the registry")
            if key == SITE_LABEL:
                raise ValueError(f"label {SITE_LABEL} is the site's: set EntryBody.site")
        problem = site_problem(self.site)
        if problem:
            raise ValueError(f"site {self.site[:40]!r}: {problem}")
        if len(self.labels) + len(site_labels(self.site)) > MAX_LABELS:
            raise ValueError(f"more than {MAX_LABELS} labels (the site counts as one)")
        data = self.canonical_bytes()
        if len(data) > MAX_ENTRY_BYTES:
            raise ValueError(f"entry of {len(data)} bytes exceeds {MAX_ENTRY_BYTES}")
        return SignedEntry(self, data, identity.sign(data))

    def successor(self, **changes: Any) -> EntryBody:
        """The next version of this body, with ``changes`` applied (state never goes back)."""
        new = replace(self, version=self.version + 1, **changes)
        if new.state < self.state:
            raise ValueError(f"lifecycle cannot go from {self.state.label} to {new.state.label}")
        return new


@dataclass(frozen=True)
class SignedEntry:
    body: EntryBody
    signed_bytes: bytes
    signature: bytes
    digest: bytes = field(init=False, repr=False, compare=False)
    # Computed once: merges and every anti-entropy row (one per member) read them. The rank is
    # (state, version, digest).
    rank: tuple[int, int, bytes] = field(init=False, repr=False, compare=False)
    session_id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        digest = record_digest(self.signed_bytes, self.signature)
        object.__setattr__(self, "digest", digest)
        object.__setattr__(self, "rank", (int(self.body.state), self.body.version, digest))
        object.__setattr__(self, "session_id", self.body.session_id)

    def gc_at(self, terminal_hold_s: float) -> float:
        """Wall-clock time after which every replica drops this entry."""
        if self.body.state >= State.DOWN:
            return min(self.body.expires_at, self.body.updated_at + terminal_hold_s)
        return self.body.expires_at

    def verify(self, verifier: Verifier) -> bool:
        body = self.body
        if session_id_for(body.public_key) != body.session_id:
            return False
        if not verifier.verify(body.public_key, self.signed_bytes, self.signature):
            return False
        cert = body.provider_cert
        return cert is None or verifier.verify(
            cert.provider_key, cert.message(body.public_key), cert.signature
        )

    def verified_provider(self, now: float, verifier: Verifier) -> str | None:
        """Fingerprint of the provider key that certified this session, if valid now."""
        cert = self.body.provider_cert
        if cert is None or cert.provider != self.body.provider:
            return None
        if not cert.is_valid_for(self.body.public_key, now, verifier):
            return None
        return key_fingerprint(cert.provider_key)

    def to_wire(self) -> list[bytes]:
        return [self.signed_bytes, self.signature]

    @classmethod
    def from_wire(cls, obj: Any) -> SignedEntry:
        """Parse (not verify) an entry received from the network; DecodeError if malformed."""
        signed_bytes, signature = codec.take_list(obj, min_len=2, max_len=2, what="entry")
        signed_bytes = codec.take_bytes(signed_bytes, max_len=MAX_ENTRY_BYTES, what="entry")
        signature = codec.take_bytes(signature, size=SIGNATURE_BYTES, what="signature")
        return cls(parse_body(signed_bytes), signed_bytes, signature)


def parse_body(signed_bytes: bytes) -> EntryBody:
    f = codec.take_list(
        codec.unpack(signed_bytes, max_bytes=MAX_ENTRY_BYTES, max_items=256),
        min_len=15,
        max_len=15,
        what="entry body",
    )
    if f[0] != ENTRY_DOMAIN:
        raise DecodeError("entry body: wrong domain tag")
    http, gossip = codec.take_list(f[6], min_len=2, max_len=2, what="addresses")
    gpu_type, gpu_count, gpu_mem, host = codec.take_list(f[7], min_len=4, max_len=4, what="hw")
    kind, eversion, url = codec.take_list(f[8], min_len=3, max_len=3, what="engine")
    models = []
    for m in codec.take_list(f[9], max_len=MAX_MODELS, what="models"):
        mid, mlen, quant = codec.take_list(m, min_len=3, max_len=3, what="model")
        models.append(
            ModelInfo(
                codec.take_printable(mid, max_len=MAX_MODEL_ID, what="model id"),
                codec.take_opt_int(mlen, hi=2**40, what="max_model_len"),
                codec.take_opt_str(quant, max_len=64, what="quantization"),
            )
        )
    labels = []
    for pair in codec.take_list(f[10], max_len=MAX_LABELS, what="labels"):
        k, v = codec.take_list(pair, min_len=2, max_len=2, what="label")
        labels.append(
            (
                codec.take_str(k, max_len=MAX_LABEL_KEY, what="label key", empty=False),
                codec.take_str(v, max_len=MAX_LABEL_VALUE, what="label value"),
            )
        )
    try:
        site, labels = split_site(labels)
    except ValueError as exc:
        raise DecodeError(f"labels: {exc}") from None
    cert = None
    if f[14] is not None:
        provider, pkey, not_after, sig = codec.take_list(f[14], min_len=4, max_len=4, what="cert")
        cert = ProviderCert(
            codec.take_str(provider, max_len=64, what="cert provider"),
            codec.take_bytes(pkey, size=PUBLIC_KEY_BYTES, what="provider key"),
            codec.take_float(not_after, what="cert not_after"),
            codec.take_bytes(sig, size=SIGNATURE_BYTES, what="cert signature"),
        )
    state = codec.take_int(f[3], hi=int(State.LEFT), what="state")
    session_id = codec.take_str(f[1], max_len=32, what="session id", empty=False)
    if len(session_id) != 32:
        raise DecodeError("session id: wrong length")
    return EntryBody(
        session_id=session_id,
        public_key=codec.take_bytes(f[2], size=PUBLIC_KEY_BYTES, what="public key"),
        state=State(state),
        version=codec.take_int(f[4], what="version"),
        provider=codec.take_str(f[5], max_len=64, what="provider"),
        addresses=Addresses(
            codec.take_url(http, max_len=300, what="http address"),
            codec.take_addr(gossip, max_len=300, what="gossip address", empty=True),
        ),
        hardware=Hardware(
            codec.take_str(gpu_type, max_len=64, what="gpu type"),
            codec.take_int(gpu_count, hi=4096, what="gpu count"),
            codec.take_float(gpu_mem, hi=1e6, what="gpu memory"),
            codec.take_str(host, max_len=255, what="host"),
        ),
        engine=EngineInfo(
            codec.take_str(kind, max_len=64, what="engine kind"),
            codec.take_str(eversion, max_len=64, what="engine version"),
            codec.take_url(url, max_len=300, what="engine url"),
        ),
        models=tuple(models),
        labels=tuple(labels),
        started_at=codec.take_float(f[11], what="started_at"),
        updated_at=codec.take_float(f[12], what="updated_at"),
        expires_at=codec.take_float(f[13], what="expires_at"),
        provider_cert=cert,
        site=site,
    )


def join(a: SignedEntry, b: SignedEntry) -> SignedEntry:
    """Lattice join of two entries of one session: the one of greater rank."""
    if a.session_id != b.session_id:
        raise ValueError("join of entries of different sessions")
    return a if a.rank >= b.rank else b


class MergeOutcome(enum.Enum):
    NEW = "new"
    UPDATED = "updated"
    STALE = "stale"  # older than or equal to what we hold (duplicates, replays, rollbacks)
    INVALID = "invalid"  # bad signature or id, or a lifetime the cluster does not allow
    EXPIRED = "expired"  # past its gc time, or rank covered by a tombstone
    COLLECTED = "collected"  # newer than ours but already collectable: ours is dropped too
    FULL = "full"  # a new session while the registry, or its provider's share, is at its cap

    @property
    def changed(self) -> bool:
        return self in (MergeOutcome.NEW, MergeOutcome.UPDATED)


@dataclass(frozen=True)
class RegistryLimits:
    terminal_hold_s: float = 300.0
    max_entry_ttl_s: float = 7200.0
    max_clock_skew_s: float = 60.0
    # Bounds on what a cluster-key holder can make every replica store: new sessions past them
    # are refused (counted as merges{outcome="full"}) until entries expire. Far above any real
    # mesh; a mesh whose one provider runs more agents raises the second.
    max_entries: int = 65536
    max_entries_per_provider: int = 16384


@dataclass(frozen=True)
class RegistryStatistics:
    entries: int
    tombstones: int
    by_state: dict[str, int]
    merges: dict[str, int]


class Registry:
    """A replica of the registry; pure (every time-dependent call takes ``now``)."""

    def __init__(self, verifier: Verifier, limits: RegistryLimits | None = None) -> None:
        self.verifier = verifier
        self.limits = limits or RegistryLimits()
        self._entries: dict[str, SignedEntry] = {}
        self._per_provider: dict[str, int] = {}  # live entries by provider name
        # session id -> (the collected entry, when to forget it). The entry is kept, signed, so
        # anti-entropy can show a replica that missed it why its older copy must go.
        self._tombstones: dict[str, tuple[SignedEntry, float]] = {}
        # (time, session id): when an entry is due for collection or a tombstone for forgetting.
        # Lazy: stale items (entry since replaced, tombstone since renewed) are skipped.
        self._due: list[tuple[float, str]] = []
        self._merges: dict[str, int] = {o.value: 0 for o in MergeOutcome}
        # Bumped on every change of the entry set, so readers (the ingress route table) can
        # cache what they derive from it and rebuild only when it moved.
        self.generation = 0

    # -- merge ------------------------------------------------------------------------------

    def merge(self, entry: SignedEntry, now: float, *, own: bool = False) -> MergeOutcome:
        """Merge one signed entry (``own``: this node's own, never refused for room)."""
        outcome = self._merge(entry, now, own)
        self._merges[outcome.value] += 1
        if outcome.changed or outcome is MergeOutcome.COLLECTED:
            self.generation += 1
        return outcome

    def _merge(self, entry: SignedEntry, now: float, own: bool) -> MergeOutcome:
        sid = entry.session_id
        current = self._entries.get(sid)
        if current is not None and entry.rank <= current.rank:
            return MergeOutcome.STALE  # cheap path: no signature check for what we have
        tomb = self._tombstones.get(sid)
        if tomb is not None and entry.rank <= tomb[0].rank:
            return MergeOutcome.EXPIRED
        if not self._lifetime_allowed(entry, now):
            return MergeOutcome.INVALID
        if now >= entry.gc_at(self.limits.terminal_hold_s):
            if current is None or not entry.verify(self.verifier):
                return MergeOutcome.EXPIRED
            # The owner moved past our copy and that newer entry is itself collectable (e.g. a
            # LEFT we missed while partitioned): collect ours as every other replica did.
            del self._entries[sid]
            self._count_provider(current.body.provider, -1)
            self._bury(entry, now)
            return MergeOutcome.COLLECTED
        provider = entry.body.provider
        counted = current is not None and current.body.provider == provider
        if not counted and not own and not self._has_room(provider, new_session=current is None):
            return MergeOutcome.FULL
        if not entry.verify(self.verifier):
            return MergeOutcome.INVALID
        if not counted:  # a new session, or one that moved to another provider
            if current is not None:
                self._count_provider(current.body.provider, -1)
            self._count_provider(provider, 1)
        self._entries[sid] = entry
        heapq.heappush(self._due, (entry.gc_at(self.limits.terminal_hold_s), sid))
        # A newer version outranks the tombstone, so it covers everything the tombstone did.
        self._tombstones.pop(sid, None)
        return MergeOutcome.NEW if current is None else MergeOutcome.UPDATED

    def _has_room(self, provider: str, *, new_session: bool) -> bool:
        """Whether one more entry of ``provider`` fits the caps (``RegistryLimits``)."""
        limits = self.limits
        if new_session and len(self._entries) >= limits.max_entries:
            return False
        return self._per_provider.get(provider, 0) < limits.max_entries_per_provider

    def _count_provider(self, provider: str, delta: int) -> None:
        n = self._per_provider.get(provider, 0) + delta
        if n > 0:
            self._per_provider[provider] = n
        else:
            self._per_provider.pop(provider, None)

    def _lifetime_allowed(self, entry: SignedEntry, now: float) -> bool:
        body = entry.body
        limits = self.limits
        return (
            body.updated_at <= now + limits.max_clock_skew_s
            and body.started_at <= body.updated_at
            and body.expires_at <= body.updated_at + limits.max_entry_ttl_s
        )

    def adopt(self, source: Registry, exclude: Iterable[str] = ()) -> None:
        """Join another replica's state (but the sessions in ``exclude``) into ours.

        For simulations of a formed cluster in one process: ``source``'s entries and tombstones
        passed its own merges, signature checks included, so they are shared rather than checked
        and copied again. The result is the lattice join, as if each had been merged here.
        """
        skip = set(exclude)
        entries = dict(source._entries)
        tombstones = dict(source._tombstones)
        for sid in skip:
            entries.pop(sid, None)
            tombstones.pop(sid, None)
        for sid, tomb in self._tombstones.items():
            theirs = tombstones.get(sid)
            if theirs is None or tomb[0].rank > theirs[0].rank:
                tombstones[sid] = tomb
        for sid, entry in self._entries.items():
            theirs_entry = entries.get(sid)
            if theirs_entry is None or entry.rank > theirs_entry.rank:
                entries[sid] = entry
        for sid, tomb in tombstones.items():
            held = entries.get(sid)
            if held is not None and held.rank <= tomb[0].rank:
                del entries[sid]
        for sid in [sid for sid in tombstones if sid in entries]:
            del tombstones[sid]  # a newer entry covers what its tombstone did
        due = list(source._due)  # a heap stays a heap when copied
        for item in self._due:
            heapq.heappush(due, item)
        # Entries per provider: the source's counts, corrected where the result can differ
        # from the source (the excluded sessions, and ours: entries or tombstones).
        counts = dict(source._per_provider)
        for sid in skip | self._entries.keys() | self._tombstones.keys():
            before, after = source._entries.get(sid), entries.get(sid)
            if before is not None:
                counts[before.body.provider] -= 1
            if after is not None:
                counts[after.body.provider] = counts.get(after.body.provider, 0) + 1
        self._per_provider = {p: n for p, n in counts.items() if n > 0}
        self._entries, self._tombstones, self._due = entries, tombstones, due
        self.generation += 1

    # -- garbage collection -----------------------------------------------------------------

    def gc(self, now: float) -> list[str]:
        """Drop entries past their gc time (tombstoning them) and forget old tombstones."""
        hold = self.limits.terminal_hold_s
        removed: list[str] = []
        while self._due and self._due[0][0] <= now:
            _, sid = heapq.heappop(self._due)
            entry = self._entries.get(sid)
            if entry is not None and now >= entry.gc_at(hold):
                del self._entries[sid]
                self._count_provider(entry.body.provider, -1)
                removed.append(sid)
                self._bury(entry, now)
                self.generation += 1
            elif entry is None:
                tomb = self._tombstones.get(sid)
                if tomb is not None and now >= tomb[1]:
                    del self._tombstones[sid]
        return removed

    def _bury(self, entry: SignedEntry, now: float) -> None:
        """Tombstone until every older version of the session has certainly expired."""
        limits = self.limits
        forget_at = max(
            now, entry.body.updated_at + limits.max_entry_ttl_s + limits.max_clock_skew_s
        )
        self._tombstones[entry.session_id] = (entry, forget_at)
        heapq.heappush(self._due, (forget_at, entry.session_id))

    def tombstone(self, session_id: str) -> SignedEntry | None:
        """The collected entry behind a tombstone, if any."""
        tomb = self._tombstones.get(session_id)
        return None if tomb is None else tomb[0]

    def tombstones(self) -> list[SignedEntry]:
        return [entry for entry, _ in self._tombstones.values()]

    def next_gc_at(self) -> float | None:
        return self._due[0][0] if self._due else None

    # -- reads ------------------------------------------------------------------------------

    def get(self, session_id: str) -> SignedEntry | None:
        return self._entries.get(session_id)

    def is_tombstoned(self, session_id: str) -> bool:
        return session_id in self._tombstones

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[SignedEntry]:
        return iter(list(self._entries.values()))

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def session_ids(self) -> list[str]:
        return list(self._entries)

    def digest(self) -> dict[str, tuple[int, int, bytes]]:
        """Rank of every entry held: what anti-entropy compares."""
        return {sid: e.rank for sid, e in self._entries.items()}

    def query(
        self,
        *,
        state: State | None = None,
        model: str | None = None,
        gpu: str | None = None,
        labels: Iterable[tuple[str, str]] = (),
        site: str | None = None,
    ) -> list[SignedEntry]:
        wanted = list(labels)
        gpu_lower = gpu.lower() if gpu else None
        out = []
        for entry in self._entries.values():
            body = entry.body
            if state is not None and body.state != state:
                continue
            if model is not None and not any(m.id == model for m in body.models):
                continue
            if gpu_lower is not None and body.hardware.gpu_type.lower() != gpu_lower:
                continue
            if site is not None and body.site != site:
                continue
            if wanted and not all(pair in body.labels for pair in wanted):
                continue
            out.append(entry)
        return out

    def statistics(self) -> RegistryStatistics:
        by_state = {s.label: 0 for s in State}
        for e in self._entries.values():
            by_state[e.body.state.label] += 1
        return RegistryStatistics(
            entries=len(self._entries),
            tombstones=len(self._tombstones),
            by_state=by_state,
            merges=dict(self._merges),
        )
