"""What a KV cache costs: the element size of each dtype the engine runs in, and how
many blocks a memory budget holds. One table and one division, shared by the engine's
limits, the simulator's cost model and the capacity planner (torch-free)."""

from __future__ import annotations

# Bytes per element of the dtypes servelab runs in (`[engine] dtype`), by torch's name.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks a sequence of `num_tokens` tokens holds (its last one partly filled)."""
    return -(-num_tokens // block_size)


def kv_pool_blocks(pool_bytes: float, kv_bytes_per_token: float, block_size: int) -> int:
    """Whole blocks of `block_size` tokens that `pool_bytes` of KV memory holds, at
    `kv_bytes_per_token` (ModelConfig.kv_bytes_per_token: K and V of every layer); 0 when
    the budget is negative or below one block."""
    return int(max(0.0, pool_bytes) // (kv_bytes_per_token * block_size))
