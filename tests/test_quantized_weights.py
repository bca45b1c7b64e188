"""`[engine] weights = "int8" | "int4"`: linear layers that keep GGML blocks (q8_0, q4_0,
q4_1) in memory. The blocks are bit for bit what the `gguf` package's reference quantizers
make; the kernel (AVX-512, AVX2 and scalar paths) matches a float64 matmul of the blocks
as `gguf` dequantizes them; an engine on quantized weights decodes greedily as
`transformers` does on those dequantized weights; the torch path serves where the library
is not loaded. Accuracy against the float model and speed are measured, not asserted:
examples/measurements/quantized_weights.py."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from servelab import LLM, SamplingParams
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.model.quantized_linear import (BLOCK_BYTES, FORMAT_IDS, INT8_ACTIVATIONS, INTERLEAVED, QuantizedLinear,
                                             QuantizedWeight, deinterleave_blocks, interleave_blocks,
                                             quantize_activations, quantize_linears)
from servelab.plugins.kernels.cpu_build import kernel_build

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402
from native_steps import tokens_and_logprobs, watch_native_steps  # noqa: E402
from kernel_cache import HAS_COMPILER  # noqa: E402

needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: quantized layers take the torch path")
GGML_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
              "q4_1": GGMLQuantizationType.Q4_1}
FORMATS = list(BLOCK_BYTES)


def _gguf_blocks(weight: torch.Tensor, format: str) -> torch.Tensor:
    """gguf's reference blocks of `weight`, its rows padded with zeros to whole blocks."""
    padded = F.pad(weight.float(), (0, -weight.shape[1] % 32))
    return torch.from_numpy(gguf_quants.quantize(padded.numpy(), GGML_TYPES[format]))


def _gguf_dequantized(blocks: torch.Tensor, format: str, in_features: int) -> torch.Tensor:
    return torch.from_numpy(gguf_quants.dequantize(blocks.numpy(), GGML_TYPES[format]))[:, :in_features]


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("shape", [(5, 32), (70, 100), (13, 576), (1, 7)])
def test_blocks_are_the_gguf_reference_bit_for_bit(format, shape):
    """Quantized as ggml-quants.c does (as `gguf` reimplements it), zero and one-sided blocks
    included; dequantized to the same floats."""
    generator = torch.Generator().manual_seed(shape[0] * shape[1])
    weight = torch.randn(shape, generator=generator) * torch.rand(shape[0], 1, generator=generator) * 4
    weight[0, : min(32, shape[1])] = 0  # a block of zeros: scale 0
    if shape[0] > 1:
        weight[1] = weight[1].abs()  # every value of the row's blocks positive
    quantized = QuantizedWeight.quantize(weight, format)
    expected = _gguf_blocks(weight, format)
    assert quantized.blocks.dtype == torch.uint8 and torch.equal(quantized.blocks, expected)
    assert torch.equal(quantized.dequantize(), _gguf_dequantized(expected, format, shape[1]))
    assert quantized.nbytes == shape[0] * -(-shape[1] // 32) * BLOCK_BYTES[format]


def _kernels():
    kernels = kernel_build().wait()
    if kernels is None:
        pytest.skip(f"the kernels did not build: {kernel_build().error}")
    return kernels


@needs_compiler
def test_the_kernel_takes_the_path_of_the_cpu():
    """The vector path this CPU's build has (what ATEN_CPU_CAPABILITY names, when it is set)."""
    capability = torch.backends.cpu.get_cpu_capability()
    assert _kernels().quant_path() == {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "scalar")
    vnni = capability == "AVX512" and os.environ.get("SERVELAB_CPU_VNNI", "1") != "0" and _cpu_has("avx512_vnni")
    int_path = "avx512-vnni" if vnni else "avx2" if capability in ("AVX512", "AVX2") else "scalar"
    assert _kernels().quant_int_path() == int_path


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return any(line.startswith("flags") and f" {flag}" in line for line in cpuinfo)
    except OSError:
        return False


@needs_compiler
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("out_features, in_features", [(1, 32), (70, 100), (211, 13), (9, 576), (130, 1536)])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("scalar", [False, True], ids=["vector", "scalar"])
def test_kernel_matches_a_float64_matmul_of_the_gguf_dequantized_weight(format, out_features, in_features, bias,
                                                                         scalar):
    """Every remainder of output rows a task takes (1-4), a last block padded past
    in_features, 1-4 rows of x (weights widened in registers) and more (widened once into a
    scratch row: 5, 6, 7, 13, 64), no rows, leading dims and a strided input. Float32 sums
    of K products of ~1 drift by ~1e-7 x K; a wrong weight, scale or nibble is off by ~1."""
    kernels = _kernels()
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    blocks = _gguf_blocks(weight, format)
    dequantized = _gguf_dequantized(blocks, format, in_features).double()
    b = torch.randn(out_features, generator=generator) if bias else None

    def check(x):
        expected = F.linear(x.double(), dequantized, None if b is None else b.double())
        got = kernels.quant_linear(x, blocks, FORMAT_IDS[format], b, scalar)
        assert got.dtype == torch.float32 and got.shape == (*x.shape[:-1], out_features)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6 * in_features)

    for rows in (0, 1, 2, 3, 4, 5, 6, 7, 13, 64):
        check(torch.randn(rows, in_features, generator=generator))
    check(torch.randn(2, 3, 2 * in_features, generator=generator)[..., ::2])


