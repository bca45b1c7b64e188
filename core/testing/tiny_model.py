"""Tiny random Hugging Face checkpoints, built with `transformers` on the fly.

The end-to-end contracts and servelab's own tests run on these: a 2-layer model builds
and runs in well under a second, yet has GQA, RoPE and odd sizes, so a policy that
mixes up sequences, blocks or heads changes the greedy tokens.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

# Shapes chosen to be odd on purpose: GQA 6:2 / 4:1, head_dim 12, vocab 211.
TINY_SHAPES = {
    "llama": dict(hidden_size=72, intermediate_size=100, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=12, vocab_size=211, max_position_embeddings=256),
    "llama3-rope-tied": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, vocab_size=199, max_position_embeddings=256,
                             tie_word_embeddings=True,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # A much smaller model over the "llama" vocabulary: a draft model for speculative decoding.
    "llama-draft": dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, vocab_size=211, max_position_embeddings=256),
    # Multi-head attention (as many KV heads as query heads), untied, an odd MLP width.
    "llama-mha": dict(hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=157, max_position_embeddings=256),
    "qwen2": dict(hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=203, max_position_embeddings=256),
    "mistral": dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=190, max_position_embeddings=256, sliding_window=None),
    # Mixtures of experts: expert counts that are not powers of two, top-k 1, 2 and 3, hidden
    # sizes that are not multiples of 16; Qwen2-MoE with its shared expert and a dense layer.
    "mixtral": dict(hidden_size=36, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=10, vocab_size=151, max_position_embeddings=256,
                    num_local_experts=5, num_experts_per_tok=2),
    "mixtral-top1": dict(hidden_size=36, intermediate_size=28, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=10, vocab_size=151, max_position_embeddings=256,
                         num_local_experts=3, num_experts_per_tok=1),
    "qwen2_moe": dict(hidden_size=40, intermediate_size=50, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=163, max_position_embeddings=256, num_experts=7,
                      num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=30,
                      norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": dict(hidden_size=52, intermediate_size=60, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=14, vocab_size=173, max_position_embeddings=256,
                      num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20, norm_topk_prob=True),
}


def build_checkpoint(kind: str, path) -> str:
    """Save a seeded random HF model of `kind` (a key of TINY_SHAPES) to `path`; returns the directory."""
    import torch
    import transformers

    shape = dict(TINY_SHAPES[kind])
    family = kind.split("-")[0]
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    config = config_cls(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(1234)
    model = model_cls(config)
    # Default init is small enough that greedy decoding collapses to one token; widen it
    # so outputs vary and a wrong kernel cannot hide behind a constant argmax.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # MoE experts are stacked [experts, rows, columns]
                param.normal_(0.0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
            elif "norm" not in name:
                param.normal_(0.0, 0.05)  # biases (Qwen2 q/k/v)
    model.save_pretrained(path)
    return str(path)


_built: dict[str, str] = {}


def tiny_checkpoint(kind: str = "llama") -> str:
    """A checkpoint of `kind`, built once per process into a temporary directory."""
    if kind not in _built:
        root = Path(tempfile.mkdtemp(prefix="servelab-tiny-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _built[kind] = build_checkpoint(kind, root / kind)
    return _built[kind]
