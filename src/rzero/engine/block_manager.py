"""Paged KV-cache bookkeeping: block allocation, reference counts and prefix caching.

A block holds ATTN_BLOCK consecutive positions of one or more sequences (shared when they have the
same prefix). A full block whose K/V have been computed is registered under a hash of its whole
prefix, so a later request with the same prefix (a GRPO group, a multi-turn continuation, a shared
system prompt) reuses it instead of recomputing it. Freed blocks keep their hash until they are
handed out again, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict


def block_hash(previous: int | None, tokens: list[int]) -> int:
    return hash((previous, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        self._forget(block)
        self.ref_count[block] = 1
        return block

    def retain(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None

    def match_prefix(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Cached blocks that hold the first tokens of `tokens`, covering at most max_tokens."""
        matched, previous = [], None
        for start in range(0, max_tokens - self.block_size + 1, self.block_size):
            previous = block_hash(previous, tokens[start : start + self.block_size])
            block = self.by_hash.get(previous)
            if block is None:
                break
            matched.append(block)
        return matched

    def register(self, block: int, h: int) -> None:
        """Record that `block` now holds the computed K/V of the prefix hashed as h."""
        if h in self.by_hash or self.hash_of[block] is not None:
            return
        self.by_hash[h] = block
        self.hash_of[block] = h

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update their K/V are stale)."""
        self.by_hash.clear()
        self.hash_of = [None] * self.num_blocks

    def _forget(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            self.by_hash.pop(h, None)
            self.hash_of[block] = None
