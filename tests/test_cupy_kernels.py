"""cupy-paged: the CUDA sources compile (nvcc, no GPU needed), the launch plan covers every
query and key, selecting the backend without CuPy or a GPU is a clear error, and on a GPU
the kernels match torch-paged and the engine matches transformers greedy decoding.

What needs what:
- compile tests, for the model's dtypes and the quantized caches (kv_cache_dtype int8,
  fp8_e4m3, fp8_e5m2), and the host build of the quantized-row codecs (kv_quant.cuh) that
  checks their bytes against torch's: nvcc (skipped, with the reason, only where nvcc is absent);
- plan and selection-error tests: nothing (the error test runs where CuPy or a GPU is missing);
- conformance and end-to-end tests: CuPy and a CUDA GPU (skipped with the reason otherwise).
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from servelab import LLM, ConfigError, SamplingParams
from servelab.plugins.kernels import cupy_paged
from servelab.plugins.kernels.options import CupyPagedOptions
from servelab.testing import AttentionBackendContract

KERNELS = Path(cupy_paged.__file__).resolve().parent


def _find_nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _gpu_problem() -> str | None:
    """Why the GPU tests cannot run here, or None."""
    try:
        cupy_paged.check_available("cuda")
    except ConfigError as exc:
        return str(exc)
    return None


NVCC = _find_nvcc()
GPU_PROBLEM = _gpu_problem()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
needs_gpu = pytest.mark.skipif(GPU_PROBLEM is not None, reason=GPU_PROBLEM or "")

# ---------------------------------------------------------------- compile (nvcc, no GPU)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Each dtype at head size 128, the other serving head sizes in one dtype each, other block
# sizes and the odd head sizes the contract uses in one dtype each: a kernel's source is one
# template, so each compile covers one dtype or one size's constants (block size only
# changes constants), and the product of the two would compile the same code again.
ATTENTION_BUILDS = (
    [(dtype, 128, 16) for dtype in DTYPES] + [("bfloat16", 64, 16), ("float16", 80, 16), ("float32", 96, 16)]
    + [("bfloat16", 128, 8), ("bfloat16", 128, 32), ("float32", 12, 3), ("float16", 4, 1), ("bfloat16", 256, 16),
       ("float32", 256, 4)]
)
WRITE_BUILDS = [(dtype, 128, 16) for dtype in DTYPES] + [("bfloat16", 64, 16), ("float16", 80, 16),
                                                         ("float32", 96, 16)]
QUANTIZED_KV = ("int8", "fp8_e4m3", "fp8_e5m2")
# Each quantized cache with each model dtype, at one of two serving head sizes in turn (rows
# of 68 and 132 bytes, 4-aligned), and the odd shapes, each with one cache in turn: 80 and 96
# (rows of 84 and 100), 12 (a 16-aligned row of 16 bytes), 4 (8 bytes), 256.
QUANTIZED_ATTENTION_BUILDS = (
    [(kv, dtype, (64, 128)[(i + j) % 2], 16) for i, kv in enumerate(QUANTIZED_KV) for j, dtype in enumerate(DTYPES)]
    + [(QUANTIZED_KV[i % 3], dtype, head_dim, block) for i, (dtype, head_dim, block) in
       enumerate((("bfloat16", 80, 16), ("float16", 96, 8), ("float32", 12, 3), ("float16", 4, 1),
                  ("bfloat16", 256, 32)))]
)
QUANTIZED_WRITE_BUILDS = [(kv, dtype, (4, 80, 128)[(i + j) % 3]) for i, kv in enumerate(QUANTIZED_KV)
                          for j, dtype in enumerate(DTYPES)]


def nvcc(source: str, dtype: str, head_dim: int, block_size: int, *extra: str, output: Path,
         kv_cache_dtype: str = "auto") -> str:
    defines = cupy_paged.compile_defines(DTYPES[dtype], head_dim, block_size, kv_cache_dtype)
    command = [NVCC, "-std=c++17", *defines, *extra, "-o", str(output), str(KERNELS / source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}"
    return result.stderr


@needs_nvcc
@pytest.mark.parametrize("dtype,head_dim,block_size", ATTENTION_BUILDS)
def test_paged_attention_compiles_to_ptx(dtype, head_dim, block_size, tmp_path):
    ptx = tmp_path / "paged_attention.ptx"
    nvcc("paged_attention.cu", dtype, head_dim, block_size, "--ptx", "-arch=compute_90", output=ptx)
    text = ptx.read_text()
    assert ".entry sl_paged_attention" in text and ".entry sl_reduce_partitions" in text


@needs_nvcc
@pytest.mark.parametrize("dtype,head_dim,block_size", WRITE_BUILDS)
def test_cache_write_compiles_to_ptx(dtype, head_dim, block_size, tmp_path):
    ptx = tmp_path / "cache_write.ptx"
    nvcc("cache_write.cu", dtype, head_dim, block_size, "--ptx", "-arch=compute_80", output=ptx)
    assert ".entry sl_cache_write" in ptx.read_text()


@needs_nvcc
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_kernel_fits_in_registers_on_hopper(dtype, tmp_path):
    """The benchmark's instantiation (head size 128, block 16) assembles for sm_90 without
    spilling its per-lane queries and accumulators to local memory."""
    log = nvcc("paged_attention.cu", dtype, 128, 16, "-cubin", "-arch=sm_90", "-Xptxas", "-v",
               output=tmp_path / "paged_attention.cubin")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and not any(spills), log


@needs_nvcc
@pytest.mark.parametrize("kv_cache_dtype,dtype,head_dim,block_size", QUANTIZED_ATTENTION_BUILDS)
def test_quantized_paged_attention_compiles_to_ptx(kv_cache_dtype, dtype, head_dim, block_size, tmp_path):
    ptx = tmp_path / "paged_attention.ptx"
    nvcc("paged_attention.cu", dtype, head_dim, block_size, "--ptx", "-arch=compute_90", output=ptx,
         kv_cache_dtype=kv_cache_dtype)
    text = ptx.read_text()
    assert ".entry sl_paged_attention" in text and ".entry sl_reduce_partitions" in text


@needs_nvcc
@pytest.mark.parametrize("kv_cache_dtype,dtype,head_dim", QUANTIZED_WRITE_BUILDS)
def test_quantized_cache_write_compiles_to_ptx(kv_cache_dtype, dtype, head_dim, tmp_path):
    ptx = tmp_path / "cache_write.ptx"
    nvcc("cache_write.cu", dtype, head_dim, 16, "--ptx", "-arch=compute_80", output=ptx, kv_cache_dtype=kv_cache_dtype)
    text = ptx.read_text()
    assert ".entry sl_cache_write" in text and "shfl.sync.bfly" in text  # the warp's max of the row


@needs_nvcc
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED_KV)
def test_quantized_decode_kernel_fits_in_registers_on_hopper(kv_cache_dtype, tmp_path):
    log = nvcc("paged_attention.cu", "bfloat16", 128, 16, "-cubin", "-arch=sm_90", "-Xptxas", "-v",
               output=tmp_path / "paged_attention.cubin", kv_cache_dtype=kv_cache_dtype)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and not any(spills), log


def test_kernel_source_inlines_the_header():
    """NVRTC gets one string (CuPy's compile cache is keyed by it), header included."""
    header = (KERNELS / "kv_quant.cuh").read_text()
    for name in cupy_paged.SOURCES:
        assert '#include "kv_quant.cuh"' in (KERNELS / name).read_text()
        text = cupy_paged.kernel_source(name)
        assert '#include "kv_quant.cuh"' not in text and header in text


@pytest.fixture(scope="module")
def codec_binary(tmp_path_factory):
    """kv_quant.cuh's codecs built for the host (tests/cuda/kv_quant_host.cu)."""
    binary = tmp_path_factory.mktemp("codecs") / "kv_quant_host"
    source = Path(__file__).resolve().parent / "cuda" / "kv_quant_host.cu"
    command = [NVCC, "-std=c++17", "-I", str(KERNELS), "-o", str(binary), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}"
    return binary


def _rows_to_quantize(head_dim: int) -> torch.Tensor:
    """Rows over 60 decades of magnitude (fp8 subnormals, tiny and huge scales), a row of
    zeros, one of signed zeros, and int8 ties (x / scale on .5 exactly)."""
    generator = torch.Generator().manual_seed(head_dim)
    rows = torch.randn(3000, head_dim, generator=generator) * torch.logspace(-30, 30, 3000).unsqueeze(1)
    rows[0] = 0.0
    rows[1] = -0.0
    rows[2] = torch.arange(head_dim) - head_dim / 2 - 0.5
    rows[2, 0] = 127.0
    rows[3, : head_dim // 2] = 1e-3  # many elements far below the row's largest
    return rows


@needs_nvcc
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED_KV)
@pytest.mark.parametrize("head_dim", [4, 6, 80, 128])
def test_quantized_rows_are_torch_reference_bytes(codec_binary, kv_cache_dtype, head_dim, tmp_path):
    """The CUDA codecs (kv_quant.cuh, composed as sl_cache_write composes them) write the
    bytes of servelab.plugins.kernels.kv_quant.quantize_rows, padding and scale included."""
    import numpy as np

    from servelab.plugins.kernels.kv_quant import quantize_rows

    rows = _rows_to_quantize(head_dim)
    rows.numpy().astype(np.float32).tofile(tmp_path / "in")
    kind = cupy_paged.KV_CODES[kv_cache_dtype]
    subprocess.run([str(codec_binary), "quantize", str(kind), str(head_dim), str(tmp_path / "in"),
                    str(tmp_path / "out")], check=True, timeout=60)
    got = torch.from_numpy(np.fromfile(tmp_path / "out", dtype=np.uint8)).view(len(rows), -1)
    expected = quantize_rows(rows, kv_cache_dtype)
    differ = (got != expected).any(dim=1).nonzero().flatten().tolist()
    assert not differ, f"{len(differ)} rows differ, first {differ[:5]}: {got[differ[0]]} != {expected[differ[0]]}"


@needs_nvcc
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED_KV)
def test_quantized_elements_decode_as_torch_does(codec_binary, kv_cache_dtype, tmp_path):
    """Every byte's value (decode times kWiden, as the attention kernel applies it) is
    torch's value of that byte, for the finite ones (the writer never stores the others)."""
    import numpy as np

    from servelab.plugins.kernels.kv_quant import storage_dtype

    kind = cupy_paged.KV_CODES[kv_cache_dtype]
    subprocess.run([str(codec_binary), "decode", str(kind), str(tmp_path / "out")], check=True, timeout=60)
    got = torch.from_numpy(np.fromfile(tmp_path / "out", dtype=np.float32))
    expected = torch.arange(256, dtype=torch.uint8).view(storage_dtype(kv_cache_dtype)).float()
    finite = torch.isfinite(expected)
    assert torch.equal(got[finite], expected[finite])