def test_activations_are_quantized_as_llama_cpp_s_q8_0():
    """Per block of 32 (the last padded): d = amax / 127 kept in float32 (gguf's q8_0 rounds
    it to float16), q = round-half-even(x / d): the q of gguf's q8_0 reference (round half
    away from zero), but at exact halves."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 100, generator=generator) * 3
    x[0, :32] = 0  # a block of zeros: scale 0
    got = quantize_activations(x)
    q = _gguf_blocks(x, "q8_0").view(3, 4, 34)[..., 2:].contiguous().view(torch.int8).float()
    d = F.pad(x, (0, 28)).view(3, 4, 32).abs().amax(-1, keepdim=True) / 127
    assert got.shape == x.shape and torch.equal(got, (d * q).view(3, 128)[:, :100])
    assert torch.equal(quantize_activations(torch.tensor([[63.5, 127.0, 0.5, -63.5] + [0.0] * 28])),
                       torch.tensor([[64.0, 127.0, 0.0, -64.0] + [0.0] * 28]))  # 63.5 and 0.5: to even


@needs_compiler
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("out_features, in_features", [(1, 32), (70, 100), (211, 13), (9, 576), (130, 1536)])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("scalar", [False, True], ids=["vector", "scalar"])
def test_int8_activation_kernel_matches_a_float64_matmul_of_the_same_quantization(format, out_features, in_features,
                                                                                  bias, scalar):
    """Integer dot products (VNNI, AVX2 maddubs, scalar): the gguf-dequantized weight times
    x quantized as quantize_activations does, in float64, to float32 rounding (a wrong sign
    trick, offset or scale is off by ~1), for every tile (1-8 rows in registers, 13, 64, and
    133 in chunks of 64; none; leading dims, a strided input; column counts that leave a
    group of 16 part empty); and within 3% (RMS) of the float activations' result, what int8
    activations cost on Gaussian inputs. The vector kernels read the interleaved blocks, the
    scalar reference either layout."""
    kernels = _kernels()
    generator = torch.Generator().manual_seed(out_features * 5 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    blocks = _gguf_blocks(weight, format)
    dequantized = _gguf_dequantized(blocks, format, in_features).double()
    b = torch.randn(out_features, generator=generator) if bias else None
    interleaved = interleave_blocks(blocks, format)
    int8 = FORMAT_IDS[format] + INT8_ACTIVATIONS

    def check(x):
        expected = F.linear(quantize_activations(x).double(), dequantized, None if b is None else b.double())
        got = kernels.quant_linear(x, interleaved, int8 + INTERLEAVED, b, scalar, out_features)
        if scalar:
            assert torch.equal(kernels.quant_linear(x, blocks, int8, b, True), got)
        assert got.dtype == torch.float32 and got.shape == (*x.shape[:-1], out_features)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6 * in_features)
        if x.numel():
            exact = F.linear(x.double(), dequantized, None if b is None else b.double())
            assert (got.double() - exact).norm() <= 0.03 * exact.norm()

    for rows in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 64, 133):
        check(torch.randn(rows, in_features, generator=generator))
    check(torch.randn(2, 3, 2 * in_features, generator=generator)[..., ::2])


@needs_compiler
@pytest.mark.parametrize("format", FORMATS)
def test_int8_activation_kernels_equal_the_scalar_reference_bit_for_bit_at_any_batch(format):
    """Every path sums a block's exact integer dot product into a float in block order, so
    the vector kernels give the scalar reference's floats exactly, and a row's result is the
    same alone or beside any number of other rows (a request's tokens never depend on its
    batch)."""
    kernels = _kernels()
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(37, 200, generator=generator)
    blocks = QuantizedWeight.quantize(weight, format).blocks
    interleaved = interleave_blocks(blocks, format)
    int8 = FORMAT_IDS[format] + INT8_ACTIVATIONS
    bias = torch.randn(37, generator=generator)
    x = torch.randn(70, 200, generator=generator)
    reference = kernels.quant_linear(x, blocks, int8, bias, True)
    for rows in (1, 2, 3, 5, 8, 9, 16, 17, 64, 65, 70):
        got = kernels.quant_linear(x[:rows], interleaved, int8 + INTERLEAVED, bias, False, 37)
        assert torch.equal(got, reference[:rows]), rows
    for row in (0, 9, 69):
        assert torch.equal(kernels.quant_linear(x[row:row + 1], interleaved, int8 + INTERLEAVED, bias, False, 37)[0],
                           reference[row])


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("out_features", [1, 16, 37, 64])
def test_interleaving_moves_the_blocks_bytes_and_nothing_else(format, out_features):
    blocks = QuantizedWeight.quantize(torch.randn(out_features, 100), format).blocks
    interleaved = interleave_blocks(blocks, format)
    assert interleaved.shape == (-(-out_features // 16) * 16, blocks.shape[1])
    assert torch.equal(deinterleave_blocks(interleaved, format, out_features), blocks)
    # the first record: column 0's d, then (q4) column 0's first four nibble bytes right after the scales
    scales = 64 if format == "q4_1" else 32
    assert torch.equal(interleaved[0, 0:2], blocks[0, 0:2])
    if format != "q8_0":
        assert torch.equal(interleaved[0, scales:scales + 4], blocks[0, scales // 16:scales // 16 + 4])
    else:
        assert torch.equal(interleaved[0, 32:36] ^ 0x80, blocks[0, 2:6])


@needs_compiler
def test_a_layer_interleaves_its_blocks_for_the_library_and_reads_them_back():
    weight = QuantizedWeight.quantize(torch.randn(37, 100), "q4_1")
    layer = QuantizedLinear(weight, activations="int8")
    x = torch.randn(3, 100)
    on_torch = layer(x)
    layer.use_kernels(_kernels())
    assert layer.interleaved and layer.blocks.shape == (48, weight.blocks.shape[1])
    assert torch.equal(layer.quantized_weight.blocks, weight.blocks)
    torch.testing.assert_close(layer(x), on_torch, rtol=1e-5, atol=1e-5)
    assert layer(x).shape == (3, 37)


def test_a_library_without_interleaved_kernels_keeps_ggml_blocks():
    """A quantized-linear library of an earlier contract (no `quant_group_columns`) is handed
    GGML's blocks and called as before."""
    calls = []

    class EarlierLibrary:
        def quant_linear(self, x, blocks, format, bias=None, scalar=False):
            calls.append((blocks.shape, format))
            return F.linear(quantize_activations(x), QuantizedWeight("q8_0", blocks, 64).dequantize(), bias)

        def quant_path(self):
            return "scalar"

    weight = QuantizedWeight.quantize(torch.randn(8, 64), "q8_0")
    layer = QuantizedLinear(weight, activations="int8")
    layer.use_kernels(EarlierLibrary())
    assert not layer.interleaved and layer.blocks is weight.blocks
    assert layer(torch.randn(2, 64)).shape == (2, 8)
    assert calls == [((8, 68), FORMAT_IDS["q8_0"] + INT8_ACTIVATIONS)]


