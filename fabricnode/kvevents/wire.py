"""vLLM's KV-cache event messages: the strict, bounded decoder, and the encoder the simulated
engine publishes with. Pure.

One message is three ZMQ frames, ``(topic, seq, payload)``: the topic the publisher was given
(``--kv-events-config``'s ``topic``), an 8-byte big-endian sequence number that counts the
publisher's batches from 0, and a msgpack batch ``[ts, events]`` or ``[ts, events,
data_parallel_rank]`` (msgspec's ``array_like`` struct with ``omit_defaults``: the rank is left
out when it is None). Checked against vLLM's own ``vllm/distributed/kv_events.py`` and against
batches recorded from a real vLLM (tests/unit/kvevents/data, tests/support/record_kv_events.py).

An event has been encoded two ways (msgspec's ``tag=True`` structs):

* **positional** (vLLM before mid-2026, ``array_like=True``): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, ...]``, ``["BlockRemoved",
  block_hashes, medium, ...]``, ``["AllBlocksCleared"]``;
* **tagged maps** (since): ``{"type": "BlockStored", "block_hashes": ..., ...}``, the fields by
  name, those equal to their default left out.

Both decode to the same ``Stored``, ``Removed`` and ``Cleared``. What a later vLLM adds is
ignored: more positions, more keys; an event type we do not know is kept as ``Unknown`` (and
counted by whoever applies the batch), not an error. A block hash is what vLLM puts on the
wire (``ExternalBlockHash``: bytes, or a 64-bit integer with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); it is only ever compared with hashes of the same
publisher, so it is kept as it came.

Bounds (every one is checked before anything is kept; a message past one is a
``DecodeError``): ``MAX_PAYLOAD_BYTES`` a batch, ``MAX_EVENTS`` events in it, ``MAX_BLOCKS``
block hashes and ``MAX_BLOCKS * MAX_BLOCK_SIZE`` token ids in one event, hashes of at most
``MAX_HASH_BYTES``, token ids below 2**32, names of at most ``MAX_NAME`` characters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from fabricnode.errors import DecodeError

MAX_TOPIC_BYTES = 256
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
MAX_EVENTS = 65536
MAX_BLOCKS = 65536  # blocks one event names (a 1M-token context of 16-token blocks)
MAX_BLOCK_SIZE = 4096
MAX_HASH_BYTES = 64
MAX_NAME = 256
MAX_TOKEN_ID = 2**32
SEQ_BYTES = 8

STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"

Hash = int | bytes


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks the engine put into its prefix cache, in order: each extends the one before
    (the first extends ``parent``, None: it starts a prompt), ``token_ids`` their tokens,
    ``block_size`` a block's."""

    hashes: tuple[Hash, ...]
    parent: Hash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None  # "GPU", "CPU" (an offloading tier) or None: unspecified
    lora: str | None = None  # the adapter the blocks were computed under
    group: int | None = None  # the KV-cache group (hybrid models have several)


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks the engine evicted from its prefix cache."""

    hashes: tuple[Hash, ...]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """The engine dropped every cached block (a reset of its prefix cache)."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """An event of a type this version does not know (a later vLLM's): kept to be counted."""

    tag: str


Event = Stored | Removed | Cleared | Unknown


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float  # the publisher's wall clock
    events: tuple[Event, ...]
    dp_rank: int | None = None  # the data-parallel rank that published it


@dataclass(frozen=True, slots=True)
class Message:
    topic: bytes
    seq: int
    batch: Batch


def decode(frames: Sequence[bytes]) -> Message:
    """One multipart message of the publisher: ``(topic, seq, payload)``."""
    if len(frames) != 3:
        raise DecodeError(f"kv events: expected 3 frames, got {len(frames)}")
    topic, seq, payload = frames
    if len(topic) > MAX_TOPIC_BYTES:
        raise DecodeError(f"kv events: a topic of {len(topic)} bytes")
    if len(seq) != SEQ_BYTES:
        raise DecodeError(f"kv events: a sequence number of {len(seq)} bytes, not 8")
    return Message(bytes(topic), int.from_bytes(seq, "big"), decode_batch(payload))


def decode_batch(payload: bytes) -> Batch:
    """A batch's msgpack (module docstring)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise DecodeError(f"kv events: a batch of {len(payload)} bytes")
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_PAYLOAD_BYTES,
            max_bin_len=MAX_HASH_BYTES,
            max_array_len=MAX_BLOCKS * MAX_BLOCK_SIZE,
            max_map_len=64,
            max_ext_len=0,
            use_list=True,
        )
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise DecodeError(f"kv events: undecodable batch ({type(exc).__name__})") from exc
    if not isinstance(obj, list) or len(obj) < 2:
        raise DecodeError("kv events: a batch is [ts, events, (rank)]")
    ts, events = obj[0], obj[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise DecodeError("kv events: a batch's ts is not a number")
    if not isinstance(events, list) or len(events) > MAX_EVENTS:
        raise DecodeError(f"kv events: a batch's events are not a list of <= {MAX_EVENTS}")
    rank = obj[2] if len(obj) > 2 else None
    if rank is not None:
        rank = _int(rank, 0, 2**16, "data_parallel_rank")
    return Batch(float(ts), tuple(_event(e) for e in events), rank)


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str) or len(tag) > MAX_NAME:
            raise DecodeError("kv events: an event map without a type")
        if tag == STORED:
            return _stored(
                raw.get("block_hashes"),
                raw.get("parent_block_hash"),
                raw.get("token_ids"),
                raw.get("block_size"),
                raw.get("medium"),
                raw.get("lora_name"),
                raw.get("group_idx"),
            )
        if tag == REMOVED:
            return _removed(raw.get("block_hashes"), raw.get("medium"), raw.get("group_idx"))
        return Cleared() if tag == CLEARED else Unknown(tag)
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and len(raw[0]) <= MAX_NAME:
        tag = raw[0]
        if tag == STORED:
            if len(raw) < 5:
                raise DecodeError("kv events: a positional BlockStored of fewer than 5 fields")
            medium = raw[6] if len(raw) > 6 else None
            lora = raw[7] if len(raw) > 7 and (raw[7] is None or isinstance(raw[7], str)) else None
            return _stored(raw[1], raw[2], raw[3], raw[4], medium, lora, None)
        if tag == REMOVED:
            if len(raw) < 2:
                raise DecodeError("kv events: a positional BlockRemoved without its hashes")
            return _removed(raw[1], raw[2] if len(raw) > 2 else None, None)
        return Cleared() if tag == CLEARED else Unknown(tag)
    raise DecodeError("kv events: an event is neither a tagged map nor a tagged array")


def _stored(
    hashes: Any, parent: Any, tokens: Any, size: Any, medium: Any, lora: Any, group: Any
) -> Stored:
    block_size = _int(size, 1, MAX_BLOCK_SIZE, "block_size")
    blocks = _hashes(hashes)
    if not isinstance(tokens, list) or len(tokens) > len(blocks) * block_size:
        raise DecodeError("kv events: token_ids are not a list of at most blocks x block_size")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < MAX_TOKEN_ID:
            raise DecodeError("kv events: a token id is not an integer in [0, 2**32)")
    return Stored(
        blocks,
        None if parent is None else _hash(parent),
        tuple(tokens),
        block_size,
        _name(medium, "medium"),
        _name(lora, "lora_name"),
        None if group is None else _int(group, 0, 1024, "group_idx"),
    )


def _removed(hashes: Any, medium: Any, group: Any) -> Removed:
    return Removed(
        _hashes(hashes),
        _name(medium, "medium"),
        None if group is None else _int(group, 0, 1024, "group_idx"),
    )


def _hashes(raw: Any) -> tuple[Hash, ...]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_BLOCKS:
        raise DecodeError(f"kv events: block_hashes are not a list of 1..{MAX_BLOCKS}")
    return tuple(_hash(h) for h in raw)


def _hash(raw: Any) -> Hash:
    if isinstance(raw, bytes) and 0 < len(raw) <= MAX_HASH_BYTES:
        return raw
    if isinstance(raw, int) and not isinstance(raw, bool) and -(2**63) <= raw < 2**64:
        return raw
    raise DecodeError("kv events: a block hash is neither bytes nor a 64-bit integer")


def _int(raw: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not lo <= raw <= hi:
        raise DecodeError(f"kv events: {what} is not an integer in [{lo}, {hi}]")
    return raw


def _name(raw: Any, what: str) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or len(raw) > MAX_NAME:
        raise DecodeError(f"kv events: {what} is not a string of at most {MAX_NAME}")
    return raw


# -- encoding (the simulated engine publishes what vLLM does) --------------------------------


def encode(topic: bytes, seq: int, batch: Batch, *, positional: bool = False) -> list[bytes]:
    """The three frames vLLM would publish for ``batch``: its events as tagged maps (today's
    vLLM) or, ``positional``, as tagged arrays (vLLM before mid-2026)."""
    events = [_encoded(e, positional) for e in batch.events]
    body: list[Any] = [batch.ts, events]
    if batch.dp_rank is not None:
        body.append(batch.dp_rank)
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    return [topic, seq.to_bytes(SEQ_BYTES, "big"), payload]


def _encoded(event: Event, positional: bool) -> Any:
    if isinstance(event, Stored):
        hashes, tokens = list(event.hashes), list(event.token_ids)
        if positional:
            return [STORED, hashes, event.parent, tokens, event.block_size, None, event.medium]
        out: dict[str, Any] = {
            "type": STORED,
            "block_hashes": hashes,
            "parent_block_hash": event.parent,
            "token_ids": tokens,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora,
        }
        if event.group is not None:
            out["group_idx"] = event.group
        return out
    if isinstance(event, Removed):
        if positional:
            return [REMOVED, list(event.hashes), event.medium]
        removed: dict[str, Any] = {
            "type": REMOVED,
            "block_hashes": list(event.hashes),
            "medium": event.medium,
        }
        if event.group is not None:
            removed["group_idx"] = event.group
        return removed
    if isinstance(event, Cleared):
        return [CLEARED] if positional else {"type": CLEARED}
    return [event.tag] if positional else {"type": event.tag}
