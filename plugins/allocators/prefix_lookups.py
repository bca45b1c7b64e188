"""Prefix-cache lookup statistics, and the base the prefix-caching allocators share.

A lookup counts once, when the sequence it was made for is admitted (its first
`allocate` succeeds): a refused admission's lookup is forgotten with `free`, so hits
and lookups describe the sequences that actually ran.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs

from servelab.interfaces import AllocatorContext, AllocatorStats
from servelab.plugins.allocators.paged import PagedAllocator


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
    """Paged blocks plus what `radix` and `hash` do alike: count lookups at admission,
    report them in `stats()`, and share a block another sequence cached first."""

    # First in, first out: eviction appends blocks in least-recently-used order, and they
    # are taken in that order.
    free_list_type = deque

    def __init__(self, options: Any, context: AllocatorContext) -> None:
        super().__init__(options, context)
        self.lookups = PrefixLookups()

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        if not super().allocate(seq_id, num_tokens):
            return False
        self.lookups.admitted(seq_id)
        return True

    def stats(self) -> AllocatorStats:
        lookups = self.lookups
        return attrs.evolve(super().stats(), prefix_hit_tokens=lookups.hit_tokens,
                            prefix_lookup_tokens=lookups.lookup_tokens, num_prefix_lookups=lookups.num_lookups)

    def _share_cached(self, table: list[int], index: int, cached: int) -> None:
        """Another sequence computed and cached this block's prefix first (both ran in one
        step): hold its block and free ours, so the table runs through cached blocks."""
        self._hold(cached)
        self._release(table[index])
        table[index] = cached