def test_the_quantized_write_launches_a_warp_per_row():
    assert cupy_paged.write_grid(10, 8, 128, quantized=True) == 10  # 80 rows, 8 warps a block
    assert cupy_paged.write_grid(10, 8, 128, quantized=False) == 40  # 10,240 elements, 256 a block
    assert cupy_paged.write_grid(10 ** 6, 8, 128, quantized=True) == 65535  # then grid-stride


# ---------------------------------------------------------------- launch plan (CPU)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (16, 4), (32, 4), (12, 1), (14, 2)])
def test_tiles_cover_every_query_once(num_heads, num_kv_heads):
    rng = random.Random(num_heads)
    query_lens = tuple(rng.randint(1, 40) for _ in range(9))
    context_lens = tuple(q + rng.randint(0, 100) for q in query_lens)
    plan = cupy_paged.plan_step(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=64, options=CupyPagedOptions(), num_sms=132)
    group = num_heads // num_kv_heads
    per_cta = cupy_paged.heads_per_cta(group)
    assert group % per_cta == 0 and per_cta <= cupy_paged.ROWS_PER_CTA
    per_tile = cupy_paged.ROWS_PER_CTA // per_cta
    covered = [[0] * q for q in query_lens]
    for seq, q0 in plan.tiles.tolist():
        for i in range(q0, min(q0 + per_tile, query_lens[seq])):
            covered[seq][i] += 1
    assert all(count == 1 for row in covered for count in row)


