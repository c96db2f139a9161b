"""Reading an uploaded file out of a ``multipart/form-data`` body (``POST /v1/files``). Pure.

The grammar is the one ``dataplane.multipart`` reads (RFC 7578): parts opened by ``--boundary``,
their headers, an empty line, the content up to ``CRLF--boundary``. Here every part is kept,
with its name and filename; the body is already within the ingress's body limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fabricnode.dataplane.multipart import MAX_PART_HEAD_BYTES, boundary_of

_DISPOSITION = re.compile(rb"(?im)^content-disposition\s*:([^\r\n]*)")
_PARAM = re.compile(rb'(?i);\s*(name|filename)\s*=\s*(?:"([^"]*)"|([^\s;]+))')


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None
    content: bytes


def form_parts(body: bytes, content_type: bytes) -> dict[str, Part] | str:
    """The parts of a form by name (the first of each), or why it cannot be read."""
    boundary = boundary_of(content_type)
    if boundary is None:
        return "Content-Type must be multipart/form-data with a boundary"
    delim = b"--" + boundary
    sep = b"\r\n" + delim
    if body.startswith(delim):
        pos = 0
    else:
        pos = body.find(sep)
        if pos < 0:
            return "the form has no part"
        pos += 2
    parts: dict[str, Part] = {}
    while True:
        pos += len(delim)
        if body.startswith(b"--", pos):
            return parts
        eol = body.find(b"\r\n", pos)
        if eol < 0 or eol - pos > 64:
            return "malformed form: a part delimiter without a line end"
        head_start = eol + 2
        if body.startswith(b"\r\n", head_start):
            head_end = head_start
        else:
            head_end = body.find(b"\r\n\r\n", head_start, head_start + MAX_PART_HEAD_BYTES + 4)
            if head_end < 0:
                return "malformed form: a part's headers do not end"
        content = head_end + 4 if head_end > head_start else head_start + 2
        nxt = body.find(sep, content)
        if nxt < 0:
            return "malformed form: the body ends inside a part"
        m = _DISPOSITION.search(body, head_start, head_end)
        if m is not None:
            params: dict[bytes, str] = {}
            for p in _PARAM.finditer(m.group(1)):
                raw = p.group(2) if p.group(2) is not None else p.group(3)
                params.setdefault(p.group(1).lower(), raw.decode("utf-8", "replace"))
            name = params.get(b"name")
            if name is not None and name not in parts:
                parts[name] = Part(name, params.get(b"filename"), body[content:nxt])
        pos = nxt + 2
