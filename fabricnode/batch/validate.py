"""Checking a batch's input file before any request of it runs. Pure: bytes in, a plan or the
problems out.

A batch fails at validation, with every problem named by its line (up to ``MAX_ERRORS``), when
its file is not what the OpenAI Batch API accepts: each line one JSON object with a string
``custom_id`` unique in the file, ``method`` ``POST``, ``url`` equal to the batch's endpoint, and
a ``body`` object naming a ``model`` the mesh serves or declares. Limits: ``MAX_LINES`` requests
and the agent's body limit in bytes (the upload itself is refused beyond it). Blank lines are
skipped, as OpenAI does.

The file is read as a stream of lines (``validate_lines``; the worker hands in
``store.iter_lines`` of the open file): what is held is the plan's offsets and the
``custom_id``s seen, never the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import orjson

from fabricnode.batch.store import Plan

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_ERRORS = 100  # problems listed; a count of the rest follows
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class Problem:
    code: str
    message: str
    line: int | None = None  # from 1
    param: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def validate_input(
    data: bytes,
    endpoint: str,
    *,
    known_model: Callable[[str], bool],
    shard_size: int,
    max_lines: int = MAX_LINES,
) -> Plan | list[Problem]:
    """The plan of a valid input file held in memory, else its problems in line order."""
    return validate_lines(
        _split(data), endpoint, known_model=known_model, shard_size=shard_size, max_lines=max_lines
    )


def _split(data: bytes) -> Iterator[tuple[int, bytes]]:
    pos = 0
    end = len(data)
    while pos < end:
        nl = data.find(b"\n", pos)
        stop = end if nl < 0 else nl
        yield pos, data[pos:stop]
        pos = stop + 1


def validate_lines(
    lines: Iterable[tuple[int, bytes]],
    endpoint: str,
    *,
    known_model: Callable[[str], bool],
    shard_size: int,
    max_lines: int = MAX_LINES,
) -> Plan | list[Problem]:
    """The plan of a valid input file given as its lines (``(offset, line without its
    newline)``, every line, blank ones too), else its problems in line order."""
    problems: list[Problem] = []
    more = 0
    offsets: list[int] = []
    seen: set[str] = set()
    unknown_models: set[str] = set()

    def problem(code: str, message: str, line: int | None, param: str | None = None) -> None:
        nonlocal more
        if len(problems) < MAX_ERRORS:
            problems.append(Problem(code, message, line, param))
        else:
            more += 1

    number = 0
    last_end = 0
    for start, raw in lines:
        stop = start + len(raw)
        number += 1
        if not raw.strip():
            continue
        if len(offsets) >= max_lines:
            problem(
                "too_many_requests",
                f"the file has more than {max_lines} requests, the most one batch takes",
                number,
            )
            break
        offsets.append(start)
        last_end = stop
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            problem("invalid_json_line", "this line is not valid JSON", number)
            continue
        if not isinstance(doc, dict):
            problem("invalid_json_line", "this line is not a JSON object", number)
            continue
        cid = doc.get("custom_id")
        if not isinstance(cid, str) or not cid:
            problem("missing_custom_id", "'custom_id' must be a non-empty string", number,
                    "custom_id")  # fmt: skip
        elif len(cid) > MAX_CUSTOM_ID_CHARS:
            problem("invalid_custom_id", f"'custom_id' is longer than {MAX_CUSTOM_ID_CHARS} "
                    "characters", number, "custom_id")  # fmt: skip
        elif cid in seen:
            problem("duplicate_custom_id", f"custom_id {cid!r} is used by an earlier line",
                    number, "custom_id")  # fmt: skip
        else:
            seen.add(cid)
        method = doc.get("method")
        if method != "POST":
            problem("invalid_method", f"'method' must be \"POST\", not {method!r}", number,
                    "method")  # fmt: skip
        url = doc.get("url")
        if url != endpoint:
            problem("mismatched_endpoint", f"'url' {url!r} is not the batch's endpoint "
                    f"{endpoint!r}", number, "url")  # fmt: skip
        body = doc.get("body")
        if not isinstance(body, dict):
            problem("invalid_body", "'body' must be a JSON object", number, "body")
            continue
        model = body.get("model")
        if not isinstance(model, str) or not model:
            problem("missing_model", "'body.model' must be a non-empty string", number,
                    "body.model")  # fmt: skip
        elif model in unknown_models or not known_model(model):
            unknown_models.add(model)
            problem("model_not_found", f"model {model!r} is not served or declared by any "
                    "node of the mesh", number, "body.model")  # fmt: skip
    if not offsets and not problems:
        problem("empty_file", "the input file has no request", None)
    if more:
        problems.append(Problem("too_many_errors", f"{more} more problems are not listed", None))
    if problems:
        return problems
    offsets.append(last_end)
    return Plan(tuple(offsets), shard_size)


def request_line(data: bytes, plan: Plan, index: int) -> bytes:
    """The raw text of request line ``index`` (from 0) of a validated file."""
    start = plan.offsets[index]
    nl = data.find(b"\n", start)
    return data[start : nl if nl >= 0 else len(data)]
