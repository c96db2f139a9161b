"""The pure request decoder of the ``/v1`` data plane: a request in, its routed record
(``Routed``) or an OpenAI error out.

``decode`` runs every check the ingress makes before it routes, in this order, each with its own
status and code: the API key (401 ``invalid_api_key``, only when a keys file exists; named by
``Authorization: Bearer KEY`` or Anthropic's ``x-api-key: KEY``), its rate limit (429
``rate_limit_exceeded`` with ``Retry-After``) -- both in ``authorize``, which the stateful
Responses paths use alone --, the body (400 ``invalid_json`` when it is not JSON or not an
object; for the audio endpoints 400 ``invalid_form`` when it is not a readable
``multipart/form-data`` body), ``model`` (400 ``invalid_model``), the ``X-Fabric-Providers``
and ``X-Fabric-Require`` headers, then ``X-Fabric-Priority`` (400 ``invalid_header``). The
header grammars live here too.
No sockets, no trio, no clock reads: the rate limiter and ``now`` are passed in.

``Routed`` is the one record of a request that routing reads, each field worked out once: the
policies' part (``RouteRequest``: model, session key, prompt-size estimate, prefix blocks),
kind, stream, key, providers, requirements, tier and tenant, and the node a Responses request
is pinned to. The body is parsed once (orjson) and kept as ``Routed.doc``; the prompt text for
cache-aware routing (``prompt_text``) is only extracted when a policy asks for it (the ingress
sets ``prefix_blocks`` then: only it knows how many nodes there are to choose from).
Per-request objects are plain classes with ``__slots__``: this module is compiled with mypyc
with the rest of the folder, and a plain class's ``__init__`` runs natively there.

``error_body`` is the one OpenAI error body of the agent's public port: the data plane and the
control app (``fabricnode.control.app``) both answer with it. ``error_body_for`` picks the
dialect of a path: Anthropic's shape on ``/v1/messages*`` (``endpoints``), OpenAI's elsewhere.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from fabricnode.dataplane.endpoints import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    FORM_KINDS,
    MESSAGES,
    RESPONSES,
    STREAMING_KINDS,
    anthropic_error_body,
    anthropic_path,
    node_of_response,
)
from fabricnode.dataplane.keytable import ApiKey, KeyTable, RateLimiter, bearer_token
from fabricnode.dataplane.multipart import form_fields
from fabricnode.dataplane.residency import narrow, parse_alternatives

# The OpenAI error ``type`` of each status (what the official clients map to exception classes).
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str) -> bytes:
    """``{"error": {"message", "type", "code"}}``, the shape OpenAI's API and clients use."""
    return orjson.dumps({"error": {"message": message, "type": error_type(status), "code": code}})


def error_body_for(path: bytes, status: int, message: str, code: str) -> bytes:
    """The error body in the dialect of ``path``: Anthropic's on ``/v1/messages*``, else
    OpenAI's (``code`` has no place in Anthropic's shape)."""
    if anthropic_path(path):
        return anthropic_error_body(status, message)
    return error_body(status, message, code)


def malformed_code(status: int) -> str:
    """The error code of a request the HTTP parser refused with ``status``."""
    return {
        400: "bad_request",
        408: "request_timeout",
        413: "request_too_large",
        414: "uri_too_long",
        431: "headers_too_large",
        503: "server_busy",
        505: "http_version_not_supported",
    }.get(status, "bad_request")


class Rejection:
    """A request refused before routing: the OpenAI error it gets."""

    __slots__ = ("code", "headers", "message", "status")

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers  # extra response headers (Retry-After)

    def __repr__(self) -> str:
        return f"Rejection({self.status}, {self.message!r}, {self.code!r})"


# Priority tiers (``tiers``): ``X-Fabric-Priority``'s values.
INTERACTIVE = "interactive"
BATCH = "batch"
TIERS = (INTERACTIVE, BATCH)
PRIORITY_HEADER = b"x-fabric-priority"
NO_TENANT = "-"  # the tenant of batch requests without an API key


