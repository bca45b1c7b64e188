"""Model shapes the simulator knows, as ModelConfig records (no weights needed)."""

from __future__ import annotations

from servelab.errors import ConfigError
from servelab.model.model_config import ModelConfig
from servelab.model.moe_config import MoEShape


def _shape(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
           max_positions: int, head_dim: int | None = None) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, max_position_embeddings=max_positions,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=None,
        bos_token_id=None, eos_token_ids=(),
    )


# Mixtral-8x7B: 32 layers, every one sparse (8 experts, top-2, each expert a SwiGLU of width 14336)
MIXTRAL_8X7B = ModelConfig(
    model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling=None,
    max_position_embeddings=32768, tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
    sliding_window=None, bos_token_id=1, eos_token_ids=(2,),
    moe=MoEShape(num_experts=8, top_k=2, expert_intermediate_size=14336, norm_topk_prob=True, float_weights=True,
                 shared_expert_intermediate_size=0, sparse_layers=tuple(range(32)),
                 checkpoint_block="block_sparse_moe", checkpoint_projections=("w1", "w3", "w2")))

MODEL_SHAPES = {
    "llama-3-8b": _shape(4096, 32, 32, 8, 14336, 128256, 8192),
    "llama-3-70b": _shape(8192, 80, 64, 8, 28672, 128256, 8192),
    "qwen2-7b": _shape(3584, 28, 28, 4, 18944, 152064, 32768),
    "tiny-random": _shape(512, 8, 8, 4, 1408, 8192, 2048, head_dim=64),
    "mixtral-8x7b": MIXTRAL_8X7B,  # a mixture of experts: the step cost model refuses it, `servelab size` prices it
}


def model_shape(name: str) -> ModelConfig:
    try:
        return MODEL_SHAPES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown model shape {name!r}; choose {', '.join(MODEL_SHAPES)}") from None


def num_parameters(shape: ModelConfig) -> tuple[int, int]:
    """(parameters used per token in the decoder layers, LM head parameters) of a dense decoder."""
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    per_layer = shape.hidden_size * (q + 2 * kv) + q * shape.hidden_size + 3 * shape.hidden_size * shape.intermediate_size
    return shape.num_layers * per_layer, shape.hidden_size * shape.vocab_size
