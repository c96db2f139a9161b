"""The endpoints the data plane routes, the dialect each speaks and the ids it hands out.

Pure: no sockets, no clock, no randomness of its own (callers pass random bytes in).

Dispatch
--------
``ENDPOINTS`` maps the path of every ``POST`` endpoint that is routed by the ``model`` of its
body to the endpoint's *kind*: one dict lookup is all the dispatch of a routed request costs,
for chat as for any other. Besides the OpenAI-style ``/v1`` paths, vLLM serves some
model-addressed endpoints outside ``/v1`` (``/rerank``, ``/score``, ``/pooling``, ``/classify``,
``/tokenize``, ``/detokenize``, ``/v2/rerank``); they are in the table too, so the ingress looks
the path up first and only a path that is not in it goes on to ``/v1/models``, the stateful
Responses paths, the agent's own ``/version`` and ``/ping``, and finally the control app. None of
the control app's paths (``/health``, ``/ready``, ``/metrics``, ``/fabric/v1/...``) is in the
table.

* JSON bodies (every kind but ``FORM_KINDS``) are routed by their ``model`` field.
* ``FORM_KINDS`` (audio transcriptions and translations) are ``multipart/form-data``: routed by
  the ``model`` form field (``multipart.form_fields``).
* ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` name no model: they are
  routed by the id (below), and so is a ``POST /v1/responses`` with a ``previous_response_id``.

Dialects
--------
The Anthropic paths (``/v1/messages`` and below) answer every error the ingress itself makes in
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, so the ``anthropic`` SDK
raises its typed exceptions; every other path answers in OpenAI's shape
(``request.error_body``). A stream that breaks after its first byte ends with an error event in
its endpoint's format (``stream_error_events``): ``data: {"error": ...}`` for chat,
completions and the others; ``event: error`` (``ResponseErrorEvent``) then
``event: response.failed`` for Responses; ``event: error`` with Anthropic's error object for
Messages.

Response ids
------------
vLLM's ``ResponsesRequest`` takes a ``request_id`` and answers with it as the response's ``id``
(``ResponsesResponse.from_request``); its response store is keyed by it. The ingress sets it on
every ``POST /v1/responses`` to ``resp_<session id of the serving node><16 random hex
digits><16 hex digits of owner tag>`` (69 characters), so that any ingress can read from an id
which node stored the response and route a follow-up there, with no shared store
(``response_id``/``parse_response_id``), and whose key may read, continue or cancel it
(``responses.owner_tag``: a MAC with the cluster key, so every ingress can check it and no key
holder can make one for another key). An id of the form without the tag (53 characters, from
before responses had owners) still names its node; one of neither form (made by an engine
directly) names none.

Across sites: a response made for a client of another site (the request came over the
federation link) is stored where it was made, and its id names that site too:
``resp_<64 hex digits>_<site>`` (``site_of_response``). A follow-up at any other site goes out
through the gateways to that site alone, whose gateway pins it to the node (``responses``,
"Across sites").
"""

from __future__ import annotations

import re

import orjson

CHAT = "chat"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"
RESPONSES = "responses"
MESSAGES = "messages"
COUNT_TOKENS = "count_tokens"
TRANSCRIPTIONS = "transcriptions"
TRANSLATIONS = "translations"
# Kinds of the stateful Responses follow-ups (routed by the response id, not by a model).
RESPONSE_GET = "response_get"
RESPONSE_CANCEL = "response_cancel"

ENDPOINTS: dict[bytes, str] = {
    b"/v1/chat/completions": CHAT,
    b"/v1/completions": COMPLETIONS,
    b"/v1/embeddings": EMBEDDINGS,
    b"/v1/responses": RESPONSES,
    b"/v1/messages": MESSAGES,
    b"/v1/messages/count_tokens": COUNT_TOKENS,
    b"/v1/rerank": "rerank",
    b"/rerank": "rerank",
    b"/v2/rerank": "rerank",
    b"/v1/score": "score",
    b"/score": "score",
    b"/pooling": "pooling",
    b"/classify": "classify",
    b"/tokenize": "tokenize",
    b"/detokenize": "detokenize",
    b"/v1/audio/transcriptions": TRANSCRIPTIONS,
    b"/v1/audio/translations": TRANSLATIONS,
}

