"""The simulated engine's HTTP plumbing, shared by the app and its endpoint modules: the one
error type and its two wire shapes (OpenAI's, which vLLM uses, and Anthropic's on
``/v1/messages``), reading a bounded body, and writing JSON and server-sent events.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fabricnode.asgi import Receive, Send

Scope = Mapping[str, Any]
Json = dict[str, Any]


class HttpError(Exception):
    """An answer other than 200. ``code`` is the OpenAI error's ``code``: the existing endpoints
    send a string (``model_not_found``), the ones that mirror vLLM 0.32 its HTTP status (an
    int). ``kind`` is the error's ``type``; by default derived from the status."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | int,
        param: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind or _kind(status)


class ClientGone(Exception):
    """The client disconnected before its request was read; nothing to answer."""


def _kind(status: int) -> str:
    if status >= 500:
        return "ServiceUnavailableError" if status == 503 else "InternalServerError"
    return {404: "NotFoundError", 405: "MethodNotAllowed"}.get(status, "BadRequestError")


def error_doc(
    status: int, message: str, code: str | int, param: str | None = None, kind: str | None = None
) -> Json:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {"message": message, "type": kind or _kind(status), "param": param, "code": code}
    }


def anthropic_error_doc(exc: HttpError) -> Json:
    """Anthropic's error shape, as vLLM's ``/v1/messages`` sends it: the OpenAI error's type and
    message under ``{"type": "error", "error": {...}}``."""
    return {"type": "error", "error": {"type": exc.kind, "message": exc.message}}


# Past its limit a body is still read, and dropped, up to this much, so that the client (which
# is still sending) reads the 400 instead of a connection reset.
DRAIN_LIMIT_BYTES = 256 * 1024 * 1024


async def read_body(receive: Receive, limit: int, what: str = "request body") -> bytes:
    """The whole request body; ``HttpError`` 400 past ``limit`` bytes (the rest is read and
    dropped, up to ``DRAIN_LIMIT_BYTES``), ``ClientGone`` if the client leaves first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body = message.get("body", b"")
        size += len(body)
        more = bool(message.get("more_body", False))
        if size > limit:
            chunks.clear()
            if not more or size > DRAIN_LIMIT_BYTES:
                raise HttpError(400, f"{what} too large (limit {limit} bytes)", "body_too_large")
            continue
        chunks.append(body)
        if not more:
            return b"".join(chunks)


def parse_json(body: bytes) -> Json:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"invalid JSON body: {exc}", "invalid_json") from None
    if not isinstance(doc, dict):
        raise HttpError(400, "the request body must be a JSON object", "invalid_json")
    return doc


def dumps(doc: Json) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


async def send_body(send: Send, status: int, body: bytes, content_type: str) -> None:
    headers = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, doc: Json, status: int = 200) -> None:
    await send_body(send, status, dumps(doc), "application/json")


async def start_sse(send: Send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        }
    )


async def send_chunk(send: Send, data: bytes, *, last: bool = False) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": not last})


def sse_data(doc: Json) -> bytes:
    """One ``data:`` event (OpenAI's streams)."""
    return b"data: " + dumps(doc) + b"\n\n"


def sse_event(event: str, doc: Json) -> bytes:
    """One named event: ``event:`` and ``data:`` lines (the Responses and Anthropic streams)."""
    return b"event: " + event.encode() + b"\ndata: " + dumps(doc) + b"\n\n"