@needs_compiler
def test_int8_activation_kernel_takes_extreme_blocks():
    """q8_0 weights of -128 (gguf never writes one, other quantizers may: |w| = 128 must not
    saturate maddubs' int16 pairs), x's own extremes, and blocks of zeros on either side."""
    kernels = _kernels()
    generator = torch.Generator().manual_seed(11)
    blocks = _gguf_blocks(torch.randn(8, 64, generator=generator), "q8_0").view(8, 2, 34)
    blocks[:4, :, 2:] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
    blocks[5, 1, 2:] = 0
    blocks = blocks.reshape(8, 68)
    dequantized = _gguf_dequantized(blocks, "q8_0", 64).double()
    x = torch.randn(6, 64, generator=generator)
    x[0] = 1000.0
    x[1, ::2] = -1000.0
    x[2, 32:] = 0
    expected = F.linear(quantize_activations(x).double(), dequantized)
    int8 = FORMAT_IDS["q8_0"] + INT8_ACTIVATIONS
    reference = kernels.quant_linear(x, blocks, int8, None, True)
    torch.testing.assert_close(reference.double(), expected, rtol=1e-5, atol=1e-3)
    got = kernels.quant_linear(x, interleave_blocks(blocks, "q8_0"), int8 + INTERLEAVED, None, False, 8)
    assert torch.equal(got, reference)


