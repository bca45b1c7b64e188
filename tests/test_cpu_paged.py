"""cpu-paged: the C++ kernels build where a compiler exists, pass the attention contract
(the kernel for every row, and with rows past max_kernel_query_len on torch's SDPA), match
transformers end to end, and fall back to the torch path, saying so once, when they
cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.errors import ConfigError
from servelab.interfaces import AttentionContext
from servelab.plugins.kernels.cpu_build import kernel_build
from servelab.plugins.kernels.cpu_paged import CpuPagedAttention
from servelab.plugins.kernels.options import CpuPagedOptions
from servelab.testing import AttentionBackendContract
from servelab.testing.attention_batch import dense_reference, metadata_for

from kernel_cache import HAS_COMPILER, seed_objects
from native_steps import tokens_and_logprobs, watch_native_steps

needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: cpu-paged serves on the torch path")


class TestCpuPaged(AttentionBackendContract):
    plugin_name = "cpu-paged"
    options = CpuPagedOptions(build="wait")


class TestCpuPagedWithSdpaForLongRows(AttentionBackendContract):
    plugin_name = "cpu-paged"
    options = CpuPagedOptions(build="wait", max_kernel_query_len=16)


def _context(dtype=torch.float32, num_heads=6, num_kv_heads=2, head_dim=64, block_size=4, num_blocks=64):
    return AttentionContext(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            block_size=block_size, num_blocks=num_blocks, dtype=dtype, device=torch.device("cpu"))


@needs_compiler
def test_kernels_build_where_a_compiler_exists():
    assert kernel_build().wait() is not None, f"cpu-paged kernels failed to build: {kernel_build().error}"
    assert CpuPagedAttention(CpuPagedOptions(build="wait"), _context()).kernels_ready


def _attend_over_cache(backend, context, tables, contexts, query_lens, seed=0):
    """The backend's output for rows of `query_lens` tokens whose earlier keys sit in the
    cache (written as the runner would), and the dense float32 reference."""
    generator = torch.Generator().manual_seed(seed)
    dtype, block_size = context.dtype, context.block_size
    shape = lambda n, heads: (n, heads, context.head_dim)
    key_cache = torch.zeros(backend.kv_cache_shape(), dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    keys = [torch.randn(shape(n, context.num_kv_heads), generator=generator).to(dtype) for n in contexts]
    values = [torch.randn(shape(n, context.num_kv_heads), generator=generator).to(dtype) for n in contexts]
    queries = [torch.randn(shape(n, context.num_heads), generator=generator).to(dtype) for n in query_lens]
    for table, k, v, n in zip(tables, keys, values, query_lens):
        for position in range(k.shape[0] - n):
            block, offset = table[position // block_size], position % block_size
            key_cache[:, block, offset] = k[position]
            value_cache[:, block, offset] = v[position]
    metadata = metadata_for(tables, query_lens, contexts, block_size, "cpu")
    scale = context.head_dim**-0.5
    out = backend.forward(torch.cat(queries), torch.cat([k[-n:] for k, n in zip(keys, query_lens)]),
                          torch.cat([v[-n:] for v, n in zip(values, query_lens)]), key_cache, value_cache,
                          backend.prepare(metadata), scale)
    expected = torch.cat([dense_reference(q, k, v, n, scale) for q, k, v, n in zip(queries, keys, values, query_lens)])
    return out.float(), expected


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_draft_rows_see_a_causal_prefix(dtype):
    """Rows of 3 query tokens on top of a cache (speculative verification): each token
    attends to the keys up to its own position only."""
    context = _context(dtype)
    backend = CpuPagedAttention(CpuPagedOptions(build="wait"), context)
    out, expected = _attend_over_cache(backend, context, [[5, 9, 2, 7, 30], [11, 3, 40]], [19, 10], [3, 3])
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_and_draft_rows_over_long_contexts(dtype, block_size):
    """Decode and draft rows over contexts of tens of blocks, scattered over the cache:
    causal limits just before and after a 64-key boundary (65 keys with 3 query tokens), an
    exact multiple of it, 300 keys."""
    context = _context(dtype, block_size=block_size, num_blocks=160)
    backend = CpuPagedAttention(CpuPagedOptions(build="wait"), context)
    contexts, query_lens = [65, 128, 300, 129], [3, 1, 2, 1]
    order = torch.randperm(160, generator=torch.Generator().manual_seed(2)).tolist()
    tables, start = [], 0
    for n in contexts:
        blocks = -(-n // block_size)
        tables.append(order[start:start + blocks])
        start += blocks
    out, expected = _attend_over_cache(backend, context, tables, contexts, query_lens, seed=3)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 4, 64), (8, 4, 64), (6, 2, 32), (16, 2, 128)])
def test_prompt_tiles_match_dense_attention(dtype, num_heads, num_kv_heads, head_dim):
    """The tiled path for rows of many query tokens: a 150-token chunk on top of 90 cached
    tokens (tiles that start mid-context, keys hidden lane by lane on the diagonal blocks),
    a whole 37-token prompt (a partial last tile and block) and a decode row in one step,
    blocks scattered over the cache, every GQA group size the tiles pad differently."""
    context = _context(dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                       num_blocks=40)
    backend = CpuPagedAttention(CpuPagedOptions(build="wait"), context)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [order[:15], order[15:18], order[18:22]]
    out, expected = _attend_over_cache(backend, context, tables, [240, 37, 50], [150, 37, 1])
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@needs_compiler
@pytest.mark.parametrize("head_dim, tiled", [(64, True), (12, False)])
def test_prompt_rows_go_to_sdpa_only_without_a_tiled_path(head_dim, tiled):
    """By default the kernel attends every row; where its library has no tiled path for the
    head dim (not a multiple of the vector width, or no AVX2), rows longer than 16 query
    tokens go to torch-paged's SDPA instead of the slow row-by-row path."""
    context = _context(head_dim=head_dim, block_size=16)
    backend = CpuPagedAttention(CpuPagedOptions(build="wait"), context)
    prepared = backend.prepare(metadata_for([[0, 1, 2], [3]], [40, 1], [40, 9], 16, "cpu"))
    assert backend._kernels.tiles_prompts(head_dim) is tiled
    assert (len(prepared.prefill_groups) == 0) is tiled
    assert prepared.kernel_seqs.tolist() == ([0, 1] if tiled else [1])


