"""The attention backends against dense attention and against each other, beyond the
contract's small shapes: GQA ratios 1-8, head and block sizes, ragged contexts over many
blocks, prompt chunks with a causal offset, float32 and bfloat16; torch-paged reads
shuffled block tables, sdpa-contiguous contiguous ones (servelab.testing's BatchCheck
gives each what it declares). Also: torch-paged's grouping, and the engine refusing
sdpa-contiguous with an allocator whose tables are not contiguous."""

from __future__ import annotations

import math

import pytest
import torch

from servelab import LLM
from servelab.errors import ConfigError
from servelab.interfaces import AttentionContext
from servelab.plugins.kernels.cpu_paged import CpuPagedAttention
from servelab.plugins.kernels.options import CpuPagedOptions, TorchPagedOptions
from servelab.plugins.kernels.sdpa_contiguous import SdpaContiguousAttention
from servelab.plugins.kernels.torch_paged import TorchPagedAttention, decode_groups, prefill_groups
from servelab.testing.attention_batch import TOLERANCE, BatchCheck, dense_reference, metadata_for

GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # ratios 1, 2, 4, 8
# (cached tokens, new tokens): whole prompts, decodes over contexts of 1-38 blocks (block
# size 16), chunks on top of a cache, equal decode contexts (the unmasked fast path).
SHAPES = [(0, 37), (130, 1), (255, 1), (64, 17), (0, 1), (600, 1), (16, 16), (500, 3), (130, 1), (0, 37)]
BACKENDS = {
    "torch-paged": lambda context: TorchPagedAttention(None, context),
    # every sequence in its own group: the unmasked slice path for every decode
    "torch-paged-singles": lambda context: TorchPagedAttention(
        TorchPagedOptions(decode_group_size=1, prefill_group_size=1), context),
    # everyone in one group: ragged decode masks, padded prompt groups
    "torch-paged-one-group": lambda context: TorchPagedAttention(TorchPagedOptions(
        decode_group_tokens=1 << 30, prefill_padding=1e9, prefill_group_area=1 << 40), context),
    "sdpa-contiguous": lambda context: SdpaContiguousAttention(None, context),
    # the C++ kernel for every row: prompts and chunks on its tiled path (causal limits per token)
    "cpu-paged": lambda context: CpuPagedAttention(CpuPagedOptions(build="wait"), context),
    # the C++ kernel for short rows, torch-paged's SDPA path for longer ones
    "cpu-paged-sdpa-prompts": lambda context: CpuPagedAttention(
        CpuPagedOptions(build="wait", max_kernel_query_len=16), context),
}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_dense_attention(backend, num_heads, num_kv_heads, dtype):
    for head_dim, block_size in ((64, 16), (32, 1), (128, 5)):
        BatchCheck(BACKENDS[backend], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=block_size, shapes=SHAPES, dtype=dtype, device="cpu", scale=head_dim ** -0.5,
                   seed=num_heads * 10 + num_kv_heads + head_dim).run()


def _fill(backend, contexts, tables, keys, values, block_size):
    """Write every sequence's K/V through backend.forward (one prefill per sequence)."""
    shape = backend.kv_cache_shape()
    key_cache = torch.zeros(shape, dtype=keys[0].dtype)
    value_cache = torch.zeros_like(key_cache)
    for table, context, k, v in zip(tables, contexts, keys, values):
        metadata = metadata_for([table], [context], [context], block_size, "cpu")
        query = torch.zeros(context, backend.context.num_heads, k.shape[-1], dtype=k.dtype)
        backend.forward(query, k, v, key_cache, value_cache, backend.prepare(metadata), 1.0)
    return key_cache, value_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_contiguous_and_paged_agree_on_the_same_data(dtype):
    """A decode batch of ragged and equal contexts: sdpa-contiguous on contiguous tables and
    torch-paged on shuffled ones, over the same K/V, give the same output."""
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size = 8, 4, 64, 16
    contexts = [300, 300, 300, 17, 1, 64, 65, 1024]
    lengths = [math.ceil(c / block_size) for c in contexts]
    num_blocks = sum(lengths) + 4
    starts = [sum(lengths[:i]) + 2 for i in range(len(lengths))]
    contiguous = [list(range(s, s + n)) for s, n in zip(starts, lengths)]
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    shuffled = [[physical.pop() for _ in range(n)] for n in lengths]
    keys = [torch.randn(c, kv_heads, head_dim, generator=generator).to(dtype) for c in contexts]
    values = [torch.randn(c, kv_heads, head_dim, generator=generator).to(dtype) for c in contexts]
    query = torch.randn(len(contexts), heads, head_dim, generator=generator).to(dtype)
    context = AttentionContext(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                               num_blocks=num_blocks, dtype=dtype, device=torch.device("cpu"))
    outputs = []
    for backend, tables in ((SdpaContiguousAttention(None, context), contiguous),
                            (TorchPagedAttention(None, context), shuffled)):
        # Everything but the last token as a prefill, then one decode step writes the last token.
        prefix = [c - 1 for c in contexts]
        caches = _fill(backend, [p for p in prefix if p], [t for t, p in zip(tables, prefix) if p],
                       [k[:p] for k, p in zip(keys, prefix) if p], [v[:p] for v, p in zip(values, prefix) if p],
                       block_size)
        metadata = metadata_for(tables, [1] * len(contexts), contexts, block_size, "cpu")
        last_k = torch.stack([k[-1] for k in keys])
        last_v = torch.stack([v[-1] for v in values])
        outputs.append(backend.forward(query, last_k, last_v, *caches, backend.prepare(metadata), head_dim ** -0.5))
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(outputs[0].float(), outputs[1].float(), rtol=tolerance, atol=tolerance)
    for row, c in enumerate(contexts):
        expected = dense_reference(query[row:row + 1], keys[row], values[row], 1, head_dim ** -0.5)
        torch.testing.assert_close(outputs[1][row:row + 1].float(), expected, rtol=tolerance, atol=tolerance)