# Bodies that are multipart/form-data, routed by their ``model`` form field.
FORM_KINDS = frozenset((TRANSCRIPTIONS, TRANSLATIONS))
# Kinds whose errors are in Anthropic's shape.
ANTHROPIC_KINDS = frozenset((MESSAGES, COUNT_TOKENS))
# Kinds that may answer with a stream when asked (``"stream": true``).
STREAMING_KINDS = frozenset(
    (CHAT, COMPLETIONS, RESPONSES, MESSAGES, TRANSCRIPTIONS, TRANSLATIONS, RESPONSE_GET)
)
# Kinds whose broken streams may continue on another node (``resume``): the others end with
# their error event (a continuation of a Responses or Messages stream would need its events
# rewritten as ``resume.Splicer`` does chat chunks, and the stored state of a Responses answer
# lives on the node that broke).
RESUMABLE_KINDS = frozenset((CHAT, COMPLETIONS))
# Kinds whose stream, broken before its first event reached the client, is sent again whole to
# another node: the client holds only the head, and any node serving the model can answer.
RESENDABLE_KINDS = frozenset((CHAT, COMPLETIONS, RESPONSES, MESSAGES))
# Kinds whose JSON body is a prompt the engine prefills (its size estimates the tokens, as for
# routing): counted on the nodes' prefill clocks (``prefill``).
PREFILL_KINDS = frozenset((CHAT, COMPLETIONS, RESPONSES, MESSAGES, EMBEDDINGS))
# Kinds whose answer carries no usage of its own (a stored response read again, a cancel).
NO_USAGE_KINDS = frozenset((RESPONSE_GET, RESPONSE_CANCEL, COUNT_TOKENS, "tokenize", "detokenize"))

RESPONSES_PREFIX = b"/v1/responses/"
CANCEL_SUFFIX = b"/cancel"
ANTHROPIC_PREFIX = b"/v1/messages"
# Where clients find the list of what the data plane serves (named in the 404 of other paths).
ENDPOINT_DOCS = "docs/user-guide.md#endpoints"


def anthropic_path(path: bytes) -> bool:
    """Does ``path`` speak Anthropic's dialect (``/v1/messages`` and below)?"""
    return path.startswith(ANTHROPIC_PREFIX) and (
        len(path) == len(ANTHROPIC_PREFIX) or path[len(ANTHROPIC_PREFIX)] == 0x2F  # "/"
    )


def response_follow_up(path: bytes) -> tuple[str, str] | None:
    """``(kind, response id)`` of ``/v1/responses/{id}`` (``RESPONSE_GET``) or
    ``/v1/responses/{id}/cancel`` (``RESPONSE_CANCEL``); None for any other path."""
    if not path.startswith(RESPONSES_PREFIX):
        return None
    rest = path[len(RESPONSES_PREFIX) :]
    kind = RESPONSE_GET
    if rest.endswith(CANCEL_SUFFIX):
        rest = rest[: -len(CANCEL_SUFFIX)]
        kind = RESPONSE_CANCEL
    if not rest or b"/" in rest or len(rest) > MAX_RESPONSE_ID_CHARS:
        return None
    return kind, rest.decode("latin-1")


# == response ids ============================================================================

RESPONSE_ID_PREFIX = "resp_"
SESSION_HEX = 32  # a session id: 16 bytes of SHA-256, hex
NONCE_BYTES = 8
OWNER_TAG_BYTES = 8
MAX_RESPONSE_ID_CHARS = 256
SITE_SEPARATOR = "_"  # before the site of a response stored for a client of another site
_TAGGED_ID = re.compile(
    r"resp_([0-9a-f]{32})([0-9a-f]{16})([0-9a-f]{16})?(?:_([A-Za-z0-9][A-Za-z0-9._-]{0,63}))?"
)


