"""Handing memory that loading freed back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Return freed heap pages to the OS. Loading frees many mid-sized temporaries (a
    checkpoint tensor, its fused concatenation, a weight's unpacked copy) that glibc keeps in
    its heap rather than unmapping, where they would count against the process's resident
    memory for its whole life."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
