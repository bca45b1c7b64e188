"""Reference paged attention in torch: the ground truth every other backend matches.

New K/V are scattered into the cache through the slot mapping; attention gathers each
sequence's K/V block by block through its block table. Sequences are attended in
groups: decode rows (one query token) apart from multi-token rows (prompts, chunks,
drafts), sorted by context length and cut into small groups, so that padding stays
small and a group's gathered K/V stays in the CPU's cache between the gather and the
two matmuls that read it. No per-token Python loops.

Cache layout: [num_kv_heads, num_blocks, block_size, head_dim]. Gathering a group's
blocks then yields [kv_heads, seqs, context, head_dim] directly, the layout batched
matmul wants, with no transpose copy of the gathered K/V.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from servelab.interfaces import AttentionContext, AttentionMetadata
from servelab.plugins.kernels.options import TorchPagedOptions


@attrs.frozen
class _Group:
    """Sequences of one step attended together, padded to a common shape."""

    query_index: torch.Tensor  # [G, Q] row of the flattened batch per query (0 where padded)
    query_valid: torch.Tensor  # [G, Q] bool
    output_rows: torch.Tensor  # [num valid queries] rows of the flattened batch, in (G, Q) order
    hidden: torch.Tensor  # [1, G, 1, Q, C] bool: key j hidden from query i
    # [kvh * G * M] rows of the cache viewed as [kvh * num_blocks, block_size * d]: for each
    # KV head, each sequence's M = C // block_size blocks, row after row.
    cache_rows: torch.Tensor


@attrs.frozen
class _Prepared:
    slot_mapping: torch.Tensor  # [T]
    groups: tuple[_Group, ...]


class TorchPagedAttention:
    def __init__(self, options: TorchPagedOptions | None, context: AttentionContext) -> None:
        self.options = options or TorchPagedOptions()
        self.context = context
        self.block_size = context.block_size

    def kv_cache_shape(self) -> tuple[int, ...]:
        context = self.context
        return (context.num_kv_heads, context.num_blocks, context.block_size, context.head_dim)

    def kv_cache_block_dim(self) -> int:
        return 1

    def prepare(self, metadata: AttentionMetadata) -> _Prepared:
        is_decode = metadata.query_lens == 1
        groups = []
        for selector, size in ((is_decode, self.options.decode_group_size),
                               (~is_decode, self.options.prefill_group_size)):
            seq_index = selector.nonzero().flatten()
            if not seq_index.numel():
                continue
            by_length = seq_index[torch.argsort(metadata.context_lens[seq_index], stable=True)]
            groups.extend(self._group(metadata, chunk) for chunk in by_length.split(size))
        return _Prepared(metadata.slot_mapping, tuple(groups))

    def _group(self, metadata: AttentionMetadata, seq_index: torch.Tensor) -> _Group:
        device = metadata.query_lens.device
        query_lens = metadata.query_lens[seq_index]
        context_lens = metadata.context_lens[seq_index]
        max_query = int(query_lens.max())
        num_ctx_blocks = -(-int(context_lens.max()) // self.block_size)
        query_pos = torch.arange(max_query, device=device)
        key_pos = torch.arange(num_ctx_blocks * self.block_size, device=device)
        query_valid = query_pos[None, :] < query_lens[:, None]
        query_index = torch.where(query_valid, metadata.query_start_loc[seq_index, None] + query_pos, 0)
        # Query i of a sequence sits at absolute position context_len - query_len + i.
        absolute = (context_lens - query_lens)[:, None] + query_pos[None, :]
        visible = (key_pos[None, None, :] <= absolute[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
        block_ids = metadata.block_tables[seq_index, :num_ctx_blocks].flatten()
        head_offsets = torch.arange(self.context.num_kv_heads, device=device) * self.context.num_blocks
        return _Group(query_index, query_valid, query_index[query_valid], ~visible[None, :, None],
                      (head_offsets[:, None] + block_ids[None, :]).flatten())

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, prepared: _Prepared,
                scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
        key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, prepared.slot_mapping, key.transpose(0, 1))
        value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, prepared.slot_mapping, value.transpose(0, 1))
        output = torch.empty_like(query)
        for group in prepared.groups:
            output[group.output_rows] = self._attend(query, key_cache, value_cache, group, scale)
        return output

    def _attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                group: _Group, scale: float) -> torch.Tensor:
        num_seqs, max_query = group.query_index.shape
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = key_cache.shape[0]
        group_size = num_heads // num_kv_heads
        # One index_select over dim 0 of a 2-D view copies whole (head, block) rows; on CPU it
        # runs ~3x faster than indexing dim 1 or advanced indexing. [kvh*G*M, block*d] -> [kvh, G, C, d]
        block_row = key_cache.shape[2] * head_dim
        keys = key_cache.view(-1, block_row).index_select(0, group.cache_rows).view(num_kv_heads, num_seqs, -1, head_dim)
        values = value_cache.view(-1, block_row).index_select(0, group.cache_rows).view(num_kv_heads, num_seqs, -1, head_dim)
        # Queries sharing a KV head are stacked: [G, Q, h, d] -> [kvh, G, g * Q, d].
        q = query[group.query_index].view(num_seqs, max_query, num_kv_heads, group_size, head_dim)
        q = q.permute(2, 0, 3, 1, 4).reshape(num_kv_heads, num_seqs, group_size * max_query, head_dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale)  # [kvh, G, g*Q, C]
        scores = scores.view(num_kv_heads, num_seqs, group_size, max_query, -1).masked_fill_(group.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(num_kv_heads, num_seqs, group_size * max_query, -1)
        out = torch.matmul(probs, values).view(num_kv_heads, num_seqs, group_size, max_query, head_dim)
        out = out.permute(1, 3, 0, 2, 4).reshape(num_seqs, max_query, num_heads, head_dim)
        return out[group.query_valid]
