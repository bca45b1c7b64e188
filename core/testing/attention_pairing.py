"""Which allocators an attention backend can be paired with."""

from __future__ import annotations

from typing import Any

from servelab.interfaces import ContiguousBlockTablesBackend


def needs_contiguous_tables(backend: Any) -> bool:
    """The backend reads each sequence's K/V as one contiguous run of blocks."""
    return isinstance(backend, ContiguousBlockTablesBackend) and bool(backend.requires_contiguous_block_tables)
