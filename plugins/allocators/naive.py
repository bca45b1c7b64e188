"""The naive allocator: each sequence reserves one contiguous, block-aligned run of
max_model_len slots, first fit, the way serving engines worked before PagedAttention.

A pool of 10 blocks with reservations of 3 blocks (max_model_len 12, block size 4):

    blocks   0 1 2 | 3 4 5 | 6 7 8 | 9
             seq a | free  | seq c | free     (b, which held 3-5, has finished)

A sequence holding 5 tokens still reserves all 12 slots: 7 are reserved but empty
(internal waste). Block 9 is free but no reservation can ever use it (external
fragmentation). A request is refused whenever no free run of max_model_len slots is left,
however few tokens it needs and however many slots are free in total. The block table
is the run's prefix that holds tokens, so the one paged attention path reads it too.
"""

from __future__ import annotations

import bisect
from typing import Any

from servelab.errors import ConfigError
from servelab.interfaces import AllocatorContext, AllocatorStats


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` slots."""
    return -(-num_tokens // block_size)


class _Run:
    __slots__ = ("start", "num_tokens")

    def __init__(self, start: int, num_tokens: int) -> None:
        self.start = start  # first block of the reservation
        self.num_tokens = num_tokens  # slots holding (or about to hold) tokens


class NaiveAllocator:
    """Contiguous max_model_len reservations, first fit over a sorted list of free runs.

    Never shares a block: fork copies the parent's blocks into the child's own run.
    Every block table is one run of consecutive blocks (`ContiguousAllocator`), which is
    what lets attention `sdpa-contiguous` read a sequence's K/V as a view of the cache.
    """

    contiguous_block_tables = True

    def __init__(self, options: Any, context: AllocatorContext) -> None:
        self.block_size = context.block_size
        self.num_blocks = context.num_blocks
        self.reservation = blocks_for(context.max_model_len, context.block_size)  # blocks per sequence
        if self.reservation > context.num_blocks:
            raise ConfigError(
                f"allocator 'naive' reserves max_model_len={context.max_model_len} slots "
                f"({self.reservation} blocks) per sequence, more than the {context.num_blocks} blocks of the "
                f"KV cache; raise [engine] kv_cache_memory or num_kv_blocks, or lower max_model_len")
        self._free_runs: list[list[int]] = [[0, context.num_blocks]]  # [start, length], sorted by start
        self._seqs: dict[str, _Run] = {}
        self._num_slots_used = 0
        self._copies: list[tuple[int, int]] = []

    # ------------------------------------------------------------ KVAllocator

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        if num_tokens > self.reservation * self.block_size:
            return False
        run = self._seqs.get(seq_id)
        if run is None:
            if num_tokens <= 0:
                return True
            start = self._reserve()
            if start is None:
                return False
            run = self._seqs[seq_id] = _Run(start, 0)
        if num_tokens > run.num_tokens:
            self._num_slots_used += num_tokens - run.num_tokens
            run.num_tokens = num_tokens
        return True

    def free(self, seq_id: str) -> None:
        run = self._seqs.pop(seq_id, None)
        if run is None:
            return
        self._num_slots_used -= run.num_tokens
        self._release(run.start)

    def block_table(self, seq_id: str) -> list[int]:
        run = self._seqs.get(seq_id)
        if run is None:
            return []
        return list(range(run.start, run.start + blocks_for(run.num_tokens, self.block_size)))

    def stats(self) -> AllocatorStats:
        num_used = len(self._seqs) * self.reservation
        return AllocatorStats(
            num_blocks=self.num_blocks,
            num_used_blocks=num_used,
            num_free_blocks=self.num_blocks - num_used,
            num_token_slots_used=self._num_slots_used,
            num_token_slots_reserved_empty=num_used * self.block_size - self._num_slots_used,
            num_free_slots_unusable=sum(length % self.reservation for _, length in self._free_runs) * self.block_size,
            block_size=self.block_size,
        )

    # ------------------------------------------------------------ ForkingAllocator

    def fork(self, parent_id: str, child_id: str) -> bool:
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into {child_id!r}: it already holds KV blocks")
        parent = self._seqs.get(parent_id)
        if parent is None:
            return True
        start = self._reserve()
        if start is None:
            return False
        self._seqs[child_id] = _Run(start, parent.num_tokens)
        self._num_slots_used += parent.num_tokens
        num_blocks = blocks_for(parent.num_tokens, self.block_size)
        self._copies.extend((parent.start + i, start + i) for i in range(num_blocks))
        return True

    def rollback(self, seq_id: str, num_slots: int) -> None:
        run = self._seqs.get(seq_id)
        if run is None or num_slots <= 0:
            return
        num_tokens = max(0, run.num_tokens - num_slots)
        self._num_slots_used -= run.num_tokens - num_tokens
        run.num_tokens = num_tokens

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def ref_count(self, block_id: int) -> int:
        for run in self._seqs.values():
            if run.start <= block_id < run.start + blocks_for(run.num_tokens, self.block_size):
                return 1
        return 0

    # ------------------------------------------------------------ free runs

    def _reserve(self) -> int | None:
        """First fit: the lowest free run long enough; returns its first block."""
        for index, (start, length) in enumerate(self._free_runs):
            if length >= self.reservation:
                if length == self.reservation:
                    del self._free_runs[index]
                else:
                    self._free_runs[index] = [start + self.reservation, length - self.reservation]
                return start
        return None

    def _release(self, start: int) -> None:
        """Return a reservation, merging it with free neighbours."""
        runs = self._free_runs
        index = bisect.bisect(runs, [start, 0])
        runs.insert(index, [start, self.reservation])
        if index + 1 < len(runs) and start + self.reservation == runs[index + 1][0]:
            runs[index][1] += runs.pop(index + 1)[1]
        if index > 0 and runs[index - 1][0] + runs[index - 1][1] == start:
            runs[index - 1][1] += runs.pop(index)[1]
