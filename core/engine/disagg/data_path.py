"""A runner's paged KV pool as block bytes, out and in (the KV-transfer data path).

A block's bytes are every layer's K then V block, each in the cache's own dimension
order, read through a byte view: bf16/fp32 caches and one-byte caches (int8, FP8, whose
scales sit inline at the end of each (token, KV head) row) move alike, bit for bit.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

import torch

from servelab.interfaces import KVLayout
from servelab.tier_copy import copyable


class RunnerDataPath:
    """`KVDataPath` over a runner's `kv_caches` (a list of (K, V) per layer)."""

    def __init__(self, runner: Any, kv_cache_dtype: str, block_size: int) -> None:
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = runner.kv_caches
        self.block_dim: int = runner.block_dim
        key = self.kv_caches[0][0]
        shape = list(key.shape)
        del shape[self.block_dim]
        self._layout = KVLayout(
            block_size=block_size, kv_cache_dtype=kv_cache_dtype, storage_dtype=str(key.dtype),
            scales="none" if kv_cache_dtype == "auto" else "inline-row", layer_range=(0, len(self.kv_caches)),
            block_shape=tuple(shape), tp_rank_map=((0, _kv_heads(shape)),))
        self._piece_bytes = [copyable(cache).select(self.block_dim, 0).numel() * copyable(cache).element_size()
                             for pair in self.kv_caches for cache in pair]

    def layout(self) -> KVLayout:
        return self._layout

    def save(self, blocks: Seq[int]) -> list[bytes]:
        if not blocks:
            return []
        dim = self.block_dim
        index = torch.tensor(list(blocks), dtype=torch.int64)
        pieces = []
        for pair in self.kv_caches:
            for cache in pair:
                raw = copyable(cache).index_select(dim, index.to(cache.device)).movedim(dim, 0).contiguous().cpu()
                pieces.append(raw.view(torch.uint8).reshape(len(blocks), -1))
        rows = torch.cat(pieces, dim=1).numpy()
        return [row.tobytes() for row in rows]

    def load(self, blocks: Seq[int], data: Seq[bytes]) -> None:
        if not blocks:
            return
        expected = sum(self._piece_bytes)
        for block, payload in zip(blocks, data):
            if len(payload) != expected:
                raise ValueError(f"block {block}: {len(payload)} bytes, a block of this pool is {expected}")
        dim = self.block_dim
        rows = torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8).reshape(len(blocks), expected)
        index = torch.tensor(list(blocks), dtype=torch.int64)
        start = 0
        pieces = iter(self._piece_bytes)
        for pair in self.kv_caches:
            for cache in pair:
                size = next(pieces)
                raw = copyable(cache)
                block_shape = list(raw.shape)
                del block_shape[dim]
                values = rows[:, start:start + size].contiguous().view(raw.dtype).reshape(len(blocks), *block_shape)
                raw.index_copy_(dim, index.to(cache.device), values.movedim(0, dim).to(cache.device))
                start += size


def _kv_heads(block_shape: list[int]) -> int:
    """The KV heads of a block of shape [heads, slots, row] or [slots, heads, row] (the larger
    leading extent is ambiguous; the map records the first dimension, which is the heads
    for every built-in backend)."""
    return block_shape[0]
