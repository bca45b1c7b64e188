"""Attention for allocators whose block tables are contiguous: each sequence's K/V is read
as a view of the cache (no gather copy) and attended by torch's scaled_dot_product_attention.

The `naive` allocator reserves one contiguous, block-aligned run per sequence, so the
blocks of a sequence's table are consecutive: with the cache laid out [kv_heads,
num_blocks, block_size, head_dim], cache[:, first:first + n] viewed as [kv_heads,
n * block_size, head_dim] is that sequence's keys. One attention call per sequence:
decode queries fold the query heads that share a KV head into its rows, multi-token
queries use `enable_gqa` and `is_causal` (whole prompts) or a lower-right causal mask
(chunks on top of a cache).

The backend declares `requires_contiguous_block_tables`; the engine refuses, at start,
an allocator that does not declare `contiguous_block_tables` (paged, radix). `prepare`
checks each step's tables as well, so a policy that breaks its promise fails loudly
instead of reading another sequence's K/V.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from servelab.interfaces import AttentionContext, AttentionMetadata


@attrs.frozen
class _Seq:
    first_slot: int  # slot (first block * block_size) where the sequence's run starts
    query_start: int
    query_len: int
    context_len: int
    mask: torch.Tensor | None  # [1, 1, Q, C] bool visible keys, for a chunk on top of a cache


@attrs.frozen
class _Prepared:
    slot_mapping: torch.Tensor  # [T]
    seqs: tuple[_Seq, ...]


class SdpaContiguousAttention:
    """Reads each sequence's contiguous K/V run as a view; refuses non-contiguous tables."""

    requires_contiguous_block_tables = True

    def __init__(self, options: Any, context: AttentionContext) -> None:
        self.options = options
        self.context = context
        self.block_size = context.block_size

    def kv_cache_shape(self) -> tuple[int, ...]:
        context = self.context
        return (context.num_kv_heads, context.num_blocks, context.block_size, context.head_dim)

    def kv_cache_block_dim(self) -> int:
        return 1

    def prepare(self, metadata: AttentionMetadata) -> _Prepared:
        block_size = self.block_size
        tables = metadata.block_tables.cpu()
        num_blocks = (metadata.context_lens.cpu() + block_size - 1) // block_size
        position = torch.arange(tables.shape[1])
        broken = ((tables != tables[:, :1] + position) & (position < num_blocks[:, None])).any(dim=1)
        if bool(broken.any()):
            row = int(broken.nonzero()[0])
            raise ValueError(
                f"attention 'sdpa-contiguous' needs contiguous block tables, but sequence {row} of this step has "
                f"{tables[row, :int(num_blocks[row])].tolist()}: use allocator 'naive', or attention 'torch-paged'")
        device = metadata.query_lens.device
        seqs = []
        start = 0
        for first, query_len, context_len in zip(tables[:, 0].tolist(), metadata.query_lens_list,
                                                 metadata.context_lens_list):
            mask = None
            if 1 < query_len < context_len:  # a chunk on top of a cache: query i sees keys <= offset + i
                mask = torch.ones(query_len, context_len, dtype=torch.bool, device=device).tril(
                    context_len - query_len)[None, None]
            seqs.append(_Seq(first * block_size, start, query_len, context_len, mask))
            start += query_len
        return _Prepared(metadata.slot_mapping, tuple(seqs))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, prepared: _Prepared,
                scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
        num_heads = query.shape[1]
        keys_flat = key_cache.view(num_kv_heads, -1, head_dim)  # [kvh, slots, d]: a run is a slice
        values_flat = value_cache.view(num_kv_heads, -1, head_dim)
        keys_flat.index_copy_(1, prepared.slot_mapping, key.transpose(0, 1))
        values_flat.index_copy_(1, prepared.slot_mapping, value.transpose(0, 1))
        gqa = num_heads != num_kv_heads
        outputs = []
        for seq in prepared.seqs:
            keys = keys_flat[None, :, seq.first_slot:seq.first_slot + seq.context_len]  # [1, kvh, C, d]
            values = values_flat[None, :, seq.first_slot:seq.first_slot + seq.context_len]
            q = query[seq.query_start:seq.query_start + seq.query_len]  # [Q, h, d]
            if seq.query_len == 1:  # the query heads of a KV head are its rows: [1, kvh, g, d]
                out = F.scaled_dot_product_attention(q.view(1, num_kv_heads, -1, head_dim), keys, values,
                                                     scale=scale)
                outputs.append(out.view(1, num_heads, head_dim))
            else:
                out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=seq.mask,
                                                     is_causal=seq.mask is None, scale=scale, enable_gqa=gqa)
                outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0].contiguous()
