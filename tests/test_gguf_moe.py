"""GGUF mixtures of experts, written as llama.cpp's converter writes them: a Mixtral
(architecture "llama" with an expert count, experts stacked per projection) and a Qwen2-MoE
(architecture "qwen2moe": experts stacked per projection, a shared expert behind its gate,
q/k/v biases, query/key rows not permuted) load under their own numbers and decode as
transformers does on the same weights (F32), and on Q8_0 expert blocks as transformers does
on their dequantized values. The dense "qwen2" architecture reads on the same path."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.errors import CheckpointError
from servelab.model.gguf_checkpoint import GGUFFile
from servelab.model.loader import Checkpoint
from servelab.testing.tiny_gguf import (TINY_QWEN2MOE_Q8_SHAPE, build_tiny_mixtral, build_tiny_qwen2,
                                        build_tiny_qwen2moe, write_mixtral_gguf, write_qwen2_gguf,
                                        write_qwen2moe_gguf)

pytest.importorskip("gguf")

PROMPTS = [[5, 9, 13, 2, 40, 7], list(range(300, 330)), [17]]


def hf_greedy(path, prompts=PROMPTS, n=8):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def servelab_greedy(path, n=8):
    llm = LLM(str(path), max_model_len=128)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return build_tiny_mixtral(tmp_path_factory.mktemp("mixtral") / "hf")


def test_an_f32_mixtral_gguf_decodes_as_transformers(mixtral, tmp_path):
    path = write_mixtral_gguf(mixtral, tmp_path / "mixtral.gguf")
    config = Checkpoint.open(str(path)).config
    assert config.model_type == "mixtral" and config.moe.num_experts == 5 and config.moe.top_k == 2
    expected = hf_greedy(mixtral)
    assert len({t for run in expected for t in run}) > 4
    assert servelab_greedy(path) == expected


def dequantized_experts(checkpoint, out):
    """`checkpoint` with each routed expert's rows through Q8_0 and back, saved to `out`."""
    import transformers
    from gguf import GGMLQuantizationType, quants

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 3:  # stacked experts: each expert's rows through Q8_0 and back
                for expert in range(param.shape[0]):
                    blocks = quants.quantize(param[expert].numpy(), GGMLQuantizationType.Q8_0)
                    param[expert].copy_(torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0)))
    model.save_pretrained(out)
    return out


def test_q8_0_experts_decode_as_transformers_on_their_dequantized_values(mixtral, tmp_path):
    path = write_mixtral_gguf(mixtral, tmp_path / "mixtral-q8.gguf", expert_type="Q8_0")
    assert servelab_greedy(path) == hf_greedy(dequantized_experts(mixtral, tmp_path / "dequantized"))


@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory):
    return build_tiny_qwen2moe(tmp_path_factory.mktemp("qwen2moe") / "hf")


def test_an_f32_qwen2moe_gguf_decodes_as_transformers(qwen2moe, tmp_path):
    path = write_qwen2moe_gguf(qwen2moe, tmp_path / "qwen2moe.gguf")
    checkpoint = Checkpoint.open(str(path))
    config, moe = checkpoint.config, checkpoint.config.moe
    assert config.model_type == "qwen2_moe" and config.qkv_bias and not config.o_bias
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (40, 4, 2, 10)
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size,
            moe.shared_expert_intermediate_size) == (7, 3, 24, 30)
    assert not moe.norm_topk_prob and moe.sparse_layers == (0, 1)
    tensors = checkpoint.tensors()
    assert tuple(tensors["layers.0.mlp.shared_expert_gate.weight"].shape) == (1, 40)
    assert checkpoint.tokenizer.decode(checkpoint.tokenizer.encode("def f(x):\n    return 42")) == \
        "def f(x):\n    return 42"
    expected = hf_greedy(qwen2moe)
    assert len({t for run in expected for t in run}) > 4
    assert servelab_greedy(path) == expected


def test_q8_0_qwen2moe_experts_decode_as_transformers_on_their_dequantized_values(tmp_path):
    """Widths that are multiples of the Q8_0 block; the shared expert's gate written [hidden],
    as older converters squeezed it."""
    import gguf

    hf = build_tiny_qwen2moe(tmp_path / "hf", **TINY_QWEN2MOE_Q8_SHAPE)
    path = write_qwen2moe_gguf(hf, tmp_path / "qwen2moe-q8.gguf", expert_type="Q8_0", squeeze_shared_gate=True)
    types = {t.name: (t.tensor_type.name, len(t.shape)) for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.1.ffn_down_exps.weight"] == ("Q8_0", 3) and types["blk.0.ffn_gate_inp_shexp.weight"][1] == 1
    assert servelab_greedy(path) == hf_greedy(dequantized_experts(hf, tmp_path / "dequantized"))


def test_a_dense_qwen2_gguf_decodes_as_transformers(tmp_path):
    hf = build_tiny_qwen2(tmp_path / "hf")
    path = write_qwen2_gguf(hf, tmp_path / "qwen2.gguf")
    config = Checkpoint.open(str(path)).config
    assert config.model_type == "qwen2" and config.moe is None and config.qkv_bias and not config.o_bias
    expected = hf_greedy(hf)
    assert len({t for run in expected for t in run}) > 4
    assert servelab_greedy(path) == expected


def test_a_tensor_the_architecture_lacks_is_refused(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "qwen2moe")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate.weight", np.zeros((6, 4), dtype=np.float32))  # llama's dense MLP
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="tensor 'blk.0.ffn_gate.weight', which a qwen2moe decoder does not have"):
        GGUFFile(tmp_path / "odd.gguf").hf_tensors(SimpleNamespace(num_heads=1, num_kv_heads=1))
