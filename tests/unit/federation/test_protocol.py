"""The link's framing: messages round-trip in any chunking; oversized or bad frames raise."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabricnode.errors import DecodeError
from fabricnode.federation.protocol import (
    HEADER,
    FrameReader,
    Hello,
    Ping,
    Pong,
    Summary,
    encode,
)

MESSAGES = [Hello(1, "A", "gw.a:7950"), Summary(b"x" * 1000), Ping(7), Pong(7), Hello(1, "B", "")]


@given(cuts=st.lists(st.integers(0, 1200), max_size=10))
def test_messages_survive_any_chunking(cuts: list[int]) -> None:
    stream = b"".join(encode(m) for m in MESSAGES)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    reader = FrameReader()
    out = []
    for start, end in itertools.pairwise(points):
        out += reader.feed(stream[start:end])
    assert out == MESSAGES
    assert reader.buffered == 0


def test_an_oversized_frame_is_refused_before_it_is_read() -> None:
    reader = FrameReader(max_frame_bytes=100)
    with pytest.raises(DecodeError, match="exceeds"):
        reader.feed(HEADER.pack(101))


@pytest.mark.parametrize(
    "body",
    [b"\xc1", b"\x92\x09\x01", b"\x94\x01\x01\xa3a b\xa0", b"\x92\x03\xa1x", b"\x91\x01"],
)
def test_bad_messages_raise_decode_errors(body: bytes) -> None:
    with pytest.raises(DecodeError):
        FrameReader().feed(HEADER.pack(len(body)) + body)
