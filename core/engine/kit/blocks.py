"""The kit's block pool (`PagedAllocator`, the `paged` allocator as registered): a
sequence's KV lives in fixed-size blocks taken from a free list on demand (PagedAttention),
so waste is bounded by block_size - 1 slots.

Seam: `free_list_type`, the class holding the free block ids (`popleft()` takes the next,
`append(block)` returns one). A LIFO pool is one line:

    class LIFOPool(PagedAllocator):
        free_list_type = StackOfBlocks    # popleft() = pop(): the last freed block first

Blocks are ref-counted, so sequences can share them. A child forked from a sequence
holding 10 tokens (block size 4) shares all three of its blocks:

    parent  [7 | 2 | 5]       tokens 0-3 in block 7, 4-7 in block 2, 8-9 in block 5
    child   [7 | 2 | 5]       ref counts 7: 2, 2: 2, 5: 2

When the child appends token 10, block 5 is shared, so it is copied first (copy-on-write):

    child   [7 | 2 | 9]       copy 5 -> 9 queued for the runner; ref counts 5: 1, 9: 1

Full shared blocks are never written again, so they are never copied.

Free blocks are handed out lowest id first, which keeps the blocks in use packed (and one
sequence's close together), where a FIFO free list scatters them over the whole cache and
slows decode attention (docs/performance.md, "Lowest-id-first block allocation").
"""

from __future__ import annotations

import heapq
from typing import Any

from servelab.interfaces import AllocatorContext, AllocatorStats


