"""Quantized KV cache (`[engine] kv_cache_dtype`): the row format's round-trip bounds, the
cpu-paged kernels against the torch-paged reference (and both against dense attention over
the dequantized K/V) on odd shapes, the pool sized from the smaller element, the engine end
to end with each dtype, and the refusals."""

from __future__ import annotations


import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.interfaces import AttentionContext, QuantizedKVBackend, kv_row_elements
from servelab.kv_sizing import kv_row_bytes
from servelab.plugins.kernels.cpu_paged import CpuPagedAttention
from servelab.plugins.kernels.kv_quant import dequantize_rows, quantize_rows
from servelab.plugins.kernels.options import CpuPagedOptions
from servelab.plugins.kernels.torch_paged import TorchPagedAttention
from servelab.testing.attention_batch import dense_reference, metadata_for

from kernel_cache import HAS_COMPILER

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: cpu-paged serves on the torch path")


# ---------------------------------------------------------------- the row format

# Elements' rounding: int8 half a step of the scale; fp8 half an ulp of a 3-bit (e4m3) or
# 2-bit (e5m2) mantissa, relative, or half the subnormal spacing (2^-9, 2^-16) of the scale.
RELATIVE = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
SUBNORMAL_STEP = {"fp8_e4m3": 2.0**-9, "fp8_e5m2": 2.0**-16}


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("head_dim", [12, 13, 64])
def test_round_trip_stays_within_the_format_s_rounding(kv_cache_dtype, head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    # rows of very different magnitudes, one of zeros, one with a single outlier
    x = torch.randn(40, 3, head_dim, generator=generator) * torch.logspace(-3, 3, 40)[:, None, None]
    x[5] = 0.0
    x[7, :, 0] = 1e4
    rows = quantize_rows(x, kv_cache_dtype)
    assert rows.dtype == torch.uint8 and rows.shape == (40, 3, kv_row_elements(head_dim, kv_cache_dtype))
    back = dequantize_rows(rows, head_dim, kv_cache_dtype)
    amax = x.abs().amax(-1, keepdim=True)
    error = (back - x).abs()
    if kv_cache_dtype == "int8":
        bound = amax / 127 / 2 * (1 + 1e-5)
    else:
        scale = amax / {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}[kv_cache_dtype]
        bound = torch.maximum(x.abs() * RELATIVE[kv_cache_dtype], scale * SUBNORMAL_STEP[kv_cache_dtype] / 2) * (1 + 1e-5)
    assert (error <= bound + 1e-30).all(), float((error - bound).max())
    assert torch.equal(back[5], torch.zeros_like(back[5]))  # a row of zeros stays zeros (scale 0)
    # each row's largest element is stored at the format's largest value: exact up to float rounding
    peak = x.abs().argmax(-1, keepdim=True)
    assert torch.allclose(back.gather(-1, peak).abs(), amax, rtol=1e-6)


def test_rows_are_padded_for_an_aligned_scale():
    assert kv_row_elements(64, "auto") == 64
    assert kv_row_elements(64, "int8") == 68 and kv_row_elements(13, "fp8_e4m3") == 20
    assert kv_row_bytes(64, 4) == 256 and kv_row_bytes(64, 2, "fp8_e5m2") == 68


# ---------------------------------------------------------------- kernels against the reference

def _context(kv_cache_dtype, dtype, num_heads, num_kv_heads, head_dim, block_size):
    return AttentionContext(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                            num_blocks=160, dtype=dtype, device=torch.device("cpu"), kv_cache_dtype=kv_cache_dtype)


def _mixed_step(backend, seed):
    """Decodes (one over 150 keys), draft rows (two over 70 keys), a whole prompt and a chunk
    over a cached prefix, on shuffled block tables; earlier tokens written into the cache
    first. Returns the output, the caches and the full-precision inputs."""
    context = backend.context
    block_size, dtype = context.block_size, context.dtype
    generator = torch.Generator().manual_seed(seed)
    query_lens, context_lens = [1, 1, 3, 40, 7, 1, 2], [17, 33, 20, 40, 30, 150, 70]
    order = torch.randperm(context.num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for length in context_lens:
        count = -(-length // block_size)
        tables.append(order[used:used + count])
        used += count
    keys = [torch.randn(n, context.num_kv_heads, context.head_dim, generator=generator).mul(3).to(dtype)
            for n in context_lens]
    values = [torch.randn(n, context.num_kv_heads, context.head_dim, generator=generator).to(dtype)
              for n in context_lens]
    queries = [torch.randn(n, context.num_heads, context.head_dim, generator=generator).to(dtype) for n in query_lens]
    key_cache = torch.zeros(backend.kv_cache_shape(), dtype=backend.kv_cache_storage_dtype())
    value_cache = torch.zeros_like(key_cache)
    earlier = [(table[p // block_size] * block_size + p % block_size, k[p], v[p])
               for table, k, v, q in zip(tables, keys, values, query_lens) for p in range(k.shape[0] - q)]
    prefill = metadata_for([[s // block_size] for s, _, _ in earlier], [1] * len(earlier),
                           [s % block_size + 1 for s, _, _ in earlier], block_size, "cpu")
    backend_write = TorchPagedAttention(None, context)  # the reference writes the earlier tokens for both
    backend_write._write(torch.stack([k for _, k, _ in earlier]), torch.stack([v for _, _, v in earlier]),
                         key_cache, value_cache, prefill.slot_mapping)
    metadata = metadata_for(tables, query_lens, context_lens, block_size, "cpu")
    scale = context.head_dim**-0.5
    out = backend.forward(torch.cat(queries), torch.cat([k[-n:] for k, n in zip(keys, query_lens)]),
                          torch.cat([v[-n:] for v, n in zip(values, query_lens)]), key_cache, value_cache,
                          backend.prepare(metadata), scale)
    return out, key_cache, value_cache, (queries, keys, values, query_lens, scale)


SHAPES = [(6, 2, 64, 4), (4, 4, 12, 5), (8, 1, 80, 16), (4, 2, 128, 16), (3, 1, 20, 3)]
SHAPE_IDS = ["gqa3-d64-b4", "mha-d12-b5", "gqa8-d80-b16", "gqa2-d128-b16", "gqa3-d20-b3"]


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_the_reference_attends_the_dequantized_cache(kv_cache_dtype, shape):
    """torch-paged over a quantized cache equals dense attention over the dequantized K/V."""
    backend = TorchPagedAttention(None, _context(kv_cache_dtype, torch.float32, *shape))
    out, _, _, (queries, keys, values, query_lens, scale) = _mixed_step(backend, seed=1)
    roundtrip = [dequantize_rows(quantize_rows(t, kv_cache_dtype), t.shape[-1], kv_cache_dtype) for t in keys + values]
    deq_keys, deq_values = roundtrip[:len(keys)], roundtrip[len(keys):]
    expected = torch.cat([dense_reference(q, k, v, n, scale)
                          for q, k, v, n in zip(queries, deq_keys, deq_values, query_lens)])
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    # and close to full precision: the quantization error, not a wrong attention
    full = torch.cat([dense_reference(q, k, v, n, scale) for q, k, v, n in zip(queries, keys, values, query_lens)])
    assert (out - full).abs().max() < {"int8": 0.1, "fp8_e4m3": 0.4, "fp8_e5m2": 0.8}[kv_cache_dtype]


@needs_compiler
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_quantized_cpu_kernels_match_the_reference(kv_cache_dtype, dtype, shape):
    """The C++ write quantizes to the same bytes as kv_quant, and the kernels (decode path,
    draft rows, prompt tiles; the vectorised and the generic head dims) attend as torch-paged."""
    context = _context(kv_cache_dtype, dtype, *shape)
    kernel = CpuPagedAttention(CpuPagedOptions(build="wait"), context)
    assert kernel.kernels_ready
    reference = TorchPagedAttention(None, context)
    out, key_cache, value_cache, _ = _mixed_step(kernel, seed=2)
    expected, key_reference, value_reference, _ = _mixed_step(reference, seed=2)
    assert torch.equal(key_cache.view(torch.uint8), key_reference.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), value_reference.view(torch.uint8))
    tolerance = dict(rtol=1e-4, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=4e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)


@needs_compiler
def test_the_kernel_refuses_a_cache_whose_rows_are_not_the_quantized_layout():
    context = _context("int8", torch.float32, 4, 2, 16, 4)
    kernels = CpuPagedAttention(CpuPagedOptions(build="wait"), context)._kernels
    key = torch.randn(2, 2, 16)
    wrong = torch.zeros(2, 64, 4, 16, dtype=torch.int8)  # no room for the scales
    slots = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="quantized cache's rows"):
        kernels.write_cache(key, key, wrong, wrong.clone(), slots)
    assert not wrong.any()


# ---------------------------------------------------------------- the engine

def test_the_pool_holds_more_tokens_in_the_smaller_element(llama_checkpoint):
    """Same kv_cache_memory: the llama test model (2 layers, 2 KV heads, head dim 12) takes
    2*2*2*12*4 = 384 bytes a token in fp32 and 2*2*2*16 = 128 quantized (12 bytes, the scale's 4)."""
    blocks = {}
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(llama_checkpoint, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=384 * 16 * 30, max_model_len=128,
                  **{"attention.name": "torch-paged"})
        blocks[kv_cache_dtype] = llm.engine.allocator.stats().num_blocks
        key_cache = llm.engine.runner.kv_caches[0][0]
        assert key_cache.dtype == (torch.int8 if kv_cache_dtype == "int8" else torch.float32)
        assert key_cache.shape[-1] == kv_row_elements(12, kv_cache_dtype)
    assert blocks == {"auto": 30, "int8": 90}


@pytest.mark.parametrize("kv_cache_dtype, kind", [("int8", "llama"), ("fp8_e4m3", "qwen2"),
                                                  ("fp8_e5m2", "llama-mha")])
def test_engine_end_to_end_with_each_dtype(checkpoint_factory, kv_cache_dtype, kind):
    """Greedy generation through LLM on a quantized cache (head dims 12, 16 and 12: the
    kernels' generic and vectorised paths): cpu-paged (kernels, native decoder) gives the
    tokens and logprobs torch-paged gives, and each prompt's first-token log-probabilities
    stay near the full-precision cache's (its prompt attends freshly quantized K/V)."""
    path = checkpoint_factory(kind)
    prompts = [[5, 9, 13, 2, 40, 7], list(range(3, 40)), [17]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    runs = {}
    for backend, kv in (("torch-paged", "auto"), ("torch-paged", kv_cache_dtype), ("cpu-paged", kv_cache_dtype)):
        options = {"attention.name": backend} | ({"attention.build": "wait"} if backend == "cpu-paged" else {})
        llm = LLM(path, kv_cache_dtype=kv, max_model_len=128, **options)
        runs[backend, kv] = llm.generate(prompts, params)
    quantized, full = runs["torch-paged", kv_cache_dtype], runs["torch-paged", "auto"]
    if HAS_COMPILER:
        kernel = runs["cpu-paged", kv_cache_dtype]
        assert [o.token_ids for o in kernel] == [o.token_ids for o in quantized]
        for k, q in zip(kernel, quantized):
            for at_k, at_q in zip(k.outputs[0].logprobs, q.outputs[0].logprobs):
                assert at_k.keys() == at_q.keys()
                assert all(abs(at_k[t].logprob - at_q[t].logprob) < 1e-3 for t in at_k)
    tolerance = {"int8": 0.02, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2}[kv_cache_dtype]
    for q, f in zip(quantized, full):
        first_q, first_f = q.outputs[0].logprobs[0], f.outputs[0].logprobs[0]
        shared = first_q.keys() & first_f.keys()
        assert len(shared) >= 3
        assert max(abs(first_q[t].logprob - first_f[t].logprob) for t in shared) < tolerance


def test_the_command_line_takes_the_kv_cache_dtype(capsys):
    from servelab.cli import main

    assert main(["generate", "--kv-cache-dtype", "fp8_e4m3", "--prompt", "def f(x):", "--max-tokens", "4",
                 "--set", "attention.name=torch-paged"]) == 0
    assert capsys.readouterr().out.strip()


# ---------------------------------------------------------------- refusals

def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"kv_cache_dtype must be one of auto, int8, fp8_e4m3, fp8_e5m2, got 'int4'"):
        EngineConfig.from_dict({"engine": {"kv_cache_dtype": "int4"}})


def test_a_backend_without_quantized_caches_is_refused(llama_checkpoint):
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='int8': attention 'sdpa-contiguous' cannot store a "
                                          r"quantized KV cache"):
        LLM(llama_checkpoint, kv_cache_dtype="int8", max_model_len=128,
            **{"attention.name": "sdpa-contiguous", "allocator.name": "naive"})


def test_cupy_paged_takes_the_quantized_caches_torch_paged_takes():
    """cupy-paged states the capability for torch-paged's kv_cache_dtypes (its kernels are
    checked in tests/test_cupy_kernels.py); without CuPy or a GPU, building it for one
    fails on what is missing, not on the cache dtype."""
    from servelab.plugins.kernels import cupy_paged

    assert cupy_paged.CupyPagedAttention.supported_kv_cache_dtypes == TorchPagedAttention.supported_kv_cache_dtypes
    try:
        cupy_paged.check_available("cuda")
    except ConfigError:
        with pytest.raises(ConfigError, match="cupy-paged needs CuPy and a CUDA GPU: "):
            cupy_paged.CupyPagedAttention(None, _context("fp8_e4m3", torch.float16, 4, 2, 64, 16))


def test_backends_declare_the_capability():
    assert isinstance(TorchPagedAttention(None, _context("auto", torch.float32, 4, 2, 16, 4)), QuantizedKVBackend)
    from servelab.plugins.kernels.sdpa_contiguous import SdpaContiguousAttention

    assert not isinstance(SdpaContiguousAttention(None, _context("auto", torch.float32, 4, 2, 16, 4)),
                          QuantizedKVBackend)


# ---------------------------------------------------------------- simulator and bench table

def test_the_simulator_sizes_the_pool_from_the_smaller_element():
    from servelab.bench.sim.cost_model import CostModel
    from servelab.bench.sim.hardware import accelerator
    from servelab.bench.sim.shapes import model_shape

    shape = model_shape("llama-3-8b")  # 32 layers, 8 KV heads of 128
    full, fp8 = (CostModel(shape, accelerator("h100"), kv_cache_dtype=kv) for kv in ("auto", "fp8_e4m3"))
    assert full.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 and fp8.kv_bytes_per_token == 2 * 32 * 8 * 132
    assert fp8.kv_blocks(16) == int(full.kv_pool_bytes() // (fp8.kv_bytes_per_token * 16))
    # decode attention reads the one-byte rows: a long-context decode step gets cheaper
    step = lambda cost: cost.step([1] * 64, [8192] * 64, 64).seconds
    assert step(fp8) < step(full)


def test_the_bench_table_names_the_kv_dtype_and_bytes_a_token(capsys):
    from servelab.cli import main

    assert main(["bench", "--sim", "h100", "--sim-model", "tiny-random", "--kv-cache-dtype", "fp8_e5m2",
                 "--workload", "fixed:num_requests=4,prompt_len=32,output_len=4"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("KV dtype / bytes a token"))
    assert "fp8_e5m2 / 4,352" in row  # tiny-random: 2 (K, V) * 8 layers * 4 KV heads * (64 + 4) bytes
