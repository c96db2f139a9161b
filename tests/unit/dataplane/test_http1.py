"""The sans-IO HTTP/1.1 layer of the data plane (``fabricnode.dataplane.http1``), without sockets:
framing, keep-alive, pipelining, limits and refusals, and fuzzing of the request parser path."""

from __future__ import annotations

import itertools

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabricnode.dataplane.http1 import (
    MAX_RESPONSE_HEAD_BYTES,
    MAX_RESPONSE_HEADERS,
    BodyBudget,
    Request,
    RequestParser,
    ResponseParser,
    full_response,
)

LIMITS = {"max_head_bytes": 1024, "max_headers": 10, "max_body_bytes": 64}
ERROR_STATUSES = {400, 413, 414, 431, 505}

CHAT = (
    b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: fabric\r\n"
    b"Content-Type: application/json\r\nContent-Length: 15\r\n\r\n"
    b'{"model":"m1"}\n'
)
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: fabric\r\n\r\n"
CHUNKED = (
    b"POST /v1/completions HTTP/1.1\r\nHost: fabric\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\n"
)
STREAM = CHAT + MODELS + CHUNKED + b"GET /last HTTP/1.0\r\n\r\n"


def parse(data: bytes, **limits: int) -> RequestParser:
    parser = RequestParser(**limits)
    parser.feed(data)
    return parser


def summary(parser: RequestParser) -> list[tuple[bytes, bytes, bytes, bool, dict[bytes, bytes]]]:
    return [(r.method, r.target, r.body, r.keep_alive, r.headers) for r in parser.ready]


def assert_consistent(parser: RequestParser) -> None:
    """What the connection loop relies on, whatever bytes were fed."""
    for req in parser.ready:
        assert isinstance(req, Request)
        assert req.method and req.target
        assert len(req.body) == req.body_len <= parser.max_body_bytes
        assert len(req.headers) <= parser.max_headers
    if parser.error is not None:
        status, message = parser.error
        assert status in ERROR_STATUSES and message
        return
    if parser.head_complete:
        assert parser.pending is not None
    if parser.pending is not None:
        assert parser.pending.body_len <= parser.max_body_bytes


# == requests ================================================================================


def test_simple_request_is_parsed_with_lowercased_headers_and_body() -> None:
    parser = parse(CHAT)
    assert parser.error is None and not parser.mid_request
    (req,) = parser.ready
    assert req.method == b"POST"
    assert req.target == b"/v1/chat/completions?x=1"
    assert req.path == b"/v1/chat/completions"
    assert req.headers[b"content-type"] == b"application/json"
    assert req.body == b'{"model":"m1"}\n' and req.body_len == 15
    assert req.keep_alive and not req.expect_continue


