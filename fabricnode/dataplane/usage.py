"""Token usage at the ingress: read from each response, and totals per key and model.

Owns what the ingress does once per answered request to learn and count its usage: reading it
from a response body or stream, and adding it to the ledger behind ``/metrics``. The request
log it also feeds is ``fabricnode.requestlog``'s.

Theory of operation
-------------------
Everything here is sync and cheap enough for the request hot path of the trio data plane.

* ``usage_from_json`` reads ``usage`` from a non-streamed response body, in each endpoint's
  own fields: ``prompt_tokens``/``completion_tokens`` (OpenAI chat, completions, embeddings,
  score, pooling, classify; rerank's ``prompt_tokens``), ``input_tokens``/``output_tokens``
  (Responses, Anthropic Messages). ``audio_seconds_from_json`` reads the audio duration vLLM
  reports as the usage of a transcription or translation (``{"type": "duration", "seconds"}``).
* ``StreamUsage`` is fed the raw bytes of a streamed (SSE) response as they are relayed, split
  anywhere. It frames lines and events itself and never parses JSON just to look: an event is
  parsed only if its bytes contain ``"usage": {`` (a literal quote cannot occur unescaped inside
  a JSON string, so this is exact up to the cost of one parse). The usage object may be the
  event's own (chat, completions, Anthropic's ``message_delta``), its ``response``'s (the
  Responses API's final ``response.completed``) or its ``message``'s (Anthropic's
  ``message_start``); each of the two counts is taken from the last event that reports it
  (engines report cumulative counts: Anthropic's input tokens come with ``message_start``, the
  output tokens with the last ``message_delta``). Engines report usage in a last
  chunk when asked (``stream_options.include_usage``), and some in every chunk (cumulative; the
  last one wins). Without any usage, completion tokens are estimated as the number of events
  carrying non-empty ``content``/``text``/``reasoning_content``/``arguments`` -- one event per
  token for vLLM and SGLang without speculative decoding -- and prompt tokens are unknown.
* ``UsageLedger`` keeps totals per (key name or ``anonymous``, model) for /metrics and the
  admin view, in bounded memory: model names come from clients.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from fabricnode.dataplane.sse import sse_data
from fabricnode.requestlog.format import ANONYMOUS, MAX_MODEL_CHARS


def _loads(data: bytes) -> Any:
    return orjson.loads(data)


_JSON_ERRORS = (ValueError, TypeError, RecursionError)
OTHER_MODELS = "(other)"


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def usage_fields(usage: Any) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens a usage object reports, each None when it reports none:
    ``prompt_tokens``/``completion_tokens`` (OpenAI) or ``input_tokens``/``output_tokens``
    (Responses, Anthropic)."""
    if not isinstance(usage, dict):
        return None, None
    prompt = usage.get("prompt_tokens")
    if prompt is None:
        prompt = usage.get("input_tokens")
    completion = usage.get("completion_tokens")
    if completion is None:
        completion = usage.get("output_tokens")
    return _count(prompt), _count(completion)


def _usage_object(doc: Any) -> Any:
    """The usage object of a response or event: its own, its ``response``'s (Responses
    events) or its ``message``'s (Anthropic's ``message_start``)."""
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if isinstance(usage, dict):
        return usage
    for name in ("response", "message"):
        inner = doc.get(name)
        if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
            return inner["usage"]
    return None


def _usage_pair(usage: Any) -> tuple[int, int] | None:
    """(prompt, completion) of a whole answer's usage; None unless it reports prompt tokens
    (embeddings, rerank and the like report no completion: 0)."""
    prompt, completion = usage_fields(usage)
    if prompt is None:
        return None
    if completion is None:
        if isinstance(usage, dict) and usage.get("completion_tokens", usage.get("output_tokens")):
            return None  # reported, but not a count
        completion = 0
    return prompt, completion


def usage_from_json(body: bytes) -> tuple[int, int] | None:
    """(prompt tokens, completion tokens) of a non-streamed response, else None."""
    if b'"usage"' not in body:
        return None
    try:
        doc = _loads(body)
    except _JSON_ERRORS:
        return None
    return _usage_pair(_usage_object(doc))


def audio_seconds_from_json(body: bytes) -> float | None:
    """The audio duration a transcription or translation reports as its usage
    (``{"usage": {"type": "duration", "seconds": N}}``, vLLM and OpenAI), else None."""
    if b'"duration"' not in body:
        return None
    try:
        doc = _loads(body)
    except _JSON_ERRORS:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict) or usage.get("type") != "duration":
        return None
    seconds = usage.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return None
    return float(seconds) if 0 <= seconds < 1e9 else None


# -- streamed responses -----------------------------------------------------------------------

_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_CONTENT = re.compile(rb'"(?:content|text|reasoning_content|arguments)"\s*:\s*"(?!")')
_ERROR = re.compile(rb'^\s*\{\s*"error"\s*:')
MAX_LINE_BYTES = 1 << 20


