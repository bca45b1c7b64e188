"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama decoder with a
sparse block (servelab.model.moe) in place of the MLP of each sparse layer and, for
Qwen3-MoE, an RMSNorm over each query and key head before the rotation.

These models take the decoder's plain torch path: the fused layer ops and the native
decoder (plugins/kernels/cpu_decoder) know only the dense MLP. Their linear layers
(experts included) still take the packed and quantized matmuls, and once the experts sit on
a library's panels, a library that runs grouped experts (servelab.model.moe.ExpertKernels)
runs each sparse block's routed experts in one call.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.model.expert_routing import routing_policy
from servelab.model.llama import Attention, LlamaForCausalLM, RMSNorm, _rows
from servelab.model.model_config import ModelConfig
from servelab.model.moe import SparseMoeBlock, sparse_blocks
from servelab.model.rope import RotaryEmbedding, apply_rotary


class QKNormAttention(Attention):
    """Attention whose query and key heads are each RMS-normalised before the rotation (Qwen3)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], backend: Any, prepared: Any,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = self.q_norm(qkv[:, :self.q_size].reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].reshape(num_tokens, self.num_kv_heads,
                                                                               self.head_dim))
        q, k = apply_rotary(torch.cat([q, k], dim=1), cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache[0], kv_cache[1], prepared,
                              self.scale)
        return self.o_proj(_rows(out.reshape(num_tokens, self.q_size), keep_rows))


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__(config, rotary)
        shape = config.moe
        routing = routing_policy(shape.routing, shape.num_expert_groups, shape.topk_groups) if shape else None
        for index, layer in enumerate(self.layers):
            if config.qk_norm:
                layer.self_attn = QKNormAttention(config)
            if shape is not None and index in shape.sparse_layers:
                layer.mlp = SparseMoeBlock(config, routing)

    def _fusable(self, input_ids: torch.Tensor) -> bool:
        return False

    def _linears_moved(self) -> None:
        for block in self.sparse_blocks().values():
            block.use_native_experts()

    def sparse_blocks(self) -> dict[int, SparseMoeBlock]:
        """The sparse block of each sparse layer, by layer index."""
        return sparse_blocks(self)


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    return MoEForCausalLM if config.moe is not None or config.qk_norm else LlamaForCausalLM
