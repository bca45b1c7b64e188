"""The radix allocator: the kit's prefix cache over a radix tree (SGLang's
RadixAttention, vLLM's automatic prefix caching).

Full blocks of computed tokens enter a radix tree keyed by their tokens (`cache_blocks`,
called by the engine after every step). A new sequence starts from the blocks of its
longest cached prefix (`match_prefix`, called by the scheduler at admission), so only
the uncached tail is computed. A finished sequence's cached blocks stay in the tree;
blocks no sequence holds are evicted, leaves first, in the order of the `[eviction]`
policy (least recently used by default), only when the free list runs dry.

Invariant that makes every unheld cached block evictable: the cached blocks a sequence
holds are the first `num_cached_blocks` of its table, a path from the tree's root, so a
held block's ancestors are held too. (When two sequences computed the same prefix in
one step, the second to cache it switches to the first one's blocks and frees its own.)
"""

from __future__ import annotations

from typing import Any

from servelab.interfaces import AllocatorContext, PrefixSummary
from servelab.kit import PrefixCachingPagedAllocator
from servelab.plugins.allocators.radix_tree import RadixTree


class RadixAllocator(PrefixCachingPagedAllocator):
    def __init__(self, options: Any, context: AllocatorContext) -> None:
        super().__init__(options, context, RadixTree())

    @property
    def tree(self) -> RadixTree:
        return self.index

    def prefix_summary(self) -> PrefixSummary:
        """What this cache holds, as a router reads it (`ReplicaSnapshot.prefix_summary`):
        the same chained hashes the `hash` allocator names its blocks with."""
        return PrefixSummary(self.block_size, self.index.block_hashes())