@pytest.mark.parametrize(
    ("head", "keep_alive"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nConnection: Close\r\n\r\n", False),
        (b"GET / HTTP/1.0\r\n\r\n", False),
        (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", True),
    ],
)
def test_keep_alive_follows_the_version_and_connection_header(
    head: bytes, keep_alive: bool
) -> None:
    (req,) = parse(head).ready
    assert req.keep_alive is keep_alive


def test_pipelined_requests_in_one_feed_come_out_in_order() -> None:
    parser = parse(STREAM)
    assert parser.error is None and not parser.mid_request
    assert [(r.method, r.path) for r in parser.ready] == [
        (b"POST", b"/v1/chat/completions"),
        (b"GET", b"/v1/models"),
        (b"POST", b"/v1/completions"),
        (b"GET", b"/last"),
    ]
    assert [r.keep_alive for r in parser.ready] == [True, True, True, False]


def test_chunked_body_is_dechunked() -> None:
    (req,) = parse(CHUNKED).ready
    assert req.body == b"hello world"
    assert req.headers[b"transfer-encoding"] == b"chunked"


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_split_of_the_bytes_gives_the_same_requests(cuts: list[int]) -> None:
    whole = summary(parse(STREAM))
    points = [0, *sorted(cuts), len(STREAM)]
    parser = RequestParser()
    for start, end in itertools.pairwise(points):
        parser.feed(STREAM[start:end])
    assert parser.error is None
    assert summary(parser) == whole


def test_byte_at_a_time_gives_the_same_requests() -> None:
    parser = RequestParser()
    for i in range(len(STREAM)):
        parser.feed(STREAM[i : i + 1])
        assert parser.mid_request or i == len(STREAM) - 1 or len(parser.ready) < 4
    assert summary(parser) == summary(parse(STREAM))


def test_a_partial_request_is_mid_request_until_it_completes() -> None:
    parser = parse(CHAT[:-5])
    assert parser.mid_request and parser.head_complete and not parser.ready
    parser.feed(CHAT[-5:])
    assert not parser.mid_request and len(parser.ready) == 1


def test_expect_continue_is_reported_once_the_head_is_complete() -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n"
    parser = parse(head)
    assert not parser.head_complete
    parser.feed(b"\r\n")
    assert parser.head_complete
    assert parser.pending is not None and parser.pending.expect_continue
    parser.feed(b"{}")
    (req,) = parser.ready
    assert req.expect_continue and req.body == b"{}"


# == limits and refusals =====================================================================


def test_content_length_over_the_limit_is_413_before_the_body_arrives() -> None:
    parser = parse(b"POST / HTTP/1.1\r\nContent-Length: 65\r\n\r\n", **LIMITS)
    assert parser.error is not None and parser.error[0] == 413
    assert not parser.ready


def test_content_length_at_the_limit_is_accepted() -> None:
    parser = parse(b"POST / HTTP/1.1\r\nContent-Length: 64\r\n\r\n" + b"x" * 64, **LIMITS)
    assert parser.error is None and parser.ready[0].body_len == 64


def test_chunked_body_over_the_limit_is_413_while_it_arrives() -> None:
    parser = parse(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", **LIMITS)
    for _ in range(4):
        parser.feed(b"20\r\n" + b"x" * 32 + b"\r\n")
    assert parser.error is not None and parser.error[0] == 413
    assert not parser.ready
    assert parser.pending is not None and parser.pending.body_len <= 64 + 32


def test_too_many_headers_is_431() -> None:
    head = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(11)) + b"\r\n"
    parser = parse(head, **LIMITS)
    assert parser.error is not None and parser.error[0] == 431


def test_header_block_too_big_is_431() -> None:
    parser = parse(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 1100 + b"\r\n\r\n", **LIMITS)
    assert parser.error is not None and parser.error[0] == 431


def test_a_header_line_that_never_ends_is_431_without_buffering_it_all() -> None:
    parser = parse(b"GET / HTTP/1.1\r\nX-Big: ", **LIMITS)
    fed = 0
    while parser.error is None and fed < 1_000_000:
        parser.feed(b"a" * 100)
        fed += 100
    assert parser.error is not None and parser.error[0] == 431
    assert fed <= 1100


def test_a_head_split_across_many_feeds_under_the_limit_is_accepted() -> None:
    head = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 80) for i in range(9))
    parser = RequestParser(**LIMITS)
    for i in range(0, len(head), 7):
        parser.feed(head[i : i + 7])
    parser.feed(b"\r\n")
    assert parser.error is None and len(parser.ready) == 1


def test_request_target_too_long_is_414() -> None:
    parser = parse(b"GET /" + b"a" * 1100 + b" HTTP/1.1\r\n\r\n", **LIMITS)
    assert parser.error is not None and parser.error[0] == 414


