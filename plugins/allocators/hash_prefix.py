"""The hash allocator: paged blocks plus a hash-keyed prefix cache (vLLM's automatic
prefix caching).

Every full block of computed tokens is named by a hash chained through its parent
(`servelab.interfaces.chained_block_hash`, the one routers use):

    hash(block i) = hash((hash(block i - 1), tokens of block i))      block 0: parent ROOT_BLOCK_HASH

so a block's name stands for the whole prefix it ends, not for its own tokens alone:
"X0 X1" and "Y0 X1" share the tokens of block 1 but not its name. A lookup walks a new
sequence's full blocks, hashing as it goes, and confirms each hit against the stored
parent hash and tokens (a collision is a miss, never a wrong hit).

A block no sequence holds stays cached, and evictable: unheld cached blocks sit in one
LRU queue, and are taken (their names dropped) only when the free list runs dry. A
sequence's blocks enter the queue last block first, so its tail goes before its head,
and a block shared by several sequences enters with its last holder: a parent is never
evicted before its child.

Cached blocks are never written: a write into one (possible only after a rollback)
copies it first, like any shared block. Drafts are never cached: only tokens of the
sequence up to its computed count are hashed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs

from servelab.interfaces import ROOT_BLOCK_HASH, AllocatorContext, PrefixSummary, Sequence, chained_block_hash
from servelab.plugins.allocators.paged import SeqBlocks
from servelab.plugins.allocators.prefix_lookups import PrefixCachingPagedAllocator

ROOT_HASH = ROOT_BLOCK_HASH  # the parent hash of block 0


@attrs.frozen
class CachedBlock:
    """What a cached block holds: its chained hash, its parent's, and its tokens."""

    block_hash: int
    parent_hash: int
    tokens: tuple[int, ...]


chained_hash = chained_block_hash  # the routers' hash too, so PrefixSummary matches prefix_block_hashes


class HashAllocator(PrefixCachingPagedAllocator):
    def __init__(self, options: Any, context: AllocatorContext) -> None:
        super().__init__(options, context)
        self._block_of: dict[int, int] = {}  # block hash -> the cached block holding that prefix
        self._cached: dict[int, CachedBlock] = {}  # block id -> what it caches
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unheld cached blocks, LRU first

    # ------------------------------------------------------------ PrefixCachingAllocator

    def match_prefix(self, seq: Sequence) -> int:
        if seq.request_id in self._seqs:
            raise ValueError(f"match_prefix: {seq.request_id!r} already holds KV blocks")
        block_size = self.block_size
        max_blocks = (seq.num_tokens - 1) // block_size  # at least one token is computed, for logits
        blocks: list[int] = []
        parent_hash = ROOT_HASH
        for index in range(max_blocks):
            tokens = tuple(seq.token_slice(index * block_size, (index + 1) * block_size))
            block = self._lookup(parent_hash, tokens)
            if block is None:
                break
            blocks.append(block)
            parent_hash = self._cached[block].block_hash
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
        num_full = min(seq.num_computed_tokens, state.num_tokens, seq.num_tokens) // block_size
        table = state.table
        for index in range(state.num_cached_blocks, num_full):
            parent_hash = self._cached[table[index - 1]].block_hash if index else ROOT_HASH
            tokens = tuple(seq.token_slice(index * block_size, (index + 1) * block_size))
            cached = self._lookup(parent_hash, tokens)
            if cached is None:
                block_hash = chained_hash(parent_hash, tokens)
                if block_hash in self._block_of:
                    return  # a hash collision with another prefix: this block and its successors stay uncached
                self._cached[table[index]] = CachedBlock(block_hash, parent_hash, tokens)
                self._block_of[block_hash] = table[index]
            elif cached != table[index]:
                self._share_cached(table, index, cached)
            state.num_cached_blocks = index + 1

    def prefix_summary(self) -> PrefixSummary:
        """What this cache holds, as a router reads it (`ReplicaSnapshot.prefix_summary`)."""
        return PrefixSummary(self.block_size, self._block_of)

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence holds (held ones stay cached)."""
        self._evict(len(self._evictable))

    # ------------------------------------------------------------ KVAllocator

    def free(self, seq_id: str) -> None:
        self.lookups.forget(seq_id)
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            for block in reversed(seq.table):  # the tail enters the LRU queue first: evicted first
                self._release(block)

    # ------------------------------------------------------------ paged hooks

    def _is_shared(self, block: int) -> bool:
        return self._ref_counts[block] > 1 or block in self._cached

    def _num_available(self) -> int:
        return len(self._free_blocks) + len(self._evictable)

    def _take_blocks(self, count: int) -> list[int]:
        shortfall = count - len(self._free_blocks)
        if shortfall > 0:
            self._evict(shortfall)
        return super()._take_blocks(count)

    def _held(self, block: int) -> None:
        self._evictable.pop(block, None)

    def _unheld(self, block: int) -> None:
        if block in self._cached:
            self._evictable[block] = None  # most recently used: evicted last
        else:
            super()._unheld(block)

    # ------------------------------------------------------------ internals

    def _lookup(self, parent_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block holding `tokens` after the prefix `parent_hash`, confirmed."""
        block = self._block_of.get(chained_hash(parent_hash, tokens))
        if block is None:
            return None
        entry = self._cached[block]
        if entry.parent_hash != parent_hash or entry.tokens != tokens:
            return None  # a hash collision: a different prefix owns this name
        if block in self._evictable:
            self._evictable.move_to_end(block)
        return block

    def _evict(self, count: int) -> None:
        """Move up to `count` unheld cached blocks, least recently used first, to the free list."""
        for _ in range(min(count, len(self._evictable))):
            block, _ = self._evictable.popitem(last=False)
            entry = self._cached.pop(block)
            del self._block_of[entry.block_hash]
            self._filled[block] = 0
            self._free_blocks.append(block)
