"""Reference paged attention in torch: the ground truth every other backend matches.

New K/V are scattered into the cache through the slot mapping; attention gathers each
sequence's K/V block by block through its block table. Decode rows (one query token)
and multi-token rows (prompts, chunks, drafts) are batched separately so one long
prompt does not pad every decode to its length. No per-token Python loops.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from servelab.interfaces import AttentionContext, AttentionMetadata


@attrs.frozen
class _Group:
    """Sequences of one step attended together, padded to a common shape."""

    seq_index: torch.Tensor  # [G] rows of the step's block_tables in this group
    query_index: torch.Tensor  # [G, Q] row of the flattened batch per query (0 where padded)
    query_valid: torch.Tensor  # [G, Q] bool
    mask: torch.Tensor  # [G, 1, Q, C] bool: key j visible to query i
    block_tables: torch.Tensor  # [G, C // block_size]


@attrs.frozen
class _Prepared:
    slot_mapping: torch.Tensor
    groups: tuple[_Group, ...]
    num_tokens: int


class TorchPagedAttention:
    def __init__(self, options: Any, context: AttentionContext) -> None:
        self.context = context
        self.block_size = context.block_size

    def prepare(self, metadata: AttentionMetadata) -> _Prepared:
        query_lens = metadata.query_lens
        is_decode = query_lens == 1
        groups = []
        for selector in (is_decode, ~is_decode):
            seq_index = selector.nonzero().flatten()
            if seq_index.numel():
                groups.append(self._group(metadata, seq_index))
        return _Prepared(metadata.slot_mapping, tuple(groups), int(metadata.query_start_loc[-1]))

    def _group(self, metadata: AttentionMetadata, seq_index: torch.Tensor) -> _Group:
        device = metadata.query_lens.device
        query_lens = metadata.query_lens[seq_index]
        context_lens = metadata.context_lens[seq_index]
        max_query = int(query_lens.max())
        num_ctx_blocks = -(-int(context_lens.max()) // self.block_size)
        block_tables = metadata.block_tables[seq_index, :num_ctx_blocks]
        query_pos = torch.arange(max_query, device=device)
        key_pos = torch.arange(num_ctx_blocks * self.block_size, device=device)
        query_valid = query_pos[None, :] < query_lens[:, None]
        query_index = torch.where(query_valid, metadata.query_start_loc[seq_index, None] + query_pos, 0)
        # Query i of a sequence sits at absolute position context_len - query_len + i.
        absolute = (context_lens - query_lens)[:, None] + query_pos[None, :]
        mask = (key_pos[None, None, :] <= absolute[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
        return _Group(seq_index, query_index, query_valid, mask[:, None], block_tables)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, prepared: _Prepared,
                scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, prepared.slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, prepared.slot_mapping, value)
        output = torch.empty_like(query)
        for group in prepared.groups:
            output[group.query_index[group.query_valid]] = self._attend(
                query, key_cache, value_cache, group, scale)
        return output

    def _attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                group: _Group, scale: float) -> torch.Tensor:
        num_seqs, max_query = group.query_index.shape
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = key_cache.shape[2]
        group_size = num_heads // num_kv_heads
        # [G, M, block, kvh, d] -> [G, kvh, C, d]
        keys = key_cache[group.block_tables].flatten(1, 2).permute(0, 2, 1, 3)
        values = value_cache[group.block_tables].flatten(1, 2).permute(0, 2, 1, 3)
        # [G, Q, h, d] -> [G, kvh, group_size * Q, d]: the query heads sharing one KV head
        q = query[group.query_index].view(num_seqs, max_query, num_kv_heads, group_size, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group_size * max_query, head_dim)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [G, kvh, g*Q, C]
        scores = scores.view(num_seqs, num_kv_heads, group_size, max_query, -1)
        scores = scores.masked_fill(~group.mask[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype).flatten(2, 3)
        out = torch.matmul(probs, values)  # [G, kvh, g*Q, d]
        out = out.view(num_seqs, num_kv_heads, group_size, max_query, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(num_seqs, max_query, num_heads, head_dim)[group.query_valid]
