"""Tiny random GGUF files, written with the `gguf` library the way llama.cpp's converter
writes them: metadata keys, a byte-level BPE vocabulary (builtin:tiny's), each tensor in a
quantization type of its own. Llamas (query/key rows permuted GGML's way), and from tiny
`transformers` checkpoints: Mixtral (architecture `llama` with experts), Qwen2 (`qwen2`)
and Qwen2-MoE (`qwen2moe`; query/key rows as they are).

`gguf` quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 itself; for the K-quants it
only dequantizes, so their blocks are written directly (random codes under scales that
keep the weights small), which is what a reader has to decode either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# Hidden and MLP widths are multiples of 256, the K-quants' block.
TINY_GGUF_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=256)
ALL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<s>' + message['role'] + '\n' + message['content'] + '</s>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")


def write_tiny_gguf(path: str | Path, types: tuple[str, ...] = ALL_TYPES, seed: int = 0,
                    tie_word_embeddings: bool = False) -> Path:
    """A 2-layer Llama GGUF at `path` whose matrices take the types in `types` in turn
    (norms stay F32, as llama.cpp keeps them)."""
    import gguf

    path = Path(path)
    shape = TINY_GGUF_SHAPE
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, shape)
    matrices = _random_matrices(shape, rng, tie_word_embeddings)
    for index, (name, values) in enumerate(matrices.items()):
        _add(writer, name, values, types[index % len(types)], rng, gguf)
    for name in _norm_names(shape):
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape["hidden_size"])).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: Any, shape: dict[str, int]) -> None:
    writer.add_name("tiny-random-llama")
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_context_length(shape["max_position_embeddings"])
    writer.add_embedding_length(shape["hidden_size"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(shape["num_attention_heads"])
    writer.add_head_count_kv(shape["num_key_value_heads"])
    writer.add_rope_dimension_count(shape["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape["vocab_size"])
    _write_tokenizer(writer)
    writer.add_chat_template(CHAT_TEMPLATE)


def _write_tokenizer(writer: Any, pre: str = "default", add_bos: bool = True) -> None:
    """builtin:tiny's byte-level BPE vocabulary (4,096 tokens) as llama.cpp's `gpt2` tokenizer keys."""
    from servelab.model.builtin import ASSETS

    tokenizer = json.loads((ASSETS / "tiny" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    specials = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_unk_token_id(vocab["<unk>"])
    writer.add_add_bos_token(add_bos)


def _random_matrices(shape: dict[str, int], rng: np.random.Generator, tied: bool) -> dict[str, np.ndarray]:
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]

    def normal(rows: int, cols: int, scale: float) -> np.ndarray:
        return (scale * rng.standard_normal((rows, cols))).astype(np.float32)

    matrices = {"token_embd.weight": normal(vocab, hidden, 0.5)}
    if not tied:
        matrices["output.weight"] = normal(vocab, hidden, 0.15)
    for i in range(shape["num_hidden_layers"]):
        matrices.update({
            f"blk.{i}.attn_q.weight": ggml_permute(normal(heads * head_dim, hidden, 0.08), heads),
            f"blk.{i}.attn_k.weight": ggml_permute(normal(kv_heads * head_dim, hidden, 0.08), kv_heads),
            f"blk.{i}.attn_v.weight": normal(kv_heads * head_dim, hidden, 0.08),
            f"blk.{i}.attn_output.weight": normal(hidden, heads * head_dim, 0.08),
            f"blk.{i}.ffn_gate.weight": normal(inter, hidden, 0.08),
            f"blk.{i}.ffn_up.weight": normal(inter, hidden, 0.08),
            f"blk.{i}.ffn_down.weight": normal(hidden, inter, 0.08),
        })
    return matrices


def _norm_names(shape: dict[str, int]) -> list[str]:
    layers = [f"blk.{i}.{kind}.weight" for i in range(shape["num_hidden_layers"]) for kind in ("attn_norm", "ffn_norm")]
    return [*layers, "output_norm.weight"]


def ggml_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of query/key rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    rows = weights.shape[0]
    return weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _add(writer: Any, name: str, values: np.ndarray, type_name: str, rng: np.random.Generator, gguf: Any) -> None:
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        writer.add_tensor(name, values)
    elif type_name in ("Q4_K", "Q6_K"):
        writer.add_tensor(name, _k_quant_blocks(type_name, values.shape, rng), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)


def _k_quant_blocks(type_name: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks of 256 weights for a [rows, cols] matrix: bytes [rows, cols / 256 * block bytes]."""
    rows, cols = shape
    blocks = rows * cols // 256

    def half(low: float, high: float) -> np.ndarray:
        return rng.uniform(low, high, (blocks, 1)).astype(np.float16).view(np.uint8)

    def codes(n: int) -> np.ndarray:
        return rng.integers(0, 256, (blocks, n), dtype=np.uint8)

    if type_name == "Q4_K":  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit codes
        # weights d*sc*q - dmin*m with q < 16, sc and m < 64: dmin = 7.5 d centres them
        d = rng.uniform(1.5e-4, 2.5e-4, (blocks, 1))
        parts = [d.astype(np.float16).view(np.uint8), (7.5 * d).astype(np.float16).view(np.uint8),
                 codes(12), codes(128)]
    else:  # Q6_K: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d (f16); weights d*sc*(q - 32)
        parts = [codes(128), codes(64), codes(16), half(1.5e-5, 2.5e-5)]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


