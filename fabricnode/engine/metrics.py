"""Engine load from a Prometheus ``/metrics`` page (vLLM and SGLang).

Theory of operation
-------------------
``parse_samples`` reads the text exposition format (0.0.4, and the sample lines of
OpenMetrics): ``name{label="value",...} value [timestamp]``. Comments, ``# HELP``/``# TYPE``
lines and blank lines are skipped; label values may hold escaped ``\\``, ``\\"`` and ``\\n``;
values may be ``NaN``, ``+Inf``, ``-Inf``. A line that does not parse is skipped: the page comes
from a child process we do not control, and nothing in it may raise.

``engine_load`` then reads the load gauges, summed over label sets (one per model, or per
engine of a data-parallel vLLM). KV-cache usage is a fraction of capacity, so it is the largest
over label sets instead (the fullest engine decides whether more requests fit). NaN and infinite
samples are ignored. vLLM:

- ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` (gauges)
- ``vllm:kv_cache_usage_perc`` (0..1 despite the name; older ``vllm:gpu_cache_usage_perc``)
- ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (tokens; older
  ``vllm:gpu_prefix_cache_hits_total`` / ``..._queries_total``)

SGLang: ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``, ``sglang:token_usage`` (0..1).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_FLOAT = re.compile(
    r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?"
    r"|[nN][aA][nN])"
)
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str, default: str = "") -> str:
        return next((v for k, v in self.labels if k == key), default)


def parse_samples(text: str) -> list[Sample]:
    """Every well-formed sample of ``text``; anything else is skipped."""
    return list(iter_samples(text))


def iter_samples(text: str) -> Iterator[Sample]:
    for line in text.split("\n"):
        sample = parse_line(line)
        if sample is not None:
            yield sample


def parse_line(line: str) -> Sample | None:
    """One sample line, or None for comments, blanks and malformed lines."""
    line = line.strip(" \t\r")
    if not line or line.startswith("#"):
        return None
    match = _NAME.match(line)
    if match is None:
        return None
    name, pos = match.group(), match.end()
    labels: tuple[tuple[str, str], ...] = ()
    if pos < len(line) and line[pos] == "{":
        parsed = _parse_labels(line, pos + 1)
        if parsed is None:
            return None
        labels, pos = parsed
    if pos >= len(line) or line[pos] not in " \t":
        return None
    tokens = line[pos:].split()
    value = _parse_float(tokens[0]) if tokens else None
    if value is None:
        return None
    if len(tokens) > 1 and tokens[1] != "#" and _parse_float(tokens[1]) is None:
        return None  # neither a timestamp nor an OpenMetrics exemplar
    return Sample(name, labels, value)


def _parse_labels(line: str, pos: int) -> tuple[tuple[tuple[str, str], ...], int] | None:
    """Labels from just after ``{``; returns them and the position after ``}``."""
    labels: list[tuple[str, str]] = []
    n = len(line)
    while True:
        pos = _skip_blanks(line, pos)
        if pos < n and line[pos] == "}":
            return tuple(labels), pos + 1
        match = _LABEL_NAME.match(line, pos)
        if match is None:
            return None
        key = match.group()
        pos = _skip_blanks(line, match.end())
        if pos >= n or line[pos] != "=":
            return None
        pos = _skip_blanks(line, pos + 1)
        if pos >= n or line[pos] != '"':
            return None
        pos += 1
        chars: list[str] = []
        while True:
            if pos >= n:
                return None
            c = line[pos]
            if c == '"':
                pos += 1
                break
            if c == "\\" and pos + 1 < n:
                nxt = line[pos + 1]
                chars.append(_ESCAPES.get(nxt, "\\" + nxt))
                pos += 2
                continue
            chars.append(c)
            pos += 1
        labels.append((key, "".join(chars)))
        pos = _skip_blanks(line, pos)
        if pos < n and line[pos] == ",":
            pos += 1
        elif pos >= n or line[pos] != "}":
            return None


def _skip_blanks(line: str, pos: int) -> int:
    while pos < len(line) and line[pos] in " \t":
        pos += 1
    return pos


def _parse_float(token: str) -> float | None:
    if _FLOAT.fullmatch(token) is None:
        return None
    try:
        return float(token)
    except (ValueError, OverflowError):
        return None


# -- engine load -------------------------------------------------------------------------------

VLLM_WAITING: tuple[str, ...] = ("vllm:num_requests_waiting",)
VLLM_RUNNING: tuple[str, ...] = ("vllm:num_requests_running",)
VLLM_KV_USAGE: tuple[str, ...] = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
VLLM_PREFIX_HITS: tuple[str, ...] = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits",
)
VLLM_PREFIX_QUERIES: tuple[str, ...] = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries",
)
SGLANG_WAITING: tuple[str, ...] = ("sglang:num_queue_reqs",)
SGLANG_RUNNING: tuple[str, ...] = ("sglang:num_running_reqs",)
SGLANG_KV_USAGE: tuple[str, ...] = ("sglang:token_usage",)


@dataclass(frozen=True)
class EngineLoad:
    """Load of one engine. ``kind`` is ``vllm``, ``sglang`` or ``""`` when the page has neither
    engine's metrics (then everything is zero/None). ``prefix_hits``/``prefix_queries`` are
    cumulative counters (tokens), None when the engine does not export them."""

    kind: str = ""
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    prefix_hits: float | None = None
    prefix_queries: float | None = None

    @property
    def prefix_hit_rate(self) -> float | None:
        """Lifetime hit rate; rates over an interval are differences of two loads' counters."""
        if self.prefix_hits is None or not self.prefix_queries:
            return None
        return min(1.0, max(0.0, self.prefix_hits / self.prefix_queries))


