"""GGUF checkpoints (llama.cpp's single-file format), read through the `gguf` library.

One file holds everything: the architecture's numbers as metadata keys, the tokenizer
(see gguf_tokenizer.py), the chat template, and the tensors, each in its own type (F32,
F16, BF16, or a block quantization: Q8_0, Q4_0, Q4_1, the K-quants ...). Every type the
`gguf` library can dequantize loads, dequantized one tensor at a time into the serving
dtype. Three architectures are read, as llama.cpp's converter (convert_hf_to_gguf.py)
writes them: `llama` (Llama-family decoders, and Mixtral: `llama` with an expert count),
`qwen2` (Qwen2: q/k/v biases) and `qwen2moe` (Qwen2-MoE: the routed experts stacked per
projection, a shared expert behind a sigmoid gate, every layer sparse). For `llama` the
converter permutes the rows of the query and key projections (it pairs each head's rotary
halves the GGML way); reading undoes that. The Qwen2 architectures rotate NEOX-style, the
Hugging Face way, and the converter leaves their rows as they are. Either way the tensors
come out in Hugging Face's layout under Hugging Face's names.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from servelab.errors import CheckpointError

# general.architecture -> model_type (a `llama` file with an expert count is a Mixtral)
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen2moe": "qwen2_moe"}
_PERMUTED_QK = {"llama"}  # architectures whose query/key rows the converter permutes (GGML's rotary pairs)

# The tensors of each architecture, as gguf.MODEL_TENSOR members -> the Hugging Face name
# (without the "model." prefix; a layer's under "layers.{i}."). The GGUF names come from
# gguf.TENSOR_NAMES, and each architecture's members must be in gguf.MODEL_TENSORS for it.
_ATTENTION = {
    "ATTN_NORM": "input_layernorm.weight", "FFN_NORM": "post_attention_layernorm.weight",
    "ATTN_Q": "self_attn.q_proj.weight", "ATTN_K": "self_attn.k_proj.weight", "ATTN_V": "self_attn.v_proj.weight",
    "ATTN_OUT": "self_attn.o_proj.weight",
}
_QKV_BIASES = {"ATTN_Q": "self_attn.q_proj.bias", "ATTN_K": "self_attn.k_proj.bias", "ATTN_V": "self_attn.v_proj.bias"}
_DENSE_MLP = {"FFN_GATE": "mlp.gate_proj.weight", "FFN_UP": "mlp.up_proj.weight", "FFN_DOWN": "mlp.down_proj.weight"}
_LAYER_TENSORS: dict[str, tuple[dict[str, str], dict[str, str]]] = {  # architecture -> (weights, biases)
    "llama": ({
        **_ATTENTION, **_DENSE_MLP,
        # Mixtral (llama.cpp writes it as architecture "llama" with an expert count): the router
        # and the experts stacked per projection [experts, rows, columns]
        "FFN_GATE_INP": "block_sparse_moe.gate.weight",
        "FFN_GATE_EXP": "block_sparse_moe.experts.w1",
        "FFN_UP_EXP": "block_sparse_moe.experts.w3",
        "FFN_DOWN_EXP": "block_sparse_moe.experts.w2",
    }, {**_QKV_BIASES, "ATTN_OUT": "self_attn.o_proj.bias"}),
    "qwen2": ({**_ATTENTION, **_DENSE_MLP}, _QKV_BIASES),
    "qwen2moe": ({
        **_ATTENTION,
        "FFN_GATE_INP": "mlp.gate.weight",  # the router
        "FFN_GATE_EXP": "mlp.experts.gate_proj",  # stacked [experts, width, hidden] (servelab.model.moe_weights)
        "FFN_UP_EXP": "mlp.experts.up_proj",
        "FFN_DOWN_EXP": "mlp.experts.down_proj",  # [experts, hidden, width]
        "FFN_GATE_INP_SHEXP": "mlp.shared_expert_gate.weight",  # [1, hidden] (older converters: [hidden])
        "FFN_GATE_SHEXP": "mlp.shared_expert.gate_proj.weight",
        "FFN_UP_SHEXP": "mlp.shared_expert.up_proj.weight",
        "FFN_DOWN_SHEXP": "mlp.shared_expert.down_proj.weight",
    }, _QKV_BIASES),
}
_MODEL_TENSORS = {"TOKEN_EMBD": "embed_tokens.weight", "OUTPUT_NORM": "norm.weight", "OUTPUT": "lm_head.weight"}
_SHARED_GATE = "mlp.shared_expert_gate.weight"
_STACKED_CACHED = 3  # stacked expert tensors kept dequantized while their experts load
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
        self.architecture = self.metadata.get(gguf.Keys.General.ARCHITECTURE)
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"GGUF file {str(path)!r} holds general.architecture={self.architecture!r}; "
                                  f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        self._check_types(gguf)

    def hf_config(self) -> dict[str, Any]:
        """The architecture's numbers as a Hugging Face config.json would hold them."""
        gguf = _import_gguf()
        arch, keys = self.architecture, gguf.Keys

        def key(template: str, default: Any = None) -> Any:  # template: a gguf.Keys "{arch}.<name>"
            return self.metadata.get(template.format(arch=arch), default)

        if gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight" in self.tensors:
            raise CheckpointError(f"GGUF file {str(self.path)!r} carries per-frequency RoPE factors "
                                  f"(rope_freqs.weight, Llama 3.1-style scaling), which servelab does not read")
        experts = key(keys.LLM.EXPERT_COUNT)
        heads = key(keys.Attention.HEAD_COUNT)
        hidden = key(keys.LLM.EMBEDDING_LENGTH)
        required = [keys.LLM.BLOCK_COUNT, keys.LLM.EMBEDDING_LENGTH, keys.Attention.HEAD_COUNT]
        if arch == "qwen2moe":
            # (its dense MLP width is unused: llama.cpp runs every layer sparse)
            required += [keys.LLM.EXPERT_COUNT, keys.LLM.EXPERT_USED_COUNT]
        else:
            required.append(keys.LLM.FEED_FORWARD_LENGTH)
        missing = [template.format(arch=arch) for template in required if key(template) is None]
        if missing:
            raise CheckpointError(f"GGUF file {str(self.path)!r} lacks metadata key {missing[0]}")
        tokens = self.metadata.get(keys.Tokenizer.LIST) or []
        layer_tensor = self._layer_tensor_name
        config: dict[str, Any] = {
            "model_type": SUPPORTED_ARCHITECTURES[arch],
            "architectures": ["LlamaForCausalLM"],
            "hidden_act": "silu",
            "vocab_size": key(keys.LLM.VOCAB_SIZE) or len(tokens) or self.tensors["token_embd.weight"].shape[-1],
            "hidden_size": hidden,
            "intermediate_size": key(keys.LLM.FEED_FORWARD_LENGTH),
            "num_hidden_layers": key(keys.LLM.BLOCK_COUNT),
            "num_attention_heads": heads,
            "num_key_value_heads": key(keys.Attention.HEAD_COUNT_KV) or heads,
            "head_dim": key(keys.Attention.KEY_LENGTH) or key(keys.Rope.DIMENSION_COUNT) or hidden // heads,
            "rms_norm_eps": key(keys.Attention.LAYERNORM_RMS_EPS, 1e-5 if arch == "llama" else 1e-6),
            "rope_theta": key(keys.Rope.FREQ_BASE, 10000.0),
            "max_position_embeddings": key(keys.LLM.CONTEXT_LENGTH, 2048),
            "tie_word_embeddings": gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight" not in self.tensors,
            "attention_bias": layer_tensor(gguf.MODEL_TENSOR.ATTN_Q, "bias") in self.tensors,
            "bos_token_id": self.metadata.get(keys.Tokenizer.BOS_ID),
            "eos_token_id": self.metadata.get(keys.Tokenizer.EOS_ID),
        }
        if arch == "llama" and experts:
            config.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
                          num_local_experts=experts, num_experts_per_tok=key(keys.LLM.EXPERT_USED_COUNT) or 2)
        elif arch == "qwen2":
            config.update(architectures=["Qwen2ForCausalLM"], use_sliding_window=False)
        elif arch == "qwen2moe":
            # llama.cpp runs every layer of a qwen2moe file sparse (no decoder_sparse_step, no
            # mlp_only_layers) and leaves the top-k weights as the softmax gave them
            width = key(keys.LLM.EXPERT_FEED_FORWARD_LENGTH) or self._rows(layer_tensor(gguf.MODEL_TENSOR.FFN_GATE_EXP))
            shared = (key(keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
                      or self._rows(layer_tensor(gguf.MODEL_TENSOR.FFN_GATE_SHEXP)) or 0)
            if not width:
                raise CheckpointError(f"GGUF file {str(self.path)!r} lacks metadata key "
                                      f"{keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch)} (and the tensor "
                                      f"{layer_tensor(gguf.MODEL_TENSOR.FFN_GATE_EXP)} to read it from)")
            config.update(architectures=["Qwen2MoeForCausalLM"], use_sliding_window=False,
                          intermediate_size=config["intermediate_size"] or shared or width,
                          num_experts=experts, num_experts_per_tok=key(keys.LLM.EXPERT_USED_COUNT),
                          moe_intermediate_size=width, shared_expert_intermediate_size=shared,
                          norm_topk_prob=bool(key(keys.LLM.EXPERT_WEIGHTS_NORM, False)),
                          decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=config["attention_bias"])
        scaling = key(keys.Rope.SCALING_TYPE)
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise CheckpointError(f"GGUF {keys.Rope.SCALING_TYPE.format(arch=arch)}={scaling!r} is not "
                                      f"supported; supported: linear")
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(key(keys.Rope.SCALING_FACTOR, 1.0))}
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

    @staticmethod
    def _layer_tensor_name(tensor: Any, kind: str = "weight", layer: int = 0) -> str:
        return f"{_import_gguf().TENSOR_NAMES[tensor].format(bid=layer)}.{kind}"

    def _rows(self, name: str) -> int | None:
        """A [.., rows, columns] tensor's rows (None when the file lacks it)."""
        tensor = self.tensors.get(name)
        return int(tensor.shape[1]) if tensor is not None and len(tensor.shape) >= 2 else None

    def _check_types(self, gguf: Any) -> None:
        dequantizable = supported_types(gguf)
        for tensor in self._reader.tensors:
            if tensor.tensor_type.name not in dequantizable:
                raise CheckpointError(
                    f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf library "
                    f"cannot dequantize; supported: {', '.join(sorted(dequantizable))}")