def test_split_k_partitions_cover_the_longest_context():
    options = CupyPagedOptions(partition_size=512)
    # batch 64 decodes of 4096 tokens, 8 KV heads: 512 blocks, too few for 132 SMs -> split
    plan = cupy_paged.plan_step((1,) * 64, (4096,) * 64, num_heads=64, num_kv_heads=8, head_dim=128,
                                options=options, num_sms=132)
    assert plan.num_partitions == 8 and plan.partition_size * plan.num_partitions >= 4096
    # a short context or "never" does not split; "always" does whenever the context exceeds a partition
    assert cupy_paged.plan_step((1,), (300,), num_heads=8, num_kv_heads=2, head_dim=64, options=options,
                                num_sms=132).num_partitions == 1
    never = CupyPagedOptions(split_k="never")
    assert cupy_paged.plan_step((1,) * 4, (4096,) * 4, num_heads=8, num_kv_heads=2, head_dim=64, options=never,
                                num_sms=132).num_partitions == 1
    always = CupyPagedOptions(partition_size=16, split_k="always")
    plan = cupy_paged.plan_step((7, 1), (7, 40), num_heads=8, num_kv_heads=2, head_dim=64, options=always, num_sms=1)
    assert plan.num_partitions == 3 and plan.partition_size * 3 >= 40
    # the partial outputs stay within the scratch budget
    big = cupy_paged.plan_step((2048,), (100_000,), num_heads=64, num_kv_heads=8, head_dim=128, options=always,
                               num_sms=132)
    assert 2048 * 64 * 129 * 4 * big.num_partitions <= cupy_paged.MAX_SCRATCH_BYTES
    assert big.partition_size * big.num_partitions >= 100_000


