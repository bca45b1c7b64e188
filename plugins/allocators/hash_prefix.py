"""The hash allocator: the kit's prefix cache over a hash table of blocks (vLLM's
automatic prefix caching).

Every full block of computed tokens is named by a hash chained through its parent
(`servelab.interfaces.chained_block_hash`, the one routers use):

    hash(block i) = hash((hash(block i - 1), tokens of block i))      block 0: parent ROOT_BLOCK_HASH

so a block's name stands for the whole prefix it ends, not for its own tokens alone:
"X0 X1" and "Y0 X1" share the tokens of block 1 but not its name. A lookup walks a new
sequence's full blocks, hashing as it goes, and confirms each hit against the stored
parent hash and tokens (a collision is a miss, never a wrong hit).

A block no sequence holds stays cached, and evictable: every unheld cached block is an
eviction candidate, taken (its name dropped) only when the free list runs dry, in the
order of the `[eviction]` policy (least recently used by default: a sequence's blocks are
released last block first, so its tail goes before its head among equals).

A policy may choose a block before the blocks cached after it (LRU rarely does, a
frequency or cost policy may): a lookup walks from the root, so those descendants could
never be hit again. They go with it, in the same eviction, instead of holding the pool
as orphans. (They are unheld: a sequence holding a block holds every block before it.)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs

from servelab.interfaces import (ROOT_BLOCK_HASH, AllocatorContext, EvictionCandidate, PrefixSummary,
                                 chained_block_hash)
from servelab.kit import PrefixCachingPagedAllocator

ROOT_HASH = ROOT_BLOCK_HASH  # the parent hash of block 0
Chunk = tuple[int, ...]


@attrs.frozen
class CachedBlock:
    """What a cached block holds: its chained hash, its parent's, its tokens, its depth."""

    block_hash: int
    parent_hash: int
    tokens: tuple[int, ...]
    depth: int = 1  # blocks from the root, this one included
    inserted: int = 0  # tick it was cached


chained_hash = chained_block_hash  # the routers' hash too, so PrefixSummary matches prefix_block_hashes


class HashIndex:
    """Chained block hash -> cached block, with what eviction policies read of each
    (`servelab.kit.PrefixIndex`)."""

    def __init__(self) -> None:
        self.block_of: dict[int, int] = {}  # block hash -> the cached block holding that prefix
        self.cached: dict[int, CachedBlock] = {}  # block id -> what it caches
        self.evictable: dict[int, EvictionCandidate] = {}  # unheld cached blocks
        self.hits: dict[int, int] = {}  # block id -> lookups that reused it
        self.last_access: dict[int, int] = {}  # block id -> tick of its last use
        self.children: dict[int, set[int]] = {}  # block id -> the cached blocks right after it
        self._clock = 0
        self._changed: Callable[[int], None] | None = None  # the cache's EvictionQueue, when it keeps one

    def __contains__(self, block: int) -> bool:
        return block in self.cached

    def __len__(self) -> int:
        return len(self.cached)

    def match(self, chunks: Iterable[Chunk]) -> list[int]:
        blocks = self.peek(chunks)
        for block in blocks:
            self.hits[block] += 1
            self._used(block)
        return blocks

    def peek(self, chunks: Iterable[Chunk]) -> list[int]:
        blocks: list[int] = []
        parent_hash = ROOT_HASH
        for chunk in chunks:
            block = self.lookup(parent_hash, chunk)
            if block is None:
                break
            blocks.append(block)
            parent_hash = self.cached[block].block_hash
        return blocks

    def insert(self, parent: int | None, chunk: Chunk, block: int) -> int | None:
        parent_hash = self.cached[parent].block_hash if parent is not None else ROOT_HASH
        cached = self.lookup(parent_hash, chunk)
        if cached is not None:
            return cached
        block_hash = chained_hash(parent_hash, chunk)
        if block_hash in self.block_of:
            return None  # a hash collision with another prefix
        depth = self.cached[parent].depth + 1 if parent is not None else 1
        self.cached[block] = CachedBlock(block_hash, parent_hash, chunk, depth, self._tick())
        self.block_of[block_hash] = block
        self.hits[block] = 0
        self.last_access[block] = self._clock
        if parent is not None:
            self.children.setdefault(parent, set()).add(block)
        return block

    def touch(self, block: int) -> None:
        """Nothing: a released block's use is recorded when it becomes unheld."""

    def held(self, block: int) -> None:
        self.evictable.pop(block, None)

    def unheld(self, block: int) -> None:
        self._used(block, unheld=True)

    def candidates(self, is_unheld: Callable[[int], bool]) -> list[EvictionCandidate]:
        return list(self.evictable.values())

    def watch(self, changed: Callable[[int], None], is_unheld: Callable[[int], bool]) -> None:
        self._changed = changed

    def candidate(self, block: int, is_unheld: Callable[[int], bool]) -> EvictionCandidate | None:
        return self.evictable.get(block)

    def blocks_of(self, block: int, size: int) -> list[int]:
        return [block]

    def drop(self, block: int, max_blocks: int, is_unheld: Callable[[int], bool]) -> tuple[list[int], bool]:
        """Uncache `block` and every cached block after it (no lookup could reach them)."""
        parent = self.block_of.get(self.cached[block].parent_hash)
        if parent is not None and parent in self.children:
            self.children[parent].discard(block)
        dropped, stack = [], [block]
        while stack:
            current = stack.pop()
            if current not in self.evictable:  # held: impossible below an unheld block, kept regardless
                continue
            del self.evictable[current]
            entry = self.cached.pop(current)
            del self.block_of[entry.block_hash]
            del self.hits[current], self.last_access[current]
            dropped.append(current)
            stack.extend(sorted(self.children.pop(current, ()), reverse=True))
        return dropped, False

    def lookup(self, parent_hash: int, tokens: Chunk) -> int | None:
        """The cached block holding `tokens` after the prefix `parent_hash`, confirmed."""
        block = self.block_of.get(chained_hash(parent_hash, tokens))
        if block is None:
            return None
        entry = self.cached[block]
        if entry.parent_hash != parent_hash or entry.tokens != tokens:
            return None  # a hash collision: a different prefix owns this name
        return block

    def _used(self, block: int, *, unheld: bool = False) -> None:
        """Record a use of cached `block`; its candidate (if it is or becomes evictable)
        follows."""
        self.last_access[block] = self._tick()
        if unheld or block in self.evictable:
            entry = self.cached[block]
            self.evictable[block] = EvictionCandidate(block=block, last_access=self._clock, inserted=entry.inserted,
                                                      hits=self.hits[block], depth=entry.depth)
            if self._changed is not None:
                self._changed(block)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock


class HashAllocator(PrefixCachingPagedAllocator):
    def __init__(self, options: Any, context: AllocatorContext) -> None:
        super().__init__(options, context, HashIndex())

    def prefix_summary(self) -> PrefixSummary:
        """What this cache holds, as a router reads it (`ReplicaSnapshot.prefix_summary`)."""
        return PrefixSummary(self.block_size, self.index.block_of)
