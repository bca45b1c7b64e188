"""The torch-paged backend against a dense attention written out per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from servelab.interfaces import AttentionContext, AttentionMetadata
from servelab.plugins.kernels.options import TorchPagedOptions
from servelab.plugins.kernels.torch_paged import TorchPagedAttention


def dense_reference(q, k, v, query_len, scale):
    """Causal attention of the last `query_len` positions over k/v [C, kvh, d], GQA by repetition."""
    context_len, num_kv_heads, _ = k.shape
    group = q.shape[1] // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i in range(query_len):
        pos = context_len - query_len + i
        scores = torch.einsum("hd,chd->hc", q[i], k[: pos + 1]) * scale
        out[i] = torch.einsum("hc,chd->hd", torch.softmax(scores, dim=-1), v[: pos + 1])
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group_size", [1, 3, 16])
def test_mixed_batch_matches_dense_attention(num_heads, num_kv_heads, block_size, group_size):
    torch.manual_seed(num_heads * 100 + block_size)
    head_dim = 16
    # (tokens already cached, new tokens): decodes, a prefill, a chunk on top of a cache.
    shapes = [(0, 7), (12, 1), (5, 1), (33, 5), (0, 1), (40, 1), (17, 9)]
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in shapes) + 3
    context = AttentionContext(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               block_size=block_size, num_blocks=num_blocks, dtype=torch.float32,
                               device=torch.device("cpu"))
    backend = TorchPagedAttention(TorchPagedOptions(decode_group_size=group_size, prefill_group_size=group_size),
                                  context)
    key_cache = torch.zeros(backend.kv_cache_shape())
    value_cache = torch.zeros(backend.kv_cache_shape())
    physical = torch.randperm(num_blocks).tolist()  # block tables in shuffled physical order
    tables, full_k, full_v, slots = [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [physical.pop() for _ in range(math.ceil(total / block_size))]
        tables.append(table)
        k = torch.randn(total, num_kv_heads, head_dim)
        v = torch.randn(total, num_kv_heads, head_dim)
        full_k.append(k)
        full_v.append(v)
        for pos in range(total):  # the cached prefix is written up front, as earlier steps would have
            if pos < cached:
                key_cache[:, table[pos // block_size], pos % block_size] = k[pos]
                value_cache[:, table[pos // block_size], pos % block_size] = v[pos]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
    query_lens = [n for _, n in shapes]
    query = torch.randn(sum(query_lens), num_heads, head_dim)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist())),
        query_lens=torch.tensor(query_lens),
        context_lens=torch.tensor([c + n for c, n in shapes]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        max_query_len=max(query_lens),
        max_context_len=max(c + n for c, n in shapes),
        query_lens_list=tuple(query_lens),
        context_lens_list=tuple(c + n for c, n in shapes),
    )
    scale = head_dim**-0.5
    out = backend.forward(query, new_k, new_v, key_cache, value_cache, backend.prepare(metadata), scale)
    start = 0
    for (cached, new), k, v in zip(shapes, full_k, full_v):
        expected = dense_reference(query[start : start + new], k, v, new, scale)
        torch.testing.assert_close(out[start : start + new], expected, rtol=1e-5, atol=1e-5)
        start += new