def response_id(session_id: str, nonce: bytes, owner_tag: bytes, site: str = "") -> str:
    """The id of a response stored by ``session_id``'s engine (``nonce``: 8 random bytes;
    ``owner_tag``: ``responses.owner_tag``'s 8 bytes; ``site``: the site of that node, named
    when the response was made for a client of another site, whose follow-ups come back
    through the gateways: ``resp_<64 hex digits>_<site>``)."""
    if (
        len(session_id) != SESSION_HEX
        or len(nonce) != NONCE_BYTES
        or len(owner_tag) != OWNER_TAG_BYTES
    ):
        raise ValueError("a session id of 32 hex digits, 8 random bytes and an 8-byte tag needed")
    rid = RESPONSE_ID_PREFIX + session_id + nonce.hex() + owner_tag.hex()
    return rid + SITE_SEPARATOR + site if site else rid


def parse_response_id(rid: str) -> tuple[str, bytes, bytes | None] | None:
    """(session id, nonce, owner tag or None for an id from before tags) of a response id
    this mesh made (``response_id``); None for any other id."""
    m = _TAGGED_ID.fullmatch(rid)
    if m is None:
        return None
    tag = m.group(3)
    return m.group(1), bytes.fromhex(m.group(2)), None if tag is None else bytes.fromhex(tag)


def node_of_response(rid: str) -> str | None:
    """The session id a response id names (``response_id``), None if it names none."""
    m = _TAGGED_ID.fullmatch(rid)
    return m.group(1) if m is not None else None


def site_of_response(rid: str) -> str:
    """The site a response id names (``response_id``'s ``site``), "" if it names none: a
    response stored at our own site, or an id this mesh did not make."""
    m = _TAGGED_ID.fullmatch(rid)
    return (m.group(4) or "") if m is not None else ""


# == errors in each dialect ==================================================================

# Anthropic's error ``type`` per status (what the ``anthropic`` SDK documents and maps).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    found = ANTHROPIC_ERROR_TYPES.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}``, Anthropic's error shape."""
    return orjson.dumps(
        {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
    )


def stream_error_events(
    kind: str,
    status: int,
    message: str,
    code: str,
    openai_body: bytes,
    *,
    response_id: str | None = None,
    model: str = "",
    sequence_number: int = 0,
    created_at: int = 0,
) -> bytes:
    """The SSE event(s) that end a stream of ``kind`` whose answer failed after its first byte.

    ``openai_body`` is the OpenAI error body (``request.error_body``) the chat-like kinds send.
    For Responses, ``sequence_number`` is the one after the last event the client received and
    ``response_id`` the id the client was told (the ``response.failed`` event carries it).
    """
    if kind in ANTHROPIC_KINDS:
        return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"
    if kind in (RESPONSES, RESPONSE_GET):
        error = orjson.dumps(
            {
                "type": "error",
                "code": code,
                "message": message,
                "param": None,
                "sequence_number": sequence_number,
            }
        )
        failed = orjson.dumps(
            {
                "type": "response.failed",
                "sequence_number": sequence_number + 1,
                "response": {
                    "id": response_id or "",
                    "object": "response",
                    "created_at": created_at,
                    "model": model,
                    "status": "failed",
                    "error": {"code": "server_error", "message": message},
                    "incomplete_details": None,
                    "output": [],
                    "parallel_tool_calls": True,
                    "tool_choice": "auto",
                    "tools": [],
                },
            }
        )
        return b"event: error\ndata: %s\n\nevent: response.failed\ndata: %s\n\n" % (error, failed)
    return b"data: " + openai_body + b"\n\n"


_SEQUENCE = re.compile(rb'"sequence_number"\s*:\s*(\d{1,18})')


def last_sequence_number(event: bytes | None) -> int | None:
    """The ``sequence_number`` of a Responses stream event's data (None if it has none)."""
    if not event:
        return None
    m = _SEQUENCE.search(event)
    return int(m.group(1)) if m is not None else None
