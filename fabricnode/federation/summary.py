"""Site summaries: what one site tells the others, signed with its site key. Pure (sans-IO).

A summary is everything routing a request to a site takes, and nothing of its nodes: which
models it serves and how much more it can take (``ModelCapacity`` per model), its gateways'
federation addresses, a sequence number and the time it was issued. Sites exchange summaries,
never registry entries (``docs/federation.md``).

Wire form
---------
``[signed_bytes, signature]``, msgpack, where ``signed_bytes`` are the canonical bytes
(``mesh.identity.canonical``) ``[b"fabric/site-summary/v1", site, seq, issued_at, [gateway,
...], [[model, replicas, admitting, waiting, prefill_backlog_tokens, kv_usage(, start_s)],
...]]``: an array in a fixed order, models sorted by name, never a map, so there is one byte
string per summary. ``start_s``, the seventh field, is there only when the site's acting
controller would start a replica of the model now and says in how many seconds it expects it
to serve (``ModelCapacity.start_s``): a model with no replica and no start is not listed.
The signature is the site key's Ed25519 signature over those bytes; it is checked
under the certificate pinned for the site the summary names (``view``), so a summary for site
C made by any other key fails wherever it goes.

``decode`` is strict and bounded: at most ``MAX_SUMMARY_BYTES``, ``MAX_MODELS`` models,
``MAX_GATEWAYS`` gateways, names of bounded length and printable, counts and fractions in
range, models strictly sorted (no duplicate), and re-encoding the decoded body must give the
signed bytes back (no second encoding of one summary). Every failure is a ``DecodeError``.

Sequence numbers: several gateways of one site sign summaries with the same key, and a gateway
restarts; so ``seq`` is taken from the wall clock in milliseconds, and never below the last one
this signer issued plus one (``next_seq``). Receivers keep the highest per site.

What a site serves: ``capacity_of`` reads a gateway's own registry (``MeshCore``) the way the
admin views do (``control.views.models_view``): per model, the SERVING entries the control
plane counts (``schema.CONTROL_COUNTS``) are its ``replicas``; of them, ``admitting`` are the
routable ones (alive, not suspect) that are awake and whose engine queues nothing (their latest
load report, at most ``max_load_age_s`` old); ``waiting`` and ``kv_usage`` (the mean) come from
the same reports. ``prefill_backlog_tokens`` is 0 until load reports carry it. ``starts``
(the controller's, when it acts on this gateway) adds each model it would start now, with its
expected start, and a row of no replica for one our site does not serve.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fabricnode.errors import DecodeError
from fabricnode.federation.sitekey import SiteKey, site_name_problem
from fabricnode.mesh import codec
from fabricnode.mesh.core import MeshCore
from fabricnode.mesh.identity import SIGNATURE_BYTES, canonical
from fabricnode.mesh.registry import MAX_MODEL_ID, SignedEntry, State
from fabricnode.mesh.schema import CONTROL_COUNTS, SLEEPING_LABEL, Standing

SUMMARY_DOMAIN = b"fabric/site-summary/v1"
MAX_MODELS = 512
MAX_GATEWAYS = 16
MAX_GATEWAY_ADDR = 300
MAX_REPLICAS = 1_000_000
MAX_WAITING = 10**9
MAX_BACKLOG_TOKENS = 10**15
MAX_SEQ = 2**62
MAX_TIME = 1e11  # seconds since the epoch: year 5138
MAX_START_S = 7 * 86400.0  # an expected start beyond a week says nothing
# the signed bytes' bound: 512 models of 256 characters (up to 4 bytes each) and their numbers
MAX_SUMMARY_BYTES = 256 * 1024 + MAX_MODELS * (4 * MAX_MODEL_ID + 48)
# Label a gateway's entry carries (its federation address): the summary lists every gateway
# of the site its registry knows, so peers learn them all from any one.
GATEWAY_LABEL = "fabric.gateway"


@dataclass(frozen=True)
class ModelCapacity:
    """How much of one model a site can take (``capacity_of`` says how each is counted)."""

    replicas: int
    admitting: int
    waiting: int
    prefill_backlog_tokens: int
    kv_usage: float  # mean over the replicas' reports, 0..1
    # Seconds until a replica the site's controller would start now is expected to serve (its
    # learned start-up time; None: it would start none now, or nobody here knows)
    start_s: float | None = None

    def row(self, name: str) -> list[object]:
        out: list[object] = [
            name,
            self.replicas,
            self.admitting,
            self.waiting,
            self.prefill_backlog_tokens,
            float(self.kv_usage),
        ]
        if self.start_s is not None:
            out.append(float(self.start_s))
        return out


@dataclass(frozen=True)
class SummaryBody:
    """A summary's content: what the site says, before or after signing."""

    site: str
    seq: int
    issued_at: float
    gateways: tuple[str, ...]
    models: Mapping[str, ModelCapacity]

    def canonical_bytes(self) -> bytes:
        rows = [cap.row(name) for name, cap in sorted(self.models.items())]
        return canonical(
            SUMMARY_DOMAIN, self.site, self.seq, float(self.issued_at), list(self.gateways), rows
        )