class FreeBlocks:
    """The free block ids, a min-heap: `popleft` takes the lowest, `append` returns one."""

    def __init__(self, blocks: range) -> None:
        self._heap = list(blocks)
        heapq.heapify(self._heap)

    def popleft(self) -> int:
        return heapq.heappop(self._heap)

    def append(self, block: int) -> None:
        heapq.heappush(self._heap, block)

    def __len__(self) -> int:
        return len(self._heap)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` slots (8 tokens at block size 4 -> 2; 9 -> 3)."""
    return -(-num_tokens // block_size)


class SeqBlocks:
    """What an allocator holds for one sequence."""

    __slots__ = ("table", "num_tokens", "num_cached_blocks")

    def __init__(self, table: list[int], num_tokens: int, num_cached_blocks: int = 0) -> None:
        self.table = table  # physical block ids in logical order; len == blocks_for(num_tokens)
        self.num_tokens = num_tokens  # token slots reserved (written, or to be written this step)
        # Prefix caching: the first num_cached_blocks blocks of `table` are prefix-cache blocks.
        self.num_cached_blocks = num_cached_blocks

    def copy(self) -> "SeqBlocks":
        return SeqBlocks(list(self.table), self.num_tokens, self.num_cached_blocks)


class PagedAllocator:
    """Ref-counted block tables over a free list that hands out the lowest id first.

    Bookkeeping only: block ids, ref counts and per-block fill. The runner performs the
    block copies `take_block_copies` hands out before the step that needs them.
    """

    free_list_type: Any = FreeBlocks  # popleft() takes the next block, append() returns one

    def __init__(self, options: Any, context: AllocatorContext) -> None:
        self.block_size = context.block_size
        self.num_blocks = context.num_blocks
        self._free_blocks = self.free_list_type(range(context.num_blocks))
        self._seqs: dict[str, SeqBlocks] = {}
        self._ref_counts = [0] * context.num_blocks
        # Slots of each block holding a token: the high-water mark of writes since the
        # block left the free list, lowered only by a rollback of its only holder.
        self._filled = [0] * context.num_blocks
        self._num_used_blocks = 0  # blocks with ref count > 0
        self._num_slots_used = 0  # sum of _filled over used blocks
        self._copies: list[tuple[int, int]] = []

    # ------------------------------------------------------------ KVAllocator

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        seq = self._seqs.get(seq_id)
        start = seq.num_tokens if seq is not None else 0
        if num_tokens <= start:
            return True
        block_size = self.block_size
        if seq is not None and start % block_size and num_tokens <= len(seq.table) * block_size:
            # The common decode step: the writes land in the partly filled last block.
            last = seq.table[-1]
            if not self._is_shared(last):
                count = num_tokens - (len(seq.table) - 1) * block_size
                if count > self._filled[last]:
                    self._num_slots_used += count - self._filled[last]
                    self._filled[last] = count
                seq.num_tokens = num_tokens
                return True
        table = seq.table if seq is not None else []
        num_new = blocks_for(num_tokens, block_size) - len(table)
        # The first write lands in the last block when it is partly filled; copy it first
        # if anyone else can read it.
        copy_index = start // block_size if start % block_size and self._is_shared(table[-1]) else None
        needed = num_new + (copy_index is not None)
        if needed > self._num_available():
            return False
        if seq is None:
            seq = self._seqs[seq_id] = SeqBlocks(table, 0)
        fresh = self._take_blocks(needed)
        if copy_index is not None:
            self._copy_on_write(seq, copy_index, fresh.pop(0))
        for block in fresh:
            self._hold(block)
            table.append(block)
        self._fill(table, start, num_tokens)
        seq.num_tokens = num_tokens
        return True

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            for block in seq.table:
                self._release(block)

    def block_table(self, seq_id: str) -> list[int]:
        seq = self._seqs.get(seq_id)
        return seq.table if seq is not None else []

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            num_blocks=self.num_blocks,
            num_used_blocks=self._num_used_blocks,
            num_free_blocks=len(self._free_blocks),
            num_cached_blocks=self.num_blocks - self._num_used_blocks - len(self._free_blocks),
            num_token_slots_used=self._num_slots_used,
            num_token_slots_reserved_empty=self._num_used_blocks * self.block_size - self._num_slots_used,
            block_size=self.block_size,
        )

    # ------------------------------------------------------------ ForkingAllocator

    def fork(self, parent_id: str, child_id: str) -> bool:
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into {child_id!r}: it already holds KV blocks")
        parent = self._seqs.get(parent_id)
        if parent is not None:
            for block in parent.table:
                self._hold(block)
            self._seqs[child_id] = parent.copy()
        return True

    def rollback(self, seq_id: str, num_slots: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None or num_slots <= 0:
            return
        num_tokens = max(0, seq.num_tokens - num_slots)
        keep = blocks_for(num_tokens, self.block_size)
        for block in seq.table[keep:]:
            self._release(block)
        del seq.table[keep:]
        seq.num_tokens = num_tokens
        seq.num_cached_blocks = min(seq.num_cached_blocks, num_tokens // self.block_size)
        last = seq.table[-1] if seq.table else None
        if last is not None and num_tokens % self.block_size and not self._is_shared(last):
            self._num_slots_used -= self._filled[last] - num_tokens % self.block_size
            self._filled[last] = num_tokens % self.block_size

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ------------------------------------------------------------ internals (the kit's prefix cache extends some)

    def _is_shared(self, block: int) -> bool:
        """Could a sequence other than the writer read this block?"""
        return self._ref_counts[block] > 1

    def _num_available(self) -> int:
        return len(self._free_blocks)

    def _take_blocks(self, count: int) -> list[int]:
        free = self._free_blocks
        return [free.popleft() for _ in range(count)]

    def _unheld(self, block: int) -> None:
        """The last holder let go of `block`."""
        self._filled[block] = 0
        self._free_blocks.append(block)

    def _held(self, block: int) -> None:
        """`block` got its first holder."""

    def _hold(self, block: int) -> None:
        ref = self._ref_counts[block]
        self._ref_counts[block] = ref + 1
        if ref == 0:
            self._num_used_blocks += 1
            self._num_slots_used += self._filled[block]
            self._held(block)

    def _release(self, block: int) -> None:
        ref = self._ref_counts[block] - 1
        self._ref_counts[block] = ref
        if ref == 0:
            self._num_used_blocks -= 1
            self._num_slots_used -= self._filled[block]
            self._unheld(block)

    def _copy_on_write(self, seq: SeqBlocks, index: int, fresh: int) -> None:
        shared = seq.table[index]
        self._hold(fresh)
        count = seq.num_tokens - index * self.block_size  # this sequence's tokens in the block
        self._filled[fresh] = count
        self._num_slots_used += count
        seq.table[index] = fresh
        self._copies.append((shared, fresh))
        self._release(shared)

    def _fill(self, table: list[int], start: int, end: int) -> None:
        """Record writes to slots [start, end) of a sequence."""
        block_size = self.block_size
        filled = self._filled
        for index in range(start // block_size, blocks_for(end, block_size)):
            block = table[index]
            count = min(block_size, end - index * block_size)
            if count > filled[block]:
                self._num_slots_used += count - filled[block]
                filled[block] = count
