"""The cpu-paged library's grouped experts (plugins/kernels/cpu_moe.cpp): one native call
for a sparse block's routed experts over their panel-packed linears.

In float32 it equals `grouped_experts` and the per-expert loop over the same panels to the
bit (the same matmul block, the same SiLU, the same order of products and sums), and the
per-expert loop in float64 within float32's rounding; in bfloat16 it equals
`grouped_experts` over the bfloat16 panels to the bit, and the float64 loop within
bfloat16's rounding. Shapes are odd on purpose (3, 5 and 7 experts; top-k 1, 2 and 3;
hidden sizes that are not multiples of 16; experts with no token; one token; 257), and an
expert with more rows than one chunk of the call takes. A served Mixtral-shaped model runs
its sparse blocks on it and decodes token for token as `transformers`. On an AVX-512 CPU the
AVX2 build (8-wide, bfloat16 widened rather than dot-multiplied) passes the same checks
(tests/test_avx2_build.py runs them on that build).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from servelab import LLM, SamplingParams
from servelab.model import moe
from servelab.model.moe import (Expert, ExpertKernels, grouped_experts, loop_experts, native_experts,
                                prepare_native_experts)
from servelab.model.packed_linear import prepack_linears, use_panel_linears
from servelab.model.quantized_linear import quantize_linears
from servelab.plugins.kernels.cpu_build import kernel_build

from test_moe_models import MAX_NEW, PROMPTS, _block, hf_greedy
from kernel_cache import HAS_COMPILER

needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the MoE blocks keep the grouped "
                                                              "torch path")


def _kernels(dtype: torch.dtype = torch.float32):
    kernels = kernel_build().wait()
    if kernels is None:
        pytest.skip(f"the cpu-paged library did not build ({kernel_build().error}): the MoE blocks keep the grouped "
                    f"torch path")
    if str(dtype).removeprefix("torch.") not in kernels.panel_dtypes():
        pytest.skip(f"the library has no {dtype} panels on this CPU (no AVX2): the experts stay on torch's linear")
    return kernels


def _experts(num_experts: int, hidden: int, width: int, seed: int) -> nn.ModuleList:
    torch.manual_seed(seed)
    experts = nn.ModuleList(Expert(hidden, width) for _ in range(num_experts))
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0.0, 0.3)
    return experts


def _on_panels(experts: nn.ModuleList, kernels, dtype: torch.dtype) -> nn.ModuleList:
    packed = copy.deepcopy(experts).to(dtype)
    prepack_linears(packed, onednn=False)
    assert use_panel_linears(packed, kernels) == 2 * len(packed)
    return packed


def _routing(tokens: int, num_experts: int, top_k: int, seed: int, idle: tuple[int, ...] = ()):
    """Softmax top-k over random logits, the `idle` experts never chosen."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=generator)
    logits[:, list(idle)] = float("-inf")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


SHAPES = [  # experts, top_k, hidden, width, tokens, idle experts
    (3, 1, 36, 28, 1, ()),
    (5, 2, 36, 44, 257, (3,)),
    (7, 3, 52, 20, 17, (0, 6)),
    (5, 3, 40, 24, 1, ()),
    (7, 2, 100, 70, 64, (2, 4)),
    (3, 2, 36, 44, 4, ()),
    (5, 1, 129, 33, 257, (1,)),
]


@needs_compiler
def test_the_library_offers_grouped_experts():
    kernels = _kernels()
    assert isinstance(kernels, ExpertKernels)
    from servelab.plugins.kernels.cpu_paged import PanelsFor

    assert isinstance(PanelsFor(kernels, ("float32",)), ExpertKernels)


@needs_compiler
@pytest.mark.parametrize("num_experts, top_k, hidden, width, tokens, idle", SHAPES)
def test_float32_equals_grouped_and_the_loop_to_the_bit(num_experts, top_k, hidden, width, tokens, idle):
    kernels = _kernels()
    experts = _experts(num_experts, hidden, width, seed=tokens + hidden)
    packed = _on_panels(experts, kernels, torch.float32)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    weights, ids = _routing(tokens, num_experts, top_k, seed=width, idle=idle)
    native = prepare_native_experts(packed)
    assert native is not None and native.num_experts() == num_experts
    with torch.inference_mode():
        got = native_experts(x, weights, ids, native)
        assert torch.equal(got, grouped_experts(x, weights, ids, packed))
        assert torch.equal(got, loop_experts(x, weights, ids, packed))
        reference = loop_experts(x.double(), weights.double(), ids, copy.deepcopy(experts).double())
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-6 * (hidden + width))
    for expert in idle:  # an idle expert's weights reach no token: zeroing them changes nothing
        packed[expert].gate_up_proj.panels.zero_()
    with torch.inference_mode():
        assert torch.equal(native_experts(x, weights, ids, native), got)