def engine_load(samples: Iterable[Sample]) -> EngineLoad:
    """The load the samples describe (see the module docstring for the metric names)."""
    by_name: dict[str, list[float]] = {}
    kinds: set[str] = set()
    for s in samples:
        if s.name.startswith("vllm:"):
            kinds.add("vllm")
        elif s.name.startswith("sglang:"):
            kinds.add("sglang")
        if math.isfinite(s.value):
            by_name.setdefault(s.name, []).append(s.value)
    if "vllm" in kinds:
        kind, waiting_names, running_names, kv_names = (
            "vllm",
            VLLM_WAITING,
            VLLM_RUNNING,
            VLLM_KV_USAGE,
        )
    elif "sglang" in kinds:
        kind, waiting_names, running_names, kv_names = (
            "sglang",
            SGLANG_WAITING,
            SGLANG_RUNNING,
            SGLANG_KV_USAGE,
        )
    else:
        return EngineLoad()
    kv = _first(by_name, kv_names)
    hits = _first(by_name, VLLM_PREFIX_HITS) if kind == "vllm" else None
    queries = _first(by_name, VLLM_PREFIX_QUERIES) if kind == "vllm" else None
    return EngineLoad(
        kind=kind,
        waiting=_count(_first(by_name, waiting_names)),
        running=_count(_first(by_name, running_names)),
        kv_usage=min(1.0, max(0.0, max(kv))) if kv else 0.0,
        prefix_hits=max(0.0, sum(hits)) if hits is not None else None,
        prefix_queries=max(0.0, sum(queries)) if queries is not None else None,
    )


# Counters only a working engine advances (tokens it took in and gave out): their sum moving
# is evidence of progress for the liveness verdict (``liveness``). Prometheus clients expose a
# counter with its ``_total`` suffix.
PROGRESS_COUNTERS = frozenset(
    (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
    )
)


def progress_total(samples: Iterable[Sample]) -> float | None:
    """The sum of the ``PROGRESS_COUNTERS`` samples; None when the page has none."""
    values = [s.value for s in samples if s.name in PROGRESS_COUNTERS and math.isfinite(s.value)]
    return sum(values) if values else None


def parse_engine_load(text: str) -> EngineLoad:
    """``engine_load(parse_samples(text))``: never raises."""
    return engine_load(iter_samples(text))


def _first(by_name: dict[str, list[float]], names: Sequence[str]) -> list[float] | None:
    """The samples of the first of ``names`` (newest name first) that the page has."""
    for name in names:
        if name in by_name:
            return by_name[name]
    return None


def _count(values: list[float] | None) -> int:
    if not values:
        return 0
    total = sum(values)
    if not math.isfinite(total) or total <= 0:
        return 0
    return min(round(total), 2**31 - 1)