# A Mixtral over builtin:tiny's vocabulary (its tokenizer goes into the file's metadata); widths that are
# multiples of 32, the Q8_0 block.
TINY_MOE_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=4096, max_position_embeddings=256,
                      num_local_experts=5, num_experts_per_tok=2)


def build_tiny_mixtral(path: str | Path, seed: int = 7) -> Path:
    """A seeded random Mixtral checkpoint directory of TINY_MOE_SHAPE (RoPE base 10,000 and
    RMS epsilon 1e-5, the values write_mixtral_gguf writes)."""
    import torch
    import transformers

    config = transformers.MixtralConfig(**TINY_MOE_SHAPE, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15 if "embed" in name or "lm_head" in name else 0.1)
    model.save_pretrained(path)
    return Path(path)


def write_mixtral_gguf(checkpoint: str | Path, path: str | Path, expert_type: str = "F32") -> Path:
    """`checkpoint` (a Mixtral directory of TINY_MOE_SHAPE) as llama.cpp's converter writes
    a Mixtral: architecture "llama" with an expert count, the router `ffn_gate_inp`, the
    experts stacked per projection (`ffn_gate_exps` [experts, width, hidden], ...) in
    `expert_type`, query/key rows permuted."""
    import gguf
    from safetensors.torch import load_file

    shape = TINY_MOE_SHAPE
    tensors = {name.removeprefix("model."): t.float().numpy()
               for file in sorted(Path(checkpoint).glob("*.safetensors")) for name, t in load_file(file).items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, shape)
    writer.add_expert_count(shape["num_local_experts"])
    writer.add_expert_used_count(shape["num_experts_per_tok"])
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", tensors["embed_tokens.weight"])
    writer.add_tensor("output.weight", tensors["lm_head.weight"])
    writer.add_tensor("output_norm.weight", tensors["norm.weight"])
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    for i in range(shape["num_hidden_layers"]):
        layer = f"layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_q.weight", ggml_permute(tensors[layer + "self_attn.q_proj.weight"], heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", ggml_permute(tensors[layer + "self_attn.k_proj.weight"], kv_heads))
        writer.add_tensor(f"blk.{i}.attn_v.weight", tensors[layer + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", tensors[layer + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_norm.weight", tensors[layer + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", tensors[layer + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", tensors[layer + "block_sparse_moe.gate.weight"])
        for gguf_name, hf_name in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
            stacked = np.stack([tensors[f"{layer}block_sparse_moe.experts.{e}.{hf_name}.weight"]
                                for e in range(shape["num_local_experts"])])
            _add(writer, f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(stacked), expert_type, rng, gguf)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


# Qwen2 and Qwen2-MoE over builtin:tiny's vocabulary, with odd shapes: hidden 40 (not a
# multiple of 16, nor of the 32 of a Q8_0 block), head_dim 10, q/k/v biases; the MoE with 7
# experts, top-3 and a shared expert. TINY_QWEN2MOE_Q8_SHAPE has the widths a Q8_0 expert
# block needs (multiples of 32).
TINY_QWEN2_SHAPE = dict(hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256)
TINY_QWEN2MOE_SHAPE = dict(TINY_QWEN2_SHAPE, num_experts=7, num_experts_per_tok=3, moe_intermediate_size=24,
                           shared_expert_intermediate_size=30, norm_topk_prob=False)
TINY_QWEN2MOE_Q8_SHAPE = dict(TINY_QWEN2MOE_SHAPE, hidden_size=64, moe_intermediate_size=32)


def build_tiny_qwen2moe(path: str | Path, seed: int = 11, **shape: Any) -> Path:
    """A seeded random Qwen2-MoE checkpoint directory of TINY_QWEN2MOE_SHAPE (updated by
    `shape`): every layer sparse (llama.cpp's form), norms and biases random too."""
    import transformers

    return _build_qwen(path, seed, transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                       {**TINY_QWEN2MOE_SHAPE, **shape})


def build_tiny_qwen2(path: str | Path, seed: int = 13, **shape: Any) -> Path:
    """A seeded random dense Qwen2 checkpoint directory of TINY_QWEN2_SHAPE (updated by `shape`)."""
    import transformers

    return _build_qwen(path, seed, transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                       {**TINY_QWEN2_SHAPE, **shape})


def _build_qwen(path: str | Path, seed: int, config_cls: Any, model_cls: Any, shape: dict[str, Any]) -> Path:
    import torch

    config = config_cls(**shape, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # experts stacked [experts, rows, columns]; the shared gate [1, hidden]
                param.normal_(0.0, 0.15 if "embed" in name or "lm_head" in name else 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.05)  # the q/k/v biases
    model.save_pretrained(path)
    return Path(path)


def write_qwen2moe_gguf(checkpoint: str | Path, path: str | Path, expert_type: str = "F32",
                        squeeze_shared_gate: bool = False) -> Path:
    """`checkpoint` (a Qwen2-MoE directory, every layer sparse) as llama.cpp's converter
    (convert_hf_to_gguf.py, Qwen2MoeModel) writes it: architecture `qwen2moe`, its metadata
    keys, tensors named through gguf's own name map for the architecture, each layer's
    experts stacked per projection (`ffn_gate_exps` [experts, width, hidden], ...) in
    `expert_type` (everything else F32), query/key rows as they are (Qwen2 rotates
    NEOX-style, so the converter does not permute them). The shared expert's gate stays
    [1, hidden]; `squeeze_shared_gate` writes it [hidden], as older converters did."""
    return _write_qwen_gguf(checkpoint, path, expert_type, squeeze_shared_gate)


def write_qwen2_gguf(checkpoint: str | Path, path: str | Path) -> Path:
    """`checkpoint` (a dense Qwen2 directory) as llama.cpp's converter (Qwen2Model) writes
    it: architecture `qwen2`, F32, query/key rows as they are, no `output` when tied."""
    return _write_qwen_gguf(checkpoint, path, "F32", False)


def _write_qwen_gguf(checkpoint: str | Path, path: str | Path, expert_type: str, squeeze_shared_gate: bool) -> Path:
    import gguf
    from safetensors.torch import load_file

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    moe = config["model_type"] == "qwen2_moe"
    if moe and (config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1):
        raise ValueError("llama.cpp's qwen2moe has every layer sparse; this checkpoint has dense layers")
    tensors = {name: t.float().numpy() for file in sorted(Path(checkpoint).glob("*.safetensors"))
               for name, t in load_file(file).items()}
    arch = gguf.MODEL_ARCH.QWEN2MOE if moe else gguf.MODEL_ARCH.QWEN2
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny-random-{gguf.MODEL_ARCH_NAMES[arch]}")
    writer.add_block_count(layers)  # TextModel.set_gguf_parameters
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta")))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if moe:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if expert_type == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    if moe:  # Qwen2MoeModel.set_gguf_parameters
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    _write_tokenizer(writer, pre="qwen2", add_bos=False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for layer in range(layers if moe else 0):  # Qwen2MoeModel.modify_tensors: each projection's experts stacked
        for projection in ("down_proj", "gate_proj", "up_proj"):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight" for e in range(config["num_experts"])]
            tensors[f"model.layers.{layer}.mlp.experts.{projection}.weight"] = np.stack([tensors.pop(n) for n in names])
    name_map = gguf.get_tensor_name_map(arch, layers)
    rng = np.random.default_rng(0)
    for hf_name, values in tensors.items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"gguf's {gguf.MODEL_ARCH_NAMES[arch]} name map has no tensor {hf_name!r}")
        if squeeze_shared_gate and name.endswith("ffn_gate_inp_shexp.weight"):
            values = values.reshape(-1)
        _add(writer, name, np.ascontiguousarray(values), expert_type if values.ndim == 3 else "F32", rng, gguf)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
