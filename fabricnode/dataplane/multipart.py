"""Reading a few text fields of a ``multipart/form-data`` body, without copying its files.

Pure. The audio endpoints (``/v1/audio/transcriptions``, ``/v1/audio/translations``) take a
form with the audio file and text fields, ``model`` among them; the ingress routes by that
field and forwards the body as it came. ``form_fields`` walks the parts by their delimiters
(``bytes.find``: no part is copied or decoded but the wanted text fields, each at most
``MAX_FIELD_BYTES``), in any order (a ``model`` part after the file is found too), to the
closing delimiter: a wanted field named twice is refused, because the engine reads the form
again with its own parser, which takes the last value where this would take the first (a
request routed by one ``model`` and served as another). For the same reason a content type
with two ``boundary`` parameters and a part with two ``name`` parameters are refused: which one
counts is the parser's choice. A form of more than ``MAX_PARTS`` parts
is refused too: an audio form has a file and a handful of fields. The body itself is held by
the HTTP layer, within the body limit and the agent's body budget like any request body (a
larger one is refused with 413 while it arrives).

Grammar (RFC 7578 / RFC 2046), as far as it is read here: the boundary comes from the
``Content-Type`` parameter (quoted or not, 1-70 characters); the body is an optional preamble,
then parts each opened by ``--boundary`` and its line end, with header lines, an empty line and
the content, the next delimiter being ``CRLF--boundary``; ``--boundary--`` closes the body. A
part's name comes from its ``Content-Disposition: form-data; name="..."`` header.
"""

from __future__ import annotations

import re

MAX_FIELD_BYTES = 4096  # a wanted text field longer than this is refused
MAX_PART_HEAD_BYTES = 8192  # one part's header block
MAX_BOUNDARY_CHARS = 70
MAX_PARTS = 256  # parts in one audio form (a file and a few fields; the Batch API's has 2)

_BOUNDARY = re.compile(rb'(?i)(?:^|;)\s*boundary\s*=\s*(?:"([^"]{1,70})"|([^\s;"]{1,70}))')
_NAME = re.compile(rb'(?im)^content-disposition\s*:[^\r\n]*;\s*name\s*=\s*(?:"([^"]*)"|([^\s;]+))')
# Every ``name`` parameter of a part's header block (a second one is refused: see below).
_NAME_PARAM = re.compile(rb"(?i);\s*name\s*=")


def boundary_of(content_type: bytes) -> bytes | None:
    """The boundary of a ``multipart/form-data`` content type, None if it is not one."""
    media, _, params = content_type.partition(b";")
    if media.strip().lower() != b"multipart/form-data":
        return None
    found = list(_BOUNDARY.finditer(params))
    if len(found) != 1:  # none, or two that parsers would choose between differently
        return None
    m = found[0]
    value = m.group(1) if m.group(1) is not None else m.group(2)
    return value if value else None


def first_part(body: bytes, delim: bytes) -> int | str:
    """Where the first part's delimiter (``--boundary``) starts, past any preamble, or why the
    body has no part."""
    if body.startswith(delim):
        return 0
    pos = body.find(b"\r\n" + delim)
    if pos < 0:
        return "the form has no part"
    return pos + 2  # past the preamble's CRLF


def next_part(body: bytes, delim: bytes, pos: int) -> tuple[int, int, int, int] | str | None:
    """The part whose delimiter starts at ``pos``: ``(head_start, head_end, content, end)``,
    its header block being ``body[head_start:head_end]`` and its content
    ``body[content:end]``; None at the closing delimiter; else why the body cannot be read.
    The next part's delimiter starts at ``end + 2``. The one walk of the parts: ``form_fields``
    here and the file upload (``batch.upload``) both read a form with it."""
    pos += len(delim)
    if body.startswith(b"--", pos):
        return None  # the closing delimiter
    eol = body.find(b"\r\n", pos)
    if eol < 0 or eol - pos > 64:  # only transport padding may follow a delimiter
        return "malformed form: a part delimiter without a line end"
    head_start = eol + 2
    if body.startswith(b"\r\n", head_start):
        head_end = head_start  # a part without headers
    else:
        head_end = body.find(b"\r\n\r\n", head_start, head_start + MAX_PART_HEAD_BYTES + 4)
        if head_end < 0:
            return "malformed form: a part's headers do not end"
    content = head_end + 4 if head_end > head_start else head_start + 2
    end = body.find(b"\r\n" + delim, content)
    if end < 0:
        return "malformed form: the body ends inside a part"
    return head_start, head_end, content, end


def form_fields(body: bytes, content_type: bytes, wanted: tuple[str, ...]) -> dict[str, str] | str:
    """The values of the ``wanted`` text fields present in a form body, or why the body cannot
    be read (one line, for a 400): among the reasons, a wanted field named twice."""
    boundary = boundary_of(content_type)
    if boundary is None:
        return "Content-Type must be multipart/form-data with a boundary"
    delim = b"--" + boundary
    pos = first_part(body, delim)
    if isinstance(pos, str):
        return pos
    found: dict[str, str] = {}
    want = frozenset(wanted)
    parts = 0
    while True:
        part = next_part(body, delim, pos)
        if part is None:
            return found
        if isinstance(part, str):
            return part
        parts += 1
        if parts > MAX_PARTS:
            return f"a form of more than {MAX_PARTS} parts"
        head_start, head_end, content, nxt = part
        m = _NAME.search(body, head_start, head_end)
        if m is not None:
            if len(_NAME_PARAM.findall(body, head_start, head_end)) > 1:
                return "a form part that names itself twice"
            raw_name = m.group(1) if m.group(1) is not None else m.group(2)
            name = raw_name.decode("utf-8", "replace")
            if name in want:
                if name in found:
                    return f"form field {name!r} given twice (one form, one {name})"
                if nxt - content > MAX_FIELD_BYTES:
                    return f"form field {name!r} longer than {MAX_FIELD_BYTES} bytes"
                try:
                    found[name] = body[content:nxt].decode("utf-8")
                except UnicodeDecodeError:
                    return f"form field {name!r} is not UTF-8 text"
        pos = nxt + 2
