"""HTTP/1.1 message parsing for the ``/v1`` data plane: httptools (llhttp) behind a small, sans-IO
wrapper with hard limits.

Why not h11: pure Python, it takes over ten times httptools' time to parse a message, and every
proxied request parses two (docs/benchmarks.md, "Per-call costs behind the data plane").
Why a wrapper: httptools is a callback parser with no notion of limits, pipelining or
``Expect: 100-continue``; this module adds them and nothing else, and owns no socket, so the
parser path is fuzzed without I/O.

Rules (theory of operation):

* ``RequestParser.feed(data)`` parses whatever bytes arrived. Completed requests queue up in
  order (pipelining is supported: a client may send the next request before the answer to the
  previous one; answers go out in order because the connection handles one at a time).
* Limits are checked while parsing. A request line or header block over ``max_head_bytes``, more
  than ``max_headers`` headers, or a body over ``max_body_bytes`` (announced by
  ``Content-Length`` or counted while a chunked body arrives) sets ``error`` to a status code and
  message; the caller answers it and closes the connection (the framing cannot be trusted any
  more). Malformed framing from llhttp is a 400 the same way.
* Request bodies are collected whole (chunked bodies are de-chunked by llhttp): the data plane
  needs the ``model`` field before it can route, and the body is then forwarded as it came.
* ``Expect: 100-continue`` is reported as ``expect_continue`` on the pending request once its
  head is complete, so the caller can send ``100 Continue`` (or refuse early with 413).
* Upgrades (``Connection: upgrade``, CONNECT) are refused: nothing here speaks anything but
  HTTP/1.x.

``ResponseParser`` is the client side, used on pooled upstream connections: it reports the
status and headers, passes decoded body pieces to a callback, and says when the message ended.
It holds upstream responses to the same kind of limits (head size and header count), consumes
interim 1xx responses, and refuses protocol switches: what a node or engine sends cannot make
an agent buffer without bound, relay a 1xx as the answer, or leave a pooled connection out of
step with its responses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import httptools

# Status reasons for the responses the data plane writes itself.
REASONS = {
    100: b"Continue",
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    415: b"Unsupported Media Type",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}

CONTINUE_RESPONSE = b"HTTP/1.1 100 Continue\r\n\r\n"
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in REASONS.items()}

# Response headers that describe the upstream hop, not the response: a proxy sets its own.
HOP_RESPONSE_HEADERS = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"x-fabric-node",
        b"x-fabric-site",
        b"server",
        b"date",
        b"proxy-connection",
        b"trailer",
        b"upgrade",
    )
)


def status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <reason>`` and its CRLF."""
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d Unknown\r\n" % status
    return line


class Request:
    """One parsed request. ``headers`` maps lower-cased names to the last value seen."""

    __slots__ = (
        "_body_parts",
        "body_len",
        "expect_continue",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "target",
    )

    def __init__(self) -> None:
        self.method = b""
        self.target = b""
        self.headers: dict[bytes, bytes] = {}
        self._body_parts: list[bytes] = []
        self.body_len = 0
        self.http_version = "1.1"
        self.keep_alive = True
        self.expect_continue = False

    @property
    def path(self) -> bytes:
        """The target without its query string."""
        return self.target.partition(b"?")[0]

    @property
    def body(self) -> bytes:
        parts = self._body_parts
        if len(parts) != 1:
            joined = b"".join(parts)
            self._body_parts = parts = [joined]
        return parts[0]


class BodyBudget:
    """The request body bytes every connection of an agent may hold at once, together.

    Each body byte is taken as it arrives and given back once its request was answered (or its
    connection ended): many slow uploads cannot grow the agent without bound, whatever the
    per-request limit.
    """

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)


