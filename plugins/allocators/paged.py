"""The paged allocator: the kit's block pool as it is (`servelab.kit.PagedAllocator`)."""

from servelab.kit import FreeBlocks, PagedAllocator, SeqBlocks, blocks_for

__all__ = ["FreeBlocks", "PagedAllocator", "SeqBlocks", "blocks_for"]
