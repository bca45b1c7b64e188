"""cupy-paged: paged attention in raw CUDA, compiled at run time by CuPy (NVRTC).

The CUDA sources sit beside this module (`cache_write.cu`, `paged_attention.cu`) and are
compiled once per (dtype, head size, block size) with -D defines; the test suite compiles
the same files to PTX with nvcc, so a kernel that does not compile fails CI without a GPU.

A step runs up to three kernels per layer: `sl_cache_write` stores the new K/V at the
slot mapping, `sl_paged_attention` attends (decodes, prompt chunks and draft verification
alike: one CUDA block per tile of query rows sharing a KV head, per split-K partition),
and `sl_reduce_partitions` merges the partitions when the step was split.

CuPy is imported only when the backend is built: listing plugins, and selecting
`cupy-paged` where CuPy or a GPU is missing, never imports it. The latter is a
ConfigError that says what is missing.

Cache layout: [num_kv_heads, num_blocks, block_size, head_dim], the same as torch-paged,
so a (head, block) pair is one contiguous block_size * head_dim run that a group of lanes
reads with coalesced 16-byte loads.

Quantized KV cache (`[engine] kv_cache_dtype` int8, fp8_e4m3, fp8_e5m2): the same layout
with torch-paged's quantized rows (kv_quant.py) as the last dimension. The kernels are
compiled for the cache's element type too (-DSL_KV, kv_quant.cuh): `sl_cache_write`
quantizes each (token, KV head) row with one warp, writing the bytes torch-paged writes,
and `sl_paged_attention` reads the one-byte elements and multiplies each row's scale into
its score (K) or softmax weight (V).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from servelab.errors import ConfigError
from servelab.interfaces import AttentionContext, AttentionMetadata, QuantizedKVBackend, kv_row_elements
from servelab.plugins.kernels.kv_quant import storage_dtype
from servelab.plugins.kernels.options import CupyPagedOptions

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("cache_write.cu", "paged_attention.cu")
HEADERS = ("kv_quant.cuh",)  # inlined into the sources' text (kernel_source)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KV_CODES = {"auto": 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}  # SL_KV in kv_quant.cuh
WRITE_THREADS = 256  # threads per block of sl_cache_write
ROWS_PER_CTA = 8  # SL_ROWS in paged_attention.cu
THREADS = 128  # SL_THREADS
NO_SPLIT = 1 << 30  # partition size that means "one partition"
MAX_SCRATCH_BYTES = 256 << 20  # split-K partial outputs per step, at most
_UNAVAILABLE = "cupy-paged needs CuPy and a CUDA GPU: "


def compile_defines(dtype: torch.dtype, head_dim: int, block_size: int,
                    kv_cache_dtype: str = "auto") -> tuple[str, ...]:
    """The -D options one instantiation of the kernels is compiled with (NVRTC and nvcc alike)."""
    return (f"-DSL_DTYPE={DTYPE_CODES[dtype]}", f"-DSL_HEAD_DIM={head_dim}", f"-DSL_BLOCK_SIZE={block_size}",
            f"-DSL_KV={KV_CODES[kv_cache_dtype]}")


def kernel_source(name: str) -> str:
    """A .cu file's text with its `#include "kv_quant.cuh"` replaced by the header's text:
    NVRTC compiles a string, and CuPy's compile cache is keyed by it, so an edit to the
    header must change the string."""
    text = (KERNEL_DIR / name).read_text()
    for header in HEADERS:
        text = text.replace(f'#include "{header}"', (KERNEL_DIR / header).read_text())
    return text


def write_grid(num_tokens: int, num_kv_heads: int, head_dim: int, quantized: bool) -> int:
    """Blocks of WRITE_THREADS for sl_cache_write: a thread per element, or a warp per
    (token, KV head) row for a quantized cache; grid-stride past 65,535."""
    if quantized:
        return min(-(-num_tokens * num_kv_heads // (WRITE_THREADS // 32)), 65535)
    return min(-(-num_tokens * num_kv_heads * head_dim // WRITE_THREADS), 65535)


def heads_per_cta(group_size: int) -> int:
    """Query heads of one GQA group a CTA takes: the largest divisor of the group <= 8."""
    return max(h for h in range(1, min(group_size, ROWS_PER_CTA) + 1) if group_size % h == 0)


@attrs.frozen
class LaunchPlan:
    """Host-side layout of one step, independent of CUDA (unit-tested on the CPU)."""

    tiles: np.ndarray  # [num_tiles, 2] int32: sequence, first query of the tile
    num_partitions: int
    partition_size: int  # keys per partition (NO_SPLIT when num_partitions == 1)


def plan_step(query_lens: tuple[int, ...], context_lens: tuple[int, ...], *, num_heads: int, num_kv_heads: int,
              head_dim: int, options: CupyPagedOptions, num_sms: int) -> LaunchPlan:
    """Cut each sequence's queries into tiles and choose the split-K partitioning.

    A tile holds 8 // heads_per_cta consecutive queries of one sequence. Split-K cuts the
    key axis of the longest context into partitions of `options.partition_size` keys ("auto"
    does so only when the step has fewer than 8 CUDA blocks per SM otherwise), keeping the
    float32 partial outputs within MAX_SCRATCH_BYTES.
    """
    group = num_heads // num_kv_heads
    per_cta = heads_per_cta(group)
    queries_per_tile = ROWS_PER_CTA // per_cta
    q = np.asarray(query_lens, dtype=np.int64)
    tiles_per_seq = -(-q // queries_per_tile)
    num_tiles = int(tiles_per_seq.sum())
    seq = np.repeat(np.arange(len(q)), tiles_per_seq)
    first_tile = np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)
    q0 = (np.arange(num_tiles) - first_tile) * queries_per_tile
    tiles = np.stack([seq, q0], axis=1).astype(np.int32)

    max_context = max(context_lens)
    parts = 1
    if options.split_k != "never" and max_context > options.partition_size:
        ctas = num_tiles * num_kv_heads * (group // per_cta)
        if options.split_k == "always" or ctas < 8 * num_sms:
            parts = -(-max_context // options.partition_size)
            num_tokens = int(q.sum())
            per_part = num_tokens * num_heads * (head_dim + 1) * 4
            parts = max(1, min(parts, MAX_SCRATCH_BYTES // per_part))
    if parts == 1:
        return LaunchPlan(tiles, 1, NO_SPLIT)
    return LaunchPlan(tiles, parts, -(-max_context // parts))


@attrs.frozen
class Prepared:
    plan: LaunchPlan
    tiles: torch.Tensor  # [num_tiles, 2] int32 on the device
    metadata: AttentionMetadata
    part_out: torch.Tensor | None  # [T * num_heads * P * head_dim] float32 scratch (split-K)
    part_lse: torch.Tensor | None  # [T * num_heads * P]


def _import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise ConfigError(_UNAVAILABLE + _NO_CUPY.format(exc=exc)) from exc
    return cupy


_NO_CUPY = ("CuPy is not installed ({exc}); install it with `pip install \"servelab[cuda]\"` "
            "(cupy-cuda13x; cupy-cuda12x for a CUDA 12 driver)")


def check_available(device: Any) -> None:
    """Raise ConfigError, naming everything missing, unless CuPy imports and `device` is a
    usable CUDA device."""
    device = torch.device(device)
    problems = []
    try:
        import cupy
    except ImportError as exc:
        cupy = None
        problems.append(_NO_CUPY.format(exc=exc))
    if device.type != "cuda":
        problems.append(f"engine.device is {str(device)!r}; set engine.device = \"cuda\"")
    elif not torch.cuda.is_available():
        problems.append("torch sees no CUDA device (torch.cuda.is_available() is False)")
    elif cupy is not None:
        try:
            if cupy.cuda.runtime.getDeviceCount() == 0:
                problems.append("CuPy sees no CUDA device")
        except Exception as exc:  # CUDARuntimeError, a driver too old for this CuPy, ...
            problems.append(f"CuPy cannot reach a GPU ({type(exc).__name__}: {exc})")
    if problems:
        raise ConfigError(_UNAVAILABLE + "; ".join(problems))


_MODULES: dict[tuple, Any] = {}


def _kernels(cupy: Any, dtype: torch.dtype, head_dim: int, block_size: int, kv_cache_dtype: str,
             device_index: int) -> dict[str, Any]:
    """The three kernels of one instantiation, compiled once per process (and cached on
    disk by CuPy across processes)."""
    key = (dtype, head_dim, block_size, kv_cache_dtype, device_index)
    if key not in _MODULES:
        options = ("--std=c++17", *compile_defines(dtype, head_dim, block_size, kv_cache_dtype))
        with cupy.cuda.Device(device_index):
            write = cupy.RawModule(code=kernel_source("cache_write.cu"), options=options)
            attend = cupy.RawModule(code=kernel_source("paged_attention.cu"), options=options)
            _MODULES[key] = {
                "write": write.get_function("sl_cache_write"),
                "attend": attend.get_function("sl_paged_attention"),
                "reduce": attend.get_function("sl_reduce_partitions"),
            }
    return _MODULES[key]


class CupyPagedAttention(QuantizedKVBackend):
    supported_kv_cache_dtypes = frozenset({"int8", "fp8_e4m3", "fp8_e5m2"})

    def __init__(self, options: CupyPagedOptions | None, context: AttentionContext) -> None:
        if context.kv_cache_dtype not in KV_CODES:
            raise ConfigError(f"cupy-paged: unknown kv_cache_dtype {context.kv_cache_dtype!r}; "
                              f"one of {', '.join(KV_CODES)}")
        check_available(context.device)
        if context.dtype not in DTYPE_CODES:
            raise ConfigError(f"cupy-paged supports float32, float16 and bfloat16, not {context.dtype}")
        if context.num_heads % context.num_kv_heads:
            raise ConfigError(f"cupy-paged: {context.num_heads} query heads are not a multiple of "
                              f"{context.num_kv_heads} KV heads")
        self.cupy = _import_cupy()
        self.options = options or CupyPagedOptions()
        self.context = context
        self.device = torch.device(context.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = context.num_heads // context.num_kv_heads
        self.heads_per_cta = heads_per_cta(self.group)
        self.queries_per_cta = ROWS_PER_CTA // self.heads_per_cta
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        try:
            self.kernels = _kernels(self.cupy, context.dtype, context.head_dim, context.block_size,
                                    context.kv_cache_dtype, self.device.index)
        except Exception as exc:  # a compile error names the instantiation
            raise ConfigError(f"cupy-paged: compiling the kernels for {context.dtype}, head_dim {context.head_dim}, "
                              f"block_size {context.block_size}, kv_cache_dtype {context.kv_cache_dtype} "
                              f"failed: {exc}") from exc
        self.quantized = context.kv_cache_dtype != "auto"
        self._streams: dict[int, Any] = {}

    def kv_cache_shape(self) -> tuple[int, ...]:
        c = self.context
        return (c.num_kv_heads, c.num_blocks, c.block_size, kv_row_elements(c.head_dim, c.kv_cache_dtype))

    def kv_cache_block_dim(self) -> int:
        return 1

    def kv_cache_storage_dtype(self) -> torch.dtype:
        return storage_dtype(self.context.kv_cache_dtype) if self.quantized else self.context.dtype

    # ------------------------------------------------------------ per step

    def prepare(self, metadata: AttentionMetadata) -> Prepared:
        c = self.context
        plan = plan_step(metadata.query_lens_list, metadata.context_lens_list, num_heads=c.num_heads,
                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, options=self.options, num_sms=self.num_sms)
        tiles = torch.from_numpy(plan.tiles).to(self.device, non_blocking=True)
        part_out = part_lse = None
        if plan.num_partitions > 1:
            rows = sum(metadata.query_lens_list) * c.num_heads * plan.num_partitions
            part_out = torch.empty(rows * c.head_dim, dtype=torch.float32, device=self.device)
            part_lse = torch.empty(rows, dtype=torch.float32, device=self.device)
        as_int64 = {name: getattr(metadata, name).to(self.device, torch.int64).contiguous()
                    for name in ("query_start_loc", "context_lens", "block_tables", "slot_mapping")}
        return Prepared(plan, tiles, attrs.evolve(metadata, **as_int64), part_out, part_lse)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, prepared: Prepared, scale: float) -> torch.Tensor:
        c = self.context
        num_tokens = query.shape[0]
        out = torch.empty((num_tokens, c.num_heads, c.head_dim), dtype=query.dtype, device=query.device)
        if num_tokens == 0:
            return out
        query, key, value = (_aligned(t) for t in (query, key, value))
        meta = prepared.metadata
        plan = prepared.plan
        cupy = self.cupy
        arr = _cupy_array
        with cupy.cuda.Device(self.device.index), self._stream():
            self.kernels["write"](
                (write_grid(num_tokens, c.num_kv_heads, c.head_dim, self.quantized),), (WRITE_THREADS,),
                (arr(cupy, key), arr(cupy, value), arr(cupy, key_cache), arr(cupy, value_cache),
                 arr(cupy, meta.slot_mapping), np.int32(num_tokens), np.int32(c.num_kv_heads),
                 np.int64(c.num_blocks * c.block_size)))
            split = plan.num_partitions > 1
            scratch_out = arr(cupy, prepared.part_out) if split else arr(cupy, out)
            scratch_lse = arr(cupy, prepared.part_lse) if split else arr(cupy, out)
            grid = (len(plan.tiles), c.num_kv_heads * (self.group // self.heads_per_cta), plan.num_partitions)
            self.kernels["attend"](
                grid, (THREADS,),
                (arr(cupy, out), scratch_out, scratch_lse, arr(cupy, query), arr(cupy, key_cache),
                 arr(cupy, value_cache), arr(cupy, meta.block_tables), arr(cupy, prepared.tiles),
                 arr(cupy, meta.query_start_loc), arr(cupy, meta.context_lens),
                 np.int32(meta.block_tables.shape[1]), np.int32(c.num_heads), np.int32(c.num_kv_heads),
                 np.int32(c.num_blocks), np.int32(self.heads_per_cta), np.int32(self.queries_per_cta),
                 np.int32(plan.partition_size), np.float32(scale * math.log2(math.e))))
            if split:
                self.kernels["reduce"](
                    (num_tokens * c.num_heads,), (THREADS,),
                    (arr(cupy, out), scratch_out, scratch_lse, np.int32(plan.num_partitions)))
        return out

    def _stream(self) -> Any:
        """CuPy's handle on torch's current stream, so both order their work alike."""
        pointer = torch.cuda.current_stream(self.device).cuda_stream
        if pointer not in self._streams:
            self._streams[pointer] = (self.cupy.cuda.Stream.null if pointer == 0
                                      else self.cupy.cuda.ExternalStream(pointer))
        return self._streams[pointer]


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels load 16-byte chunks): a fresh copy when not."""
    if tensor.is_contiguous() and tensor.data_ptr() % 16 == 0:
        return tensor
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)  # allocations are aligned
    copy.copy_(tensor)
    return copy


def _cupy_array(cupy: Any, tensor: torch.Tensor) -> Any:
    """A zero-copy CuPy view of a contiguous torch CUDA tensor. CuPy has no bfloat16 or
    fp8, so 16-bit tensors travel as int16 and one-byte ones as uint8: the kernels only
    see the pointer."""
    if tensor.element_size() == 2:
        tensor = tensor.view(torch.int16)
    elif tensor.element_size() == 1:
        tensor = tensor.view(torch.uint8)
    return cupy.from_dlpack(tensor.detach())