# ---------------------------------------------------------------- selection without CuPy / GPU


@pytest.mark.skipif(GPU_PROBLEM is None, reason="CuPy and a GPU are here: selecting cupy-paged succeeds")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_selecting_cupy_paged_without_cupy_or_gpu_is_a_clear_error(llama_checkpoint, device):
    with pytest.raises(ConfigError, match="cupy-paged needs CuPy and a CUDA GPU: ") as info:
        LLM(llama_checkpoint, device=device, **{"attention.name": "cupy-paged"})
    message = str(info.value)
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "CuPy is not installed" in message and "servelab[cuda]" in message
    if device == "cpu":
        assert "engine.device is 'cpu'" in message


def test_cupy_paged_is_listed_without_importing_cupy():
    from servelab.registry import PluginRegistry

    registry = PluginRegistry.from_entry_points()
    registered = registry.select("attention", "cupy-paged")
    assert registered.plugin.options is CupyPagedOptions
    assert "CuPy" in registered.plugin.description


# ---------------------------------------------------------------- GPU: contract and conformance


@needs_gpu
class TestCupyPagedContract(AttentionBackendContract):
    plugin_name = "cupy-paged"
    device = "cuda"
    dtypes = ("float32", "bfloat16")
    max_examples = 8


@needs_gpu
class TestCupyPagedSplitKContract(AttentionBackendContract):
    """Every context longer than 8 keys is split, so the merge kernel runs on every shape."""

    plugin_name = "cupy-paged"
    options = CupyPagedOptions(partition_size=8, split_k="always")
    device = "cuda"
    dtypes = ("float32", "float16")
    max_examples = 5


def _make_batch(generator, shapes, num_kv_heads, num_heads, head_dim, block_size, dtype, device,
                kv_cache_dtype="auto"):
    """Caches of noise (quantized rows of noise for a quantized cache), shuffled block
    tables, and one step's queries / new K/V."""
    from servelab.plugins.kernels.kv_quant import quantize_rows, storage_dtype
    from servelab.testing.attention_batch import metadata_for

    blocks_needed = [math.ceil(c / block_size) for c, _ in shapes]
    num_blocks = sum(blocks_needed) + 5
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for count in blocks_needed:
        tables.append([physical.pop() for _ in range(count)])
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if kv_cache_dtype == "auto":
        caches = [torch.randn(shape, generator=generator).to(dtype).to(device) for _ in range(2)]
    else:
        caches = [quantize_rows(torch.randn(shape, generator=generator).to(dtype), kv_cache_dtype)
                  .view(storage_dtype(kv_cache_dtype)).to(device) for _ in range(2)]
    query_lens = [q for _, q in shapes]
    context_lens = [c for c, _ in shapes]
    tokens = sum(query_lens)
    query = torch.randn((tokens, num_heads, head_dim), generator=generator).to(dtype).to(device)
    key = torch.randn((tokens, num_kv_heads, head_dim), generator=generator).to(dtype).to(device)
    value = torch.randn((tokens, num_kv_heads, head_dim), generator=generator).to(dtype).to(device)
    metadata = metadata_for(tables, query_lens, context_lens, block_size, device)
    return num_blocks, caches, query, key, value, metadata


# (context after this step, new tokens): decodes, a prompt, chunks on top of a cache,
# drafts being verified, contexts ending on and off block boundaries, and long contexts
# crossing many blocks (split-K under "auto" for this small batch).
CONFORMANCE_SHAPES = [(1, 1), (17, 1), (64, 1), (1500, 1), (2100, 1), (33, 33), (700, 48), (260, 5), (96, 4), (8, 8)]
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
GQA = [(4, 4), (8, 4), (16, 4), (32, 4)]  # ratios 1, 2, 4, 8


