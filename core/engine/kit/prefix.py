"""The kit's prefix cache: the block pool plus an index of cached prefixes, with
eviction chosen by a policy. `radix` and `hash` are this class over two indexes.

    class RadixAllocator(PrefixCachingPagedAllocator):
        def __init__(self, options, context):
            super().__init__(options, context, RadixTree())

The index (`PrefixIndex`) maps chains of block-sized token chunks to block ids; it
knows nothing of ref counts. The cache does the rest once, for every index: lookups at
admission (`match_prefix`), caching full blocks of computed tokens (`cache_blocks`),
sharing a block another sequence cached first, keeping unheld cached blocks evictable,
asking the eviction policy which to drop when the free list runs dry, the prefix
statistics, `reset_prefix_cache` and the waiting sequences a demand-aware policy reads.

A lookup counts once, when the sequence it was made for is admitted (its first
`allocate` succeeds): a refused admission's lookup is forgotten with `free`, so hits and
lookups describe the sequences that actually ran.

Cached blocks are never written: a write into one (possible only after a rollback)
copies it first, like any shared block. Drafts are never cached: only tokens up to the
sequence's computed count are.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Protocol, Sequence as Seq, runtime_checkable

import attrs

from servelab.interfaces import (ROOT_BLOCK_HASH, AllocatorContext, AllocatorStats, DemandAwareEviction,
                                 EvictionCandidate, EvictionContext, EvictionObserver, Sequence, chained_block_hash)
from servelab.kit.blocks import PagedAllocator, SeqBlocks
from servelab.kit.eviction import EvictionQueue, LeastRecentlyUsed, checked_choice, orders_by_key

Chunk = tuple[int, ...]
MAX_ANTICIPATED = 16  # waiting sequences a demand-aware policy sees (the head of the queue)


class PrefixIndex(Protocol):
    """Cached prefixes -> block ids: the seam a prefix cache's structure fills.

    Blocks form chains from the root: a block is cached as holding `chunk` right after
    its parent block (None: the first block of a prompt). The cache tells the index when
    a cached block gains its first holder or loses its last (`held`, `unheld`); the index
    offers the unheld ones as eviction candidates.
    """

    def __contains__(self, block: int) -> bool: ...

    def __len__(self) -> int:
        """Blocks in the index."""

    def match(self, chunks: Iterable[Chunk]) -> list[int]:
        """Blocks of the longest cached prefix of `chunks`, counted as a hit and a use."""

    def peek(self, chunks: Iterable[Chunk]) -> list[int]:
        """The same blocks, changing nothing."""

    def insert(self, parent: int | None, chunk: Chunk, block: int) -> int | None:
        """Cache `block` as holding `chunk` after `parent`. Returns the block cached for that
        prefix now: `block`, or the one that held it already; None when it cannot be cached
        (a hash collision), and then neither can the blocks after it."""

    def touch(self, block: int) -> None:
        """The prefix ending at cached `block` was just in use."""

    def held(self, block: int) -> None:
        """Cached `block` got its first holder."""

    def unheld(self, block: int) -> None:
        """Cached `block` lost its last holder (it stays cached, evictable)."""

    def candidates(self, is_unheld: Callable[[int], bool]) -> list[EvictionCandidate]:
        """Every evictable entry now."""

    def drop(self, block: int, max_blocks: int, is_unheld: Callable[[int], bool]) -> tuple[list[int], bool]:
        """Remove up to `max_blocks` blocks of the candidate named `block` (deepest first);
        returns them, and whether new candidates appeared (the cache then asks its policy
        again)."""

    def blocks_of(self, block: int, size: int) -> list[int]:
        """The `size` blocks of the candidate named `block` (for its demand)."""


@runtime_checkable
class IncrementalPrefixIndex(Protocol):
    """Capability: an index that reports changes to its eviction candidates, so a
    key-ordered policy keeps its order in an `EvictionQueue` (no sort per eviction)."""

    def watch(self, changed: Callable[[int], None], is_unheld: Callable[[int], bool]) -> None:
        """From now on call `changed(block)` whenever the candidate named `block` may have
        appeared or changed (a use, a release, a split, a drop that exposes a new tail);
        `is_unheld` is the cache's test of a block no sequence holds."""

    def candidate(self, block: int, is_unheld: Callable[[int], bool]) -> EvictionCandidate | None:
        """The evictable entry named `block` now, or None."""