@pytest.mark.parametrize("kind, mlp_rows", [("llama", None), ("qwen2", None), ("llama3-rope-tied", None),
                                             ("llama", 8)])
def test_engine_greedy_matches_transformers(checkpoint_factory, monkeypatch, kind, mlp_rows):
    """With the kernels and the fused layer ops (head dims 12 and 16: the generic and the
    vectorised attention path; Qwen2's biases; tied embeddings with Llama-3 rope scaling;
    the MLP cut into chunks of 8 rows on prompt steps)."""
    import transformers

    if mlp_rows is not None:
        monkeypatch.setattr("servelab.model.llama.MLP_ROWS_AT_ONCE", mlp_rows)

    path = checkpoint_factory(kind)
    prompts = [[5, 9, 13, 2, 40, 7], list(range(3, 40)), [17]]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(path, max_model_len=128, **{"attention.name": "cpu-paged", "attention.build": "wait"})
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected


@needs_compiler
@pytest.mark.parametrize("kind, dtype, drafter", [("llama3-rope-tied", "float32", None), ("qwen2", "bfloat16", None),
                                                  ("llama3-rope-tied", "float32", "ngram")])
def test_native_decoder_is_bit_identical_to_the_python_path(checkpoint_factory, monkeypatch, kind, dtype, drafter):
    """The whole decoder in one native call gives the same logits, to the bit, as the model's
    Python loop over the same kernels; it runs every step: prompts (whose last layer computes
    only the rows whose logits are wanted, and whose MLP runs 20 rows at a time: 20, 20, 8),
    decodes and, with a drafter, verifications."""
    _panel_kernels(getattr(torch, dtype))
    monkeypatch.setattr("servelab.model.llama.MLP_ROWS_AT_ONCE", 20)
    path = checkpoint_factory(kind)
    prompts = [[5, 9, 13, 2, 40, 7, 5, 9, 13, 2], list(range(3, 40)), [17]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    results, native_steps = {}, []
    for native in (False, True):
        config = {"attention": {"name": "cpu-paged", "build": "wait", "native_decoder": native}}
        if drafter:
            config["drafter"] = {"name": drafter, "num_speculative_tokens": 3, "max_ngram": 3}
        llm = LLM(path, config=config, dtype=dtype, max_model_len=128)
        watch_native_steps(llm, native_steps, native)
        results[native] = tokens_and_logprobs(llm.generate(prompts, params))
    assert results[True] == results[False]
    assert not any(ran for native, ran in native_steps if not native)
    assert all(ran for native, ran in native_steps if native)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, hidden", [(1, 72), (37, 512)])
def test_layer_ops_match_the_torch_ops(dtype, rows, hidden):
    """Rotary and the residual add are bit-identical to the model's torch path; the norms and
    SiLU-and-multiply agree to rounding (their sums and exponentials are computed their own way)."""
    from torch.nn import functional as F

    from servelab.model.llama import RMSNorm
    from servelab.model.rope import RotaryEmbedding, apply_rotary

    ops = kernel_build().wait()
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    residual = torch.randn(rows, hidden, generator=generator).to(dtype)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = (1 + torch.rand(hidden, generator=generator)).to(dtype)
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    with torch.inference_mode():
        torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.eps), norm(x), **tolerance)
        fused_x, fused_residual = x.clone(), residual.clone()
        ops.add_rms_norm_(fused_x, fused_residual, norm.weight, norm.eps)
        assert torch.equal(fused_residual, residual + x)
        torch.testing.assert_close(fused_x, norm(residual + x), **tolerance)

        num_heads, num_kv_heads = 3, 2
        for head_dim in (16, 64, 80):  # halves shorter than a vector, whole vectors, vectors and a tail
            rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, dtype, torch.device("cpu"))
            positions = torch.randint(0, 64, (rows,), generator=generator)
            qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
            rotated = (num_heads + num_kv_heads) * head_dim
            cos, sin = rotary.tables(positions)
            expected = apply_rotary(qkv[:, :rotated].view(rows, -1, head_dim), cos, sin).reshape(rows, -1)
            untouched = qkv[:, rotated:].clone()
            ops.rotary_(qkv, positions, rotary.cos, rotary.sin, num_heads + num_kv_heads, head_dim)
            assert torch.equal(qkv[:, :rotated], expected) and torch.equal(qkv[:, rotated:], untouched), head_dim

        gate_up = (3 * torch.randn(rows, 2 * hidden, generator=generator)).to(dtype)
        gate, up = gate_up.split(hidden, dim=-1)
        torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, **tolerance)


