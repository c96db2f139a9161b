"""What one engine's cache holds by its events (``fabricnode.kvevents.index``): the blocks of
a real vLLM's recorded batches, the simulated engine's cache replayed exactly, a prompt's
cached prefix found by walking the chain, and the bounds."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.kvevents.index import BlockIndex
from fabricnode.kvevents.wire import Batch, Cleared, Removed, Stored, Unknown, decode
from fabricnode.simengine.model import BLOCK_TOKENS, PrefixCache, block_hashes
from tests.unit.kvevents.test_wire import DATA


def test_a_real_vllms_prompt_is_held_until_its_blocks_are_evicted() -> None:
    for name in ("vllm-0.32-tagged.msgpack", "vllm-0.32-positional.msgpack"):
        frames = msgpack.unpackb((DATA / name).read_bytes(), raw=False)
        messages = [decode(f) for f in frames]
        first = messages[0].batch.events[0]
        assert isinstance(first, Stored)
        index = BlockIndex()
        index.apply(messages[0].batch)
        prompt = [*first.token_ids, 7, 7, 7]  # its 4 blocks and a partial one
        assert index.cached_tokens(prompt) == 128 and len(index) == 4
        other = [prompt[0] + 1, *prompt[1:]]
        assert index.cached_tokens(other) == 0  # another first token: no prefix
        for m in messages[1:]:
            index.apply(m.batch)
        assert index.cached_tokens(prompt) == 0  # a 20-block cache evicted it
        assert index.applied.removed >= 4 and len(index) <= 20


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6), st.integers(0, 15)), max_size=25),
    st.integers(2, 12),
)
def test_the_index_replays_the_simulated_engines_cache_exactly(
    inserts: list[tuple[int, int, int]], capacity: int
) -> None:
    """Fed the simulated engine's events, the index holds the cache's blocks, and for every
    prompt finds the whole blocks the cache holds of it (its lookup's answer, before vLLM's
    rule of recomputing the last token)."""
    cache = PrefixCache(capacity, events=True)
    index = BlockIndex()
    prompts: list[list[int]] = []
    for base, blocks, extra in inserts:
        tokens = [(base * 7919 + i) % 32_000 for i in range(blocks * BLOCK_TOKENS + extra)]
        prompts.append(tokens)
        cache.insert_hashes(block_hashes(tokens), tokens)
        index.apply(Batch(0.0, tuple(cache.take_events())))
    held = set(cache._blocks)
    assert {h for h in held if index.holds(h)} == held and len(index) == len(held)
    for tokens in prompts:
        whole = 0
        for h in block_hashes(tokens):
            if h not in held:
                break
            whole += BLOCK_TOKENS
        assert index.cached_tokens(tokens) == whole


def test_bounds_groups_media_and_clears() -> None:
    tokens = tuple(range(64))
    chain = (b"a", b"b", b"c", b"d")
    index = BlockIndex(max_blocks=3)
    index.apply(Batch(0.0, (Stored(chain, None, tokens, 16),)))
    assert len(index) == 3 and index.applied.refused == 1
    assert index.cached_tokens(list(tokens)) == 48
    other = BlockIndex()
    other.apply(Batch(0.0, (Stored(chain, None, tokens, 16, "CPU"),  # an offloading tier
                            Stored(chain, None, tokens, 16, None, None, 1),  # another group
                            Removed((b"zz",)), Unknown("Later"))))  # fmt: skip
    assert len(other) == 0 and other.applied.ignored == 4
    other.apply(Batch(0.0, (Stored(chain, None, tokens, 16, "GPU", "adapter"),)))
    assert other.cached_tokens(list(tokens)) == 0  # the base model's tokens: not its blocks
    assert other.cached_tokens(list(tokens), "adapter") == 64
    other.apply(Batch(0.0, (Removed((b"b",)),)))
    assert other.cached_tokens(list(tokens), "adapter") == 16  # the chain breaks at b
    other.apply(Batch(0.0, (Cleared(),)))
    assert len(other) == 0 and other.cached_tokens(list(tokens), "adapter") == 0