@dataclass(frozen=True)
class SiteSummary:
    """A signed summary: its body, the bytes the signature covers, the signature."""

    body: SummaryBody
    signed_bytes: bytes
    signature: bytes

    @property
    def site(self) -> str:
        return self.body.site

    @property
    def seq(self) -> int:
        return self.body.seq

    @classmethod
    def sign(cls, body: SummaryBody, key: SiteKey) -> SiteSummary:
        if body.site != key.site:
            raise ValueError(f"site key of {key.site!r} cannot sign for {body.site!r}")
        check_body(body)
        signed = body.canonical_bytes()
        return cls(body, signed, key.sign(signed))

    def encode(self) -> bytes:
        return codec.pack([self.signed_bytes, self.signature])

    def verify(self, public_key: bytes) -> bool:
        """Whether ``public_key`` (raw Ed25519) signed it."""
        try:
            Ed25519PublicKey.from_public_bytes(public_key).verify(self.signature, self.signed_bytes)
        except (InvalidSignature, ValueError):
            return False
        return True


def decode(data: bytes) -> SiteSummary:
    """Parse (not verify) a summary from the network; DecodeError if malformed."""
    outer = codec.unpack(data, max_bytes=MAX_SUMMARY_BYTES + 256, max_items=4)
    signed, signature = codec.take_list(outer, min_len=2, max_len=2, what="summary")
    signed = codec.take_bytes(signed, max_len=MAX_SUMMARY_BYTES, what="summary")
    signature = codec.take_bytes(signature, size=SIGNATURE_BYTES, what="summary signature")
    body = parse_body(signed)
    return SiteSummary(body, signed, signature)


def parse_body(signed: bytes) -> SummaryBody:
    obj = codec.unpack(signed, max_bytes=MAX_SUMMARY_BYTES, max_items=MAX_MODELS + 8)
    domain, site, seq, issued_at, gateways, rows = codec.take_list(
        obj, min_len=6, max_len=6, what="summary body"
    )
    if domain != SUMMARY_DOMAIN:
        raise DecodeError("summary: not a site summary")
    site = codec.take_str(site, max_len=64, what="summary site", empty=False)
    if site_name_problem(site):
        raise DecodeError("summary site: not a site name")
    seq = codec.take_int(seq, lo=1, hi=MAX_SEQ, what="summary seq")
    if not isinstance(issued_at, float):
        raise DecodeError("summary issued_at: expected a float")
    issued = codec.take_float(issued_at, lo=0.0, hi=MAX_TIME, what="summary issued_at")
    addrs = codec.take_list(gateways, max_len=MAX_GATEWAYS, what="summary gateways")
    gw = tuple(codec.take_addr(a, max_len=MAX_GATEWAY_ADDR, what="gateway") for a in addrs)
    if len(set(gw)) != len(gw):
        raise DecodeError("summary gateways: a gateway twice")
    models: dict[str, ModelCapacity] = {}
    previous = ""
    for row in codec.take_list(rows, max_len=MAX_MODELS, what="summary models"):
        models_row = codec.take_list(row, min_len=6, max_len=7, what="summary model")
        name, replicas, admitting, waiting, backlog, kv = models_row[:6]
        start_s = None
        if len(models_row) == 7:
            if not isinstance(models_row[6], float):
                raise DecodeError("start_s: expected a float")
            start_s = codec.take_float(models_row[6], lo=0.0, hi=MAX_START_S, what="start_s")
        name = codec.take_printable(name, max_len=MAX_MODEL_ID, what="summary model")
        if models and name <= previous:
            raise DecodeError("summary models: not sorted by name, or a model twice")
        previous = name
        replicas = codec.take_int(replicas, hi=MAX_REPLICAS, what="replicas")
        admitting = codec.take_int(admitting, hi=replicas, what="admitting")
        if not isinstance(kv, float):
            raise DecodeError("kv_usage: expected a float")
        models[name] = ModelCapacity(
            replicas,
            admitting,
            codec.take_int(waiting, hi=MAX_WAITING, what="waiting"),
            codec.take_int(backlog, hi=MAX_BACKLOG_TOKENS, what="prefill backlog"),
            codec.take_float(kv, lo=0.0, hi=1.0, what="kv_usage"),
            start_s,
        )
    body = SummaryBody(site, seq, issued, gw, models)
    if body.canonical_bytes() != signed:
        raise DecodeError("summary: not in canonical form")
    return body


