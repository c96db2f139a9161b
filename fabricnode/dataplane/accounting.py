"""Accounting at the ingress: token usage per request, totals per key and model, a request log.

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
* ``RequestLog`` buffers one ``TraceRecord`` per request in memory (bounded: when full, records
  are dropped and counted rather than growing without limit) and ``flush`` appends them as JSON
  lines, meant to run periodically in a worker thread. The file is rotated by size
  (``log.jsonl`` -> ``log.jsonl.1`` -> ...). A full disk costs log lines, never the ingress.
* ``read_request_log_after`` reads only what the log gained after a cursor (inode and offset,
  kept across rotations), and ``recent_sums`` sums it per model with a mergeable TTFT
  histogram: the elastic controller polls every agent for it every few seconds.

Request log format (one JSON object per line, the LLMFabric trace schema plus ingress fields)::

    {"v": 1, "T": 1732270000.123, "M": "llama-3.3-70b", "I": 512, "O": 128,
     "latency_s": 2.41, "ttft_s": 0.18, "status": 200, "node": "<session id>",
     "key": "alice", "stream": true, "max_tokens": 256, "temperature": 0.7,
     "endpoint": "chat", "tier": "interactive"}

``T`` is the arrival time (Unix seconds), ``M`` the requested model, ``I``/``O`` input/output
tokens (null when unknown), ``endpoint`` the kind of endpoint (``dataplane.endpoints``:
``chat``, ``responses``, ``messages``, ``rerank``, ``transcriptions``, ...), ``tier`` the
request's priority tier (``interactive`` or ``batch``: ``dataplane.tiers``); each is absent
from lines written before it existed, and read as null from them. There is deliberately no
field that could hold prompt or output text: the trace is shareable the way the paper's is.
"""

from __future__ import annotations

import math
import os
import re
import statistics as stats
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import orjson

from fabricnode.dataplane.endpoints import sse_data as sse_data
from fabricnode.dataplane.ttft import TTFT_BUCKET_BASE_S as TTFT_BUCKET_BASE_S
from fabricnode.dataplane.ttft import TTFT_BUCKET_FACTOR as TTFT_BUCKET_FACTOR
from fabricnode.dataplane.ttft import TTFT_BUCKETS as TTFT_BUCKETS
from fabricnode.dataplane.ttft import ttft_bound as ttft_bound
from fabricnode.dataplane.ttft import ttft_bucket as ttft_bucket
from fabricnode.dataplane.ttft import ttft_quantile as ttft_quantile
from fabricnode.errors import ConfigError


def _loads(data: bytes) -> Any:
    return orjson.loads(data)


def _dumps_line(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc) + b"\n"


_JSON_ERRORS = (ValueError, TypeError, RecursionError)
ANONYMOUS = "anonymous"
OTHER_MODELS = "(other)"
MAX_MODEL_CHARS = 128
TRACE_VERSION = 1


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


