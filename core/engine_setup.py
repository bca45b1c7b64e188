"""Deriving the engine's limits (context length, token budget, KV blocks) from the
config and the model, with errors that name the key to change."""

from __future__ import annotations

import attrs

from servelab.config import EngineSection
from servelab.errors import ConfigError
from servelab.model.model_config import ModelConfig

_DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@attrs.frozen
class EngineLimits:
    max_model_len: int
    max_num_batched_tokens: int
    num_kv_blocks: int


def resolve_limits(engine: EngineSection, model: ModelConfig) -> EngineLimits:
    max_model_len = engine.max_model_len or min(model.max_position_embeddings, 2048)
    if max_model_len > model.max_position_embeddings:
        raise ConfigError(
            f"[engine] max_model_len={max_model_len} exceeds the model's "
            f"max_position_embeddings={model.max_position_embeddings}")
    if model.sliding_window is not None and max_model_len > model.sliding_window:
        raise ConfigError(
            f"[engine] max_model_len={max_model_len} exceeds the model's sliding_window={model.sliding_window}, "
            f"which servelab does not implement; set max_model_len <= {model.sliding_window}")
    max_num_batched_tokens = engine.max_num_batched_tokens or max(2048, max_model_len)
    block_bytes = model.kv_bytes_per_token(_DTYPE_SIZES[engine.dtype]) * engine.block_size
    # Past what max_num_seqs sequences of max_model_len can hold, more blocks sit idle.
    useful_blocks = engine.max_num_seqs * -(-max_model_len // engine.block_size)
    num_kv_blocks = engine.num_kv_blocks or min(engine.kv_cache_memory // block_bytes, useful_blocks)
    if num_kv_blocks * engine.block_size < max_model_len:
        raise ConfigError(
            f"the KV cache holds {num_kv_blocks} blocks x {engine.block_size} = "
            f"{num_kv_blocks * engine.block_size} tokens, fewer than max_model_len={max_model_len}; "
            f"raise [engine] kv_cache_memory or num_kv_blocks, or lower max_model_len")
    return EngineLimits(max_model_len, max_num_batched_tokens, num_kv_blocks)
