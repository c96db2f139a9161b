"""The request log's line format: one ``TraceRecord`` per request, one JSON object per line.

Owns what a line holds and how it is written and read back; ``writer`` appends lines,
``reader`` and ``cursor`` read them, ``sums`` adds them up. No file I/O here.

One line (the LLMFabric trace schema plus ingress fields)::

    {"v": 1, "T": 1732270000.123, "M": "llama-3.3-70b", "I": 512, "O": 128,
     "latency_s": 2.41, "ttft_s": 0.18, "status": 200, "node": "<session id>",
     "key": "alice", "stream": true, "max_tokens": 256, "temperature": 0.7,
     "endpoint": "chat", "tier": "interactive", "site": "alps"}

``T`` is the arrival time (Unix seconds), ``M`` the requested model, ``I``/``O`` input/output
tokens (null when unknown), ``endpoint`` the kind of endpoint (``dataplane.endpoints``:
``chat``, ``responses``, ``messages``, ``rerank``, ``transcriptions``, ...), ``tier`` the
request's priority tier (``interactive`` or ``batch``: ``dataplane.tiers``), ``site`` the site
of the node that served (``mesh.sites``; ``""`` when none did, like ``node``); each is absent
from lines written before it existed, and read as null from them. There is deliberately no
field that could hold prompt or output text: the trace is shareable the way the paper's is.

The ingress hands a request over as a ``RawTrace`` tuple, cheap to make on the event loop;
``raw_line`` builds its line in the writer's flush thread, off the request path, and writes the
same bytes as ``record_line`` of the equivalent ``TraceRecord``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

ANONYMOUS = "anonymous"  # the key name of a request made without an API key
MAX_MODEL_CHARS = 128  # the longest model, node, key, endpoint, tier or site name kept
TRACE_VERSION = 1
_JSON_ERRORS = (ValueError, TypeError, RecursionError)  # what decoding untrusted JSON raises


def loads(data: bytes) -> Any:
    return orjson.loads(data)


def dumps_line(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc) + b"\n"


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
    site: str | None = None  # the serving node's site (None: a line from before it was logged)

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
            "site": None if self.site is None else str(self.site)[:MAX_MODEL_CHARS],
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
            site=doc["site"] if isinstance(doc.get("site"), str) else None,
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


def record_line(record: TraceRecord) -> bytes:
    """The log line of a record, newline included."""
    return dumps_line(record.as_dict())


def parse_line(line: bytes) -> TraceRecord | None:
    """The record of one log line; None for a line that is not one (cut short by a crash)."""
    try:
        return TraceRecord.from_dict(loads(line))
    except (*_JSON_ERRORS, KeyError):
        return None


# The fields of one request as the ingress hands them over, in TraceRecord's order: a tuple is
# cheap to make on the event loop; the line is built from it in the writer's flush thread.
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
    str,  # site: the serving node's ("" if none served)
]


def raw_line(raw: RawTrace) -> bytes:
    """The log line of a ``RawTrace``: ``TraceRecord.as_dict`` for fields whose types the
    ingress guarantees (so only the rounding and the length caps are left to do)."""
    (t, model, inp, out, latency, ttft, status, node, key, stream, max_tokens, temperature,
     endpoint, tier, site) = raw  # fmt: skip
    return dumps_line(
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
            "site": site[:MAX_MODEL_CHARS],
        }
    )