def _conformance(num_heads, num_kv_heads, head_dim, block_size, dtype, options=None, shapes=CONFORMANCE_SHAPES,
                 kv_cache_dtype="auto"):
    """cupy-paged against torch-paged on one mixed step: the cache write byte for byte
    (quantized rows included), the attention output within TOLERANCE."""
    from servelab.interfaces import AttentionContext
    from servelab.plugins.kernels.torch_paged import TorchPagedAttention

    generator = torch.Generator().manual_seed(num_heads * 1000 + head_dim * 10 + block_size)
    num_blocks, caches, query, key, value, metadata = _make_batch(
        generator, shapes, num_kv_heads, num_heads, head_dim, block_size, dtype, "cuda", kv_cache_dtype)
    context = AttentionContext(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               block_size=block_size, num_blocks=num_blocks, dtype=dtype, device=torch.device("cuda"),
                               kv_cache_dtype=kv_cache_dtype)
    reference = TorchPagedAttention(None, context)
    backend = cupy_paged.CupyPagedAttention(options, context)
    assert backend.kv_cache_shape() == reference.kv_cache_shape() == tuple(caches[0].shape)
    assert backend.kv_cache_storage_dtype() == reference.kv_cache_storage_dtype() == caches[0].dtype
    scale = head_dim ** -0.5
    ref_caches = [c.clone() for c in caches]
    expected = reference.forward(query, key, value, *ref_caches, reference.prepare(metadata), scale)
    got = backend.forward(query, key, value, *caches, backend.prepare(metadata), scale)
    torch.cuda.synchronize()
    for mine, theirs in zip(caches, ref_caches):  # as bytes: torch.equal has no fp8 on CUDA
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), "the cache write differs from torch-paged's"
    tolerance = TOLERANCE[dtype]
    error = (got.float() - expected.float()).abs().max().item()
    assert torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance), (
        f"max abs error {error:.3g} > {tolerance} [{num_heads}/{num_kv_heads} heads, head_dim {head_dim}, "
        f"block {block_size}, {dtype}, kv_cache_dtype {kv_cache_dtype}]")


@needs_gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_matches_torch_paged_bf16(num_heads, num_kv_heads, head_dim, block_size):
    _conformance(num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (32, 4)])
def test_matches_torch_paged_other_dtypes(dtype, num_heads, num_kv_heads):
    _conformance(num_heads, num_kv_heads, 128, 16, dtype)


@needs_gpu
@pytest.mark.parametrize("split_k", ["never", "always"])
def test_matches_torch_paged_with_and_without_split_k(split_k):
    _conformance(32, 4, 128, 16, torch.bfloat16, CupyPagedOptions(partition_size=128, split_k=split_k))


@needs_gpu
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED_KV)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", [
    (32, 4, 128, 16, torch.bfloat16), (8, 4, 64, 8, torch.float16), (4, 4, 80, 16, torch.float32),
    (16, 4, 96, 32, torch.bfloat16)])
def test_quantized_cache_matches_torch_paged(kv_cache_dtype, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Quantize-on-write is torch-paged's bytes; attention over the quantized cache (both
    read the same rows) matches torch-paged's within the model dtype's tolerance."""
    _conformance(num_heads, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype=kv_cache_dtype)


@needs_gpu
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED_KV)
def test_quantized_cache_matches_torch_paged_with_split_k(kv_cache_dtype):
    _conformance(32, 4, 128, 16, torch.bfloat16, CupyPagedOptions(partition_size=128, split_k="always"),
                 kv_cache_dtype=kv_cache_dtype)


# ---------------------------------------------------------------- GPU: engine end to end


def _hf_greedy(checkpoint: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@needs_gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_engine_greedy_matches_transformers(checkpoint_factory, kind):
    path = checkpoint_factory(kind)
    vocab = __import__("json").load(open(f"{path}/config.json"))["vocab_size"]
    rng = random.Random(0)
    lengths, max_new = [1, 5, 17, 33, 9, 64, 2, 40], [12, 20, 7, 16, 25, 9, 30, 14]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    expected = [_hf_greedy(path, p, n) for p, n in zip(prompts, max_new)]
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=128, **{"attention.name": "cupy-paged"})
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_new]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
