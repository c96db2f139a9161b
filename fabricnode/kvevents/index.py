"""What one engine's prefix cache holds, as its KV-cache events say. Pure, bounded.

The index keeps every block the engine stored and has not removed: its hash, its parent's, and
a fingerprint of its tokens (``hash`` of the token tuple and of the adapter name, not the
tokens: 16 token ids a block would cost more than the rest of the entry). Blocks are also found
by content, ``(parent, fingerprint) -> hash``: that is how a sequence of token ids is walked
down the engine's chain, block by block, to the longest prefix the engine holds
(``cached_tokens``), which is what the engine's own prefix-cache lookup finds for those tokens
(the same chain: a block's hash covers its parent's and its tokens; for an adapter's blocks the
adapter too). A fingerprint collision costs a wrong count for one prompt, never a crash.

Only the blocks of one KV-cache group are kept (``group``: the first, full attention, where a
prompt's prefix is; a hybrid model's sliding-window groups hold only the window) and only
blocks on the GPU (``medium`` ``GPU`` or unspecified: an offloading tier's blocks are not
where a prefill finds them).

Bounds: at most ``max_blocks`` blocks. A ``Stored`` past the bound is not kept (counted in
``refused``): the index then under-claims, which costs a prompt a routing hint, never a wrong
one; an engine's real cache is far smaller than the default (131,072 blocks of 16 tokens: two
million tokens, about 25 MB here). ``Cleared`` and ``clear`` (a new engine process, a gap the
replay did not cover) empty it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fabricnode.kvevents.wire import Batch, Cleared, Hash, Removed, Stored

DEFAULT_MAX_BLOCKS = 131_072
GPU_MEDIA = (None, "GPU")


@dataclass
class Applied:
    """What applying batches did, summed (for metrics)."""

    stored: int = 0  # blocks added
    removed: int = 0  # blocks dropped
    cleared: int = 0
    refused: int = 0  # blocks not kept: past the bound
    ignored: int = 0  # events of another group or medium, of unknown types, or of unknown blocks


class BlockIndex:
    """The blocks one engine holds (module docstring)."""

    __slots__ = ("_blocks", "_by_content", "applied", "block_size", "group", "max_blocks")

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, group: int = 0) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self.group = group
        self.block_size = 0  # the engine's, from its first Stored (0: none seen)
        # hash -> (parent, content key): what removal needs to find the content entry
        self._blocks: dict[Hash, tuple[Hash | None, int]] = {}
        self._by_content: dict[tuple[Hash | None, int], Hash] = {}
        self.applied = Applied()

    def __len__(self) -> int:
        return len(self._blocks)

    def holds(self, block: Hash) -> bool:
        return block in self._blocks

    def clear(self) -> None:
        self._blocks.clear()
        self._by_content.clear()
        self.applied.cleared += 1

    def apply(self, batch: Batch) -> None:
        for event in batch.events:
            if isinstance(event, Stored):
                self._stored(event)
            elif isinstance(event, Removed):
                self._removed(event)
            elif isinstance(event, Cleared):
                self.clear()
            else:
                self.applied.ignored += 1

    def _ours(self, group: int | None, medium: str | None) -> bool:
        return (group is None or group == self.group) and medium in GPU_MEDIA

    def _stored(self, event: Stored) -> None:
        applied = self.applied
        if not self._ours(event.group, event.medium):
            applied.ignored += 1
            return
        size = event.block_size
        self.block_size = size
        tokens = event.token_ids
        whole = len(tokens) == size * len(event.hashes)  # else the tokens cannot be placed
        parent = event.parent
        blocks, by_content = self._blocks, self._by_content
        for i, block in enumerate(event.hashes):
            if block not in blocks:
                if len(blocks) >= self.max_blocks:
                    applied.refused += len(event.hashes) - i
                    return
                applied.stored += 1
            else:
                self._forget(block)
            key = fingerprint(tokens[i * size : (i + 1) * size], event.lora) if whole else 0
            blocks[block] = (parent, key)
            if whole:
                by_content[(parent, key)] = block
            parent = block

    def _removed(self, event: Removed) -> None:
        if not self._ours(event.group, event.medium):
            self.applied.ignored += 1
            return
        for block in event.hashes:
            if self._forget(block):
                self.applied.removed += 1
            else:
                self.applied.ignored += 1

    def _forget(self, block: Hash) -> bool:
        entry = self._blocks.pop(block, None)
        if entry is None:
            return False
        if self._by_content.get(entry) == block:
            del self._by_content[entry]
        return True

    def cached_tokens(self, token_ids: Sequence[int], lora: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` (a prompt as the engine tokenizes it) the
        engine holds, in whole blocks: the walk down its chain (module docstring)."""
        size = self.block_size
        if size <= 0:
            return 0
        blocks, by_content = self._blocks, self._by_content
        parent: Hash | None = None
        held = 0
        for start in range(0, len(token_ids) - size + 1, size):
            block = by_content.get((parent, fingerprint(token_ids[start : start + size], lora)))
            if block is None or block not in blocks:
                break
            parent = block
            held += size
        return held


def fingerprint(tokens: Sequence[int], lora: str | None) -> int:
    """A block's content as the index keys it: its tokens and its adapter."""
    return hash((tuple(tokens), lora))
