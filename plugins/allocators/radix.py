"""The radix allocator: paged blocks plus a prefix cache (SGLang's RadixAttention,
vLLM's automatic prefix caching).

Full blocks of computed tokens enter a radix tree keyed by their tokens (`cache_blocks`,
called by the engine after every step). A new sequence starts from the blocks of its
longest cached prefix (`match_prefix`, called by the scheduler at admission), so only
the uncached tail is computed. A finished sequence's cached blocks stay in the tree;
blocks no sequence holds are evicted, least recently used leaves first, only when the
free list runs dry. Cached blocks are never written: a write into one (possible only
after a rollback) copies it first, like any shared block.

Invariant that makes every unheld cached block evictable: the cached blocks a sequence
holds are the first `num_cached_blocks` of its table, a path from the tree's root, so a
held block's ancestors are held too. (When two sequences computed the same prefix in
one step, the second to cache it switches to the first one's blocks and frees its own.)
"""

from __future__ import annotations

from typing import Any

from servelab.interfaces import AllocatorContext, Sequence
from servelab.plugins.allocators.paged import SeqBlocks
from servelab.plugins.allocators.prefix_lookups import PrefixCachingPagedAllocator
from servelab.plugins.allocators.radix_tree import RadixTree


class RadixAllocator(PrefixCachingPagedAllocator):
    def __init__(self, options: Any, context: AllocatorContext) -> None:
        super().__init__(options, context)
        self.tree = RadixTree()
        self._num_cached = 0  # blocks in the tree that no sequence holds

    # ------------------------------------------------------------ PrefixCachingAllocator

    def match_prefix(self, seq: Sequence) -> int:
        if seq.request_id in self._seqs:
            raise ValueError(f"match_prefix: {seq.request_id!r} already holds KV blocks")
        block_size = self.block_size
        # At least one token must be computed to produce logits.
        max_blocks = (seq.num_tokens - 1) // block_size
        chunks = (tuple(seq.token_slice(i * block_size, (i + 1) * block_size)) for i in range(max_blocks))
        blocks = self.tree.match(chunks)
        for block in blocks:
            self._hold(block)
        num_hit = len(blocks) * block_size
        self._seqs[seq.request_id] = SeqBlocks(blocks, num_hit, num_cached_blocks=len(blocks))
        self.lookups.looked_up(seq.request_id, num_hit, seq.num_tokens)
        return num_hit

    def cache_blocks(self, seq: Sequence) -> None:
        state = self._seqs.get(seq.request_id)
        if state is None:
            return
        block_size = self.block_size
        num_full = min(seq.num_computed_tokens, state.num_tokens) // block_size
        if num_full <= state.num_cached_blocks:
            return
        table = state.table
        for index in range(state.num_cached_blocks, num_full):
            parent = table[index - 1] if index else None
            chunk = tuple(seq.token_slice(index * block_size, (index + 1) * block_size))
            cached = self.tree.insert(parent, chunk, table[index])
            if cached != table[index]:
                self._share_cached(table, index, cached)
            state.num_cached_blocks = index + 1

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence holds (held ones stay cached)."""
        self._evict(len(self.tree))

    # ------------------------------------------------------------ KVAllocator

    def free(self, seq_id: str) -> None:
        self.lookups.forget(seq_id)
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.num_cached_blocks:
            self.tree.touch(seq.table[seq.num_cached_blocks - 1])  # its prefix was just in use
        super().free(seq_id)

    # ------------------------------------------------------------ paged hooks

    def _is_shared(self, block: int) -> bool:
        return self._ref_counts[block] > 1 or block in self.tree

    def _num_available(self) -> int:
        return len(self._free_blocks) + self._num_cached

    def _take_blocks(self, count: int) -> list[int]:
        shortfall = count - len(self._free_blocks)
        if shortfall > 0:
            self._evict(shortfall)
        return super()._take_blocks(count)

    def _evict(self, count: int) -> None:
        """Move up to `count` unheld cached blocks, LRU leaves first, to the free list."""
        for block in self.tree.evict(count, self._is_unheld):
            self._num_cached -= 1
            self._filled[block] = 0
            self._free_blocks.append(block)

    def _held(self, block: int) -> None:
        if block in self.tree:
            self._num_cached -= 1

    def _unheld(self, block: int) -> None:
        if block in self.tree:
            self._num_cached += 1  # stays cached, and full
        else:
            super()._unheld(block)

    def _is_unheld(self, block: int) -> bool:
        return self._ref_counts[block] == 0
