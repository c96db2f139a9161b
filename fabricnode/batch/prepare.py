"""Turning what a researcher has into a Batch API input file (``fabric batch submit``). Pure:
bytes in, the input file or its problems out.

A researcher's file is JSON Lines of OpenAI batch lines, of request bodies, or of prompts, mixed
as they like. Line by line (N counts from 1; a blank line stays blank, so that the line numbers
the agent's validation reports, ``validate``, are those of the researcher's file):

* a JSON object with ``body`` is an OpenAI batch line: a missing ``custom_id`` becomes
  ``line-N``, a missing ``method`` ``POST`` and a missing ``url`` the batch's endpoint;
* a JSON object without ``body`` is the request body; a ``custom_id`` in it is taken out and
  names the request, else it is ``line-N``;
* a JSON string, or a line that is not JSON, is a prompt: ``{"messages": [{"role": "user",
  "content": TEXT}]}`` for ``/v1/chat/completions``, ``{"prompt": TEXT}`` for
  ``/v1/completions``, ``{"input": TEXT}`` for ``/v1/embeddings``. A line that parses as a
  number, ``true``, ``false`` or ``null`` is text too (``2024`` is a fine prompt);
* a line that starts with ``{`` and does not parse is a problem (a broken JSON line is never
  sent as a prompt), and so is a JSON array; other lines that do not parse are text
  (``[INST] Hi [/INST]``, ``"Hello," she said.``).

``model`` (``--model``) sets ``body.model`` of every line, replacing any; without it, every
body must name its model. ``max_tokens`` (``--max-tokens``) sets ``body.max_tokens`` the same
way (not for embeddings). The endpoint, when not given, is the ``url`` of the first OpenAI batch
line, else ``/v1/chat/completions``. A UTF-8 byte order mark at the start is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from fabricnode.batch.validate import ENDPOINTS, MAX_ERRORS, Problem

DEFAULT_ENDPOINT = "/v1/chat/completions"
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Prepared:
    data: bytes  # the input file to upload, one line per line of the researcher's file
    endpoint: str
    requests: int
    prompts: int  # of the requests, lines of text (or JSON strings) wrapped into a body
    models: tuple[str, ...]  # the models the requests name, sorted


def prompt_body(endpoint: str, text: str) -> dict[str, Any]:
    """The request body a line of text becomes for ``endpoint``."""
    if endpoint == "/v1/completions":
        return {"prompt": text}
    if endpoint == "/v1/embeddings":
        return {"input": text}
    return {"messages": [{"role": "user", "content": text}]}


def prepare_input(
    data: bytes,
    *,
    endpoint: str | None = None,
    model: str | None = None,
    max_tokens: int | None = None,
) -> Prepared | list[Problem]:
    """The input file for ``data`` (rules in the module docstring), else its problems in line
    order (at most ``MAX_ERRORS``, then a count of the rest)."""
    if endpoint is not None and endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint {endpoint!r} is not one of {', '.join(ENDPOINTS)}")
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    problems: list[Problem] = []

    def problem(code: str, message: str, line: int | None, param: str | None = None) -> None:
        problems.append(Problem(code, message, line, param))

    # Pass 1: what each line is (the endpoint may be named by a line after the first prompts).
    parsed: list[tuple[int, str, Any]] = []  # (line, kind, value); kind: blank|line|body|text
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            problem("invalid_encoding", "this line is not UTF-8 text", number)
            continue
        stripped = text.strip()
        if not stripped:
            parsed.append((number, "blank", None))
            continue
        kind, value = _classify(text, stripped)
        if kind == "problem":
            problem("invalid_json_line", value, number)
            continue
        parsed.append((number, kind, value))
    if endpoint is None:
        urls = (v.get("url") for n, k, v in parsed if k == "line")
        endpoint = next((u for u in urls if isinstance(u, str) and u in ENDPOINTS), None)
        endpoint = endpoint or DEFAULT_ENDPOINT

    # Pass 2: one OpenAI batch line per request.
    out: list[bytes] = []
    models: set[str] = set()
    prompts = 0
    for number, kind, value in parsed:
        if kind == "blank":
            out.append(b"")
            continue
        if kind == "text":
            prompts += 1
        line = _batch_line(kind, value, number, endpoint)
        given = line.get("body")
        if not isinstance(given, dict):  # left to the agent's validation, which names it
            out.append(orjson.dumps(line))
            continue
        body = line["body"] = dict(given)
        if model is not None:  # first, where a reader looks for it
            body = line["body"] = {"model": model} | {k: v for k, v in body.items() if k != "model"}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        named = body.get("model")
        if isinstance(named, str) and named:
            models.add(named)
        else:
            problem("missing_model", "the request names no model (give --model MODEL, or a "
                    "\"model\" in the line)", number, "body.model")  # fmt: skip
        out.append(orjson.dumps(line))
    requests = sum(1 for _, kind, _ in parsed if kind != "blank")
    if not requests and not problems:
        problem("empty_file", "the file has no request (every line is blank)", None)
    if problems:
        problems.sort(key=lambda p: p.line or 0)
        more = len(problems) - MAX_ERRORS
        if more > 0:
            del problems[MAX_ERRORS:]
            problems.append(
                Problem("too_many_errors", f"{more} more problems are not listed", None)
            )
        return problems
    return Prepared(
        data=b"\n".join(out).rstrip(b"\n") + b"\n",
        endpoint=endpoint,
        requests=requests,
        prompts=prompts,
        models=tuple(sorted(models)),
    )


def _batch_line(kind: str, value: Any, number: int, endpoint: str) -> dict[str, Any]:
    """The OpenAI batch line of line ``number`` (its body not yet given a model)."""
    if kind == "line":
        line = dict(value)
        line.setdefault("custom_id", f"line-{number}")
        line.setdefault("method", "POST")
        line.setdefault("url", endpoint)
        return line
    body = prompt_body(endpoint, value) if kind == "text" else dict(value)
    cid = body.pop("custom_id", None)
    return {
        "custom_id": cid if cid is not None else f"line-{number}",
        "method": "POST",
        "url": endpoint,
        "body": body,
    }


def _classify(text: str, stripped: str) -> tuple[str, Any]:
    """``("line", obj)`` an OpenAI batch line, ``("body", obj)`` a request body, ``("text",
    str)`` a prompt, or ``("problem", why)``."""
    first = stripped[0]
    if first in '{["':
        try:
            doc = orjson.loads(stripped)
        except orjson.JSONDecodeError as exc:
            if first != "{":
                return "text", text  # "Hello," she said. / [INST] Hi [/INST]
            return (
                "problem",
                f"this line starts like JSON but does not parse ({exc.msg} at column {exc.colno})",
            )
        if isinstance(doc, dict):
            return ("line" if "body" in doc else "body"), doc
        if isinstance(doc, str):
            return "text", doc
        return "problem", "a JSON array is not a request (expected an object, a string or text)"
    return "text", text