@needs_compiler
def test_kernel_refuses_mismatched_inputs():
    kernels = _kernels()
    blocks = QuantizedWeight.quantize(torch.randn(8, 64), "q4_1").blocks
    with pytest.raises(RuntimeError, match="x has 96 features, which take 3 blocks of 20 bytes a row; "
                                           "the weight has 40 bytes a row"):
        kernels.quant_linear(torch.randn(2, 96), blocks, FORMAT_IDS["q4_1"])
    with pytest.raises(RuntimeError, match="x must be a float32 tensor"):
        kernels.quant_linear(torch.randn(2, 64, dtype=torch.bfloat16), blocks, FORMAT_IDS["q4_1"])
    with pytest.raises(RuntimeError, match="format must be 0 \\(q8_0\\), 1 \\(q4_0\\) or 2 \\(q4_1\\), plus 16 "
                                           "for int8 activations \\(plus 32 more for interleaved blocks\\), got 7"):
        kernels.quant_linear(torch.randn(2, 64), blocks, 7)
    with pytest.raises(RuntimeError, match="got 34"):  # interleaved blocks are for int8 activations only
        kernels.quant_linear(torch.randn(2, 64), blocks, FORMAT_IDS["q4_1"] + INTERLEAVED)
    if kernels.quant_int_path() != "scalar":
        with pytest.raises(RuntimeError, match="the vector kernels multiply int8 activations by interleaved blocks"):
            kernels.quant_linear(torch.randn(2, 64), blocks, FORMAT_IDS["q4_1"] + INT8_ACTIVATIONS)
    with pytest.raises(RuntimeError, match="out_features 8 does not match the 8 rows of interleaved blocks"):
        kernels.quant_linear(torch.randn(2, 64), blocks, FORMAT_IDS["q4_1"] + INT8_ACTIVATIONS + INTERLEAVED)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 tensor of 8 values"):
        kernels.quant_linear(torch.randn(2, 64), blocks, FORMAT_IDS["q4_1"], torch.randn(7))
    with pytest.raises(RuntimeError, match="blocks must be a contiguous 2-D uint8 tensor"):
        kernels.quant_linear(torch.randn(2, 64), blocks.float(), FORMAT_IDS["q4_1"])


@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_torch_path_and_the_kernel_agree(format, dtype, activations):
    """Before the library is loaded (or without a compiler) a layer dequantizes with torch;
    once it has the kernel, the same outputs to float rounding, in the input's dtype."""
    generator = torch.Generator().manual_seed(3)
    linear = nn.Linear(100, 70).to(dtype)
    layer = QuantizedLinear(QuantizedWeight.quantize(linear.weight, format), linear.bias, activations=activations)
    x = torch.randn(5, 100, generator=generator).to(dtype)
    on_torch = layer(x)
    inputs = quantize_activations(x.float()) if activations == "int8" else x
    expected = F.linear(inputs.double(), _gguf_dequantized(_gguf_blocks(linear.weight.detach(), format), format,
                                                      100).double(), linear.bias.double())
    assert on_torch.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(on_torch.double(), expected, **tolerance)
    if HAS_COMPILER:
        layer.use_kernels(_kernels())
        torch.testing.assert_close(layer(x).double(), on_torch.double(), **tolerance)


