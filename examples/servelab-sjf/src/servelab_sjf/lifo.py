"""A paged allocator handing out the most recently freed block first (LIFO), so a new
sequence lands in memory that was just in use: the kit's block pool, another free list."""

from servelab.kit import PagedAllocator


class BlockStack(list):
    def __init__(self, blocks):  # a fresh pool hands out block 0 first
        super().__init__(reversed(blocks))

    popleft = list.pop  # the top of the stack: the block freed last


class LIFOPagedAllocator(PagedAllocator):
    free_list_type = BlockStack
