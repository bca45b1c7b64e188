"""KV caches on huge pages: an ordinary zeroed tensor to every reader, 2 MiB-aligned on Linux
so the OS can back it with huge pages."""

from __future__ import annotations

import sys

import pytest
import torch

from servelab.model.memory import HUGE_PAGE, zeros_on_huge_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(4, 300, 16, 64), (2, 3)], ids=["cache", "tiny"])
def test_a_zeroed_tensor_of_the_shape_and_dtype_asked_for(shape, dtype):
    tensor = zeros_on_huge_pages(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.any()
    tensor.view(-1)[-1] = 1  # writable to its last element
    assert tensor.sum().item() == 1 and tensor.untyped_storage().nbytes() >= tensor.nbytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked for on Linux only")
def test_a_cache_starts_on_a_huge_page_boundary():
    tensor = zeros_on_huge_pages((4, 300, 16, 64), torch.float32)
    assert tensor.nbytes >= HUGE_PAGE and tensor.data_ptr() % HUGE_PAGE == 0


def test_the_engine_keeps_its_cpu_kv_caches_there():
    from servelab import LLM

    llm = LLM("builtin:tiny", max_model_len=128, num_kv_blocks=256)
    caches = [cache for pair in llm.engine.runner.kv_caches for cache in pair]
    assert len({cache.data_ptr() for cache in caches}) == len(caches)
    if sys.platform.startswith("linux") and caches[0].nbytes >= HUGE_PAGE:
        assert all(cache.data_ptr() % HUGE_PAGE == 0 for cache in caches)


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool is mapped lazily on Linux only")
def test_a_large_pool_is_resident_only_where_written():
    before = _resident_bytes()
    tensor = zeros_on_huge_pages((64, 2**20), torch.float32)  # 256 MiB
    assert _resident_bytes() - before < 64 * 2**20
    assert not tensor[::8].any()  # reading the zero pages maps no memory of its own
    tensor[0].fill_(1.0)  # 4 MiB written
    assert _resident_bytes() - before < 64 * 2**20 and tensor.sum().item() == 2**20