@pytest.mark.parametrize(
    "data",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
        b"hello there\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost a\r\n\r\n",
        b"GET / HTTP/1.1\nHost: a\n\n",
        b"GET / HTTP/1.1\r\n Folded: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    ],
    ids=[
        "tls",
        "words",
        "no-colon",
        "bare-lf",
        "obs-fold",
        "nul-in-value",
        "two-lengths",
        "negative-length",
        "length-and-chunked",
        "unknown-coding",
        "bad-chunk-size",
    ],
)
def test_garbage_and_ambiguous_framing_are_400(data: bytes) -> None:
    parser = parse(data)
    assert parser.error is not None and parser.error[0] == 400
    assert not parser.ready


@pytest.mark.parametrize(
    "data",
    [
        b"GET /v1/models HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        b"POST /v1/models HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
        b"Content-Length: 2\r\n\r\n{}",
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    ],
    ids=["websocket", "h2c", "connect"],
)
def test_upgrades_are_400_and_never_queued_as_requests(data: bytes) -> None:
    parser = parse(MODELS + data)
    assert parser.error is not None and parser.error[0] == 400
    assert [r.path for r in parser.ready] == [b"/v1/models"]  # only the request before it


def test_http2_preface_is_refused() -> None:
    parser = parse(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert parser.error is not None and parser.error[0] in (400, 505)
    assert not parser.ready


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.2"])
def test_other_http_versions_are_refused(version: bytes) -> None:
    parser = parse(b"GET / " + version + b"\r\n\r\n")
    assert parser.error is not None and parser.error[0] in (400, 505)


def test_after_an_error_further_bytes_are_ignored() -> None:
    parser = parse(b"BAD\x00 / HTTP/1.1\r\n\r\n")
    error = parser.error
    parser.feed(MODELS)
    assert parser.error == error and not parser.ready


def test_requests_before_an_error_stay_queued_in_order() -> None:
    parser = parse(CHAT + MODELS + b"\x00garbage\r\n\r\n")
    assert parser.error is not None and parser.error[0] == 400
    assert [r.path for r in parser.ready] == [b"/v1/chat/completions", b"/v1/models"]


# == fuzzing =================================================================================

FUZZ = settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=6))
def test_arbitrary_bytes_never_raise_and_leave_a_consistent_parser(pieces: list[bytes]) -> None:
    parser = RequestParser(**LIMITS)
    for piece in pieces:
        parser.feed(piece)
        assert_consistent(parser)


@st.composite
def mutated_requests(draw: st.DrawFn) -> list[bytes]:
    data = bytearray(STREAM)
    for _ in range(draw(st.integers(min_value=1, max_value=6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "duplicate"]))
        at = draw(st.integers(min_value=0, max_value=max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] = draw(st.integers(min_value=0, max_value=255))
        elif op == "insert":
            data[at:at] = draw(
                st.sampled_from([b"\r\n", b":", b" ", b"\x00", b"0", b"ffffffff", b"\r\n\r\n"])
                | st.binary(min_size=1, max_size=8)
            )
        elif op == "delete":
            del data[at : at + draw(st.integers(min_value=1, max_value=8))]
        else:
            end = at + draw(st.integers(min_value=1, max_value=200))
            data[at:at] = data[at:end]
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=5)))
    points = [0, *cuts, len(data)]
    return [bytes(data[a:b]) for a, b in itertools.pairwise(points)]


@FUZZ
@given(mutated_requests())
def test_mutated_requests_never_raise_and_leave_a_consistent_parser(pieces: list[bytes]) -> None:
    parser = RequestParser(**LIMITS)
    for piece in pieces:
        parser.feed(piece)
        assert_consistent(parser)
    # The same bytes in one piece give the same requests or an error, never something else.
    whole = parse(b"".join(pieces), **LIMITS)
    if parser.error is None and whole.error is None:
        assert summary(parser) == summary(whole)


