"""EP x TP: an expert-parallel model's attention heads split over the same ranks.

With `tensor_parallel_size` = `expert_parallel_size` = N (the layout of vLLM's
`--enable-expert-parallel`), rank r holds the experts its placement gives it
(servelab.distributed.expert_parallel) and, of every layer's attention, its heads as
tensor parallelism splits them (servelab.model.shard_layout: query heads evenly, KV heads
split or replicated), the output projection row-parallel (one all-reduce), so each rank's
KV cache holds only its heads. The rest (embedding, norms, routers, dense MLP layers,
shared experts, the LM head) stays whole on every rank: after the attention's all-reduce
every rank holds the same hidden state and computes the rest alike.
"""

from __future__ import annotations

import torch
from torch import nn

from servelab.distributed.comm import Communicator
from servelab.distributed.sharded_model import RowParallelLinear
from servelab.model.shard_layout import ShardLayout


def shard_attention(model: nn.Module, layout: ShardLayout, comm: Communicator) -> None:
    """Replace each layer's (loaded, whole) attention by this rank's heads of it."""
    local = layout.local_config()
    head_dim = layout.config.head_dim
    q_start, q_end = (head * head_dim for head in layout.heads)
    kv_start, kv_end = (head * head_dim for head in layout.kv_heads)
    for layer in model.layers:
        whole = layer.self_attn
        q, k = whole.q_size, whole.kv_size
        rows = torch.cat([torch.arange(q_start, q_end), torch.arange(q + kv_start, q + kv_end),
                          torch.arange(q + k + kv_start, q + k + kv_end)])
        part = type(whole)(local).to(device=whole.qkv_proj.weight.device, dtype=whole.qkv_proj.weight.dtype)
        with torch.no_grad():
            part.qkv_proj.weight.copy_(whole.qkv_proj.weight[rows])
            if whole.qkv_proj.bias is not None:
                part.qkv_proj.bias.copy_(whole.qkv_proj.bias[rows])
            output = RowParallelLinear(q_end - q_start, whole.o_proj.out_features, whole.o_proj.bias is not None,
                                       comm).to(part.qkv_proj.weight)
            output.linear.weight.copy_(whole.o_proj.weight[:, q_start:q_end])
            if whole.o_proj.bias is not None:
                output.bias.copy_(whole.o_proj.bias)
        part.o_proj = output
        for norm in ("q_norm", "k_norm"):  # Qwen3-MoE's per-head norms: one weight every head shares
            if hasattr(whole, norm):
                setattr(part, norm, getattr(whole, norm))
        layer.self_attn = part