# -- request log ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request as logged: the paper's trace fields (T, M, I, O) plus ingress fields."""

    t: float  # arrival, Unix seconds
    model: str
    input_tokens: int | None
    output_tokens: int | None
    latency_s: float
    ttft_s: float | None = None
    status: int = 200
    node: str = ""  # session id of the node that served ("" if none did)
    key: str = ANONYMOUS  # API key name
    stream: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    endpoint: str | None = None  # the endpoint's kind (None: a line from before it was logged)
    tier: str | None = None  # interactive | batch (None: a line from before it was logged)

    def as_dict(self) -> dict[str, Any]:
        """The JSON object of one log line (see the module docstring).

        Every field is coerced to its type: ``max_tokens`` and ``temperature`` come from the
        client's request, and a string smuggled into them must not put text in the log.
        """
        return {
            "v": TRACE_VERSION,
            "T": _opt_float(self.t) or 0.0,
            "M": str(self.model)[:MAX_MODEL_CHARS],
            "I": opt_int(self.input_tokens),
            "O": opt_int(self.output_tokens),
            "latency_s": _opt_float(self.latency_s) or 0.0,
            "ttft_s": _opt_float(self.ttft_s),
            "status": opt_int(self.status) or 0,
            "node": str(self.node)[:MAX_MODEL_CHARS],
            "key": str(self.key)[:MAX_MODEL_CHARS],
            "stream": self.stream is True,
            "max_tokens": opt_int(self.max_tokens),
            "temperature": _opt_float(self.temperature),
            "endpoint": None if self.endpoint is None else str(self.endpoint)[:MAX_MODEL_CHARS],
            "tier": None if self.tier is None else str(self.tier)[:MAX_MODEL_CHARS],
        }

    @classmethod
    def from_dict(cls, doc: Any) -> TraceRecord:
        """Parse one log line's object; ValueError if it is not a trace record."""
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        t, model = doc.get("T"), doc.get("M")
        if not _is_number(t) or not isinstance(model, str):
            raise ValueError("missing T or M")
        return cls(
            t=float(t),
            model=model,
            input_tokens=opt_int(doc.get("I")),
            output_tokens=opt_int(doc.get("O")),
            latency_s=float(doc["latency_s"]) if _is_number(doc.get("latency_s")) else 0.0,
            ttft_s=float(doc["ttft_s"]) if _is_number(doc.get("ttft_s")) else None,
            status=opt_int(doc.get("status")) or 0,
            node=doc["node"] if isinstance(doc.get("node"), str) else "",
            key=doc["key"] if isinstance(doc.get("key"), str) else ANONYMOUS,
            stream=doc.get("stream") is True,
            max_tokens=opt_int(doc.get("max_tokens")),
            temperature=float(doc["temperature"]) if _is_number(doc.get("temperature")) else None,
            endpoint=doc["endpoint"] if isinstance(doc.get("endpoint"), str) else None,
            tier=doc["tier"] if isinstance(doc.get("tier"), str) else None,
        )


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def opt_int(value: Any) -> int | None:
    """An int that fits any JSON reader (64-bit), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63:
        return value
    return None


def _opt_float(value: Any) -> float | None:
    return round(float(value), 6) if _is_number(value) else None


@dataclass(frozen=True)
class RequestLogStats:
    buffered: int
    written: int
    dropped: int
    rotations: int
    write_errors: int
    last_error: str


# The fields of one request as the ingress hands them over, in TraceRecord's order: a tuple is
# cheap to make on the event loop; the line is built from it in ``flush``, off the request path.
RawTrace = tuple[
    float,  # t: arrival, Unix seconds
    str,  # model
    int | None,  # input tokens
    int | None,  # output tokens
    float,  # latency_s
    float | None,  # ttft_s
    int,  # status
    str,  # node
    str,  # key
    bool,  # stream
    int | None,  # max_tokens (already checked: see ``opt_int``)
    float | None,  # temperature (already a float)
    str,  # endpoint: the endpoint's kind
    str,  # tier: interactive | batch
]


class RequestLog:
    """Append-only JSON-lines request log: ``append`` on the hot path, ``flush`` in a thread.

    ``append`` only puts the record in a bounded in-memory buffer (``max_buffer`` records);
    ``flush`` serializes and appends the buffer to ``path`` (mode 0600), rotating first when
    the file would pass ``rotate_bytes``: ``path`` -> ``path.1`` -> ... -> ``path.<keep>``.

    The buffer is a deque, whose ``append`` and ``popleft`` are atomic: the event loop adds
    records without taking a lock, and the flushing thread takes them from the other end.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_buffer: int = 10_000,
        rotate_bytes: int = 64 * 1024 * 1024,
        keep: int = 1,
    ) -> None:
        if max_buffer < 1 or rotate_bytes < 1 or keep < 1:
            raise ValueError("max_buffer, rotate_bytes and keep must be >= 1")
        self.path = path
        self.max_buffer = max_buffer
        self.rotate_bytes = rotate_bytes
        self.keep = keep
        self._buffer: deque[TraceRecord | RawTrace] = deque()
        self._lock = threading.Lock()  # the counters below (event loop vs flush thread)
        self._flush_lock = threading.Lock()  # one flush at a time
        self._written = 0
        self._dropped = 0
        self._rotations = 0
        self._write_errors = 0
        self._last_error = ""

    def append(self, record: TraceRecord | RawTrace) -> bool:
        """Buffer one record; False (and counted) if the buffer is full."""
        buffer = self._buffer
        if len(buffer) >= self.max_buffer:
            with self._lock:
                self._dropped += 1
            return False
        buffer.append(record)
        return True

    def flush(self) -> int:
        """Write what is buffered; returns how many records were written.

        Blocking file I/O: call it from a worker thread. An OSError (disk full, directory
        gone) loses this batch, is counted in ``write_errors``/``dropped`` and is not raised.
        """
        with self._flush_lock:
            buffer = self._buffer
            batch = [buffer.popleft() for _ in range(len(buffer))]
            if not batch:
                return 0
            lines = []
            for record in batch:
                try:
                    if isinstance(record, tuple):
                        lines.append(_raw_line(record))
                    else:
                        lines.append(_dumps_line(record.as_dict()))
                except (TypeError, ValueError, OverflowError):  # never fatal
                    with self._lock:
                        self._dropped += 1
            data = b"".join(lines)
            try:
                self._write(data)
            except OSError as exc:
                with self._lock:
                    self._write_errors += 1
                    self._dropped += len(batch)
                    self._last_error = f"{exc.filename or self.path}: {exc.strerror or exc}"
                return 0
            with self._lock:
                self._written += len(batch)
            return len(batch)

    def _write(self, data: bytes) -> None:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(data) > self.rotate_bytes:
            self._rotate()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            written = 0
            while written < len(data):  # os.write may write less than asked
                written += os.write(fd, data[written:])
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        for n in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{n + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._rotations += 1

    def statistics(self) -> RequestLogStats:
        with self._lock:
            return RequestLogStats(
                buffered=len(self._buffer),
                written=self._written,
                dropped=self._dropped,
                rotations=self._rotations,
                write_errors=self._write_errors,
                last_error=self._last_error,
            )


def _raw_line(raw: RawTrace) -> bytes:
    """The log line of a ``RawTrace``: ``TraceRecord.as_dict`` for fields whose types the
    ingress guarantees (so only the rounding and the length caps are left to do)."""
    (t, model, inp, out, latency, ttft, status, node, key, stream, max_tokens, temperature,
     endpoint, tier) = raw  # fmt: skip
    return _dumps_line(
        {
            "v": TRACE_VERSION,
            "T": round(t, 6),
            "M": model[:MAX_MODEL_CHARS],
            "I": inp,
            "O": out,
            "latency_s": round(latency, 6),
            "ttft_s": None if ttft is None else round(ttft, 6),
            "status": status,
            "node": node[:MAX_MODEL_CHARS],
            "key": key[:MAX_MODEL_CHARS],
            "stream": stream,
            "max_tokens": max_tokens,
            "temperature": None if temperature is None else round(temperature, 6),
            "endpoint": endpoint,
            "tier": tier,
        }
    )


def request_log_files(path: Path) -> list[Path]:
    """``path`` and its rotated predecessors that exist, oldest first."""
    rotated: list[tuple[int, Path]] = []
    for candidate in path.parent.glob(f"{path.name}.*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
            rotated.append((int(suffix), candidate))
    files = [p for _, p in sorted(rotated, reverse=True)]
    if path.exists():
        files.append(path)
    return files


def read_request_log(path: Path, *, include_rotated: bool = False) -> list[TraceRecord]:
    """The records of a request log (and, if asked, of its rotated files, oldest first).

    Lines that are not trace records (a line cut short by a crash) are skipped; a file with
    lines but no record at all is refused with one ConfigError line, since it is most likely
    not a request log.
    """
    files = request_log_files(path) if include_rotated else [path]
    if not files:
        raise ConfigError(f"request log {path} does not exist")
    records: list[TraceRecord] = []
    lines = 0
    for file in files:
        try:
            raw = file.read_bytes()
        except FileNotFoundError as exc:
            raise ConfigError(f"request log {file} does not exist") from exc
        except OSError as exc:
            raise ConfigError(f"cannot read request log {file}: {exc.strerror}") from exc
        for line in raw.splitlines():
            if not line.strip():
                continue
            lines += 1
            try:
                records.append(TraceRecord.from_dict(_loads(line)))
            except (*_JSON_ERRORS, KeyError):
                continue
    if lines and not records:
        raise ConfigError(f"{path} is not a fabric request log (no trace record in it)")
    return records


def workload_summary(
    records: Iterable[TraceRecord], *, duration_s: float | None = None
) -> dict[str, dict[str, float]]:
    """Per model: arrival ``rate`` (req/s) and token means/std -- the planner's workload.

    The rate counts every request that was not refused as a client error (4xx): 5xx and 503
    "no eligible node" are demand the mesh failed to serve. It is over ``duration_s`` if given,
    else over the span of all the records' arrival times (at least 1 s). Token statistics use
    the requests whose input and output counts are known; std is the population std (0 for
    one sample); a model with no such request gets 0.0.
    """
    arrivals: dict[str, int] = {}
    inputs: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    first, last = math.inf, -math.inf
    for r in records:
        first, last = min(first, r.t), max(last, r.t)
        if 400 <= r.status < 500:
            continue
        arrivals[r.model] = arrivals.get(r.model, 0) + 1
        if r.input_tokens is not None and r.output_tokens is not None:
            inputs.setdefault(r.model, []).append(r.input_tokens)
            outputs.setdefault(r.model, []).append(r.output_tokens)
    if duration_s is not None:
        if duration_s <= 0:
            raise ValueError("duration_s must be positive")
        span = duration_s
    else:
        span = max(1.0, last - first) if math.isfinite(first) else 1.0
    summary: dict[str, dict[str, float]] = {}
    for model in sorted(arrivals):
        ins, outs = inputs.get(model, []), outputs.get(model, [])
        summary[model] = {
            "rate": arrivals[model] / span,
            "input_mean": stats.fmean(ins) if ins else 0.0,
            "output_mean": stats.fmean(outs) if outs else 0.0,
            "input_std": stats.pstdev(ins) if ins else 0.0,
            "output_std": stats.pstdev(outs) if outs else 0.0,
        }
    return summary


def workload_sums(records: Iterable[TraceRecord]) -> dict[str, dict[str, float]]:
    """Per model: request count and token sums -- mergeable across ingresses.

    ``requests`` counts what was not refused as a client error (as ``workload_summary``);
    ``measured`` those with both token counts known, over which the ``*_sum``/``*_sumsq``
    fields run. ``merge_workload_sums`` turns sums from any number of ingresses into rates and
    moments.
    """
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if 400 <= r.status < 500:
            continue
        row = out.setdefault(
            r.model,
            {
                "requests": 0.0,
                "measured": 0.0,
                "input_sum": 0.0,
                "input_sumsq": 0.0,
                "output_sum": 0.0,
                "output_sumsq": 0.0,
            },
        )
        row["requests"] += 1
        if r.input_tokens is not None and r.output_tokens is not None:
            row["measured"] += 1
            row["input_sum"] += r.input_tokens
            row["input_sumsq"] += r.input_tokens * r.input_tokens
            row["output_sum"] += r.output_tokens
            row["output_sumsq"] += r.output_tokens * r.output_tokens
    return out


def merge_workload_sums(
    parts: Iterable[Mapping[str, Mapping[str, float]]], window_s: float
) -> dict[str, dict[str, float]]:
    """Sums from several ingresses (each over the same ``window_s``) -> rate and token moments
    per model, in ``workload_summary``'s shape (population std)."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    total: dict[str, dict[str, float]] = {}
    for part in parts:
        for model, row in part.items():
            acc = total.setdefault(model, {})
            for key, value in row.items():
                acc[key] = acc.get(key, 0.0) + float(value)
    summary: dict[str, dict[str, float]] = {}
    for model in sorted(total):
        acc = total[model]
        n = acc.get("measured", 0.0)

        def moments(prefix: str, n: float = n, acc: dict[str, float] = acc) -> tuple[float, float]:
            if n <= 0:
                return 0.0, 0.0
            mean = acc.get(f"{prefix}_sum", 0.0) / n
            var = max(0.0, acc.get(f"{prefix}_sumsq", 0.0) / n - mean * mean)
            return mean, math.sqrt(var)

        in_mean, in_std = moments("input")
        out_mean, out_std = moments("output")
        summary[model] = {
            "rate": acc.get("requests", 0.0) / window_s,
            "input_mean": in_mean,
            "output_mean": out_mean,
            "input_std": in_std,
            "output_std": out_std,
        }
    return summary


# -- the log's tail, for the elastic controller -----------------------------------------------
#
# The controller asks every agent every few seconds what its log gained since the last time.
# A cursor names a place in the log: ``<inode>:<byte offset>`` of the file the place is in, so
# rotation (``path`` renamed to ``path.1``) does not lose it; only the bytes after it are read,
# and only whole lines (a line being written is read next time, whole).

CURSOR_END = "end"  # ask for a cursor at the log's end (nothing before it counts)


def recent_sums(records: Iterable[TraceRecord]) -> dict[str, dict[str, Any]]:
    """Per model, what the elastic controller's scaling policy needs of some records: counts
    and token sums (mergeable across ingresses) and a TTFT histogram.

    ``requests`` counts what was not refused as a client error (4xx), as ``workload_sums``;
    ``prompt_tokens`` sums the known input tokens of those, over ``prompt_known`` requests;
    ``output_tokens`` the known output tokens, over ``output_known`` (answered) requests;
    ``ttft`` maps a bucket (``ttft_bucket``, as a string: JSON keys) to the count of answered
    requests whose first token came in it (streams only: a JSON answer has no first token), of
    the interactive tier only: a batch request's first token includes its wait for spare
    capacity at the ingress (``tiers``), which a latency objective must not scale for.
    """
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if 400 <= r.status < 500:
            continue
        row = out.get(r.model)
        if row is None:
            row = out[r.model] = {
                "requests": 0,
                "prompt_tokens": 0,
                "prompt_known": 0,
                "output_tokens": 0,
                "output_known": 0,
                "ttft": {},
            }
        row["requests"] += 1
        if r.input_tokens is not None and r.input_tokens >= 0:
            row["prompt_tokens"] += r.input_tokens
            row["prompt_known"] += 1
        if r.output_tokens is not None and r.output_tokens >= 0:
            row["output_tokens"] += r.output_tokens
            row["output_known"] += 1
        if r.ttft_s is not None and r.status == 200 and r.ttft_s >= 0 and r.tier != "batch":
            key = str(ttft_bucket(r.ttft_s))
            row["ttft"][key] = row["ttft"].get(key, 0) + 1
    return out


def parse_cursor(cursor: str) -> tuple[int, int] | None:
    """``(inode, offset)`` of a cursor, None for ``CURSOR_END``; ValueError if malformed."""
    if cursor == CURSOR_END:
        return None
    ino, sep, offset = cursor.partition(":")
    if not sep or not ino.isdigit() or not offset.isdigit() or len(cursor) > 64:
        raise ValueError(f"not a request log cursor: {cursor[:64]!r}")
    return int(ino), int(offset)


def read_request_log_after(path: Path, cursor: str) -> tuple[list[TraceRecord], str]:
    """The records appended to the request log at ``path`` after ``cursor``, and the cursor
    after them (module section above). Blocking file I/O: call it from a worker thread.

    ``CURSOR_END`` gives no record and the cursor at the end. A cursor whose file is gone
    (rotated out of the kept files) or was cut shorter reads what the current files hold. Lines
    that are not trace records are skipped; ValueError for a malformed cursor, ConfigError
    when a file cannot be read.
    """
    place = parse_cursor(cursor)
    files = request_log_files(path)
    if not files:
        return [], "0:0"  # nothing logged yet: whatever is written first is new
    stats = []
    for file in files:
        try:
            stats.append((file, os.stat(file)))
        except FileNotFoundError:  # rotated away between the listing and now
            continue
        except OSError as exc:
            raise ConfigError(f"cannot read request log {file}: {exc.strerror}") from exc
    if not stats:
        return [], "0:0"
    if place is None:
        file, st = stats[-1]
        return [], _cursor_at_end(file, st.st_ino, st.st_size)
    ino, offset = place
    start = next((i for i, (_, st) in enumerate(stats) if st.st_ino == ino), None)
    if start is None or stats[start][1].st_size < offset:
        start, offset = len(stats) - 1, 0  # its file is gone or was cut: the current one
    records: list[TraceRecord] = []
    new_cursor = cursor
    for i in range(start, len(stats)):
        file, st = stats[i]
        at = offset if i == start else 0
        data = _read_from(file, at)
        whole = data.rfind(b"\n") + 1
        for line in data[:whole].splitlines():
            if not line.strip():
                continue
            try:
                records.append(TraceRecord.from_dict(_loads(line)))
            except (*_JSON_ERRORS, KeyError):
                continue
        new_cursor = f"{st.st_ino}:{at + whole}"
    return records, new_cursor


def _read_from(file: Path, offset: int) -> bytes:
    try:
        with open(file, "rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise ConfigError(f"cannot read request log {file}: {exc.strerror}") from exc


def _cursor_at_end(file: Path, ino: int, size: int) -> str:
    """The cursor after the last whole line of ``file`` (a line being written is not yet)."""
    at = max(0, size - MAX_LINE_BYTES)
    try:
        with open(file, "rb") as f:
            f.seek(at)
            data = f.read(size - at)
    except OSError as exc:
        raise ConfigError(f"cannot read request log {file}: {exc.strerror}") from exc
    end = at + data.rfind(b"\n") + 1
    return f"{ino}:{end}"
