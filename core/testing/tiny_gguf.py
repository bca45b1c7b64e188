"""Tiny random Llama GGUF files, written with the `gguf` library the way llama.cpp's
converter writes them: metadata keys, a byte-level BPE vocabulary (builtin:tiny's),
query/key rows permuted GGML's way, and each tensor in a quantization type of its own.

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
    from servelab.model.builtin import ASSETS

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
    tokenizer = json.loads((ASSETS / "tiny" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    specials = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_unk_token_id(vocab["<unk>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


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
