"""Paged KV-cache block allocation."""

from __future__ import annotations

from collections import deque

from coserve.engine.sequence import Sequence


class BlockManager:
    """Hands out fixed-size KV blocks (``block_size`` tokens each, all layers) to sequences.

    Invariant: every block id is either in the free list or in exactly one sequence's table.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_new_tokens`` more computed tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            raise RuntimeError(f"allocate: need {need} blocks, {len(self._free)} free")
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []

    def take(self, n: int) -> list[int]:
        """Remove ``n`` free blocks from the pool (lent to a co-serving user of the pool)."""
        if n > len(self._free):
            raise RuntimeError(f"take: {n} blocks asked, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