def _dequantized_checkpoint(source: str, target, weights: str) -> str:
    """`source`'s checkpoint with every linear weight replaced by gguf's dequantization of the
    blocks `weights` keeps (int4: q4_1, the LM head q8_0), for transformers to run."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    decoder_format, head_format = {"int8": ("q8_0", "q8_0"), "int4": ("q4_1", "q8_0")}[weights]
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                format = head_format if name == "lm_head" else decoder_format
                module.weight.copy_(_gguf_dequantized(_gguf_blocks(module.weight, format), format,
                                                      module.in_features))
    model.save_pretrained(target)
    return str(target)


@pytest.mark.parametrize("kind, weights, build", [("llama", "int8", "wait"), ("llama", "int4", "wait"),
                                                  ("qwen2", "int4", "wait"), ("llama", "int4", "never")])
def test_engine_greedy_matches_transformers_on_the_dequantized_weights(checkpoint_factory, tmp_path, kind,
                                                                        weights, build):
    """A quantized model is a float model whose weights are the blocks' values: servelab on
    the blocks decodes greedily as transformers does on gguf's dequantization of them (odd
    widths: a last block padded; Qwen2's biases; `build = "never"`: the torch path)."""
    import transformers

    if build == "wait" and not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    path = checkpoint_factory(kind)
    reference = _dequantized_checkpoint(path, tmp_path / "dequantized", weights)
    prompts = [[5, 9, 13, 2, 40, 7], list(range(3, 40)), [17]]
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(path, max_model_len=128, weights=weights, quantized_activations="float",
              **{"attention.name": "cpu-paged", "attention.build": build})
    outputs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4 + 1
    assert all((m.kernels is not None) == (build == "wait") for m in layers)


