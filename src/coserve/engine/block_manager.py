"""Paged KV-cache block allocation, with automatic prefix caching.

With ``enable_prefix_caching`` a full block whose KV has been computed is registered under a
digest of every token up to its end (a chain: the block's tokens and the digest of the block
before) and of the sequence's cache key (its adapter: the KV of every layer depends on it). A
sequence admitted later whose tokens start with the same blocks reuses them instead of computing
them again (its prefill starts after them, as a later chunk of a chunked prefill would). A block
that no sequence holds any more keeps its KV and its digest until the space is needed: such
blocks count as free and are taken least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from coserve.engine.sequence import Sequence


def cache_key(*parts: str) -> bytes:
    """The digest of what, besides its tokens, decides a sequence's KV (its adapter's name and
    path; none for the base model)."""
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).digest()


BASE_CACHE_KEY = cache_key()
"""The cache key of a request without an adapter."""


class BlockManager:
    """Hands out fixed-size KV blocks (``block_size`` tokens each, all layers) to sequences.

    Invariant: every block is in exactly one of: the free list, the cached-free LRU (free, its
    KV registered under a digest), a co-serving user's loan (:meth:`take`), or the tables of
    ``refs[block] >= 1`` sequences (more than one only for a shared cached prefix).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free and registered, least recently used first
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}  # digest -> the block holding that prefix's KV
        self._digest_of: dict[int, bytes] = {}
        self._key_of: dict[int, bytes] = {}  # block -> the cache key it was registered under
        # prompt tokens asked for at admission, and those found cached (vLLM's prefix cache counters)
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered prefix (held by a sequence or free)."""
        return len(self._digest_of)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_new_tokens`` more computed tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"allocate: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            block = self._pop_free()
            self._refs[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._cached[block] = None  # (most recently used: evicted last)
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def take(self, n: int) -> list[int]:
        """Remove ``n`` free blocks from the pool (lent to a co-serving user of the pool, which
        writes them: a cached block taken is forgotten)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"take: {n} blocks asked, {self.num_free_blocks} free")
        return [self._pop_free() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def _pop_free(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._cached.popitem(last=False)
        self._unregister(block)
        return block

    def _unregister(self, block: int) -> None:
        del self._block_of[self._digest_of.pop(block)]
        del self._key_of[block]

    # ------------------------------------------------------------------ prefix caching

    def _digests(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The digests of ``seq``'s first ``num_blocks`` full blocks (kept on the sequence: its
        tokens never change, only grow)."""
        key, bs, have = seq.cache_key, self.block_size, seq.block_digests
        assert key is not None
        while len(have) < num_blocks:
            i = len(have)
            h = hashlib.blake2b(have[-1] if have else key, digest_size=16)
            h.update(array("q", seq.token_slice(i * bs, (i + 1) * bs)).tobytes())
            have.append(h.digest())
        return have[:num_blocks]

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold ``seq``'s longest registered prefix (none where caching is
        off or the sequence is not cacheable), at most all but its last token's block: a
        prefill must run to sample. Changes nothing."""
        if not self.enable_prefix_caching or seq.cache_key is None or seq.block_table:
            return []
        found = []
        for digest in self._digests(seq, (seq.num_tokens - 1) // self.block_size):
            block = self._block_of.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def can_admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Can ``seq`` be admitted with the prefix in ``cached`` (:meth:`match`) and
        ``num_new_tokens`` computed after it?"""
        need = self.blocks_for_tokens(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return need <= self.num_free_blocks - sum(1 for b in cached if self._refs[b] == 0)

    def reuse(self, seq: Sequence, cached: list[int]) -> None:
        """Give ``seq`` (with no blocks yet) the prefix in ``cached``: its KV counts as computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if self.enable_prefix_caching and seq.cache_key is not None:
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += len(cached) * self.block_size
        for block in cached:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
        seq.block_table = list(cached)
        seq.num_registered_blocks = len(cached)
        seq.num_computed_tokens = len(cached) * self.block_size

    def register(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose KV is now computed (after a step), so that later
        sequences can reuse them. A prefix registered already (another sequence computed it at
        the same time) keeps its first block."""
        if not self.enable_prefix_caching or seq.cache_key is None:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        digests = self._digests(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block, digest = seq.block_table[i], digests[i]
            if digest not in self._block_of and block not in self._digest_of:
                self._block_of[digest] = block
                self._digest_of[block] = digest
                self._key_of[block] = seq.cache_key
        seq.num_registered_blocks = full

    def forget(self, key: bytes) -> int:
        """Drop the prefixes registered under ``key`` (an adapter unloaded: its name may come back
        with other weights); the blocks stay with the sequences that hold them. Returns how many."""
        blocks = [b for b, k in self._key_of.items() if k == key]
        for block in blocks:
            self._unregister(block)
            if block in self._cached:
                del self._cached[block]
                self._free.append(block)
        return len(blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every registered prefix (a benchmark's next run must not find the last one's);
        returns how many blocks were registered."""
        n = len(self._digest_of)
        for block in list(self._digest_of):
            self._unregister(block)
        self._free.extend(self._cached)
        self._cached.clear()
        return n