class RouteRequest:
    """What the policies know of a request."""

    __slots__ = ("model", "prefix_blocks", "prompt_tokens_est", "session_key")

    def __init__(
        self,
        model: str,
        prefix_blocks: tuple[int, ...],
        session_key: str | None,
        prompt_tokens_est: int,
    ) -> None:
        self.model = model
        # Cumulative block hashes of the prompt (``prompt_blocks``).
        self.prefix_blocks = prefix_blocks
        # Sticky-session key (X-Session-ID, or the body's "user").
        self.session_key = session_key
        self.prompt_tokens_est = prompt_tokens_est

    def __repr__(self) -> str:
        return (
            f"RouteRequest({self.model!r}, {len(self.prefix_blocks)} blocks, "
            f"{self.session_key!r}, {self.prompt_tokens_est})"
        )


class Routed(RouteRequest):
    """A request that passed every check: the one record of it that routing reads, with what
    is worked out once per request (the policies' part is ``RouteRequest``'s: model, session,
    prompt-size estimate, and the prefix blocks the ingress sets when a policy ranks by them).
    """

    __slots__ = (
        "batch",
        "doc",
        "key",
        "kind",
        "pinned",
        "providers",
        "requirements",
        "sites",
        "stream",
        "tenant",
    )

    def __init__(
        self,
        kind: str,
        model: str,
        stream: bool,
        doc: dict[str, Any],
        key: ApiKey | None,
        providers: frozenset[str],
        requirements: Requirements | None,
        session: str | None,
        prompt_tokens_est: int,
        batch: bool = False,
        tenant: str = NO_TENANT,
    ) -> None:
        super().__init__(model, (), session, prompt_tokens_est)
        self.kind = kind  # the endpoint's kind (``endpoints.ENDPOINTS``)
        self.stream = stream  # an SSE answer was asked for (never for embeddings)
        self.doc = doc  # the parsed body, read again for the request log
        self.key = key  # the caller's API key; None when the ingress runs open
        self.providers = providers  # allowed providers; empty = any
        self.requirements = requirements  # X-Fabric-Require; None = no constraint
        # Data residency (``residency``): the sites that may serve it, None = any. The decoder
        # sets the key's and the header's; the ingress narrows it by the model's.
        self.sites = allowed_sites(key, requirements)
        # The batch tier (``X-Fabric-Priority: batch``, or the batch owner header), and the
        # tenant it is queued under: its key's id, else the owner header's, else "-".
        self.batch = batch
        self.tenant = tenant
        # The node a ``POST /v1/responses`` continuing a stored response must go to (the one
        # its ``previous_response_id`` names), None for any other request.
        self.pinned = pinned_node(doc) if kind == RESPONSES else None


KEY_REJECTION = Rejection(
    401,
    "missing or invalid API key (Authorization: Bearer KEY, or x-api-key: KEY)",
    "invalid_api_key",
)


def key_of(headers: Mapping[bytes, bytes], keys: KeyTable) -> ApiKey | None:
    """The key the request names, None if none or unknown: ``Authorization: Bearer KEY``, else
    (or when that one is unknown) Anthropic's ``x-api-key: KEY``."""
    raw = headers.get(b"authorization")
    token = bearer_token(raw.decode("latin-1")) if raw else None
    key = keys.lookup(token) if token is not None else None
    if key is None:
        other = headers.get(b"x-api-key")
        if other:
            token = other.decode("latin-1").strip()
            key = keys.lookup(token) if token else None
    return key


def authorize(
    headers: Mapping[bytes, bytes], keys: KeyTable | None, limiter: RateLimiter, now: float
) -> ApiKey | Rejection | None:
    """The caller's key (None when the ingress runs open), or the 401/429 it gets instead.

    A request within its rate takes a token even if a later check refuses it, as a request that
    reaches a server does.
    """
    if keys is None or not keys.enabled:
        return None
    key = key_of(headers, keys)
    if key is None:
        return KEY_REJECTION
    rate = key.rate
    if rate is not None:
        wait_s = limiter.check(key.key_id, rate.rate_per_s, rate.burst, now)
        if wait_s > 0:
            return Rejection(
                429,
                f"rate limit of {rate.rate_per_s:g} requests/s exceeded",
                "rate_limit_exceeded",
                [(b"retry-after", b"%d" % max(1, math.ceil(wait_s)))],
            )
    return key