def _panel_kernels(dtype):
    kernels = kernel_build().wait()
    if str(dtype).removeprefix("torch.") not in kernels.panel_dtypes():
        pytest.skip(f"no {dtype} matmul in the library on this CPU (it has no AVX2): such layers stay on torch's")
    return kernels


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("out_features, in_features", [(64, 72), (120, 71), (211, 13), (176, 100), (1024, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_a_float64_reference(dtype, out_features, in_features, bias):
    """The library's matmul against torch's linear in float64: whole and padded last panels,
    an odd reduction (bf16 pads it to whole pairs), every remainder of rows a block takes
    (1-7), enough blocks to prefetch the next panel (19 rows in uneven blocks, 100 rows), no
    rows, leading dims and a strided input. Float32 sums of `in_features` terms of ~1 drift
    by ~1e-7 x in_features at most, and bf16 rounds its output to 8 bits, as oneDNN's does; a
    wrong weight, row or column is off by ~1. However its rows are cut into blocks, a row's
    output is bit for bit the one it gets alone (a request's tokens never depend on its batch)."""
    from torch.nn import functional as F

    kernels = _panel_kernels(dtype)
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    panels = kernels.pack_panels(weight)
    width = kernels.panel_width()
    assert panels.shape[0] == -(-out_features // width) and panels.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-6 * in_features) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)

    def check(x):
        expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
        got = kernels.panel_linear(x, panels, b, out_features)
        assert got.dtype == dtype and got.shape == (*x.shape[:-1], out_features)
        torch.testing.assert_close(got.double(), expected, **tolerance)

    for rows in (0, 1, 2, 3, 5, 6, 7, 19, 100):
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        check(x)
        if rows in (7, 19):
            alone = torch.cat([kernels.panel_linear(x[i:i + 1], panels, b, out_features) for i in range(rows)])
            assert torch.equal(kernels.panel_linear(x, panels, b, out_features), alone)
    check(torch.randn(2, 3, 2 * in_features, generator=generator).to(dtype)[..., ::2])  # leading dims, strided


@needs_compiler
def test_panel_linear_refuses_mismatched_inputs():
    kernels = kernel_build().wait()
    panels = kernels.pack_panels(torch.randn(70, 16))
    with pytest.raises(RuntimeError, match="x must be float32 with 16 features"):
        kernels.panel_linear(torch.randn(3, 15), panels, None, 70)
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernels.panel_linear(torch.randn(3, 16, dtype=torch.bfloat16), panels, None, 70)
    with pytest.raises(RuntimeError, match="out_features 500 does not match"):
        kernels.panel_linear(torch.randn(3, 16), panels, None, 500)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 tensor of 70 values"):
        kernels.panel_linear(torch.randn(3, 16), panels, torch.randn(69), 70)
    with pytest.raises(RuntimeError, match="weight must be a 2-D float32 or bfloat16 tensor"):
        kernels.pack_panels(torch.randn(70, 16, dtype=torch.float64))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("moved", [True, False])
def test_the_linears_move_to_the_library_once_it_is_ready(llama_checkpoint, dtype, moved):
    """Every packed linear, the LM head too, moves to the library's matmul at the first step
    that has the kernels, and the oneDNN copy is freed; `panel_linears = false` keeps them
    all on oneDNN. Greedy tokens equal transformers' either way in float32
    (test_engine_greedy_matches_transformers runs the default), and the native decoder stays
    bit-identical to the Python loop in both dtypes (test_native_decoder_is_bit_identical...)."""
    from servelab.model.packed_linear import PackedLinear, can_prepack

    _panel_kernels(dtype)
    llm = LLM(llama_checkpoint, max_model_len=64, dtype=str(dtype).removeprefix("torch."),
              **{"attention.name": "cpu-paged", "attention.build": "wait", "attention.panel_linears": moved})
    llm.generate([[5, 9, 13]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    linears = {name: m for name, m in llm.engine.runner.model.named_modules() if isinstance(m, PackedLinear)}
    assert len(linears) == 2 * 4 + 1
    assert all((m.panels is not None) is moved for m in linears.values())
    # moved: the panels are the only copy (the LM head keeps its plain weight for drafters and
    # tied embeddings); not moved: oneDNN's packing or, where this CPU has none for the dtype,
    # the plain weight
    onednn = can_prepack(torch.device("cpu"), dtype)
    for name, m in linears.items():
        if moved:
            assert m.packed_weight is None and hasattr(m, "weight") is (name == "lm_head"), name
        else:
            assert (m.packed_weight is not None) is onednn and hasattr(m, "weight") is (name == "lm_head" or not onednn)


@needs_compiler
@pytest.mark.parametrize("amx", [None, True, False], ids=["this-cpu", "amx", "no-amx"])
def test_by_default_bf16_linears_stay_on_onednn_where_it_has_amx(llama_checkpoint, monkeypatch, amx):
    """`panel_linears = "auto"` (the default) moves float32 layers always and bfloat16 ones
    only where oneDNN does not compute bfloat16 on AMX tiles (there it is several times the
    library's matmul on batches). "this-cpu" asks this CPU; the others stand in for the CPU
    this one is not. Either way the greedy tokens are the ones `panel_linears = true` makes
    in float32, and a bfloat16 engine still generates."""
    from servelab.model.packed_linear import PackedLinear
    from servelab.plugins.kernels import cpu_paged

    _panel_kernels(torch.bfloat16)
    if amx is not None:
        monkeypatch.setattr(cpu_paged, "onednn_bf16_on_amx", lambda: amx)
    on_amx = cpu_paged.onednn_bf16_on_amx()
    prompt, greedy = [[5, 9, 13]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tokens = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(llama_checkpoint, max_model_len=64, dtype=dtype,
                  **{"attention.name": "cpu-paged", "attention.build": "wait"})
        tokens[dtype] = llm.generate(prompt, greedy)[0].token_ids
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
        moved = dtype == "float32" or not on_amx
        assert layers and all((m.panels is not None) is moved for m in layers), (dtype, on_amx)
    every = LLM(llama_checkpoint, max_model_len=64, **{"attention.name": "cpu-paged", "attention.build": "wait",
                                                        "attention.panel_linears": True})
    assert tokens["float32"] == every.generate(prompt, greedy)[0].token_ids
    assert len(tokens["bfloat16"]) == 4


def test_panel_linears_takes_true_false_or_auto():
    assert CpuPagedOptions().panel_linears == "auto"
    assert CpuPagedOptions(panel_linears=False).panel_linears is False
    with pytest.raises(ConfigError, match='panel_linears must be true, false or "auto"'):
        CpuPagedOptions(panel_linears="sometimes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unpacking_a_onednn_weight_is_exact(dtype):
    """use_panels reads a dropped weight back out of oneDNN's layout: to the bit."""
    from torch import nn

    from servelab.model.packed_linear import PackedLinear, can_prepack

    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip("this torch build has no oneDNN linear packing")
    linear = nn.Linear(100, 211).to(dtype)
    assert torch.equal(PackedLinear(linear).unpacked_weight(), linear.weight.detach())


FALLBACK_SCRIPT = """
import torch, structlog
from structlog.testing import capture_logs
from servelab.interfaces import AttentionContext
from servelab.plugins.kernels.cpu_paged import CpuPagedAttention
from servelab.plugins.kernels.options import CpuPagedOptions
context = AttentionContext(num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, num_blocks=8,
                           dtype=torch.float32, device=torch.device("cpu"))
with capture_logs() as logs:
    backend = CpuPagedAttention(CpuPagedOptions(build="wait"), context)
warnings = [e for e in logs if e["log_level"] == "warning"]
print(backend.kernels_ready, len(warnings), warnings[0]["event"] if warnings else "")
"""


def test_without_a_compiler_the_torch_path_serves_and_says_so_once(tmp_path):
    # A fresh extension cache and a compiler that does not exist: the build fails.
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    result = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "1", "cpu_paged.kernels_unavailable"]


CACHED_SCRIPT = """
import sys
from servelab import LLM, SamplingParams
from servelab.plugins.kernels.cpu_build import is_cached, kernel_build
llm = LLM("builtin:tiny", max_model_len=128)  # the default attention: cpu-paged, build = "cached"
backend = llm.engine.runner.backend
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
before = llm.generate([[5, 9, 13, 2]], params)[0].token_ids
ready_at_start = backend.kernels_ready
if sys.argv[1] == "empty":
    kernel_build().wait()  # the build for the next start, begun by the engine
after = llm.generate([[5, 9, 13, 2]], params)[0].token_ids
print(ready_at_start, backend.kernels_ready, is_cached(), before == after)
"""


@needs_compiler
def test_the_cached_build_mode_never_switches_mid_run_and_builds_for_the_next_start(tmp_path):
    """An empty cache: the whole run stays on the torch path while the library is built
    for the next start. The next start finds it and uses the kernels from its first step.
    (The cache holds this session's compiled objects but no library, so the build links
    rather than compiles: the same path through the build, in seconds.)"""
    seed_objects(tmp_path / "ext")
    # the build does not wait for the suite's other worker to go quiet (test_yielding_build covers that)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), SERVELAB_BUILD_YIELD="0")
    runs = [subprocess.run([sys.executable, "-c", CACHED_SCRIPT, cache], env=env, capture_output=True, text=True,
                           timeout=600) for cache in ("empty", "filled")]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert [run.stdout.split() for run in runs] == [["False", "False", "True", "True"],
                                                     ["True", "True", "True", "True"]]


def test_selected_on_a_non_cpu_device_falls_back_without_building():
    context = AttentionContext(num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, num_blocks=8,
                               dtype=torch.float32, device=torch.device("meta"))
    backend = CpuPagedAttention(CpuPagedOptions(build="wait"), context)
    assert not backend.kernels_ready


@needs_compiler
def test_a_stale_build_lock_is_removed(tmp_path, monkeypatch):
    """A lock left by a build process that was killed would make torch wait forever."""
    import time

    from torch.utils import cpp_extension

    from servelab.plugins.kernels import cpu_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name, _ = cpu_build._flags()
    lock = tmp_path / name / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - 2 * cpu_build.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    cpu_build._clear_stale_lock(cpp_extension, name)
    assert not lock.exists()
    lock.touch()  # a fresh lock belongs to a build in progress: kept
    cpu_build._clear_stale_lock(cpp_extension, name)
    assert lock.exists()
