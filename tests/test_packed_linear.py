"""Linear layers packed for oneDNN: the same results as torch's linear at every batch
size, the LM head keeps its (tied) weight, the engine's greedy tokens still equal
transformers' with packing on and off, and a failure to pack falls back in one line."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn
from torch.nn import functional as F

from servelab import LLM, SamplingParams
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.model import packed_linear
from servelab.model.packed_linear import PackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN linear packing")


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch_linear(dtype, tolerance, bias):
    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN does not pack {dtype} weights on this CPU (bfloat16 needs AVX-512 BW/VL/DQ)")
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 80, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96, generator=generator))
    packed = PackedLinear(linear)
    for rows in (1, 3, 64, 257):
        x = torch.randn(rows, 96, generator=generator).to(dtype)
        with torch.inference_mode():
            expected = F.linear(x, linear.weight, linear.bias).float()
            got = packed(x).float()
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 8)) for _ in range(2))
        self.lm_head = nn.Linear(8, 10, bias=False)
        self.lm_head.weight = self.embed.weight


def test_prepack_replaces_every_linear_and_keeps_the_tied_head():
    model = _Tiny()
    assert prepack_linears(model, keep_weights=("lm_head",)) == 5
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.lm_head.weight is model.embed.weight
    assert not hasattr(model.layers[0][0], "weight")  # the unpacked copy is dropped


def test_without_onednn_the_layers_hold_their_plain_weights_until_panels_take_them():
    """Where oneDNN cannot pack a dtype on this CPU (bfloat16 on AVX2) the layers are wrapped
    all the same: torch's linear on the same Parameter, bit-identical (the library's panels
    taking them over: test_cpu_paged.py's test_the_linears_move_to_the_library_once_it_is_ready)."""
    model = _Tiny().to(torch.bfloat16)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        expected = model.layers[0](x)
    first = model.layers[0][0].weight
    assert prepack_linears(model, keep_weights=("lm_head",), onednn=False) == 5
    layer = model.layers[0][0]
    assert isinstance(layer, PackedLinear) and layer.packed_weight is None and layer.weight is first
    with torch.inference_mode():
        assert torch.equal(model.layers[0](x), expected)


def test_a_failed_pack_falls_back_with_one_warning(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(packed_linear.torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    model = _Tiny()
    with capture_logs() as logs:
        assert prepack_linears(model) == 0
    assert [e["event"] for e in logs] == ["packed_linear.unavailable"]
    assert isinstance(model.layers[0][0], nn.Linear)


@pytest.mark.parametrize("prepack", [True, False])
def test_greedy_matches_transformers_with_and_without_packing(checkpoint_factory, prepack):
    import transformers

    path = checkpoint_factory("qwen2")  # q/k/v biases go through the packed layer too
    prompts = [[5, 9, 13, 2, 40, 7], list(range(3, 30))]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(path, max_model_len=128, prepack_weights=prepack)
    layer = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, PackedLinear) is prepack
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected


def test_prepack_weights_must_be_a_boolean():
    with pytest.raises(ConfigError, match="prepack_weights must be true or false"):
        EngineConfig.from_dict({"engine": {"prepack_weights": "yes"}})
