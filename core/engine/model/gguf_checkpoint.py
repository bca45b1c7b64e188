"""GGUF checkpoints (llama.cpp's single-file format), read through the `gguf` library.

One file holds everything: the architecture's numbers as metadata keys, the tokenizer
(see gguf_tokenizer.py), the chat template, and the tensors, each in its own type (F32,
F16, BF16, or a block quantization: Q8_0, Q4_0, Q4_1, the K-quants ...). Every type the
`gguf` library can dequantize loads, dequantized one tensor at a time into the serving
dtype. llama.cpp's converter permutes the rows of the query and key projections (it pairs
each head's rotary halves the GGML way); reading undoes that, so the tensors come out in
Hugging Face's layout under Hugging Face's names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from servelab.errors import CheckpointError

SUPPORTED_ARCHITECTURES = {"llama": "llama"}  # general.architecture -> model_type
_LAYER_TENSORS = {  # blk.{i}.<gguf name> -> layers.{i}.<Hugging Face name>
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Mixtral (llama.cpp writes it as architecture "llama" with an expert count): the router
    # and the experts stacked per projection [experts, rows, columns]
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.w1",
    "ffn_up_exps.weight": "block_sparse_moe.experts.w3",
    "ffn_down_exps.weight": "block_sparse_moe.experts.w2",
}
_STACKED_CACHED = 3  # stacked expert tensors kept dequantized while their experts load
_MODEL_TENSORS = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                  "output.weight": "lm_head.weight"}
# GGML block types the quantized-weight kernels multiply as they are (quantized_linear)
KERNEL_BLOCK_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def find_gguf(directory: Path) -> Path | None:
    """The one *.gguf file in a directory without safetensors weights (None if there is none)."""
    files = sorted(directory.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(f"directory {str(directory)!r} holds {len(files)} GGUF files "
                              f"({', '.join(f.name for f in files)}); name the file to load")
    return files[0] if files else None


class GGUFFile:
    """A GGUF file's metadata and tensors (tensor data is memory-mapped, read when asked for)."""

    def __init__(self, path: Path) -> None:
        gguf = _import_gguf()
        try:
            self._reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # a bad magic number, a truncated file, a tensor type the library lacks
            raise CheckpointError(f"cannot read GGUF file {str(path)!r}: {exc}") from None
        self.path = path
        self.metadata = {name: _field_value(field) for name, field in self._reader.fields.items()}
        self.tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self.architecture = self.metadata.get("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"GGUF file {str(path)!r} holds general.architecture={self.architecture!r}; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self._check_types(gguf)

    def hf_config(self) -> dict[str, Any]:
        """The architecture's numbers as a Hugging Face config.json would hold them."""
        arch = self.architecture

        def key(name: str, default: Any = None) -> Any:
            return self.metadata.get(f"{arch}.{name}", default)

        if "rope_freqs.weight" in self.tensors:
            raise CheckpointError(f"GGUF file {str(self.path)!r} carries per-frequency RoPE factors "
                                  f"(rope_freqs.weight, Llama 3.1-style scaling), which servelab does not read")
        heads = key("attention.head_count")
        hidden = key("embedding_length")
        missing = [name for name, value in (("block_count", key("block_count")), ("embedding_length", hidden),
                                            ("feed_forward_length", key("feed_forward_length")),
                                            ("attention.head_count", heads)) if value is None]
        if missing:
            raise CheckpointError(f"GGUF file {str(self.path)!r} lacks metadata key {arch}.{missing[0]}")
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        config: dict[str, Any] = {
            "model_type": SUPPORTED_ARCHITECTURES[arch],
            "architectures": ["LlamaForCausalLM"],
            "hidden_act": "silu",
            "vocab_size": key("vocab_size") or len(tokens) or self.tensors["token_embd.weight"].shape[-1],
            "hidden_size": hidden,
            "intermediate_size": key("feed_forward_length"),
            "num_hidden_layers": key("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": key("attention.head_count_kv") or heads,
            "head_dim": key("attention.key_length") or key("rope.dimension_count") or hidden // heads,
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": key("rope.freq_base", 10000.0),
            "max_position_embeddings": key("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
        }
        if key("expert_count"):
            config.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
                          num_local_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count") or 2)
        scaling = key("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise CheckpointError(f"GGUF {arch}.rope.scaling.type={scaling!r} is not supported; supported: linear")
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
        return config

    def tokenizer(self) -> Any:
        """A `servelab.model.tokenizer.Tokenizer` with the file's chat template."""
        from servelab.model.gguf_tokenizer import build_tokenizer, special_tokens
        from servelab.model.tokenizer import Tokenizer

        return Tokenizer(backend=build_tokenizer(self.metadata),
                         chat_template=self.metadata.get("tokenizer.chat_template"),
                         special_tokens=special_tokens(self.metadata))

    def hf_tensors(self, config: Any) -> "GGUFTensors":
        return GGUFTensors(self, config.num_heads, config.num_kv_heads)

    def _check_types(self, gguf: Any) -> None:
        dequantizable = supported_types(gguf)
        for tensor in self._reader.tensors:
            if tensor.tensor_type.name not in dequantizable:
                raise CheckpointError(
                    f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf library "
                    f"cannot dequantize; supported: {', '.join(sorted(dequantizable))}")


class GGUFTensors(Mapping):
    """The file's tensors under Hugging Face names (no "model." prefix), each dequantized to
    float32 (and its query/key rows put back in Hugging Face's order) when asked for."""

    def __init__(self, file: GGUFFile, num_heads: int, num_kv_heads: int) -> None:
        self._file = file
        self._heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
        self._where = {hf_name(name): name for name in file.tensors}
        self._stacked: dict[str, torch.Tensor] = {}  # the last few stacked expert tensors, each asked once per expert
        unknown = [name for name, hf in self._where.items() if hf is None]
        if unknown:
            raise CheckpointError(f"GGUF file {str(file.path)!r} holds tensor {unknown[0]!r}, which a "
                                  f"{file.architecture} decoder does not have")

    def __getitem__(self, name: str) -> torch.Tensor:
        if ".experts." in name and name in self._stacked:
            return self._stacked[name]
        values = self._read(name)
        if values.dim() == 3:
            if len(self._stacked) >= _STACKED_CACHED:
                self._stacked.pop(next(iter(self._stacked)))
            self._stacked[name] = values
        return values

    def _read(self, name: str) -> torch.Tensor:
        gguf = _import_gguf()
        tensor = self._file.tensors[self._where[name]]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        for projection, heads in self._heads.items():
            if name.startswith("layers.") and projection in name:
                values = _unpermute(values, heads)
        if not values.flags.writeable:  # an F32 tensor is a view of the read-only mapping
            values = values.copy()
        return torch.from_numpy(values)

    def blocks(self, name: str) -> tuple[str, torch.Tensor, int] | None:
        """A 2-D tensor's own GGML blocks, when its type is one the quantized-weight kernels
        take: (format, uint8 [rows, bytes a row] with the query/key rows in Hugging Face's
        order, in_features); None for any other type (or name)."""
        if name not in self._where:
            return None
        tensor = self._file.tensors[self._where[name]]
        format = KERNEL_BLOCK_TYPES.get(tensor.tensor_type.name)
        if format is None or len(tensor.shape) != 2:
            return None
        in_features, rows = (int(n) for n in tensor.shape)
        raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
        for projection, heads in self._heads.items():
            if name.startswith("layers.") and projection in name:
                raw = _unpermute(raw, heads)  # whole rows of blocks move, as the values' rows do
        return format, torch.from_numpy(np.array(raw)), in_features

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _MODEL_TENSORS:
        return _MODEL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def supported_types(gguf: Any = None) -> set[str]:
    """The tensor types the installed gguf library dequantizes."""
    gguf = gguf or _import_gguf()
    return {"F32", "F16", *(qtype.name for qtype in gguf.quants._type_traits)}


def _unpermute(values: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a query/key projection: per head, GGML stores
    the rotary pairs interleaved; Hugging Face stores the first halves, then the second."""
    rows = values.shape[0]
    return values.reshape(heads, rows // heads // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # a value type this reader cannot decode; no key servelab reads
        return None


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading GGUF files needs the gguf package: pip install 'servelab[gguf]' "
                              "(or pip install gguf)") from None
    return gguf