@FUZZ
@given(
    st.dictionaries(
        st.from_regex(rb"\Ax-[a-z0-9-]{1,20}\Z"),
        st.from_regex(rb"\A[!-~]([ -~]{0,40}[!-~])?\Z"),
        max_size=8,
    ),
    st.binary(max_size=64),
)
def test_well_formed_requests_round_trip(headers: dict[bytes, bytes], body: bytes) -> None:
    head = b"".join(name + b": " + value + b"\r\n" for name, value in headers.items())
    data = b"POST /p HTTP/1.1\r\n" + head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    parser = parse(data, max_headers=20)
    assert parser.error is None
    (req,) = parser.ready
    assert req.body == body
    for name, value in headers.items():
        assert req.headers[name] == value


# == responses ===============================================================================


def feed_response(data: bytes, *, pieces: int = 1) -> tuple[ResponseParser, bytes]:
    body: list[bytes] = []
    parser = ResponseParser(body.append)
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        parser.feed(data[i : i + step])
    return parser, b"".join(body)


@pytest.mark.parametrize("pieces", [1, 7, 1000])
def test_response_with_content_length_completes_with_its_body(pieces: int) -> None:
    data = full_response(200, b'{"ok":true}', extra=[(b"x-a", b"1")])
    parser, body = feed_response(data, pieces=pieces)
    assert parser.status == 200 and parser.head_complete and parser.complete
    assert parser.content_length == 11 and not parser.chunked
    assert (b"x-a", b"1") in parser.headers
    assert body == b'{"ok":true}' and parser.keep_alive


@pytest.mark.parametrize("pieces", [1, 5, 1000])
def test_chunked_response_is_dechunked_and_completes_at_the_last_chunk(pieces: int) -> None:
    data = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n"
    )
    parser, body = feed_response(data, pieces=pieces)
    assert parser.chunked and parser.content_length is None
    assert body == b"data: one\n\ndata: two\n\n"
    assert parser.complete and parser.keep_alive


def test_response_is_incomplete_until_its_last_byte() -> None:
    parser, _ = feed_response(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nabc")
    assert parser.head_complete and not parser.complete


@pytest.mark.parametrize(
    ("data", "keep_alive"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n", True),
    ],
)
def test_response_keep_alive_follows_the_version_and_connection_header(
    data: bytes, keep_alive: bool
) -> None:
    parser, _ = feed_response(data)
    assert parser.complete and parser.keep_alive is keep_alive


def test_error_responses_written_by_the_layer_parse_back() -> None:
    data = full_response(413, b'{"error":{}}', keep_alive=False)
    assert data.startswith(b"HTTP/1.1 413 Content Too Large\r\n")
    parser, body = feed_response(data)
    assert parser.status == 413 and body == b'{"error":{}}' and not parser.keep_alive


# -- upstream responses held to limits (a hostile node or engine) ----------------------------

FINAL = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize("pieces", [1, 3, 1000])
@pytest.mark.parametrize(
    "interim",
    [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n",
        b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </b>\r\n\r\n",
    ],
)
def test_interim_responses_are_consumed_and_the_final_one_is_the_answer(
    interim: bytes, pieces: int
) -> None:
    parser, body = feed_response(interim + FINAL, pieces=pieces)
    assert parser.status == 200 and body == b"ok" and parser.complete
    assert parser.headers == [(b"Content-Length", b"2")]  # none of the interim ones
    assert parser.reusable  # one answer on the connection: it can be pooled


def test_an_interim_response_alone_is_not_a_head() -> None:
    parser, _ = feed_response(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
    assert not parser.head_complete and parser.status == 0


def test_an_endless_run_of_interim_responses_is_refused() -> None:
    with pytest.raises(httptools.HttpParserError, match="interim"):
        feed_response(b"HTTP/1.1 100 Continue\r\n\r\n" * 50 + FINAL)


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\nx",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\nx",
    ],
)
def test_switching_protocols_is_refused(data: bytes) -> None:
    with pytest.raises(httptools.HttpParserError):
        feed_response(data)