class PrefixLookups:
    """Pending lookups per sequence id, and the totals of admitted ones."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[int, int]] = {}  # seq id -> (hit tokens, looked-up tokens)
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.num_lookups = 0

    def looked_up(self, seq_id: str, hit_tokens: int, num_tokens: int) -> None:
        """`match_prefix` found `hit_tokens` of the `num_tokens` of `seq_id`."""
        self._pending[seq_id] = (hit_tokens, num_tokens)

    def admitted(self, seq_id: str) -> None:
        """`seq_id`'s allocation succeeded: its pending lookup (if any) counts now."""
        lookup = self._pending.pop(seq_id, None)
        if lookup is not None:
            self.hit_tokens += lookup[0]
            self.lookup_tokens += lookup[1]
            self.num_lookups += 1

    def forget(self, seq_id: str) -> None:
        """`seq_id` was freed: a lookup not yet admitted never counts."""
        self._pending.pop(seq_id, None)


class PrefixCachingPagedAllocator(PagedAllocator):
    """The block pool plus a prefix cache over `index`, evicting by `context.eviction`."""

    # First in, first out: evicted blocks join the free list in eviction order and are
    # taken in that order.
    free_list_type = deque

    def __init__(self, options: Any, context: AllocatorContext, index: PrefixIndex) -> None:
        super().__init__(options, context)
        self.index = index
        self.eviction = context.eviction if context.eviction is not None else LeastRecentlyUsed(
            None, EvictionContext(context.num_blocks, context.block_size))
        self.uses_demand = isinstance(self.eviction, DemandAwareEviction) and bool(self.eviction.uses_demand)
        self._observer = self.eviction if isinstance(self.eviction, EvictionObserver) else None
        self._queue: EvictionQueue | None = None  # the key order kept incrementally, where it can be
        if orders_by_key(self.eviction) and not self.uses_demand and isinstance(index, IncrementalPrefixIndex):
            is_unheld = self._is_unheld
            self._queue = EvictionQueue(self.eviction.key, lambda block: index.candidate(block, is_unheld),
                                        lambda: index.candidates(is_unheld), type(self.eviction).__name__)
            index.watch(self._queue.changed, is_unheld)
        self.lookups = PrefixLookups()
        self._num_cached = 0  # blocks in the index that no sequence holds
        self._anticipated: tuple[Sequence, ...] = ()
        # The host tier below (`[kv_offload]`): evicted blocks go down, misses look there.
        self.tier = context.host_tier
        self._names: dict[int, tuple[int, int, Chunk, int]] = {}  # cached block -> (hash, parent hash, chunk, depth)

    # ------------------------------------------------------------ PrefixCachingAllocator

    def match_prefix(self, seq: Sequence) -> int:
        if seq.request_id in self._seqs:
            raise ValueError(f"match_prefix: {seq.request_id!r} already holds KV blocks")
        chunks = list(self._chunks(seq))
        blocks = self.index.match(chunks)
        for block in blocks:
            self._hold(block)
        if self.tier is not None and len(blocks) < len(chunks):
            self._load_from_tier(chunks, blocks)
        num_hit = len(blocks) * self.block_size
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
            parent = table[index - 1] if index else None
            cached = self.index.insert(parent, block_chunk(seq, index, block_size), table[index])
            if cached is None:
                return  # this block and its successors stay uncached
            if cached != table[index]:
                self._share_cached(table, index, cached)
            elif self.tier is not None:
                self._name(cached, parent, block_chunk(seq, index, block_size))
            state.num_cached_blocks = index + 1

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence holds (held ones stay cached), in the host
        tier too."""
        tier, self.tier = self.tier, None  # dropped, not offloaded
        try:
            self._evict(self._num_cached)
        finally:
            self.tier = tier
        if tier is not None:
            tier.reset_cached()

    def anticipate(self, seqs: Seq[Sequence]) -> None:
        """The waiting sequences the scheduler expects to admit next (read by demand-aware
        eviction only)."""
        if self.uses_demand:
            self._anticipated = tuple(seqs[:MAX_ANTICIPATED])

    # ------------------------------------------------------------ KVAllocator

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        if not super().allocate(seq_id, num_tokens):
            return False
        self.lookups.admitted(seq_id)
        return True

    def free(self, seq_id: str) -> None:
        self.lookups.forget(seq_id)
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if seq.num_cached_blocks:
            self.index.touch(seq.table[seq.num_cached_blocks - 1])  # its prefix was just in use
        for block in reversed(seq.table):  # the tail is released first: evicted first among equals
            self._release(block)

    def stats(self) -> AllocatorStats:
        lookups = self.lookups
        return attrs.evolve(super().stats(), prefix_hit_tokens=lookups.hit_tokens,
                            prefix_lookup_tokens=lookups.lookup_tokens, num_prefix_lookups=lookups.num_lookups)

    # ------------------------------------------------------------ the pool's hooks

    def _is_shared(self, block: int) -> bool:
        return self._ref_counts[block] > 1 or block in self.index

    def _num_available(self) -> int:
        return len(self._free_blocks) + self._num_cached

    def _take_blocks(self, count: int) -> list[int]:
        shortfall = count - len(self._free_blocks)
        if shortfall > 0:
            self._evict(shortfall)
        return super()._take_blocks(count)

    def _held(self, block: int) -> None:
        if block in self.index:
            self._num_cached -= 1
            self.index.held(block)

    def _unheld(self, block: int) -> None:
        if block in self.index:
            self._num_cached += 1  # stays cached, and full
            self.index.unheld(block)
        else:
            super()._unheld(block)

    # ------------------------------------------------------------ eviction

    def _evict(self, count: int) -> None:
        """Move `count` unheld cached blocks (or all there are) to the free list, in the
        order the eviction policy chooses."""
        if self._queue is not None:
            self._evict_in_key_order(count)
            return
        is_unheld = self._is_unheld
        gone: list[EvictionCandidate] = []
        while count > 0 and self._num_cached:
            candidates = self.index.candidates(is_unheld)
            if self.uses_demand:
                candidates = self._with_demand(candidates)
            by_block = {c.block: c for c in candidates}
            changed = False
            for chosen in checked_choice(self.eviction, candidates, count):
                evicted, changed = self.index.drop(chosen, count, is_unheld)
                self._free_evicted(evicted)
                gone.append(by_block[chosen])
                count -= len(evicted)
                if changed or count <= 0:
                    break
            if not changed:
                break
        self._tell_evicted(gone)

    def _evict_in_key_order(self, count: int) -> None:
        """`_evict` for a key-ordered policy: the same order, from the queue."""
        queue = self._queue
        gone: list[EvictionCandidate] = []
        while count > 0 and self._num_cached:
            candidate = queue.pop()
            if candidate is None:
                break
            evicted, _ = self.index.drop(candidate.block, count, self._is_unheld)
            self._free_evicted(evicted)
            gone.append(candidate)
            count -= len(evicted)
        queue.compact(len(self.index))
        self._tell_evicted(gone)

    def _tell_evicted(self, gone: list[EvictionCandidate]) -> None:
        """An observing policy (EvictionObserver) learns what this eviction took."""
        if gone and self._observer is not None:
            self._observer.evicted(tuple(gone))

    def _free_evicted(self, blocks: list[int]) -> None:
        """Evicted `blocks` join the free list (their contents going down to the host tier
        first, when there is one)."""
        for block in blocks:
            if self.tier is not None:
                self._offload(block)
            self._num_cached -= 1
            self._filled[block] = 0
            self._free_blocks.append(block)

    def _is_unheld(self, block: int) -> bool:
        return self._ref_counts[block] == 0

    def _with_demand(self, candidates: list[EvictionCandidate]) -> list[EvictionCandidate]:
        """`candidates` with `demand` counted over the anticipated waiting sequences."""
        demand: dict[int, int] = {}
        for seq in self._anticipated:
            if seq.request_id in self._seqs or seq.is_finished:
                continue  # admitted since, or gone
            for block in self.index.peek(self._chunks(seq)):
                demand[block] = demand.get(block, 0) + 1
        if not demand:
            return candidates
        return [attrs.evolve(c, demand=self._candidate_demand(c, demand)) if c.block in demand or c.size > 1 else c
                for c in candidates]

    def _candidate_demand(self, candidate: EvictionCandidate, demand: dict[int, int]) -> int:
        """The most waiting sequences any of the candidate's blocks serves."""
        if candidate.size == 1:
            return demand.get(candidate.block, 0)
        return max((demand.get(b, 0) for b in self.index.blocks_of(candidate.block, candidate.size)), default=0)

    # ------------------------------------------------------------ the host tier

    def _name(self, block: int, parent: int | None, chunk: Chunk) -> None:
        """Record the chained hash of newly cached `block` (the host tier's name for it)."""
        parent_hash, depth = (ROOT_BLOCK_HASH, 0) if parent is None else (self._names[parent][0],
                                                                          self._names[parent][3])
        self._names[block] = (chained_block_hash(parent_hash, chunk), parent_hash, chunk, depth + 1)

    def _offload(self, block: int) -> None:
        """`block` leaves the device cache: its contents go down to the host tier."""
        name = self._names.pop(block, None)
        if name is not None:
            key, parent, chunk, depth = name
            self.tier.offload(key, parent, chunk, depth, block)

    def _load_from_tier(self, chunks: list[Chunk], blocks: list[int]) -> None:
        """Extend a device hit `blocks` with the blocks that follow it in the host tier:
        each is brought back into a fresh device block (a move in the next plan), cached
        and held like a device hit."""
        parent = blocks[-1] if blocks else None
        parent_hash = self._names[parent][0] if parent is not None else ROOT_BLOCK_HASH
        for chunk in chunks[len(blocks):]:
            key = chained_block_hash(parent_hash, chunk)
            if not self.tier.lookup(key, parent_hash, chunk) or self._num_available() < 1:
                return
            block = self._take_blocks(1)[0]
            self._filled[block] = self.block_size
            self._hold(block)
            if self.index.insert(parent, chunk, block) != block:  # cannot be cached here (a collision)
                self._release(block)
                return
            self.tier.load(key, block)
            self._name(block, parent, chunk)
            blocks.append(block)
            parent, parent_hash = block, key

    # ------------------------------------------------------------ helpers

    def _chunks(self, seq: Sequence) -> Iterable[Chunk]:
        """The chunks a lookup may hit: at least one token must be computed, for logits."""
        block_size = self.block_size
        max_blocks = (seq.num_tokens - 1) // block_size
        return (block_chunk(seq, i, block_size) for i in range(max_blocks))

    def _share_cached(self, table: list[int], index: int, cached: int) -> None:
        """Another sequence computed and cached this block's prefix first (both ran in one
        step): hold its block and free ours, so the table runs through cached blocks."""
        self._hold(cached)
        self._release(table[index])
        table[index] = cached


def block_chunk(seq: Sequence, index: int, block_size: int) -> Chunk:
    """What names block `index` of `seq` in a prefix cache: its tokens, and for block 0 of a
    sequence served with a LoRA adapter, first the adapter's id negated (token ids are never
    negative). A block's name chains through every block before it, so K/V computed under
    one adapter is never served to another adapter, nor to the base model."""
    tokens = tuple(seq.token_slice(index * block_size, (index + 1) * block_size))
    return (-seq.lora_id, *tokens) if index == 0 and seq.lora_id else tokens
