"""Strict, bounded decoding primitives shared by every wire-facing module.

msgpack is asked to refuse oversized containers up front; the ``take_*`` helpers then check
each field's type and bounds. Every failure is a ``DecodeError``: callers at the network
boundary catch ``WireError``, count it and drop the input.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
from typing import Any

import msgpack

from fabricnode.addr import WILDCARD_HOSTS, split_hostport
from fabricnode.errors import ConfigError, DecodeError

MAX_PACKET_BYTES = 16 * 1024 * 1024


def unpack(data: bytes, *, max_bytes: int = MAX_PACKET_BYTES, max_items: int = 65536) -> Any:
    """Decode msgpack with hard bounds on size, containers and nesting; no maps with odd keys."""
    if len(data) > max_bytes:
        raise DecodeError(f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=max_items,
            max_map_len=1024,
            max_ext_len=0,
            use_list=True,
        )
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        # ExtraData, FormatError, StackError, OutOfData, UnicodeDecodeError are all ValueError.
        raise DecodeError(f"undecodable msgpack: {type(exc).__name__}") from exc


def pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def take_list(
    value: Any, *, min_len: int = 0, max_len: int = 65536, what: str = "list"
) -> list[Any]:
    if not isinstance(value, list) or not (min_len <= len(value) <= max_len):
        raise DecodeError(f"{what}: expected a list of {min_len}..{max_len} items")
    return value


def take_str(value: Any, *, max_len: int = 256, what: str = "string", empty: bool = True) -> str:
    if not isinstance(value, str) or len(value) > max_len or (not empty and not value):
        raise DecodeError(f"{what}: expected a string of at most {max_len} characters")
    return value


def take_printable(value: Any, *, max_len: int = 256, what: str = "string") -> str:
    """A non-empty string every character of which is printable by its Unicode category
    (``str.isprintable``): a name that is routed, listed and logged (a model id) never carries
    a control, format or line-separator character that could forge a log line or a table."""
    text = take_str(value, max_len=max_len, what=what, empty=False)
    if not text.isprintable():
        raise DecodeError(f"{what}: a character that is not printable")
    return text


def take_addr(value: Any, *, max_len: int = 300, what: str = "address", empty: bool = False) -> str:
    """A ``HOST:PORT`` string with a valid host (``fabricnode.addr``); ``""`` if ``empty``."""
    text = take_str(value, max_len=max_len, what=what, empty=empty)
    if text:
        _check_hostport(text, what)
    return text


def _check_hostport(text: str, what: str, default_port: int | None = None) -> None:
    problem = _hostport_problem(text, default_port)
    if problem:
        raise DecodeError(f"{what}: {problem}")


# Every packet names addresses, and the same few over and over (the members'): parsing one
# (ipaddress, the DNS label rules) was 8% of the mesh core's CPU in the cluster simulations.
# Bounded, so addresses a peer makes up only evict each other.
@functools.lru_cache(maxsize=4096)
def _hostport_problem(text: str, default_port: int | None) -> str:
    """What is wrong with ``text`` as an address to reach, ``""`` if nothing."""
    try:
        host, _ = split_hostport(text, default_port=default_port)
    except ConfigError as exc:
        return str(exc)
    if host in WILDCARD_HOSTS:  # where a server binds, never where a peer is reached
        return f"{text[:80]!r} has no host to connect to"
    return ""


def take_url(value: Any, *, max_len: int = 300, what: str = "url") -> str:
    """``""`` or an ``http(s)://HOST[:PORT][/path]`` URL with a valid host."""
    text = take_str(value, max_len=max_len, what=what)
    if text:
        scheme, sep, rest = text.partition("://")
        if not sep or scheme not in ("http", "https"):
            raise DecodeError(f"{what}: {text[:80]!r} is not an http(s) URL")
        _check_hostport(rest.split("/", 1)[0], what, 443 if scheme == "https" else 80)
    return text


def take_opt_str(value: Any, *, max_len: int = 256, what: str = "string") -> str | None:
    return None if value is None else take_str(value, max_len=max_len, what=what)


def take_bytes(
    value: Any, *, size: int | None = None, max_len: int = 65536, what: str = "bytes"
) -> bytes:
    if not isinstance(value, bytes):
        raise DecodeError(f"{what}: expected bytes")
    if (size is not None and len(value) != size) or len(value) > max_len:
        raise DecodeError(f"{what}: wrong length {len(value)}")
    return value


def take_int(value: Any, *, lo: int = 0, hi: int = 2**63 - 1, what: str = "integer") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (lo <= value <= hi):
        raise DecodeError(f"{what}: expected an integer in {lo}..{hi}")
    return value


def take_opt_int(
    value: Any, *, lo: int = 0, hi: int = 2**63 - 1, what: str = "integer"
) -> int | None:
    return None if value is None else take_int(value, lo=lo, hi=hi, what=what)


def take_float(value: Any, *, lo: float = 0.0, hi: float = 1e18, what: str = "number") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DecodeError(f"{what}: expected a number")
    number = float(value)
    if not math.isfinite(number) or not (lo <= number <= hi):
        raise DecodeError(f"{what}: {number} out of range {lo}..{hi}")
    return number


def signed_json(signed: bytes, signature: bytes) -> dict[str, str]:
    """The HTTP form of an operator-signed record: its signed bytes and signature, base64."""
    return {
        "signed": base64.b64encode(signed).decode(),
        "signature": base64.b64encode(signature).decode(),
    }


def signed_from_json(doc: Any, what: str) -> list[bytes]:
    """``[signed, signature]`` of ``signed_json``'s form (not parsed or verified yet)."""
    if not isinstance(doc, dict):
        raise DecodeError(f"{what}: expected an object with signed and signature")
    try:
        signed = base64.b64decode(str(doc.get("signed", "")), validate=True)
        signature = base64.b64decode(str(doc.get("signature", "")), validate=True)
    except (binascii.Error, ValueError):
        raise DecodeError(f"{what}: signed and signature must be base64") from None
    return [signed, signature]