@pytest.mark.parametrize("pieces", [1, 50])
def test_a_response_head_over_the_limit_is_refused_without_buffering_it_all(pieces: int) -> None:
    data = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * (MAX_RESPONSE_HEAD_BYTES * 4)
    with pytest.raises(httptools.HttpParserError, match="head over"):
        feed_response(data, pieces=pieces)


def test_too_many_response_headers_are_refused() -> None:
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_RESPONSE_HEADERS + 1))
    with pytest.raises(httptools.HttpParserError, match="headers"):
        feed_response(b"HTTP/1.1 200 OK\r\n" + headers + b"Content-Length: 0\r\n\r\n")


@pytest.mark.parametrize("status", [204, 304])
def test_bodiless_statuses_complete_with_their_head(status: int) -> None:
    parser, body = feed_response(b"HTTP/1.1 %d X\r\nContent-Length: 7\r\n\r\n" % status)
    assert parser.complete and parser.bodiless and body == b"" and parser.reusable


def test_a_big_body_after_a_small_head_is_not_counted_as_head() -> None:
    body = b"x" * (MAX_RESPONSE_HEAD_BYTES * 3)
    data = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    parser, got = feed_response(data, pieces=1)
    assert parser.complete and got == body


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=300), max_size=8))
def test_arbitrary_upstream_bytes_raise_only_parser_errors(pieces: list[bytes]) -> None:
    """Whatever a node sends, the parser raises nothing but HttpParserError (which the data
    plane turns into a failover or a broken response), and a head it reports is a final one."""
    parser = ResponseParser(lambda _: None)
    try:
        for piece in [b"HTTP/1.1 ", *pieces]:
            parser.feed(piece)
    except httptools.HttpParserError:
        return
    if parser.head_complete:
        assert parser.status >= 200


def test_release_drops_the_requests_a_closed_connection_held() -> None:
    """The parser and httptools' parser refer to each other: a connection that ends mid-body
    must hand its buffers back at once, not at the next full garbage collection."""
    parser = RequestParser(**LIMITS)
    parser.feed(b"POST /v1/x HTTP/1.1\r\ncontent-length: 60\r\n\r\n" + b"a" * 30)
    assert parser.pending is not None and parser.pending.body_len == 30
    parser.release()
    assert parser.pending is None and not parser.ready


def test_bodies_held_by_all_connections_share_one_budget() -> None:
    budget = BodyBudget(100)
    a = RequestParser(max_body_bytes=64, budget=budget)
    b = RequestParser(max_body_bytes=64, budget=budget)
    a.feed(b"POST /x HTTP/1.1\r\ncontent-length: 60\r\n\r\n" + b"a" * 60)
    assert a.ready and budget.used == 60
    b.feed(b"POST /x HTTP/1.1\r\ncontent-length: 60\r\n\r\n" + b"b" * 30)
    assert b.error is None and budget.used == 90
    b.feed(b"b" * 30)  # over the shared budget: refused, the connection will close
    assert b.error is not None and b.error[0] == 503
    a.answered(a.ready.popleft())
    b.release()
    assert budget.used == 0
    c = RequestParser(max_body_bytes=64, budget=budget)  # room again
    c.feed(b"POST /x HTTP/1.1\r\ncontent-length: 60\r\n\r\n" + b"c" * 60)
    assert c.ready and c.error is None


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.binary(max_size=80)), max_size=30))
def test_the_budget_comes_back_whole_whatever_the_connections_sent(
    feeds: list[tuple[int, bytes]],
) -> None:
    budget = BodyBudget(150)
    parsers = [RequestParser(max_body_bytes=64, budget=budget) for _ in range(3)]
    head = b"POST /x HTTP/1.1\r\ncontent-length: 50\r\n\r\n"
    for p in parsers:
        p.feed(head)
    for i, data in feeds:
        parsers[i].feed(data)
        assert 0 <= budget.used <= 150
    for p in parsers:
        while p.ready:
            p.answered(p.ready.popleft())
        p.release()
    assert budget.used == 0