def decode(
    kind: str,
    headers: Mapping[bytes, bytes],
    body: bytes,
    keys: KeyTable | None,
    limiter: RateLimiter,
    now: float,
) -> Routed | Rejection:
    """Check one request of endpoint ``kind`` (see the module docstring for the order).

    ``now`` is the monotonic clock the rate limiter counts in.
    """
    key: ApiKey | None = None
    if keys is not None and keys.enabled:
        checked = authorize(headers, keys, limiter, now)
        if isinstance(checked, Rejection):
            return checked
        key = checked
    return decode_as(kind, headers, body, key)


def decode_as(
    kind: str,
    headers: Mapping[bytes, bytes],
    body: bytes,
    key: ApiKey | None,
    tenant: str | None = None,
) -> Routed | Rejection:
    """The checks of ``decode`` after the key, for a request already authenticated as ``key``
    (the batch owner header's, for ``tenant``: ``tiers.owner_of``; such a request is batch)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        if kind in FORM_KINDS:  # a form is never JSON: the JSON kinds pay nothing for forms
            return decode_form(kind, headers, body, key, tenant)
        return Rejection(400, "request body is not valid JSON", "invalid_json")
    if not isinstance(doc, dict):
        return Rejection(400, "request body must be a JSON object", "invalid_json")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        return Rejection(400, "'model' is required and must be a string", "invalid_model")
    stream = doc.get("stream") is True and kind in STREAMING_KINDS
    return routed(kind, model, stream, doc, headers, body, key, tenant)


FORM_FIELDS = ("model", "stream")


def decode_form(
    kind: str,
    headers: Mapping[bytes, bytes],
    body: bytes,
    key: ApiKey | None,
    tenant: str | None = None,
) -> Routed | Rejection:
    """The checks after the key for a ``multipart/form-data`` body (the audio endpoints): its
    ``model`` and ``stream`` fields are read (``multipart.form_fields``) and become ``doc``."""
    fields = form_fields(body, headers.get(b"content-type", b""), FORM_FIELDS)
    if isinstance(fields, str):
        return Rejection(400, fields, "invalid_form")
    model = fields.get("model", "").strip()
    if not model:
        return Rejection(400, "the form field 'model' is required", "invalid_model")
    stream = fields.get("stream", "").strip().lower() == "true"
    doc: dict[str, Any] = {"model": model, "stream": stream}
    return routed(kind, model, stream, doc, headers, body, key, tenant)


def routed(
    kind: str,
    model: str,
    stream: bool,
    doc: dict[str, Any],
    headers: Mapping[bytes, bytes],
    body: bytes,
    key: ApiKey | None,
    tenant: str | None,
) -> Routed | Rejection:
    """The routed record of a request whose body passed: its routing headers checked
    (providers, requirements, then the tier), each value worked out once. The prompt-size
    estimate is a quarter of the body's bytes."""
    filters = route_headers(headers, key)
    if isinstance(filters, Rejection):
        return filters
    providers, requirements = filters
    batch = tenant is not None
    raw = headers.get(PRIORITY_HEADER)
    if raw is not None:
        try:
            batch = tier_of(raw) == BATCH or batch
        except ValueError as exc:
            return Rejection(400, str(exc), "invalid_header")
    r = Routed(
        kind,
        model,
        stream,
        doc,
        key,
        providers,
        requirements,
        session_key(headers, doc),
        len(body) // 4,
    )
    if batch:
        r.batch = True
        r.tenant = key.key_id if key is not None else (tenant or NO_TENANT)
    return r


def route_headers(
    headers: Mapping[bytes, bytes], key: ApiKey | None
) -> tuple[frozenset[str], Requirements | None] | Rejection:
    """The providers (``X-Fabric-Providers`` within the key's allowlist) and requirements
    (``X-Fabric-Require``) a request is routed under, or the 400 a malformed header gets."""
    try:
        return allowed_providers(headers, key), requirements_of(headers)
    except ValueError as exc:
        return Rejection(400, str(exc), "invalid_header")


