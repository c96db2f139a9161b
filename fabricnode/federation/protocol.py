"""The federation link's framing and messages. Pure (sans-IO): bytes in, messages out.

Over the TLS stream (``link``) each message is one **frame**: a 4-byte big-endian length, then
that many bytes of msgpack, at most ``MAX_FRAME_BYTES``. A message is an array whose first
element is its tag:

* ``[HELLO, version, site, gateway]``: the first frame each side sends; ``site`` must be the
  site the other side's certificate names, ``gateway`` the sender's federation address ("" when
  it takes no connections), ``version`` ``PROTOCOL_VERSION``.
* ``[SUMMARY, bytes]``: a signed site summary (``summary``), in its wire form.
* ``[PING, nonce]`` / ``[PONG, nonce]``: round-trip measurement (and keep-alive).

``FrameReader`` reassembles frames from whatever chunks the stream yields and raises
``DecodeError`` on an oversized frame or an undecodable message: the link then drops the
connection and counts it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from fabricnode.errors import DecodeError
from fabricnode.federation.sitekey import site_name_problem
from fabricnode.federation.summary import MAX_GATEWAY_ADDR, MAX_SUMMARY_BYTES
from fabricnode.mesh import codec

PROTOCOL_VERSION = 1
# ALPN protocol name of the framed link on the federation port; another use of the same port
# (cross-site requests) negotiates a name of its own (docs/federation.md).
ALPN_LINK = "fabric-fed/1"
# ALPN protocol name of a connection carrying cross-site requests (HTTP/1.1, keep-alive) from a
# peer site's gateway to ours (``link``: bridged to our data plane).
ALPN_HTTP = "fabric-http/1"
HELLO, SUMMARY, PING, PONG = 1, 2, 3, 4
HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = MAX_SUMMARY_BYTES + 1024
MAX_NONCE = 2**63 - 1


@dataclass(frozen=True)
class Hello:
    version: int
    site: str
    gateway: str


@dataclass(frozen=True)
class Summary:
    data: bytes


@dataclass(frozen=True)
class Ping:
    nonce: int


@dataclass(frozen=True)
class Pong:
    nonce: int


Message = Hello | Summary | Ping | Pong


def encode(message: Message) -> bytes:
    """One frame: the length header and the message."""
    if isinstance(message, Hello):
        obj: list[object] = [HELLO, message.version, message.site, message.gateway]
    elif isinstance(message, Summary):
        obj = [SUMMARY, message.data]
    elif isinstance(message, Ping):
        obj = [PING, message.nonce]
    else:
        obj = [PONG, message.nonce]
    body = codec.pack(obj)
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def decode_message(body: bytes) -> Message:
    obj = codec.unpack(body, max_bytes=MAX_FRAME_BYTES, max_items=8)
    items = codec.take_list(obj, min_len=2, max_len=4, what="message")
    tag = codec.take_int(items[0], lo=1, hi=255, what="message tag")
    if tag == HELLO and len(items) == 4:
        version = codec.take_int(items[1], lo=1, hi=1_000_000, what="hello version")
        site = codec.take_str(items[2], max_len=64, what="hello site", empty=False)
        if site_name_problem(site):
            raise DecodeError("hello site: not a site name")
        gateway = codec.take_addr(
            items[3], max_len=MAX_GATEWAY_ADDR, what="hello gateway", empty=True
        )
        return Hello(version, site, gateway)
    if tag == SUMMARY and len(items) == 2:
        return Summary(codec.take_bytes(items[1], max_len=MAX_FRAME_BYTES, what="summary"))
    if tag in (PING, PONG) and len(items) == 2:
        nonce = codec.take_int(items[1], lo=0, hi=MAX_NONCE, what="nonce")
        return Ping(nonce) if tag == PING else Pong(nonce)
    raise DecodeError(f"message: unknown tag {tag} or wrong length")


class FrameReader:
    """Frames from a byte stream, bounded: holds at most one frame's bytes."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Message]:
        """The messages ``data`` completes; DecodeError on an oversized or bad frame."""
        self._buffer += data
        out: list[Message] = []
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            if size > self.max_frame_bytes:
                raise DecodeError(f"frame of {size} bytes exceeds {self.max_frame_bytes}")
            if len(self._buffer) < HEADER.size + size:
                break
            body = bytes(self._buffer[HEADER.size : HEADER.size + size])
            del self._buffer[: HEADER.size + size]
            out.append(decode_message(body))
        return out
