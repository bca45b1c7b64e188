"""The eviction contract (kind `evictors`, `[eviction]`): what a prefix cache tells an
eviction policy of each evictable entry, the policy's factory context, the Protocol and
its optional capability. Changes by version: docs/contract-versions.md ("evictors").
"""

from __future__ import annotations

from typing import Protocol, Sequence as Seq, runtime_checkable

import attrs

__all__ = [
    "EvictionCandidate",
    "EvictionContext",
    "EvictionPolicy",
    "DemandAwareEviction",
    "EvictionObserver",
]


@attrs.frozen
class EvictionCandidate:
    """What a prefix cache knows of one evictable entry: a cached block no sequence holds
    (`hash`), or the evictable tail of a leaf of the tree (`radix`, `size` blocks ending at
    `block`). Ticks are the cache's own logical clock: larger is more recent, no two
    entries share one."""

    block: int  # the id the policy names it by (radix: the deepest block of the run)
    last_access: int  # tick of the last lookup through it, insertion, or release
    inserted: int  # tick it entered the cache
    hits: int = 0  # lookups that reused it
    depth: int = 1  # blocks from the root to `block` (1: the first block of a prompt)
    size: int = 1  # blocks evicting it frees
    demand: int = 0  # waiting sequences whose cached prefix runs through it (demand-aware policies only)


@attrs.frozen
class EvictionContext:
    """What an eviction policy factory receives."""

    num_blocks: int  # blocks in the KV pool
    block_size: int


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses which evictable prefix-cache entries go when the free list runs dry.

    `choose` gets every evictable entry (never one a sequence holds) and the number of
    blocks the pool needs, and returns the `block` ids of entries to evict, in order,
    until their sizes cover `num_blocks` (or every entry, when they cannot). The same
    candidates must give the same choice. The cache evicts them in that order, and asks
    again if that frees too little (a radix leaf's parent may have become a leaf).
    """

    def choose(self, candidates: Seq[EvictionCandidate], num_blocks: int) -> Seq[int]:
        """Block ids of `candidates` to evict, first to go first."""


@runtime_checkable
class DemandAwareEviction(Protocol):
    """An eviction policy that reads `EvictionCandidate.demand` (when `uses_demand` is
    True): the cache then counts, for each entry, the anticipated waiting sequences whose
    cached prefix runs through it (`AnticipatingPrefixCache`)."""

    uses_demand: bool


@runtime_checkable
class EvictionObserver(Protocol):
    """An eviction policy that keeps state which evictions move (an aging clock, as
    GreedyDual-Size-Frequency's L): the cache calls `evicted(candidates)` after every
    eviction, with the entries it evicted in order, as the policy was offered them (a
    radix tail may lose fewer blocks than its `size`; a `hash` block takes its cached
    descendants, which no lookup could reach any more, with it).

    It is called on both of the cache's paths: after `choose`, and after a key-ordered
    policy (`servelab.kit.KeyedEviction`) is served from its O(log n) queue, so an
    observing policy keeps the queue. The queue recomputes a key to tell a current entry
    from a stale one, so `key(candidate)` must stay a pure function of the candidate:
    state the policy updates in `evicted` may enter a key only as it stood when the
    policy first keyed that candidate (memoize per `(block, last_access)`)."""

    def evicted(self, candidates: Seq[EvictionCandidate]) -> None:
        """These entries were just evicted, first to go first."""