def check_body(body: SummaryBody) -> None:
    """Refuse to sign what no receiver would decode (ValueError names the bound)."""
    if len(body.models) > MAX_MODELS:
        raise ValueError(f"more than {MAX_MODELS} models")
    if len(body.gateways) > MAX_GATEWAYS:
        raise ValueError(f"more than {MAX_GATEWAYS} gateways")
    try:
        parse_body(body.canonical_bytes())
    except DecodeError as exc:
        raise ValueError(str(exc)) from None


def next_seq(last: int, now: float) -> int:
    """The next sequence number of a signer: the wall clock in ms, above its last one."""
    return min(MAX_SEQ, max(last + 1, int(now * 1000)))


# -- what our site serves ------------------------------------------------------------------


def entry_site(entry: SignedEntry) -> str | None:
    """The site an entry says its node belongs to (signed by its owner; ``default`` for an
    entry of a version before sites)."""
    return entry.body.site


def in_site(entry: SignedEntry, site: str) -> bool:
    found = entry_site(entry)
    return found is None or found == site


def capacity_of(
    core: MeshCore,
    site: str,
    now: float,
    *,
    max_load_age_s: float = 10.0,
    site_of: Callable[[SignedEntry], bool] | None = None,
    starts: Mapping[str, float] | None = None,
) -> dict[str, ModelCapacity]:
    """Per model our site serves, its capacity (module docstring) as this registry sees it;
    per model in ``starts``, its expected start (a row of no replica if none serves).

    ``site_of`` decides which entries are of our site (default ``in_site``)."""
    mine = site_of or (lambda e: in_site(e, site))
    replicas: dict[str, int] = {}
    admitting: dict[str, int] = {}
    waiting: dict[str, int] = {}
    kv: dict[str, list[float]] = {}
    for entry in core.entries(CONTROL_COUNTS):
        body = entry.body
        if body.state != State.SERVING or not mine(entry):
            continue
        standing = core.standing_of(entry)
        asleep = any(k == SLEEPING_LABEL for k, _ in body.labels)
        load = core.loads.get(entry.session_id)
        fresh = load is not None and now - load.at <= max_load_age_s
        for model in {m.id for m in body.models}:
            replicas[model] = replicas.get(model, 0) + 1
            queue = load.waiting if load is not None and fresh else 0
            free = standing >= Standing.ROUTABLE and not asleep and queue <= 0
            admitting[model] = admitting.get(model, 0) + int(free)
            if load is not None and fresh:
                waiting[model] = waiting.get(model, 0) + max(0, load.waiting)
                kv.setdefault(model, []).append(min(1.0, max(0.0, load.kv_usage)))
    starting = {
        m: float(s)
        for m, s in (starts or {}).items()
        if 0.0 <= s <= MAX_START_S and 0 < len(m) <= MAX_MODEL_ID and m.isprintable()
    }
    out: dict[str, ModelCapacity] = {}
    for model in sorted(replicas.keys() | starting.keys())[:MAX_MODELS]:
        usage = kv.get(model, [])
        out[model] = ModelCapacity(
            min(MAX_REPLICAS, replicas.get(model, 0)),
            min(MAX_REPLICAS, admitting.get(model, 0)),
            min(MAX_WAITING, waiting.get(model, 0)),
            0,
            sum(usage) / len(usage) if usage else 0.0,
            starting.get(model),
        )
    return out


def gateways_of(core: MeshCore, site: str, own: str) -> tuple[str, ...]:
    """Our site's gateways as our registry knows them (their ``GATEWAY_LABEL``), ours first."""
    found = [own] if own else []
    for entry in core.entries(CONTROL_COUNTS):
        if not in_site(entry, site) or entry.body.state not in (State.JOIN, State.SERVING):
            continue
        for key, value in entry.body.labels:
            if key == GATEWAY_LABEL and value and value not in found and _addr_ok(value):
                found.append(value)
    return tuple(found[:MAX_GATEWAYS])


def _addr_ok(text: str) -> bool:
    try:
        codec.take_addr(text, max_len=MAX_GATEWAY_ADDR)
    except DecodeError:
        return False
    return True


def body_of(
    site: str,
    seq: int,
    now: float,
    gateways: Iterable[str],
    models: Mapping[str, ModelCapacity],
) -> SummaryBody:
    return SummaryBody(site, seq, float(now), tuple(gateways), dict(models))


def as_json(body: SummaryBody) -> dict[str, Any]:
    return {
        "site": body.site,
        "seq": body.seq,
        "issued_at": body.issued_at,
        "gateways": list(body.gateways),
        "models": {
            name: {
                "replicas": c.replicas,
                "admitting": c.admitting,
                "waiting": c.waiting,
                "prefill_backlog_tokens": c.prefill_backlog_tokens,
                "kv_usage": round(c.kv_usage, 4),
                "start_s": None if c.start_s is None else round(c.start_s, 1),
            }
            for name, c in sorted(body.models.items())
        },
    }
