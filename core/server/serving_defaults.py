"""The engine settings `servelab serve` sizes for throughput where the user left them.

A library user's `LLM` keeps the engine's small defaults (a 512 MiB KV pool, 64
sequences a step), which start fast and suit tests and notebooks. A server is there to
be loaded: as vLLM's server does, it admits many sequences at once (256) and gives the KV
cache a large pool (4 GiB, as vLLM's CPU build; at most a quarter of the machine's
memory). The pool costs nothing until it is used: its memory is mapped zeroed and only
the blocks that hold tokens are ever backed (servelab.model.memory). The trade-off: more
sequences a step raise throughput and each sequence's TPOT with it; `--set
engine.max_num_seqs=N` and `--set engine.kv_cache_memory=SIZE` choose otherwise, and a
value set in the config file or with --set is never changed.

On a CPU that computes bfloat16 natively (AVX-512 BF16 or AMX), the server runs the model
in bfloat16, as vLLM's CPU server does for float32 and float16 checkpoints: on such a CPU
it serves 1.5x (AVX-512 BF16) to 2.3x (AMX) float32's tokens at saturation
(docs/serving.md); `--dtype float32` keeps float32.
Elsewhere bfloat16 is widened to float32 for every multiply and gains nothing, so float32
stays.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Iterable

SERVING_MAX_NUM_SEQS = 256
SERVING_KV_CACHE_MEMORY = 4 * 2**30
_MEMORY_SHARE = 4  # the pool takes at most 1 / _MEMORY_SHARE of the machine's memory


def serving_defaults(total_memory: int | None = None, device: str = "cpu",
                     native_bf16: bool | None = None) -> dict[str, Any]:
    """`engine.*` values the server uses where the user set none."""
    total = total_memory if total_memory is not None else machine_memory()
    memory = SERVING_KV_CACHE_MEMORY if total is None else min(SERVING_KV_CACHE_MEMORY, total // _MEMORY_SHARE)
    defaults: dict[str, Any] = {"engine.max_num_seqs": SERVING_MAX_NUM_SEQS, "engine.kv_cache_memory": memory}
    if device == "cpu" and (native_bf16 if native_bf16 is not None else cpu_computes_bf16()):
        defaults["engine.dtype"] = "bfloat16"
    return defaults


def with_serving_defaults(config: Any, explicit: Iterable[str], total_memory: int | None = None,
                          native_bf16: bool | None = None) -> Any:
    """`config` with the serving defaults for every key not in `explicit` ("engine.max_num_seqs", ...);
    a config that fixes `engine.num_kv_blocks` keeps its pool as it is. `native_bf16`: whether
    this CPU computes bfloat16 natively (None: ask it)."""
    explicit = set(explicit)
    if "engine.num_kv_blocks" in explicit:
        explicit.add("engine.kv_cache_memory")
    defaults = serving_defaults(total_memory, config.engine.device, native_bf16)
    overrides = {key: value for key, value in defaults.items() if key not in explicit}
    return config.with_overrides(overrides) if overrides else config


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX-512 BF16) or tiles (AMX), as torch
    reports them; False where torch cannot say."""
    import torch

    cpu = torch.cpu
    try:
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def explicit_keys(config_path: str | Path | None, assignments: Iterable[str]) -> set[str]:
    """The `section.key` names a config file and --set assignments give values to."""
    keys = {_dotted(assignment.partition("=")[0].strip()) for assignment in assignments}
    if config_path is not None:
        with open(config_path, "rb") as file:
            data = tomllib.load(file)
        keys |= {f"{section}.{key}" for section, table in data.items() if isinstance(table, dict) for key in table}
    return keys


def _dotted(key: str) -> str:
    return key if "." in key else f"engine.{key}"  # --set max_num_seqs=8 sets [engine]


def machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
