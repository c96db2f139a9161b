"""Reading an uploaded file out of a ``multipart/form-data`` body (``POST /v1/files``). Pure.

The parts are walked by ``dataplane.multipart`` (``first_part``, ``next_part``: the grammar of
RFC 7578 as the ingress reads it for the audio forms). Here every part is kept, with its name
and filename; the body is already within the ingress's body limit. An upload form has two
parts (``purpose`` and ``file``): one of more than ``MAX_PARTS`` is refused, so that a body of
hundreds of thousands of tiny parts costs one short walk, not a dictionary of them; the caller
walks it in a worker thread, off the event loop every other client shares.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fabricnode.dataplane.multipart import boundary_of, first_part, next_part

MAX_PARTS = 16

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
    pos = first_part(body, delim)
    if isinstance(pos, str):
        return pos
    parts: dict[str, Part] = {}
    seen = 0
    while True:
        part = next_part(body, delim, pos)
        if part is None:
            return parts
        if isinstance(part, str):
            return part
        seen += 1
        if seen > MAX_PARTS:
            return f"a form of more than {MAX_PARTS} parts (an upload has 'purpose' and 'file')"
        head_start, head_end, content, nxt = part
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
