"""vLLM's KV-event messages (``fabricnode.kvevents.wire``): batches recorded from a real vLLM
in both encodings, the encoder's round trip, and arbitrary bytes that never get past the
decoder as anything but a ``DecodeError``."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.errors import DecodeError
from fabricnode.kvevents.wire import (
    MAX_BLOCKS,
    Batch,
    Cleared,
    Removed,
    Stored,
    Unknown,
    decode,
    decode_batch,
    encode,
)

DATA = Path(__file__).parent / "data"

hashes = st.one_of(st.binary(min_size=1, max_size=64), st.integers(0, 2**64 - 1))


@st.composite
def stored(draw: st.DrawFn, positional: bool) -> Stored:
    blocks = tuple(draw(st.lists(hashes, min_size=1, max_size=6)))
    size = draw(st.integers(1, 32))
    tokens = tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=len(blocks) * size)))
    medium = draw(st.sampled_from([None, "GPU", "CPU"]))
    if positional:  # the positional form has no adapter name nor group
        return Stored(blocks, draw(st.none() | hashes), tokens, size, medium)
    lora = draw(st.none() | st.text(max_size=20))
    group = draw(st.none() | st.integers(0, 8))
    return Stored(blocks, draw(st.none() | hashes), tokens, size, medium, lora, group)


def events(positional: bool) -> st.SearchStrategy[object]:
    removed = st.builds(
        Removed,
        st.lists(hashes, min_size=1, max_size=6).map(tuple),
        st.sampled_from([None, "GPU"]),
        st.none() if positional else st.none() | st.integers(0, 8),
    )
    return st.one_of(
        stored(positional), removed, st.just(Cleared()), st.builds(Unknown, st.just("Later"))
    )


@settings(max_examples=150)
@given(
    st.data(),
    st.booleans(),
    st.floats(0, 2e9, allow_nan=False),
    st.none() | st.integers(0, 7),
    st.integers(0, 2**63),
)
def test_what_the_encoder_writes_decodes_back_in_both_encodings(
    data: st.DataObject, positional: bool, ts: float, rank: int | None, seq: int
) -> None:
    evs = tuple(data.draw(st.lists(events(positional), max_size=8)))
    batch = Batch(ts, evs, rank)  # type: ignore[arg-type]
    frames = encode(b"kv-events", seq, batch, positional=positional)
    got = decode(frames)
    assert (got.topic, got.seq, got.batch) == (b"kv-events", seq, batch)


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=4))
def test_arbitrary_frames_are_a_decode_error_or_a_message(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except DecodeError:
        pass


@settings(max_examples=300)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda inner: st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(["type", "block_hashes", "token_ids", "block_size",
                                           "parent_block_hash", "medium", "x"]), inner, max_size=5),
        max_leaves=30,
    )
)  # fmt: skip
def test_arbitrary_msgpack_is_a_decode_error_or_a_batch(obj: object) -> None:
    try:
        payload = msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return
    try:
        decode_batch(payload)
    except DecodeError:
        pass


def test_bounds_and_types_are_checked() -> None:
    def one(event: object) -> bytes:
        return msgpack.packb([1.0, [event]], use_bin_type=True)  # type: ignore[no-any-return]

    good = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
            "token_ids": [5, 6, 7, 8], "block_size": 2}  # fmt: skip
    assert decode_batch(one(good)).events[0] == Stored((1, 2), None, (5, 6, 7, 8), 2)
    bad = [
        {**good, "token_ids": [1, 2, 3, 4, 5]},  # more tokens than the blocks hold
        {**good, "token_ids": [-1]},
        {**good, "token_ids": [True]},
        {**good, "block_size": 0},
        {**good, "block_hashes": []},
        {**good, "block_hashes": [b"x" * 65]},
        {**good, "block_hashes": [1.5]},
        {**good, "block_hashes": list(range(MAX_BLOCKS + 1))},
        {**good, "medium": 7},
        {"block_hashes": [1]},  # no type
        ["BlockStored", [1]],  # too few positions
        ["BlockRemoved"],
        42,
    ]
    for event in bad:
        with pytest.raises(DecodeError):
            decode_batch(one(event))
    for batch in ([], [1.0], ["now", []], [float("inf"), []], [1.0, {}], [1.0, [], -1]):
        with pytest.raises(DecodeError):
            decode_batch(msgpack.packb(batch, use_bin_type=True))
    with pytest.raises(DecodeError):
        decode([b"t", b"\x00" * 7, one(good)])  # a sequence number is 8 bytes
    with pytest.raises(DecodeError):
        decode([b"t", b"\x00" * 8])


def test_later_fields_and_event_types_are_ignored_not_refused() -> None:
    later = {"type": "BlockStored", "block_hashes": [b"h"], "parent_block_hash": None,
             "token_ids": [], "block_size": 16, "session_id": "s", "locality": "LOCAL"}  # fmt: skip
    batch = decode_batch(msgpack.packb([2.0, [later, {"type": "BlockMoved"}], 0]))
    assert batch.events == (Stored((b"h",), None, (), 16), Unknown("BlockMoved"))
    assert batch.dp_rank == 0
    positional = ["BlockRemoved", [b"h"], "GPU", 3, "LOCAL"]  # positions it does not know
    assert decode_batch(msgpack.packb([2.0, [positional]])).events == (Removed((b"h",), "GPU"),)


def recorded(name: str) -> list[list[bytes]]:
    frames: list[list[bytes]] = msgpack.unpackb((DATA / name).read_bytes(), raw=False)
    return frames


def test_batches_recorded_from_a_real_vllm_decode_in_both_encodings() -> None:
    """tests/support/record_kv_events.py on vLLM 0.32 (CPU), the tiny model, 32-token blocks,
    a 20-block cache: a prompt's blocks stored (a chain from no parent), then other prompts
    evicting them. The tagged maps vLLM 0.32 sends and the positional arrays of the vLLM
    before it (the same batches, re-encoded with vLLM's msgspec structs of then) decode to the
    same events, but the fields only the maps carry (the KV-cache group)."""
    tagged = [decode(f) for f in recorded("vllm-0.32-tagged.msgpack")]
    positional = [decode(f) for f in recorded("vllm-0.32-positional.msgpack")]
    assert [m.seq for m in tagged] == list(range(1, 10))
    assert all(m.topic == b"kv-events" and m.batch.dp_rank == 0 for m in tagged)
    first = tagged[0].batch.events[0]
    assert isinstance(first, Stored) and first.parent is None and first.block_size == 32
    assert len(first.token_ids) == 32 * len(first.hashes) and first.group == 0
    removed = {
        h for m in tagged for e in m.batch.events if isinstance(e, Removed) for h in e.hashes
    }
    assert set(first.hashes) <= removed  # the cache of 20 blocks evicted the first prompt's
    for a, b in zip(tagged, positional, strict=True):
        assert a.seq == b.seq and a.batch.ts == b.batch.ts
        for x, y in zip(a.batch.events, b.batch.events, strict=True):
            assert type(x) is type(y) and x.hashes == y.hashes  # type: ignore[union-attr]
            if isinstance(x, Stored) and isinstance(y, Stored):
                assert (x.parent, x.token_ids, x.block_size, x.medium) == (
                    y.parent, y.token_ids, y.block_size, y.medium)  # fmt: skip
