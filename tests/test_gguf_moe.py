"""GGUF mixtures of experts: a Mixtral written as llama.cpp's converter writes one
(architecture "llama" with an expert count, experts stacked per projection) loads under
Mixtral's numbers and decodes as transformers does on the same weights (F32), and on
Q8_0 expert blocks as transformers does on their dequantized values."""

from __future__ import annotations

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.model.loader import Checkpoint
from servelab.testing.tiny_gguf import build_tiny_mixtral, write_mixtral_gguf

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


def test_q8_0_experts_decode_as_transformers_on_their_dequantized_values(mixtral, tmp_path):
    import transformers
    from gguf import GGMLQuantizationType, quants

    path = write_mixtral_gguf(mixtral, tmp_path / "mixtral-q8.gguf", expert_type="Q8_0")
    model = transformers.AutoModelForCausalLM.from_pretrained(mixtral, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 3:  # stacked experts: each expert's rows through Q8_0 and back
                for expert in range(param.shape[0]):
                    blocks = quants.quantize(param[expert].numpy(), GGMLQuantizationType.Q8_0)
                    param[expert].copy_(torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0)))
    model.save_pretrained(tmp_path / "dequantized")
    assert servelab_greedy(path) == hf_greedy(tmp_path / "dequantized")
