"""Loading Hugging Face safetensors weights into the fused-projection decoder."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from servelab.errors import CheckpointError
from servelab.model.llama import LlamaForCausalLM
from servelab.model.moe_weights import moe_source

# Checkpoint projections that the decoder stores fused, in concatenation order.
FUSED = _FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class CheckpointTensors(Mapping):
    """A checkpoint's tensors by name (without the "model." wrapper prefix), each read from
    its file when asked for: loading holds one tensor at a time, not the whole checkpoint."""

    def __init__(self, files: list[Path]) -> None:
        self._handles = [safe_open(str(file), framework="pt") for file in files]
        # Strip the wrapper prefix: "model.layers.0..." -> "layers.0...".
        self._where = {name.removeprefix("model."): (handle, name)
                       for handle in self._handles for name in handle.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        handle, stored = self._where[name]
        return handle.get_tensor(stored)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_checkpoint_tensors(path: Path) -> CheckpointTensors:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint directory {str(path)!r} has no *.safetensors weights")
    return CheckpointTensors(files)


def load_weights(model: LlamaForCausalLM, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors into `model`, fusing q/k/v and gate/up; names what is missing."""
    expected = model.state_dict()
    for name, target in expected.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        moe = model.config.moe
        source = moe_source(name, tensors, moe) if moe is not None else None
        if source is None:
            source = _source_tensor(name, tensors)
        if source.shape != target.shape:
            raise CheckpointError(f"weight {name!r} has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(source)


def _source_tensor(name: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    for fused, parts in _FUSED.items():
        if fused in name:
            pieces = [tensors.get(name.replace(fused, part)) for part in parts]
            missing = [name.replace(fused, part) for part, piece in zip(parts, pieces) if piece is None]
            if missing:
                raise CheckpointError(f"checkpoint is missing weight {missing[0]!r}")
            return torch.cat(pieces, dim=0)
    if name not in tensors:
        raise CheckpointError(f"checkpoint is missing weight {name!r}")
    return tensors[name]