def allowed_providers(headers: Mapping[bytes, bytes], key: ApiKey | None) -> frozenset[str]:
    """``X-Fabric-Providers`` within the key's allowlist: a header can only narrow it."""
    raw = headers.get(b"x-fabric-providers")
    allowed = parse_providers(raw.decode("latin-1")) if raw else frozenset()
    if key is not None and key.providers is not None:
        own = frozenset(key.providers)
        allowed = allowed & own if allowed else own
        if not allowed:
            raise ValueError("X-Fabric-Providers names no provider this API key may use")
    return allowed


def allowed_sites(key: ApiKey | None, requirements: Requirements | None) -> frozenset[str] | None:
    """The sites both the key and ``X-Fabric-Require: site=`` allow (None: any)."""
    return narrow(
        key.sites if key is not None else None,
        requirements.sites if requirements is not None else None,
    )


def requirements_of(headers: Mapping[bytes, bytes]) -> Requirements | None:
    raw = headers.get(b"x-fabric-require")
    return parse_require(raw.decode("latin-1")) if raw else None


MAX_SESSION_KEY_CHARS = 256


def session_key(headers: Mapping[bytes, bytes], doc: dict[str, Any]) -> str | None:
    """The sticky-session key: ``X-Session-Id``, else the body's ``user`` (at most 256 chars)."""
    raw = headers.get(b"x-session-id")
    if raw:
        return raw.decode("latin-1")[:MAX_SESSION_KEY_CHARS]
    user = doc.get("user")
    return user[:MAX_SESSION_KEY_CHARS] if isinstance(user, str) and user else None


def prompt_text(doc: dict[str, Any], kind: str) -> str:
    """The text prefix routing hashes: chat (and Anthropic Messages, their ``system`` first)
    roles and contents joined by U+001E; a Responses ``input`` (text, or items like chat
    messages); the completion ``prompt``; else the ``input`` (the first one of a list)."""
    if kind == CHAT:
        return _messages_text(doc.get("messages"), [])
    if kind in (MESSAGES, COUNT_TOKENS):
        system = doc.get("system")
        parts = ["system", system] if isinstance(system, str) else []
        if isinstance(system, list):
            parts.append("system")
            _content_text(system, parts)
        return _messages_text(doc.get("messages"), parts)
    if kind == RESPONSES:
        given = doc.get("input")
        if isinstance(given, list):
            instructions = doc.get("instructions")
            start = ["system", instructions] if isinstance(instructions, str) else []
            return _messages_text(given, start)
        prompt: Any = given
    elif kind == COMPLETIONS:
        prompt = doc.get("prompt")
    else:
        prompt = doc.get("input")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return str(prompt[0])
    return ""


def _messages_text(messages: Any, parts: list[str]) -> str:
    if not isinstance(messages, list):
        return "\x1e".join(parts)
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        role = m.get("role")
        parts.append(role if isinstance(role, str) else "")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            _content_text(content, parts)
    return "\x1e".join(parts)


def _content_text(content: list[Any], parts: list[str]) -> None:
    for c in content:
        if isinstance(c, dict) and isinstance(c.get("text"), str):
            parts.append(c["text"])


# -- header grammars ----------------------------------------------------------------------------


def tier_of(raw: bytes) -> str:
    """The tier an ``X-Fabric-Priority`` value names; ValueError (one line) for anything else."""
    value = raw.decode("latin-1").strip().lower()
    if value not in TIERS:
        raise ValueError(f"X-Fabric-Priority {value[:32]!r}: expected interactive or batch")
    return value


def pinned_node(doc: dict[str, Any] | None) -> str | None:
    """The node a ``POST /v1/responses`` body is pinned to (its ``previous_response_id``'s),
    None when it continues no response of this mesh."""
    if doc is None:
        return None
    previous = doc.get("previous_response_id")
    return node_of_response(previous) if isinstance(previous, str) else None


@dataclass(frozen=True, slots=True)
class Requirements:
    """What a request demands of a node's signed facts. ``gpu`` is matched case-insensitively
    (stored lower-cased); None = no constraint."""

    gpu: frozenset[str] | None = None  # allowed GPU types
    min_quant_bits: int | None = None  # quantization bits >= this (16 = unquantized)
    min_context: int | None = None  # max_model_len >= this (unknown length fails the check)
    sites: frozenset[str] | None = None  # the node's signed site is one of these (exact names)

    def __post_init__(self) -> None:
        if self.gpu is not None:
            object.__setattr__(self, "gpu", frozenset(g.lower() for g in self.gpu))