class GGUFTensors(Mapping):
    """The file's tensors under Hugging Face names (no "model." prefix), each dequantized to
    float32 (and, for `llama`, its query/key rows put back in Hugging Face's order) when
    asked for."""

    def __init__(self, file: GGUFFile, num_heads: int, num_kv_heads: int) -> None:
        self._file = file
        permuted = file.architecture in _PERMUTED_QK
        self._heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads} if permuted else {}
        self._where = {hf_name(name, file.architecture): name for name in file.tensors}
        self._stacked: dict[str, torch.Tensor] = {}  # the last few stacked expert tensors, each asked once per expert
        unknown = [name for hf, name in self._where.items() if hf is None]
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
        if name.endswith(_SHARED_GATE) and values.ndim == 1:  # [hidden], as older converters squeezed it
            values = values.reshape(1, -1)
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


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name (no "model." prefix) of a GGUF tensor of `architecture`; None
    for a tensor its decoder does not have."""
    model, layer = _name_tables(architecture)
    if gguf_name in model:
        return model[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"layers.{parts[1]}.{layer[parts[2]]}"
    return None


@functools.cache
def _name_tables(architecture: str) -> tuple[dict[str, str], dict[str, str]]:
    """({GGUF name of a model tensor: Hugging Face name}, {GGUF name of a layer's tensor
    after "blk.{i}.": Hugging Face name after "layers.{i}."}), from gguf.TENSOR_NAMES."""
    gguf = _import_gguf()
    arch = next(member for member, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    known = set(gguf.MODEL_TENSORS[arch])
    weights, biases = _LAYER_TENSORS[architecture]

    def gguf_names(table: dict[str, str], kind: str, prefix: str) -> dict[str, str]:
        names = {}
        for member, hf in table.items():
            tensor = gguf.MODEL_TENSOR[member]
            if tensor not in known:  # the tables above name a tensor llama.cpp's architecture lacks
                raise AssertionError(f"gguf's {architecture} architecture has no tensor {member}")
            names[f"{gguf.TENSOR_NAMES[tensor].removeprefix(prefix)}.{kind}"] = hf
        return names

    model = gguf_names(_MODEL_TENSORS, "weight", "")
    layer = {**gguf_names(weights, "weight", "blk.{bid}."), **gguf_names(biases, "bias", "blk.{bid}.")}
    return model, layer


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
