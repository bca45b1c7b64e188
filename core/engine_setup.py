"""Deriving the engine's limits (context length, token budget, KV blocks) from the
config and the model, with errors that name the key to change."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from servelab.config import EngineSection, build_options
from servelab.errors import ConfigError
from servelab.interfaces import AttentionContext, TargetModel
from servelab.model.kv_sizing import DTYPE_BYTES, blocks_for, kv_pool_blocks
from servelab.model.loader import DTYPES
from servelab.model.model_config import ModelConfig
from servelab.plugin_types import KINDS
from servelab.registry import build_policy


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
    # Past what max_num_seqs sequences of max_model_len can hold, more blocks sit idle.
    useful_blocks = engine.max_num_seqs * blocks_for(max_model_len, engine.block_size)
    num_kv_blocks = engine.num_kv_blocks or min(
        kv_pool_blocks(engine.kv_cache_memory, model.kv_bytes_per_token(DTYPE_BYTES[engine.dtype]), engine.block_size),
        useful_blocks)
    if num_kv_blocks * engine.block_size < max_model_len:
        raise ConfigError(
            f"the KV cache holds {num_kv_blocks} blocks x {engine.block_size} = "
            f"{num_kv_blocks * engine.block_size} tokens, fewer than max_model_len={max_model_len}; "
            f"raise [engine] kv_cache_memory or num_kv_blocks, or lower max_model_len")
    return EngineLimits(max_model_len, max_num_batched_tokens, num_kv_blocks)


def target_model(source: Any, runner: Any, engine: EngineSection) -> TargetModel | None:
    """What drafters may read of the target: its LM head (None for the simulator)."""
    lm_head = getattr(runner, "lm_head", None)
    if lm_head is None:
        return None
    config = source.model_config
    return TargetModel(hidden_size=config.hidden_size, vocab_size=config.vocab_size, lm_head=lm_head,
                       path=str(source.path) if source.path is not None else None,
                       dtype=DTYPES[engine.dtype], device=torch.device(engine.device))


def load_aux_model(spec: str, num_blocks: int, engine: EngineSection, registry: Any, attention: Any,
                   max_positions: int) -> Any:
    """Another checkpoint (a draft model) in the engine's dtype and device, with its own KV
    cache of `num_blocks` blocks and its own instance of the engine's attention backend."""
    from servelab.model.source import CheckpointSource

    source = CheckpointSource(spec)
    config = source.model_config
    if config.max_position_embeddings < max_positions:
        raise ConfigError(
            f"model {spec!r} handles {config.max_position_embeddings} positions, fewer than "
            f"max_model_len={max_positions}; lower [engine] max_model_len or choose another model")
    registered = registry.select("attention", attention.name)
    options = build_options(registered.plugin.options, attention.options, KINDS["attention"].section, attention.name)
    backend = build_policy(registered, options, AttentionContext(
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        block_size=engine.block_size, num_blocks=num_blocks, dtype=DTYPES[engine.dtype],
        device=torch.device(engine.device)))
    return source.build_runner(backend, engine, num_blocks, max_positions)
