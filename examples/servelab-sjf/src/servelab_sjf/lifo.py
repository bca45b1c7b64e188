"""A paged KV allocator whose free list is a stack: the most recently freed block is the
next one handed out (LIFO), so a new sequence lands in memory that was just in use and
is likely still in cache, where a FIFO list would walk the whole pool.

Bookkeeping only, as every servelab allocator: block tables, ref counts and queued
block copies; the runner owns the tensors. Blocks are ref-counted so `fork` shares
them, and the first write into a shared, partly filled block copies it first
(copy-on-write):

    parent  [4 | 9]    8 + 2 tokens, block size 8; the child shares both blocks
    child   [4 | 9]
    child appends a token: block 9 is shared and partly filled, so it is copied
    child   [4 | 3]    copy 9 -> 3 queued for the runner
"""

from __future__ import annotations

from typing import Any

from servelab.interfaces import AllocatorContext, AllocatorStats


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class LIFOPagedAllocator:
    """KVAllocator and ForkingAllocator over a LIFO stack of free blocks."""

    def __init__(self, options: Any, context: AllocatorContext) -> None:
        self.block_size = context.block_size
        self.num_blocks = context.num_blocks
        self._free = list(range(context.num_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self._tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}  # token slots reserved per sequence
        self._ref_counts = [0] * context.num_blocks
        self._copies: list[tuple[int, int]] = []

    # ------------------------------------------------------------ KVAllocator

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        table = self._tables.get(seq_id, [])
        have = self._num_tokens.get(seq_id, 0)
        if num_tokens <= have:
            return True
        num_new = blocks_for(num_tokens, self.block_size) - len(table)
        copy_last = have % self.block_size != 0 and self._ref_counts[table[-1]] > 1
        if num_new + copy_last > len(self._free):
            return False  # all or nothing
        if copy_last:  # the next write lands in a block someone else reads
            fresh = self._take()
            self._copies.append((table[-1], fresh))
            self._release(table[-1])
            table[-1] = fresh
        table.extend(self._take() for _ in range(num_new))
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = num_tokens
        return True

    def free(self, seq_id: str) -> None:
        for block in self._tables.pop(seq_id, []):
            self._release(block)
        self._num_tokens.pop(seq_id, None)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def stats(self) -> AllocatorStats:
        # A block holds as many tokens as its fullest holder has in it.
        filled: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            for index, block in enumerate(table):
                count = min(self.block_size, self._num_tokens[seq_id] - index * self.block_size)
                filled[block] = max(filled.get(block, 0), count)
        used = sum(1 for ref in self._ref_counts if ref)
        slots = sum(filled.values())
        return AllocatorStats(num_blocks=self.num_blocks, num_used_blocks=used, num_free_blocks=len(self._free),
                              num_token_slots_used=slots, num_token_slots_reserved_empty=used * self.block_size - slots,
                              block_size=self.block_size)

    # ------------------------------------------------------------ ForkingAllocator

    def fork(self, parent_id: str, child_id: str) -> bool:
        if child_id in self._tables:
            raise ValueError(f"cannot fork into {child_id!r}: it already holds KV blocks")
        if parent_id in self._tables:
            for block in self._tables[parent_id]:
                self._ref_counts[block] += 1
            self._tables[child_id] = list(self._tables[parent_id])
            self._num_tokens[child_id] = self._num_tokens[parent_id]
        return True  # sharing needs no free block

    def rollback(self, seq_id: str, num_slots: int) -> None:
        if seq_id not in self._tables or num_slots <= 0:
            return
        num_tokens = max(0, self._num_tokens[seq_id] - num_slots)
        keep = blocks_for(num_tokens, self.block_size)
        for block in self._tables[seq_id][keep:]:
            self._release(block)
        del self._tables[seq_id][keep:]
        self._num_tokens[seq_id] = num_tokens

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ------------------------------------------------------------ internals

    def _take(self) -> int:
        block = self._free.pop()
        self._ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)  # on top of the stack: the next one handed out