class RequestParser:
    """Sans-IO request side of one connection (see the module docstring)."""

    def __init__(
        self,
        *,
        max_head_bytes: int = 32 * 1024,
        max_headers: int = 100,
        max_body_bytes: int = 16 * 1024 * 1024,
        budget: BodyBudget | None = None,
    ) -> None:
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.max_body_bytes = max_body_bytes
        self.budget = budget  # shared by the agent's connections (None: no global bound)
        self.ready: deque[Request] = deque()
        self.pending: Request | None = None  # the request being received
        self.head_complete = False  # of the pending request
        self.error: tuple[int, str] | None = None
        self._head_bytes = 0
        self._header_count = 0
        self._head_fed = 0  # raw bytes fed since the last head or message ended
        self._parser = httptools.HttpRequestParser(self)

    # -- driving ------------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Parse ``data``; completed requests land in ``ready``; a violation sets ``error``."""
        if self.error is not None:
            return
        if not self.head_complete:
            # httptools buffers a header line until it ends, so ``on_header`` alone cannot bound
            # a head that never ends: count raw bytes too (reset when a head or message ends).
            self._head_fed += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserCallbackError:
            # The callback that raised set ``error`` already (``_fail`` keeps the first). Not
            # ``if self.error is None``: the check above narrowed it to None, and the compiled
            # data plane (fabricnode/native.py) would enforce that narrowed type at runtime.
            self._fail(400, "malformed request")
        except httptools.HttpParserInvalidMethodError:
            self._fail(400, "invalid HTTP method")
        except httptools.HttpParserInvalidURLError:
            self._fail(400, "invalid request target")
        except httptools.HttpParserError as exc:
            self._fail(400, f"malformed HTTP request: {_parser_message(exc)}")
        if not self.head_complete and self._head_fed > self.max_head_bytes:
            self._fail(431, "request headers too large")

    def release(self) -> None:
        """The connection ended: drop the requests it holds now, and give their bytes back to
        the budget. This parser and httptools' refer to each other, so without this their body
        buffers would wait for a full garbage collection (uploads cut off mid-body piled up by
        the gigabyte)."""
        held = sum(req.body_len for req in self.ready)
        if self.pending is not None:
            held += self.pending.body_len
        if self.budget is not None:
            self.budget.give(held)
        self.pending = None
        self.ready.clear()

    def answered(self, req: Request) -> None:
        """``req`` (taken from ``ready``) was answered: its body bytes go back to the budget."""
        if self.budget is not None:
            self.budget.give(req.body_len)

    @property
    def mid_request(self) -> bool:
        """True while some bytes of a request arrived but not the whole request."""
        return self.pending is not None

    def _fail(self, status: int, message: str) -> None:
        if self.error is None:
            self.error = (status, message)

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.pending = Request()
        self.head_complete = False
        self._head_bytes = 0
        self._header_count = 0

    def on_url(self, url: bytes) -> None:
        req = self.pending
        assert req is not None
        self._head_bytes += len(url)
        if self._head_bytes > self.max_head_bytes:
            self._fail(414, "request target too long")
            raise _Stop
        req.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self.pending
        assert req is not None
        self._head_bytes += len(name) + len(value) + 4
        self._header_count += 1
        if self._head_bytes > self.max_head_bytes or self._header_count > self.max_headers:
            self._fail(431, "request headers too large")
            raise _Stop
        req.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        req = self.pending
        assert req is not None
        parser = self._parser
        req.method = parser.get_method()
        req.keep_alive = parser.should_keep_alive()
        if parser.should_upgrade():  # refuse here, or the request would be queued and answered
            self._fail(400, "protocol upgrades are not supported")
            raise _Stop
        req.http_version = parser.get_http_version()
        if req.http_version not in ("1.1", "1.0"):
            self._fail(505, "only HTTP/1.0 and HTTP/1.1 are supported")
            raise _Stop
        declared = req.headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            self._fail(413, f"request body larger than {self.max_body_bytes} bytes")
            raise _Stop
        req.expect_continue = req.headers.get(b"expect", b"").lower() == b"100-continue"
        self.head_complete = True
        self._head_fed = 0

    def on_body(self, body: bytes) -> None:
        req = self.pending
        assert req is not None
        n = len(body)
        if req.body_len + n > self.max_body_bytes:
            self._fail(413, f"request body larger than {self.max_body_bytes} bytes")
            raise _Stop
        budget = self.budget
        if budget is not None and not budget.take(n):
            self._fail(503, "the agent holds too many request bodies right now; retry shortly")
            raise _Stop
        req.body_len += n
        req._body_parts.append(body)

    def on_message_complete(self) -> None:
        req = self.pending
        assert req is not None
        # The keep-alive flag must be read here: afterwards httptools always reports False.
        req.keep_alive = self._parser.should_keep_alive()
        self.ready.append(req)
        self.pending = None
        self.head_complete = False
        self._head_fed = 0


class _Stop(Exception):
    """Raised inside a callback to stop parsing once ``error`` is set."""