# ---------------------------------------------------------------- torch-paged's groups


def test_decode_groups_sort_by_length_and_respect_the_token_budget():
    contexts = [1000, 10, 20, 3000, 30, 1000]
    groups = decode_groups(contexts, max_seqs=64, max_tokens=2048)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for group in groups:
        assert len(group) == 1 or len(group) * max(contexts[i] for i in group) <= 2048
    assert [3] in groups  # longer than the budget: alone
    assert {1, 2, 4} <= set(groups[0])  # short ones share one group
    assert all(len(g) <= 2 for g in decode_groups(contexts, max_seqs=2, max_tokens=1 << 30))


def test_a_long_prompt_is_not_grouped_with_short_ones():
    query_lens = [64, 4000, 64, 64, 60]
    groups = prefill_groups(query_lens, query_lens, max_seqs=16, padding=1.25, max_area=1 << 30)
    assert [1] in groups
    assert sorted(i for g in groups for i in g) == list(range(5))
    assert len(groups) == 2  # the short ones pad little and share a group
    # Chunks on top of a long cache do not join short prompts either.
    groups = prefill_groups([64, 64, 64], [64, 3000, 64], max_seqs=16, padding=1.25, max_area=1 << 30)
    assert [1] in groups


def _prepared(backend, query_lens, context_lens, block_size):
    tables = [list(range(i * 100, i * 100 + math.ceil(c / block_size))) for i, c in enumerate(context_lens)]
    return backend.prepare(metadata_for(tables, query_lens, context_lens, block_size, "cpu"))


def test_torch_paged_masks_only_where_lengths_differ():
    context = AttentionContext(num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=1000,
                               dtype=torch.float32, device=torch.device("cpu"))
    backend = TorchPagedAttention(None, context)
    equal = _prepared(backend, [1, 1, 1], [9, 9, 9], 4)
    assert len(equal.decode.groups) == 1 and equal.decode.groups[0].hidden is None
    assert equal.decode.groups[0].context == 9
    ragged = _prepared(backend, [1, 1], [9, 12], 4)
    assert ragged.decode.groups[0].hidden is not None
    prompts = _prepared(backend, [7, 7], [7, 7], 4)  # whole prompts of one length: is_causal
    assert len(prompts.prefill_groups) == 1 and prompts.prefill_groups[0].mask is None
    chunk = _prepared(backend, [7], [20], 4)  # a chunk on top of a cache: lower-right causal mask
    assert chunk.prefill_groups[0].mask is not None


# ---------------------------------------------------------------- sdpa-contiguous's refusal


@pytest.mark.parametrize("allocator", ["paged", "radix"])
def test_sdpa_contiguous_refuses_allocators_without_contiguous_tables(allocator, monkeypatch):
    from servelab.model_source import CheckpointSource

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the policies were checked")

    monkeypatch.setattr(CheckpointSource, "build_runner", no_load)
    with pytest.raises(ConfigError) as error:
        LLM("builtin:tiny-random", max_model_len=64, **{"allocator.name": allocator,
                                                         "attention.name": "sdpa-contiguous"})
    message = str(error.value)
    assert f"allocator {allocator!r}" in message and "'sdpa-contiguous'" in message
    assert "choose allocator 'naive'" in message


def test_sdpa_contiguous_runs_with_the_naive_allocator():
    llm = LLM("builtin:tiny-random", max_model_len=64, **{"allocator.name": "naive",
                                                          "attention.name": "sdpa-contiguous"})
    assert llm.generate([5, 6, 7])[0].token_ids


def test_sdpa_contiguous_rejects_a_table_that_is_not_one_run():
    context = AttentionContext(num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=16,
                               dtype=torch.float32, device=torch.device("cpu"))
    backend = SdpaContiguousAttention(None, context)
    backend.prepare(metadata_for([[3, 4, 5], [9]], [1, 1], [12, 2], 4, "cpu"))
    with pytest.raises(ValueError, match="contiguous block tables.*allocator 'naive'"):
        backend.prepare(metadata_for([[3, 4, 5], [9, 1]], [1, 1], [12, 6], 4, "cpu"))
