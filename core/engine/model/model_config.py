"""Reading a Hugging Face `config.json` into the few numbers the decoder needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from servelab.errors import CheckpointError
from servelab.kv_sizing import kv_row_bytes
from servelab.model.moe_config import MoEShape

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Qwen2, Mistral), and of its
    mixture-of-experts kin (Mixtral, Qwen2-MoE, Qwen3-MoE: `moe` set)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # {"rope_type": "llama3" | "linear", ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoEShape | None = None  # the sparse layers; None for a dense model
    qk_norm: bool = False  # an RMSNorm over each query and key head before the rotation (Qwen3)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(f"{t} ({a})" for t, a in SUPPORTED_MODEL_TYPES.items())
            raise CheckpointError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={raw.get('architectures')}); supported: {supported}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {raw.get('hidden_act')!r}; only 'silu' (SwiGLU) is supported")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden_size = int(raw["hidden_size"])
            theta, scaling = _rope_settings(raw)
            eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
            use_window = raw.get("use_sliding_window", model_type in ("mistral", "mixtral"))
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=_qkv_bias(model_type, raw),
                o_bias=model_type not in ("qwen2", "qwen2_moe") and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                sliding_window=raw.get("sliding_window") if use_window else None,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_ids(eos),
                moe=MoEShape.from_dict(raw),
                qk_norm=model_type == "qwen3_moe",
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks required key {exc.args[0]!r}") from None

    @classmethod
    def from_directory(cls, path: Path) -> "ModelConfig":
        config_path = path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"checkpoint directory {str(path)!r} has no config.json")
        raw = json.loads(config_path.read_text())
        generation_path = path / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
        return cls.from_dict(raw, generation)

    def kv_bytes_per_token(self, dtype_size: int, kv_cache_dtype: str = "auto") -> int:
        """K and V of every layer for one token, at `dtype_size` bytes an element, or in a
        quantized cache (`kv_cache_dtype`: one byte an element and a scale per row)."""
        return 2 * self.num_layers * self.num_kv_heads * kv_row_bytes(self.head_dim, dtype_size, kv_cache_dtype)


def _qkv_bias(model_type: str, raw: dict[str, Any]) -> bool:
    if model_type == "qwen2":
        return True
    if model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    return bool(raw.get("attention_bias", False))


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_settings(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either the new (`rope_parameters`) or old
    (`rope_theta` + `rope_scaling`) config layout."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise CheckpointError(f"unsupported RoPE scaling {rope_type!r}; supported: default, linear, llama3")
    return theta, {**merged, "rope_type": rope_type}
