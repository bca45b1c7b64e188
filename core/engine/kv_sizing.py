"""What a KV cache costs: the element size of each dtype the engine runs in, the layout of a
quantized cache row, and how many blocks a memory budget holds. One table and one division,
shared by the engine's limits, the attention backends, the simulator's cost model and the
capacity planner (torch-free)."""

from __future__ import annotations

# Bytes per element of the dtypes servelab runs in (`[engine] dtype`), by torch's name.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

# `[engine] kv_cache_dtype`: "auto" stores K/V in the model's dtype; the others store one
# byte per element plus a float32 scale per (token, KV head) row (docs/attention.md,
# "Quantized KV cache").
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
# The largest magnitude each quantized element holds: a row is stored as x / scale with
# scale = max|x| / QUANTIZED_KV_MAX, so the row's largest element lands on it.
QUANTIZED_KV_MAX: dict[str, float] = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# torch's name of the element dtype each quantized cache is allocated in.
QUANTIZED_KV_TORCH_DTYPE: dict[str, str] = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_SCALE_BYTES = 4  # one float32 scale per (token, KV head) row, stored after the row's elements


def is_quantized_kv(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype != "auto"


def kv_scale_offset(head_dim: int) -> int:
    """Where a quantized row's scale starts (in elements = bytes): after the head_dim
    elements, rounded up to 4 so the float32 scale is aligned."""
    return -(-head_dim // KV_SCALE_BYTES) * KV_SCALE_BYTES


def kv_row_elements(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements one (token, KV head) row of K or V takes in the cache: head_dim in the model's
    dtype, or the one-byte elements, padding and the four bytes of the scale."""
    if not is_quantized_kv(kv_cache_dtype):
        return head_dim
    return kv_scale_offset(head_dim) + KV_SCALE_BYTES


def kv_row_bytes(head_dim: int, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one (token, KV head) row of K or V in a cache of `kv_cache_dtype`, for a
    model whose elements take `dtype_bytes` ("auto")."""
    if not is_quantized_kv(kv_cache_dtype):
        return head_dim * dtype_bytes
    return kv_row_elements(head_dim, kv_cache_dtype)


def check_kv_cache_dtype(value: str) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks a sequence of `num_tokens` tokens holds (its last one partly filled)."""
    return -(-num_tokens // block_size)


def kv_pool_blocks(pool_bytes: float, kv_bytes_per_token: float, block_size: int) -> int:
    """Whole blocks of `block_size` tokens that `pool_bytes` of KV memory holds, at
    `kv_bytes_per_token` (ModelConfig.kv_bytes_per_token: K and V of every layer); 0 when
    the budget is negative or below one block."""
    return int(max(0.0, pool_bytes) // (kv_bytes_per_token * block_size))