def _parser_message(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text[:120]


# Upstream responses are held to limits like client requests: a node or engine must not be able
# to make an agent buffer without bound or desynchronise a pooled connection.
MAX_RESPONSE_HEAD_BYTES = 32 * 1024
MAX_RESPONSE_HEADERS = 100
MAX_INTERIM_RESPONSES = 8  # 1xx before the final answer (100 Continue, 103 Early Hints)
BODILESS_STATUS = frozenset((204, 304))  # never a body, whatever the headers say


class ResponseParser:
    """Client side of a pooled upstream connection: one response at a time.

    ``on_body`` receives decoded body pieces (chunked framing removed) as they are parsed.
    Interim 1xx responses are consumed and never reported (the final response follows on the
    same connection; relaying a 1xx as the answer would leave the real one unread for the next
    request on the pooled connection). ``101 Switching Protocols``, a head over
    ``MAX_RESPONSE_HEAD_BYTES`` or ``MAX_RESPONSE_HEADERS``, and framing llhttp rejects (both
    Content-Length and Transfer-Encoding, a body after 204) raise ``httptools.HttpParserError``.
    """

    def __init__(self, on_body: Callable[[bytes], None] | None = None) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.reset(on_body)

    def reset(self, on_body: Callable[[bytes], None] | None) -> None:
        """Ready for the next response on a kept-alive connection (see ``reusable``).

        Cheaper than a new parser: httptools looks up every callback when it makes one.
        """
        self.on_body_cb = on_body
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_complete = False
        self.complete = False
        self.keep_alive = False
        self.chunked = False
        self.content_length: int | None = None
        self.content_type = b""
        # The header lines a proxy passes on (all but HOP_RESPONSE_HEADERS), ready to write.
        self.end_to_end = b""
        # The X-Fabric-Node and X-Fabric-Site an agent upstream named (cross-site answers).
        self.fabric_node = b""
        self.fabric_site = b""
        self.messages = 0
        self._head_bytes = 0  # fed while no final head was complete (interim ones included)
        self._interim = False  # the message being parsed is a 1xx
        self.interim_responses = 0
        self._refused = ""  # why a callback stopped the parser (raised as the error message)

    @property
    def reusable(self) -> bool:
        """Exactly one response parsed, whole, on a connection that stays open."""
        return self.complete and self.keep_alive and self.messages == 1

    @property
    def bodiless(self) -> bool:
        """A final status that never has a body (204, 304): relayed without framing."""
        return self.status in BODILESS_STATUS

    def feed(self, data: bytes) -> None:
        """Raises ``httptools.HttpParserError`` on a malformed or refused response."""
        if self.head_complete:
            self._parser.feed_data(data)
            return
        self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise httptools.HttpParserError("101 Switching Protocols: refused") from None
        except httptools.HttpParserError:
            if self._refused:
                raise httptools.HttpParserError(self._refused) from None
            raise
        if not self.head_complete and self._head_bytes > MAX_RESPONSE_HEAD_BYTES:
            raise httptools.HttpParserError(
                f"response head over {MAX_RESPONSE_HEAD_BYTES} bytes: refused"
            )

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_header(self, name: bytes, value: bytes) -> None:
        # Counted once the head is complete: until then the head's byte bound (``feed``) is
        # what bounds the list, and the hot path pays no check per header.
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if len(self.headers) > MAX_RESPONSE_HEADERS:
            self._refused = f"over {MAX_RESPONSE_HEADERS} response headers: refused"
            raise ValueError(self._refused)  # stops llhttp; ``feed`` raises the message
        status = self._parser.get_status_code()
        if status < 200:
            # 101 stops the parser (HttpParserUpgrade, or llhttp's pause without an Upgrade
            # header): refused in ``feed``. Any other 1xx is interim: the final answer follows.
            self._interim = True
            self.headers = []
            return
        self.status = status
        self.head_complete = True
        kept: list[bytes] = []
        for name, value in self.headers:
            lname = name.lower()
            if lname not in HOP_RESPONSE_HEADERS:
                kept.append(name + b": " + value + b"\r\n")
                if lname == b"content-type" and not self.content_type:
                    self.content_type = value
            elif lname == b"transfer-encoding":
                if b"chunked" in value.lower():
                    self.chunked = True
            elif lname == b"content-length" and value.isdigit():
                self.content_length = int(value)
            elif lname == b"x-fabric-node":
                self.fabric_node = value
            elif lname == b"x-fabric-site":
                self.fabric_site = value
        self.end_to_end = b"".join(kept)

    def on_body(self, body: bytes) -> None:
        if self.on_body_cb is not None:
            self.on_body_cb(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self.messages -= 1  # not an answer: the connection is still on its one response
            self.interim_responses += 1
            if self.interim_responses > MAX_INTERIM_RESPONSES:
                self._refused = f"over {MAX_INTERIM_RESPONSES} interim (1xx) responses: refused"
                raise ValueError(self._refused)
            return
        self.keep_alive = self._parser.should_keep_alive()
        self.complete = True


def response_head(
    status: int, headers: list[tuple[bytes, bytes]], *, keep_alive: bool = True
) -> bytes:
    """A response status line and header block (``headers`` are written as given)."""
    lines = [status_line(status)]
    for name, value in headers:
        lines.append(name + b": " + value + b"\r\n")
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def full_response(
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    *,
    extra: list[tuple[bytes, bytes]] | None = None,
    keep_alive: bool = True,
    head_only: bool = False,
) -> bytes:
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    if extra:
        headers.extend(extra)
    head = response_head(status, headers, keep_alive=keep_alive)
    return head if head_only else head + body


def frame(pieces: list[bytes], chunked: bool) -> bytes:
    """Response body pieces as they go on the wire: joined, or each as one chunk."""
    if not chunked:
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)
    out = []
    for piece in pieces:
        if piece:
            out.append(b"%x\r\n" % len(piece))
            out.append(piece)
            out.append(b"\r\n")
    return b"".join(out)


def text_of(raw: bytes) -> str:
    """The start of a raw request field, for an error message."""
    return raw[:200].decode("latin-1")
