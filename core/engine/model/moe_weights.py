"""Where a mixture-of-experts decoder's weights sit in a Hugging Face checkpoint.

A checkpoint holds each expert's projections apart (Mixtral: `block_sparse_moe.experts.{e}.w1`
gate, `w3` up, `w2` down; the Qwen MoEs: `mlp.experts.{e}.gate_proj`, `up_proj`,
`down_proj`), or, as `transformers` 5 holds them in memory, stacked: `experts.gate_up_proj`
[experts, 2 x width, hidden] and `experts.down_proj` [experts, hidden, width], or stacked
per projection as a GGUF file holds them (`experts.w1` [experts, width, hidden], ...). The decoder
keeps one module per expert with gate and up fused, as its dense MLP does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from servelab.errors import CheckpointError
from servelab.model.moe_config import MoEShape

_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight$")
_SHARED_GATE_UP = re.compile(r"^(layers\.\d+\.mlp\.shared_expert)\.gate_up_proj\.weight$")
_ROUTER = re.compile(r"^layers\.(\d+)\.mlp\.gate\.weight$")


def moe_source(name: str, tensors: Mapping[str, torch.Tensor], shape: MoEShape) -> torch.Tensor | None:
    """The checkpoint tensor for the decoder's weight `name`, or None when `name` is not a
    sparse block's (the dense rules apply)."""
    gate, up, down = shape.checkpoint_projections
    if match := _EXPERT.match(name):
        layer, expert, projection = match.groups()
        prefix = f"layers.{layer}.{shape.checkpoint_block}.experts"
        stacked = f"{prefix}.{projection}"
        if stacked in tensors:
            return tensors[stacked][int(expert)]
        parts = (gate, up) if projection == "gate_up_proj" else (down,)
        return torch.cat([_expert_part(tensors, prefix, int(expert), part) for part in parts], dim=0)
    if match := _SHARED_GATE_UP.match(name):
        return torch.cat([_get(tensors, f"{match.group(1)}.{part}.weight") for part in ("gate_proj", "up_proj")])
    if match := _ROUTER.match(name):
        return _get(tensors, f"layers.{match.group(1)}.{shape.checkpoint_block}.gate.weight")
    return None


def _expert_part(tensors: Mapping[str, torch.Tensor], prefix: str, expert: int, part: str) -> torch.Tensor:
    """One expert's projection: its own tensor, or its slice of the projection stacked over
    the experts (a GGUF file's `ffn_gate_exps` and kin, read as `experts.w1`)."""
    stacked = f"{prefix}.{part}"
    if stacked in tensors:
        return tensors[stacked][expert]
    return _get(tensors, f"{prefix}.{expert}.{part}.weight")


def _get(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"checkpoint is missing weight {name!r}")
    return tensors[name]