@needs_compiler
@pytest.mark.parametrize("kind, dtype, weights", [("llama3-rope-tied", "float32", "int4"), ("qwen2", "bfloat16", "int8")])
def test_the_native_decoder_runs_quantized_layers_bit_identically(checkpoint_factory, kind, dtype, weights):
    """With every linear quantized and handed the library's kernel, the whole decoder runs
    in one native call (every step: head dims of 16, which the kernel tiles prompts for), giving
    the Python loop's logits to the bit."""
    path = checkpoint_factory(kind)
    prompts = [[5, 9, 13, 2, 40, 7, 5, 9, 13, 2], list(range(3, 40)), [17]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    results, native_steps = {}, []
    for native in (False, True):
        llm = LLM(path, config={"attention": {"name": "cpu-paged", "build": "wait", "native_decoder": native}},
                  dtype=dtype, max_model_len=128, weights=weights)
        watch_native_steps(llm, native_steps, native)
        results[native] = tokens_and_logprobs(llm.generate(prompts, params))
    assert results[True] == results[False]
    assert [ran for native, ran in native_steps if native] and all(ran for native, ran in native_steps if native)
    assert not any(ran for native, ran in native_steps if not native)


def test_layers_hold_the_scheme_s_formats_and_the_head_keeps_its_plain_weight(checkpoint_factory):
    llm = LLM(checkpoint_factory("llama3-rope-tied"), max_model_len=64, weights="int4")
    model = llm.engine.runner.model
    formats = {name: m.format for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert formats.pop("lm_head") == "q8_0" and set(formats.values()) == {"q4_1"} and len(formats) == 8
    assert model.lm_head.weight is model.embed_tokens.weight  # the tied embedding still reads it
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]


def test_blocks_handed_over_are_kept_as_they_are():
    """The entry point for blocks a file already holds (a GGUF checkpoint's): used verbatim,
    in their own format, shape-checked, every name accounted for."""
    model = nn.Module()
    model.proj, model.lm_head = nn.Linear(64, 8), nn.Linear(64, 5, bias=False)
    given = QuantizedWeight.from_blocks("q4_0", QuantizedWeight.quantize(torch.randn(8, 64), "q4_0").blocks, 64)
    assert quantize_linears(model, "int8", given={"proj": given}) == 2
    assert model.proj.blocks is given.blocks and model.proj.format == "q4_0" and model.lm_head.format == "q8_0"
    with pytest.raises(ValueError, match="q4_0 blocks of a weight with 64 input features must be uint8 \\[rows, 36\\]"):
        QuantizedWeight.from_blocks("q4_0", torch.zeros(8, 40, dtype=torch.uint8), 64)
    fresh = nn.Module()
    fresh.proj = nn.Linear(64, 8)
    with pytest.raises(ValueError, match="blocks given for layers the model does not have: layers.0.up"):
        quantize_linears(fresh, "int4", given={"layers.0.up": given})
    fresh.proj = nn.Linear(64, 9)
    with pytest.raises(ValueError, match="blocks given for proj are \\[8, 64\\], the layer is \\[9, 64\\]"):
        quantize_linears(fresh, "int4", given={"proj": given})
    stacked = given.concat(given)
    assert stacked.out_features == 16 and torch.equal(stacked.dequantize()[8:], given.dequantize())


def test_the_option_flows_from_config_and_is_checked():
    assert EngineConfig.load(None).engine.weights == "dequantize"
    assert EngineConfig.load(None).with_set_options(["engine.weights=int4"]).engine.weights == "int4"
    with pytest.raises(ConfigError, match="\\[engine\\] weights must be one of dequantize, int8, int4, got 'int3'"):
        EngineConfig.load(None).with_overrides({"engine.weights": "int3"})
    with pytest.raises(ConfigError, match="runs on the CPU only"):
        EngineConfig.load(None).with_overrides({"engine.weights": "int8", "engine.device": "cuda"})
    with pytest.raises(ConfigError, match="not sharded over ranks yet"):
        EngineConfig.load(None).with_overrides({"engine.weights": "int8", "engine.tensor_parallel_size": 2})
    assert EngineConfig.load(None).engine.quantized_activations == "int8"
    with pytest.raises(ConfigError, match="\\[engine\\] quantized_activations must be one of int8, float, got 'int4'"):
        EngineConfig.load(None).with_overrides({"engine.quantized_activations": "int4"})
    with pytest.raises(ValueError, match="quantized weights multiply int8 or float activations, got 'int4'"):
        QuantizedLinear(QuantizedWeight.quantize(torch.randn(8, 64), "q8_0"), activations="int4")
    with pytest.raises(ConfigError, match="\\[engine\\] weights must be a str, got 8"):
        EngineConfig.load({"engine": {"weights": 8}})


def test_the_cli_takes_weights():
    from servelab.cli import load_config, parse_args

    assert load_config(parse_args(["generate", "--weights", "int8", "--prompt", "x"])).engine.weights == "int8"
    with pytest.raises(SystemExit):
        parse_args(["generate", "--weights", "int2", "--prompt", "x"])


@pytest.mark.parametrize("types, weights", [(("Q4_1",), "int4"), (("Q4_0", "Q8_0"), "int4"), (("Q8_0", "F16"), "int8"),
                                            (("Q4_1",), "int8")])
def test_a_gguf_file_s_own_blocks_reach_the_layers_as_they_are(tmp_path, types, weights):
    """A GGUF file's Q8_0 / Q4_0 / Q4_1 tensors are the layers' blocks, bytes unchanged (the
    query/key rows put in Hugging Face's order, a fused projection's parts stacked), where
    the scheme keeps that format (int4: any of them; int8: q8_0); the other layers are
    quantized from their dequantized values in the scheme's format."""
    from servelab.model.loader import Checkpoint
    from servelab.testing.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", types)
    tensors = Checkpoint.open(str(path)).tensors()
    llm = LLM(str(path), max_model_len=64, weights=weights, **{"attention.build": "never"})
    model = llm.engine.runner.model
    kept = {"int4": ("q8_0", "q4_0", "q4_1"), "int8": ("q8_0",)}[weights]
    file_formats = {name: tensors._file.tensors[tensors._where[name]].tensor_type.name.lower() for name in tensors}
    taken = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(
            name.rpartition(".")[2])
        names = [f"{name.rpartition('.')[0]}.{part}.weight" for part in parts] if parts else [f"{name}.weight"]
        formats = {file_formats[n] for n in names}
        if len(formats) == 1 and formats <= set(kept):
            assert layer.format == formats.pop()
            assert torch.equal(layer.quantized_weight.dequantize(), torch.cat([tensors[n] for n in names]))
            raw = torch.cat([tensors.blocks(n)[1] for n in names])
            assert torch.equal(layer.blocks, raw)
            taken += 1
        else:
            assert layer.format == ({"int4": "q4_1", "int8": "q8_0"}[weights] if name != "lm_head" else "q8_0")
    assert taken > 0 if set(t.lower() for t in types) & set(kept) else taken == 0
