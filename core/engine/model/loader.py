"""Building a ready-to-run decoder from a checkpoint: a Hugging Face directory, a GGUF file
(or a directory holding one), a built-in name or a named real model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import torch

from servelab.errors import CheckpointError
from servelab.model import builtin, named_models
from servelab.model.gguf_checkpoint import GGUFFile, find_gguf, is_gguf
from servelab.kv_sizing import DTYPE_BYTES
from servelab.model.llama import LlamaForCausalLM
from servelab.model.memory import release_freed_memory
from servelab.model.model_config import ModelConfig
from servelab.model.moe_model import model_class
from servelab.model.packed_linear import PACKABLE_DTYPES, can_prepack, prepack_linears
from servelab.model.quantized_linear import QuantizedWeight, quantize_linears
from servelab.model.rope import RotaryEmbedding
from servelab.model.tokenizer import Tokenizer
from servelab.model.weights import FUSED, load_weights, read_checkpoint_tensors

DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}  # `[engine] dtype` -> torch.dtype


@attrs.frozen
class Checkpoint:
    """A checkpoint's config and tokenizer, read without touching weights. `path` is the
    directory, or the GGUF file (`gguf` is then that file, opened)."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer | None
    gguf: GGUFFile | None = attrs.field(default=None, eq=False)

    @classmethod
    def open(cls, model: str) -> "Checkpoint":
        path = resolve_model(model)
        if path.is_dir() and not list(path.glob("*.safetensors")):
            path = find_gguf(path) or path
        if is_gguf(path):
            file = GGUFFile(path)
            config = ModelConfig.from_dict(file.hf_config())
            return cls(path, config, file.tokenizer(), file)
        if not path.is_dir():
            what = "is not a checkpoint directory" if path.exists() else "does not exist"
            raise CheckpointError(f"model {model!r} {what}: give a checkpoint directory, a .gguf file, or a "
                                  f"known name ({', '.join(builtin.names() + list(named_models.NAMED_MODELS))})")
        config = ModelConfig.from_directory(path)
        if not list(path.glob("*.safetensors")):
            raise CheckpointError(f"checkpoint directory {str(path)!r} has no *.safetensors weights "
                                  f"(nor a .gguf file)")
        return cls(path, config, Tokenizer.from_directory(path))

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The weights by Hugging Face name (no "model." prefix), each read when asked for."""
        if self.gguf is not None:
            return self.gguf.hf_tensors(self.config)
        return read_checkpoint_tensors(self.path)


def file_blocks(checkpoint: Checkpoint, model: LlamaForCausalLM, weights: str) -> dict[str, QuantizedWeight]:
    """A GGUF file's own blocks for the model's linear layers (a fused projection's parts
    stacked), handed to the kernels as they are: with weights = "int4" every layer whose
    parts the file holds in q8_0, q4_0 or q4_1 (all in one format); with "int8" those in
    q8_0. The other layers are quantized from their dequantized values as the scheme says.
    The LM head of a tied model takes the embedding's blocks."""
    tensors = checkpoint.gguf.hf_tensors(checkpoint.config)
    kept = {"int4": ("q8_0", "q4_0", "q4_1"), "int8": ("q8_0",)}[weights]
    given = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        owner, _, layer_leaf = name.rpartition(".")
        layer, _, block = owner.rpartition(".")  # "layers.0", "self_attn" of "layers.0.self_attn.qkv_proj"
        fused = FUSED.get(f"{block}.{layer_leaf}")
        parts = [f"{layer}.{part}" for part in fused] if fused else [name]
        if name == "lm_head" and checkpoint.config.tie_word_embeddings:
            parts = ["embed_tokens"]
        found = [tensors.blocks(f"{part}.weight") for part in parts]
        if any(f is None for f in found) or len({f[0] for f in found}) != 1 or found[0][0] not in kept:
            continue
        stacked = QuantizedWeight.from_blocks(found[0][0], torch.cat([f[1] for f in found]), found[0][2])
        if (stacked.out_features, stacked.in_features) == (module.out_features, module.in_features):
            given[name] = stacked
    return given


def resolve_model(model: str) -> Path:
    """Where `model` lives: `builtin:<name>`, a path, or a named model (when no such path exists)."""
    if model.startswith(builtin.BUILTIN_PREFIX):
        return builtin.resolve(model)
    path = Path(model)
    if not path.exists() and model in named_models.NAMED_MODELS:
        return named_models.locate(model)
    return path


def load_model(checkpoint: Checkpoint, dtype: str, device: str, max_positions: int,
               prepack_weights: bool = False, weights: str = "dequantize",
               prune: Callable[[torch.nn.Module], None] | None = None,
               quantized_activations: str = "int8",
               reshape: Callable[[torch.nn.Module], None] | None = None) -> LlamaForCausalLM:
    """The checkpoint's decoder in `dtype` on `device`; with `prepack_weights` (CPU), the
    decoder's linear layers and LM head packed for oneDNN (see servelab.model.packed_linear);
    with `weights` "int8" or "int4" they are kept as quantized blocks instead
    (servelab.model.quantized_linear). `prune` edits the module tree before any weight is
    allocated (an expert-parallel rank drops the experts it does not hold); `reshape` edits
    it once the weights are loaded, before they are packed or quantized (an expert-parallel
    rank that also splits the attention heads slices them)."""
    torch_dtype = DTYPES[dtype]
    torch_device = torch.device(device)
    config = checkpoint.config
    rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling,
                             torch_dtype, torch_device)
    with torch.device("meta"):  # no time spent on random init: every weight is loaded
        model = model_class(config)(config, rotary).to(torch_dtype)
        if prune is not None:
            prune(model)
    allocate_parameters(model, torch_device)  # once, in the target dtype
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    load_weights(model, checkpoint.tensors())
    if reshape is not None:
        reshape(model)
    if weights != "dequantize":
        given = file_blocks(checkpoint, model, weights) if checkpoint.gguf is not None else None
        quantize_linears(model, weights, given=given, activations=quantized_activations)
    if prepack_weights and can_prepack(torch_device, torch_dtype):
        prepack_linears(model, keep_weights=("lm_head",))
    elif prepack_weights and torch_device.type == "cpu" and torch_dtype in PACKABLE_DTYPES:
        # oneDNN cannot pack this dtype on this CPU: torch's linear serves the layers until a
        # native library's matmul takes them (bfloat16 on AVX2)
        prepack_linears(model, keep_weights=("lm_head",), onednn=False)
    release_freed_memory()
    return model.eval()


def allocate_parameters(model: torch.nn.Module, device: torch.device) -> None:
    """Gives every meta-device parameter and buffer uninitialised storage on `device`.
    (Module.to_empty does the same through torch's Python reference ops for meta tensors,
    which import sympy: 0.2 s of start and tens of MB for nothing.)"""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
