"""The process's memory: handing what loading freed back to the operating system, and
KV caches on huge pages."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.cache
def _madvise():
    """libc's madvise(address, length, advice), or None."""
    madvise = getattr(_libc(), "madvise", None)
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def release_freed_memory() -> None:
    """Return freed heap pages to the OS. Loading frees many mid-sized temporaries (a
    checkpoint tensor, its fused concatenation, a weight's unpacked copy) that glibc keeps in
    its heap rather than unmapping, where they would count against the process's resident
    memory for its whole life."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Return the heap's free pages to the OS (glibc's malloc_trim; nothing elsewhere)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory Linux may back with 2 MiB pages (transparent huge
    pages, asked for with madvise before the memory is first touched); elsewhere, or when
    the request is refused, an ordinary zeroed tensor. Decode attention reads K and V in
    4 KiB tiles scattered over the cache: with 4 KiB pages nearly every tile costs a TLB
    miss, with 2 MiB pages the whole cache fits the TLB.

    On Linux the memory is an anonymous mapping, which the kernel hands out zeroed on first
    touch: a large KV pool costs neither time at start nor resident memory for the blocks
    that never hold a token."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise() if sys.platform.startswith("linux") else None
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping for the tensor's life
    offset = -buffer.data_ptr() % HUGE_PAGE
    madvise(buffer.data_ptr() + offset, nbytes - nbytes % HUGE_PAGE, MADV_HUGEPAGE)  # refused: 4 KiB pages
    return buffer[offset:offset + nbytes].view(dtype).view(shape)
