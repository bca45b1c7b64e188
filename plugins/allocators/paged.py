"""The paged allocator (PagedAttention): a sequence's KV lives in fixed-size blocks
taken from a free list on demand, so waste is bounded by block_size - 1 slots."""

from __future__ import annotations

from collections import deque
from typing import Any

from servelab.interfaces import AllocatorContext, AllocatorStats


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` slots (8 tokens at block size 4 -> 2; 9 -> 3)."""
    return -(-num_tokens // block_size)


class PagedAllocator:
    """Block tables over a FIFO free list; blocks freed go to the back of the list."""

    def __init__(self, options: Any, context: AllocatorContext) -> None:
        self.block_size = context.block_size
        self.num_blocks = context.num_blocks
        self._free_blocks: deque[int] = deque(range(context.num_blocks))
        self._block_tables: dict[str, list[int]] = {}
        self._num_tokens: dict[str, int] = {}

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        table = self._block_tables.get(seq_id, [])
        num_new_blocks = blocks_for(num_tokens, self.block_size) - len(table)
        if num_new_blocks > len(self._free_blocks):
            return False
        table.extend(self._free_blocks.popleft() for _ in range(num_new_blocks))
        self._block_tables[seq_id] = table
        self._num_tokens[seq_id] = max(num_tokens, self._num_tokens.get(seq_id, 0))
        return True

    def free(self, seq_id: str) -> None:
        self._free_blocks.extend(self._block_tables.pop(seq_id, ()))
        self._num_tokens.pop(seq_id, None)

    def block_table(self, seq_id: str) -> list[int]:
        return self._block_tables.get(seq_id, [])

    def stats(self) -> AllocatorStats:
        num_used = self.num_blocks - len(self._free_blocks)
        slots_used = sum(self._num_tokens.values())
        return AllocatorStats(
            num_blocks=self.num_blocks,
            num_used_blocks=num_used,
            num_free_blocks=len(self._free_blocks),
            num_token_slots_used=slots_used,
            num_token_slots_reserved_empty=num_used * self.block_size - slots_used,
        )