MAX_REQUIRE_CHARS = 1024
MAX_GPU_ALTERNATIVES = 32
MAX_CONTEXT_TOKENS = 1 << 30
MAX_PROVIDERS = 32
MAX_PROVIDER_CHARS = 128

_TERM = re.compile(r"([A-Za-z_]+)\s*(>=|=)\s*(.*)")
_TERM_HELP = "expected gpu=TYPE[|TYPE...], quant>=BITS, ctx>=TOKENS or site=NAME[|NAME...]"


def parse_require(header: str) -> Requirements:
    """``gpu=H100|A100-80G,quant>=8,ctx>=32768,site=A|B`` -> Requirements; blank -> no
    constraint.

    Strict on purpose: a typo that silently dropped a constraint would route to hardware the
    user excluded. ValueError with one line naming the bad term.
    """
    if len(header) > MAX_REQUIRE_CHARS:
        raise ValueError(f"requirements longer than {MAX_REQUIRE_CHARS} characters")
    if not header.strip():
        return Requirements()
    gpu: frozenset[str] | None = None
    quant: int | None = None
    ctx: int | None = None
    sites: frozenset[str] | None = None
    seen: set[str] = set()
    for raw in header.split(","):
        term = raw.strip()
        shown = repr(term[:64])
        if not term:
            raise ValueError("empty requirement term (stray comma)")
        m = _TERM.fullmatch(term)
        if m is None:
            raise ValueError(f"bad requirement {shown}: {_TERM_HELP}")
        key, op, value = m.group(1).lower(), m.group(2), m.group(3).strip()
        if key in seen:
            raise ValueError(f"bad requirement {shown}: {key} given twice")
        seen.add(key)
        if key == "gpu" and op == "=":
            types = [t.strip() for t in value.split("|")]
            if not all(types) or len(types) > MAX_GPU_ALTERNATIVES or max(map(len, types)) > 64:
                raise ValueError(
                    f"bad requirement {shown}: gpu needs 1 to {MAX_GPU_ALTERNATIVES} non-empty "
                    "types of at most 64 characters, separated by |"
                )
            gpu = frozenset(types)
        elif key == "quant" and op == ">=":
            quant = _bounded_int(value, 1, 32, shown, "BITS")
        elif key == "ctx" and op == ">=":
            ctx = _bounded_int(value, 1, MAX_CONTEXT_TOKENS, shown, "TOKENS")
        elif key == "site" and op == "=":
            sites = parse_alternatives(value, f"bad requirement {shown}")
        else:
            raise ValueError(f"bad requirement {shown}: {_TERM_HELP}")
    return Requirements(gpu=gpu, min_quant_bits=quant, min_context=ctx, sites=sites)


def _bounded_int(value: str, lo: int, hi: int, shown: str, what: str) -> int:
    if not (value.isascii() and value.isdigit()) or not lo <= int(value) <= hi:
        raise ValueError(f"bad requirement {shown}: {what} must be an integer from {lo} to {hi}")
    return int(value)


def parse_providers(header: str) -> frozenset[str]:
    """``"p1, p2"`` -> {"p1", "p2"}: provider names or key fingerprints. ValueError on an empty
    list or item, more than MAX_PROVIDERS items, or an item over MAX_PROVIDER_CHARS."""
    if len(header) > MAX_PROVIDERS * (MAX_PROVIDER_CHARS + 2):
        raise ValueError("provider list too long")
    items = [p.strip() for p in header.split(",")]
    if not any(items):
        raise ValueError("empty provider list")
    if not all(items):
        raise ValueError("empty provider name in list (stray comma)")
    if len(items) > MAX_PROVIDERS:
        raise ValueError(f"more than {MAX_PROVIDERS} providers in list")
    for item in items:
        if len(item) > MAX_PROVIDER_CHARS:
            raise ValueError(f"provider name {item[:32]!r}... longer than {MAX_PROVIDER_CHARS}")
    return frozenset(items)