@needs_compiler
@pytest.mark.parametrize("num_experts, top_k, hidden, width, tokens, idle", SHAPES[:4])
def test_bfloat16_equals_grouped_to_the_bit_and_the_loop_within_rounding(num_experts, top_k, hidden, width, tokens,
                                                                         idle):
    """bfloat16 rounds every matmul output, SiLU and product; the weights stay float32 (as
    Mixtral's router keeps them) or are bfloat16 (Qwen2-MoE's): grouped_experts rounds both
    the same way."""
    kernels = _kernels(torch.bfloat16)
    experts = _experts(num_experts, hidden, width, seed=tokens + hidden)
    packed = _on_panels(experts, kernels, torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    weights, ids = _routing(tokens, num_experts, top_k, seed=width, idle=idle)
    native = prepare_native_experts(packed)
    with torch.inference_mode():
        reference = loop_experts(x.double(), weights.double(), ids, copy.deepcopy(experts).double())
        for w in (weights, weights.bfloat16()):
            got = native_experts(x.bfloat16(), w, ids, native)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, grouped_experts(x.bfloat16(), w, ids, packed))
            scale = float(reference.abs().max())
            torch.testing.assert_close(got.double(), reference, rtol=3e-2, atol=3e-2 * scale)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_expert_with_more_rows_than_a_chunk(dtype):
    """The call takes its rows in chunks of about 8 MB of intermediate buffers (~670 rows at
    width 1024 and hidden 20): an expert with 1,500 rows is cut in pieces, the others ride
    along whole or cut at a chunk's end."""
    kernels = _kernels(dtype)
    experts = _experts(3, 20, 1024, seed=7)
    packed = _on_panels(experts, kernels, dtype)
    tokens = 1500
    weights, ids = _routing(tokens, 3, 2, seed=5)
    ids[:, 0] = 1  # every token's first pair on expert 1
    ids[:, 1] = torch.where(torch.arange(tokens) % 3 == 0, 2, 0)
    x = torch.randn(tokens, 20, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        got = native_experts(x, weights, ids, prepare_native_experts(packed))
        assert torch.equal(got, grouped_experts(x, weights, ids, packed))


@needs_compiler
def test_a_bad_call_is_a_clear_error():
    kernels = _kernels()
    packed = _on_panels(_experts(3, 36, 28, seed=0), kernels, torch.float32)
    native = prepare_native_experts(packed)
    x = torch.randn(4, 36)
    weights, ids = _routing(4, 3, 2, seed=0)
    with pytest.raises(RuntimeError, match="out of range"):
        native.forward(x, weights, ids + 2)
    with pytest.raises(RuntimeError, match="features"):
        native.forward(torch.randn(4, 37), weights, ids)
    with pytest.raises(RuntimeError, match="dtype"):
        native.forward(x.double(), weights, ids)
    with torch.inference_mode():
        assert native.forward(x[:0], weights[:0], ids[:0]).shape == (0, 36)


@needs_compiler
def test_the_block_takes_the_native_call_only_over_panels(checkpoint_factory):
    """A sparse block runs its experts natively once they sit on the library's panels, with
    the grouped path's output; experts on torch's or oneDNN's linear, or quantized, keep the
    grouped path; so does `native = False`."""
    kernels = _kernels()
    block = _block(checkpoint_factory, "qwen2_moe")
    assert not block.use_native_experts()  # plain nn.Linear
    quantized = copy.deepcopy(block.experts)
    quantize_linears(quantized, "int8")
    assert prepare_native_experts(quantized) is None
    prepack_linears(block, onednn=False)
    assert not block.use_native_experts()  # wrapped, not yet on panels
    use_panel_linears(block, kernels)
    assert block.use_native_experts()
    x = torch.randn(9, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        native = block(x)
        block.native = False
        assert torch.equal(block(x), native)  # with the shared expert, added after either path
    block.experts[2] = Expert(block.gate.weight.shape[1], block.shape.expert_intermediate_size)  # off the panels
    assert not block.use_native_experts() and block._native_experts is None


@needs_compiler
@pytest.mark.parametrize("kind", ["mixtral", "mixtral-top1", "qwen2_moe"])
def test_a_served_moe_model_runs_its_experts_natively_and_matches_transformers(checkpoint_factory, monkeypatch, kind):
    _kernels()
    calls = []

    class Counted:
        def __init__(self, native):
            self.native = native

        def forward(self, x, weights, ids):
            calls.append(x.shape[0])
            return self.native.forward(x, weights, ids)

    prepare = moe.prepare_native_experts
    monkeypatch.setattr(moe, "prepare_native_experts", lambda experts: (lambda n: n and Counted(n))(prepare(experts)))
    path = checkpoint_factory(kind)
    llm = LLM(path, max_model_len=128, **{"attention.name": "cpu-paged", "attention.build": "wait"})
    outputs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW])
    assert [o.token_ids for o in outputs] == hf_greedy(path)
    blocks = llm.engine.runner.model.sparse_blocks()
    assert all(isinstance(block._native_experts, Counted) for block in blocks.values())
    assert 1 in calls and max(calls) > 1, calls  # decode rows and prompts both


@needs_compiler
def test_native_experts_false_keeps_the_grouped_path_with_the_same_tokens(checkpoint_factory):
    _kernels()
    path = checkpoint_factory("mixtral")
    outputs = {}
    for native in (True, False):
        llm = LLM(path, max_model_len=128,
                  config={"attention": {"name": "cpu-paged", "build": "wait", "native_experts": native}})
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
        outputs[native] = [o.token_ids for o in llm.generate(PROMPTS, params)]
        blocks = llm.engine.runner.model.sparse_blocks().values()
        assert all((block._native_experts is not None) == native for block in blocks)
    assert outputs[True] == outputs[False]