class StreamUsage:
    """Token usage of one streamed response, from its SSE bytes (fed in any split)."""

    __slots__ = (
        "_completion",
        "_content_events",
        "_data",
        "_done",
        "_error",
        "_events",
        "_overlong",
        "_partial",
        "_prompt",
        "last_event",
    )

    def __init__(self) -> None:
        self._partial = bytearray()  # an incomplete line
        self._overlong = False  # the incomplete line passed MAX_LINE_BYTES: drop it
        self._data: list[bytes] = []  # data lines of the event being read
        self._prompt: int | None = None  # the last reported count of each kind
        self._completion: int | None = None
        self._content_events = 0
        self._events = 0
        self._done = False
        self._error = False
        self.last_event: bytes | None = None  # the data of the last whole event

    def feed(self, chunk: bytes) -> None:
        nl = chunk.find(b"\n")
        if nl < 0:
            self._extend_partial(chunk)
            return
        if self._partial or self._overlong:
            self._extend_partial(chunk[:nl])
            if not self._overlong:
                self._line(bytes(self._partial))
            self._partial.clear()
            self._overlong = False
        else:
            self._line(chunk[:nl])
        start = nl + 1
        while (nl := chunk.find(b"\n", start)) >= 0:
            self._line(chunk[start:nl])
            start = nl + 1
        if start < len(chunk):
            self._extend_partial(chunk[start:])

    def _extend_partial(self, data: bytes) -> None:
        if self._overlong:
            return
        if len(self._partial) + len(data) > MAX_LINE_BYTES:
            self._overlong = True
            self._partial.clear()
            return
        self._partial += data

    def _line(self, line: bytes) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            if self._data:
                self._dispatch(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                self._data = []
        elif line.startswith(b"data:"):
            self._data.append(sse_data(line))
        # other fields (event:, id:, retry:) and comments (":") carry no usage

    def _dispatch(self, data: bytes) -> None:
        if data == b"[DONE]":
            self._done = True
            return
        self._events += 1
        self.last_event = data
        prompt, completion, content, error = _examine(data)
        if prompt is not None:
            self._prompt = prompt
        if completion is not None:
            self._completion = completion
        if content:
            self._content_events += 1
        if error:
            self._error = True

    def _pending(self) -> bytes | None:
        """The data of an event cut off by the end of the stream (no closing blank line)."""
        data = list(self._data)
        tail = bytes(self._partial)
        if tail.endswith(b"\r"):
            tail = tail[:-1]
        if tail.startswith(b"data:") and not self._overlong:
            data.append(sse_data(tail))
        if not data:
            return None
        joined = b"\n".join(data)
        return None if joined == b"[DONE]" else joined

    def result(self) -> tuple[int | None, int]:
        """(prompt_tokens or None if unreported, completion_tokens) for what was fed so far."""
        prompt, completion, content_events = self._prompt, self._completion, self._content_events
        pending = self._pending()
        if pending is not None:
            more_prompt, more_completion, content, _ = _examine(pending)
            if more_prompt is not None:
                prompt = more_prompt
            if more_completion is not None:
                completion = more_completion
            content_events += content
        if prompt is None and completion is None:
            return None, content_events
        return prompt, completion or 0

    @property
    def reported(self) -> bool:
        """Did the engine report usage (rather than completion tokens being counted)?"""
        return self._prompt is not None or self._completion is not None

    @property
    def done(self) -> bool:
        """Was ``data: [DONE]`` seen (the stream ended normally)?"""
        return self._done

    @property
    def error(self) -> bool:
        """Did an event carry an OpenAI-shaped ``error`` (a failure after the 200 header)?"""
        return self._error


def may_report_usage(data: bytes) -> bool:
    """Could this event's data carry a ``usage`` object? Only those events are parsed: not
    ``"usage": null`` and not the word inside generated content (escaped quotes)."""
    return b'"usage"' in data and _USAGE_OBJECT.search(data) is not None


def _examine(data: bytes) -> tuple[int | None, int | None, bool, bool]:
    """(prompt tokens, completion tokens -- each if reported --, carries content, is an error)
    of one event's data."""
    prompt: int | None = None
    completion: int | None = None
    if may_report_usage(data):
        try:
            doc = _loads(data)
        except _JSON_ERRORS:
            doc = None
        prompt, completion = usage_fields(_usage_object(doc))
    return prompt, completion, _CONTENT.search(data) is not None, _ERROR.match(data) is not None


# -- totals -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class UsageTotals:
    key: str
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    errors: int


class UsageLedger:
    """Totals per (key name, model) since the agent started.

    At most ``max_rows`` rows: once full, new models are added up under ``(other)`` for their
    key (clients choose model names, and an ingress must not grow without bound).
    """

    def __init__(self, max_rows: int = 10_000) -> None:
        self.max_rows = max_rows
        self._rows: dict[tuple[str, str], list[int]] = {}

    def record(
        self,
        key: str | None,
        model: str,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        *,
        error: bool = False,
    ) -> None:
        """Count one request (``key`` None = no auth: ``anonymous``; unknown tokens = 0)."""
        row_key = (key or ANONYMOUS, model[:MAX_MODEL_CHARS])
        row = self._rows.get(row_key)
        if row is None:
            if len(self._rows) >= self.max_rows:
                row_key = (row_key[0], OTHER_MODELS)
                row = self._rows.get(row_key)
            if row is None:
                row = self._rows[row_key] = [0, 0, 0, 0]
        row[0] += 1
        row[1] += prompt_tokens or 0
        row[2] += completion_tokens or 0
        row[3] += error

    def snapshot(self) -> list[UsageTotals]:
        """All rows, sorted by key then model."""
        return [
            UsageTotals(key, model, *row)
            for (key, model), row in sorted(self._rows.items(), key=lambda item: item[0])
        ]
