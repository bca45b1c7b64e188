"""Copies between the device KV cache and the host tier (servelab.tier_copy): a swap round
trip and prefix blocks offloaded and loaded back through the HostTier's own moves return
exactly the K/V written, on the CPU and (where there is one) on a CUDA device, where the
copies run on a side stream into pinned memory.

What needs what: the CPU cases and the run splitting need nothing; the CUDA cases need a
CUDA device (skipped with the reason otherwise; examples/gpu_check.sh runs them).
"""

from __future__ import annotations

import pytest
import torch

from servelab.kit import HostTier
from servelab.runner import host_kv_caches
from servelab.tier_copy import CudaTierCopier, host_runs, perform_moves, tier_copier

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False): the host tier's CUDA copies need one"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]
LAYERS, KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM, HOST_BLOCKS = 3, 2, 24, 4, 8, 10


def _caches(device: str, dtype: torch.dtype, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V, [kv_heads, blocks, block_size, head_dim], of noise (every
    element distinct, so a block in the wrong place shows)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, BLOCKS, BLOCK_SIZE, HEAD_DIM)
    if dtype.itemsize == 1:  # a quantized cache's bytes (uint8, int8, float8)
        make = lambda: torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).view(dtype)
    else:
        make = lambda: torch.randn(shape, generator=generator).to(dtype)
    return [(make().to(device), make().to(device)) for _ in range(LAYERS)]


def _blocks(caches, blocks: list[int]) -> list[torch.Tensor]:
    index = torch.tensor(blocks, device=caches[0][0].device)
    return [cache.index_select(1, index).cpu().view(torch.uint8) if cache.element_size() == 1
            else cache.index_select(1, index).cpu() for pair in caches for cache in pair]


def _scribble(caches, blocks: list[int]) -> None:
    """The device blocks reused right after their offload (as a forward would, on the
    current stream): an offload must have gathered them first."""
    for pair in caches:
        for cache in pair:
            if cache.element_size() == 1:
                cache.view(torch.uint8)[:, blocks] = 7
            else:
                cache[:, blocks] = cache[:, blocks].flip(-1) + 1


def _copier(caches, device: str):
    copier = tier_copier(caches, 1, HOST_BLOCKS, None, torch.device(device), host_kv_caches)
    if device == "cuda":
        assert isinstance(copier, CudaTierCopier) and copier.asynchronous
        assert copier.stream != torch.cuda.current_stream()  # the moves do not run on the compute stream
        assert all(host.is_pinned() for pair in copier.host_caches for host in pair)
    return copier


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def test_host_runs_are_consecutive_blocks_at_consecutive_positions():
    assert host_runs([4, 5, 6, 0, 1, 9, 3, 4]) == [(0, 4, 3), (3, 0, 2), (5, 9, 1), (6, 3, 2)]
    assert host_runs([2, 1, 0]) == [(0, 2, 1), (1, 1, 1), (2, 0, 1)]
    assert host_runs([]) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.int8, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_swap_round_trip_returns_the_kv_written(device, dtype):
    caches = _caches(device, dtype)
    tier = HostTier(HOST_BLOCKS, BLOCK_SIZE)
    copier = _copier(caches, device)
    seq_blocks = [3, 7, 8, 15, 2]
    written = _blocks(caches, seq_blocks)
    assert tier.swap_out("seq", seq_blocks)
    moves = tier.take_moves()
    perform_moves(copier, caches, 1, moves)
    _scribble(caches, seq_blocks)
    slots = [move.destination for move in moves]
    host = [copier.host_blocks(layer, which, slots) for layer in range(LAYERS) for which in (0, 1)]
    assert all(torch.equal(h.view(torch.uint8), w.view(torch.uint8)) for h, w in zip(host, written))
    back = [20, 0, 11, 12, 5]
    tier.swap_in("seq", back)
    perform_moves(copier, caches, 1, tier.take_moves())
    _synchronize(device)
    got = _blocks(caches, back)
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, written))


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_blocks_offloaded_and_loaded_return_the_kv_written(device):
    """Prefix blocks evicted to the host in one step, the device blocks reused at once, and
    brought back in a later step, one of them into a host block that was just loaded
    from and offloaded to again within the same step (the tier's reuse order)."""
    caches = _caches(device, torch.bfloat16, seed=1)
    tier = HostTier(3, BLOCK_SIZE)
    copier = _copier(caches, device)
    evicted = {101: 4, 102: 9, 103: 17}  # chained hash -> device block
    written = {key: _blocks(caches, [block]) for key, block in evicted.items()}
    for depth, (key, block) in enumerate(evicted.items()):
        assert tier.offload(key, 0, (key,), depth, block)
    perform_moves(copier, caches, 1, tier.take_moves())
    _scribble(caches, list(evicted.values()))
    # next step: 101 comes back into device block 1, its host block is free for 104 at once
    assert tier.lookup(101, 0, (101,))
    tier.load(101, 1)
    written[104] = _blocks(caches, [20])
    assert tier.offload(104, 0, (104,), 3, 20)
    moves = tier.take_moves()
    assert [m.kind for m in moves] == ["load", "offload"] and moves[0].source == moves[1].destination
    perform_moves(copier, caches, 1, moves)
    _scribble(caches, [20])
    # and the rest come back
    for key, block in ((102, 6), (103, 22), (104, 13)):
        assert tier.lookup(key, 0, (key,))
        tier.load(key, block)
    perform_moves(copier, caches, 1, tier.take_moves())
    _synchronize(device)
    for key, block in ((101, 1), (102, 6), (103, 22), (104, 13)):
        assert all(torch.equal(g, w) for g, w in zip(_blocks(caches, [block]), written[key])), key


def test_a_host_block_written_behind_the_tier_s_back_is_refused_not_loaded():
    """A hit is not trusted on the bookkeeping alone: a host block whose bytes changed after
    its offload (another engine on the same memory or file) fails the load by name."""
    from servelab.tier_copy import HostTierCorrupted

    caches = _caches("cpu", torch.float8_e4m3fn)
    tier = HostTier(HOST_BLOCKS, BLOCK_SIZE)
    copier = _copier(caches, "cpu")
    assert tier.swap_out("seq", [3, 7])
    moves = tier.take_moves()
    perform_moves(copier, caches, 1, moves)
    intruded = moves[1].destination
    copier.host_caches[1][0].view(torch.uint8)[:, intruded, 0, 0] ^= 0xFF  # one byte of layer 1's K, per head
    tier.swap_in("seq", [0, 1])
    with pytest.raises(HostTierCorrupted, match=rf"host tier block {intruded} no longer holds the KV offloaded"):
        perform_moves(copier, caches, 1, tier.take_moves())
