"""Reference paged attention in torch: the ground truth every other backend matches.

New K/V are scattered into the cache through the slot mapping; attention gathers each
sequence's K/V block by block through its block table. Decode rows (one query token)
and multi-token rows (prompts, chunks, drafts) are batched separately so one long
prompt does not pad every decode to its length. No per-token Python loops.

Cache layout: [num_kv_heads, num_blocks, block_size, head_dim]. Gathering a group's
blocks then yields [kv_heads, seqs, context, head_dim] directly, the layout batched
matmul wants, with no transpose copy of the gathered K/V.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from servelab.interfaces import AttentionContext, AttentionMetadata


@attrs.frozen
class _Group:
    """Sequences of one step attended together, padded to a common shape."""

    query_index: torch.Tensor  # [G, Q] row of the flattened batch per query (0 where padded)
    query_valid: torch.Tensor  # [G, Q] bool
    output_rows: torch.Tensor  # [num valid queries] rows of the flattened batch, in (G, Q) order
    hidden: torch.Tensor  # [1, G, 1, Q, C] bool: key j hidden from query i
    block_tables: torch.Tensor  # [G, C // block_size]


@attrs.frozen
class _Prepared:
    slot_mapping: torch.Tensor  # [T]
    groups: tuple[_Group, ...]


class TorchPagedAttention:
    def __init__(self, options: Any, context: AttentionContext) -> None:
        self.context = context
        self.block_size = context.block_size

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.context.num_kv_heads, num_blocks, self.block_size, self.context.head_dim)

    def prepare(self, metadata: AttentionMetadata) -> _Prepared:
        is_decode = metadata.query_lens == 1
        groups = []
        for selector in (is_decode, ~is_decode):
            seq_index = selector.nonzero().flatten()
            if seq_index.numel():
                groups.append(self._group(metadata, seq_index))
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
        return _Group(query_index, query_valid, query_index[query_valid], ~visible[None, :, None],
                      metadata.block_tables[seq_index, :num_ctx_blocks])

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, prepared: _Prepared,
                scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
        key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, prepared.slot_mapping, key.transpose(0, 1))
        value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, prepared.slot_mapping, value.transpose(0, 1))
        if len(prepared.groups) == 1 and prepared.groups[0].query_index.shape[1] == 1:
            return self._attend(query, key_cache, value_cache, prepared.groups[0], scale)  # decode only
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
        keys = key_cache[:, group.block_tables].view(num_kv_heads, num_seqs, -1, head_dim)  # [kvh, G, C, d]
        values = value_cache[:, group.block_tables].view(num_kv_heads, num_seqs, -1, head_dim)
        # Queries sharing a KV head are stacked: [G, Q, h, d] -> [kvh, G, g * Q, d].
        q = query[group.query_index].view(num_seqs, max_query, num_kv_heads, group_size, head_dim)
        q = q.permute(2, 0, 3, 1, 4).reshape(num_kv_heads, num_seqs, group_size * max_query, head_dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale)  # [kvh, G, g*Q, C]
        scores = scores.view(num_kv_heads, num_seqs, group_size, max_query, -1).masked_fill_(group.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(num_kv_heads, num_seqs, group_size * max_query, -1)
        out = torch.matmul(probs, values).view(num_kv_heads, num_seqs, group_size, max_query, head_dim)
        out = out.permute(1, 3, 0, 2, 4).reshape(num_seqs, max_query, num_heads, head_dim)
        return out[group.query_valid]
