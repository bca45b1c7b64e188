"""LoRA adapters end to end: greedy output equals peft's PeftModel and the merged weights,
mixed-adapter batches equal each request alone, swaps and prefix caching change nothing,
quantized bases, and hostile adapter files refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from lora_adapters import build_adapter, peft_greedy  # noqa: E402
from native_steps import tokens_and_logprobs, watch_native_steps  # noqa: E402

from servelab import LLM, LoRARequest, RequestError, SamplingParams  # noqa: E402
from servelab.testing.tiny_model import tiny_checkpoint  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 41, 7], [11, 3, 99, 150, 23, 8, 60, 2, 77], [100, 101, 102]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base() -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    """Three adapters of mixed ranks and targets, one with rslora, rank and alpha patterns."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": build_adapter(base, root / "attn", r=4, alpha=8, seed=1, target_modules=r".*\.self_attn\.(q|v)_proj"),
        "all": build_adapter(base, root / "all", r=8, alpha=16, seed=2,
                             target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"),
                             rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 4}),
        "mlp": build_adapter(base, root / "mlp", r=2, alpha=4, seed=3, target_modules=("up_proj", "down_proj"),
                             use_rslora=True, layers_to_transform=[1]),
    }


def requests_for(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(sorted(adapters.items()))}


def tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def llm(base) -> LLM:
    return LLM(base, enable_lora=True, max_loras=4)


@pytest.mark.parametrize("name", ["attn", "all", "mlp"])
def test_greedy_equals_peft_and_merged_weights(llm, base, adapters, name):
    request = requests_for(adapters)[name]
    got = tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=request))
    for prompt, out in zip(PROMPTS[:2], got):
        assert out == peft_greedy(base, adapters[name], prompt, 8)
        assert out == peft_greedy(base, adapters[name], prompt, 8, merged=True)


def test_adapters_change_the_output(llm, base, adapters):
    """The adapters are not the identity (else the comparisons above prove nothing)."""
    plain = tokens(llm.generate(PROMPTS[:2], GREEDY))
    assert plain == [peft_greedy(base, None, p, 8) for p in PROMPTS[:2]]
    for request in requests_for(adapters).values():
        assert tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=request)) != plain


def test_a_mixed_batch_equals_each_request_alone(llm, adapters):
    requests = requests_for(adapters)
    mix = [requests["attn"], None, requests["all"], requests["mlp"], requests["attn"], None]
    prompts = [PROMPTS[i % 3] for i in range(len(mix))]
    together = tokens(llm.generate(prompts, GREEDY, lora_request=mix))
    alone = [tokens(llm.generate([p], GREEDY, lora_request=r))[0] for p, r in zip(prompts, mix)]
    assert together == alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_decoder_adds_the_same_updates(base, adapters, dtype):
    """Decode steps with adapters run the whole decoder in one native call, with tokens and
    logprobs bit-identical to the Python layers' path, pool swaps included (max_loras=2
    over three adapters)."""
    from servelab.plugins.kernels.cpu_build import kernel_build

    if kernel_build().wait() is None:
        pytest.skip("the cpu-paged library is not built here")
    requests = requests_for(adapters)
    mix = [requests["attn"], None, requests["all"], requests["mlp"], requests["all"]]
    prompts = [PROMPTS[i % 3] for i in range(len(mix))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    results, steps = {}, []
    for native in (False, True):
        llm = LLM(base, enable_lora=True, max_loras=2, dtype=dtype,
                  config={"attention": {"name": "cpu-paged", "build": "wait", "native_decoder": native}})
        watch_native_steps(llm, steps, native)
        outputs = [llm.generate(prompts[i:i + 2], params, lora_request=mix[i:i + 2])[0] for i in range(0, 5, 2)]
        results[native] = tokens_and_logprobs(outputs)
    assert results[True] == results[False]
    assert any(ran for native, ran in steps if native) and not any(ran for native, ran in steps if not native)


def test_one_slot_forces_swaps_and_changes_no_output(base, adapters, llm):
    requests = requests_for(adapters)
    mix = [requests["attn"], requests["all"], None, requests["mlp"], requests["all"]]
    prompts = [PROMPTS[i % 3] for i in range(len(mix))]
    expected = tokens(llm.generate(prompts, GREEDY, lora_request=mix))
    one_slot = LLM(base, enable_lora=True, max_loras=1, max_cpu_loras=1)
    assert tokens(one_slot.generate(prompts, GREEDY, lora_request=mix)) == expected
    manager = one_slot.engine.runner.lora
    assert manager.num_pool_loads >= 3  # every adapter change swapped the one slot


def test_prefix_cache_is_keyed_by_adapter(base, adapters):
    """A prompt cached under one adapter is not served to another (nor to the base model),
    and is served to the same adapter."""
    requests = requests_for(adapters)
    prompt = list(range(3, 3 + 40))  # several full blocks
    reference = LLM(base, enable_lora=True, **{"allocator.name": "hash"})
    expected = {name: tokens(reference.generate([prompt], GREEDY, lora_request=requests.get(name)))[0]
                for name in ("attn", "all", None)}
    cached = LLM(base, enable_lora=True, **{"allocator.name": "radix"})
    hits = []
    for name in ("attn", "all", None, "attn", None):
        out = cached.generate([prompt], GREEDY, lora_request=requests.get(name))[0]
        assert out.outputs[0].token_ids == expected[name]
        hits.append(out.metrics.num_cached_tokens)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0 and hits[4] > 0


def test_int4_base_with_adapter_matches_the_dequantized_base(base, adapters, tmp_path):
    """The adapter on int4 blocks equals the same adapter on a float checkpoint holding the
    blocks' dequantized weights, within the int4 kernel's float rounding."""
    from safetensors.torch import load_file, save_file
    import shutil
    from servelab.model.quantized_linear import QuantizedWeight

    dequantized = tmp_path / "dequantized"
    shutil.copytree(base, dequantized)
    tensors = load_file(str(dequantized / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            format = "q8_0" if name == "lm_head.weight" else "q4_1"
            tensors[name] = QuantizedWeight.quantize(tensor, format).dequantize().contiguous()
    save_file(tensors, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    request = requests_for(adapters)["all"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    quantized = LLM(base, enable_lora=True, weights="int4", quantized_activations="float").generate(
        PROMPTS, params, lora_request=request)
    reference = LLM(str(dequantized), enable_lora=True).generate(PROMPTS, params, lora_request=request)
    assert tokens(quantized) == tokens(reference)
    for got, want in zip(quantized, reference):
        for step_got, step_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            token = next(iter(step_want))
            assert step_got[token].logprob == pytest.approx(step_want[token].logprob, abs=2e-3)


def test_a_request_naming_an_adapter_needs_enable_lora(base, adapters):
    plain = LLM(base)
    with pytest.raises(RequestError, match="enable_lora"):
        plain.generate(PROMPTS[:1], GREEDY, lora_request=requests_for(adapters)["attn"])


def test_one_id_names_one_adapter(llm, adapters):
    requests = requests_for(adapters)
    llm.generate(PROMPTS[:1], GREEDY, lora_request=requests["attn"])
    with pytest.raises(RequestError, match="already names adapter"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("other", requests["attn"].lora_int_id,
                                                                   adapters["mlp"]))
    with pytest.raises(RequestError, match="lora_int_id must be an int > 0"):
        LoRARequest("x", 0, adapters["mlp"])


def test_the_scheduler_caps_adapters_per_batch(base, adapters):
    requests = requests_for(adapters)
    llm = LLM(base, enable_lora=True, max_loras=2)
    seen: list[set[int]] = []
    runner = llm.engine.runner
    prepare = runner.prepare

    def watching(plan, *args, **kwargs):
        seen.append({seq.lora_id for seq, _ in plan.scheduled if seq.lora_id})
        return prepare(plan, *args, **kwargs)

    runner.prepare = watching
    mix = [requests["attn"], requests["all"], requests["mlp"], requests["attn"], requests["mlp"], None]
    outs = llm.generate([PROMPTS[i % 3] for i in range(len(mix))], GREEDY, lora_request=mix)
    assert all(len(out.outputs[0].token_ids) == 8 for out in outs)
    assert max(len(step) for step in seen) == 2


@pytest.mark.parametrize("weights, dtype, tolerance", [("int8", "float32", 2e-2), ("dequantize", "bfloat16", 0.15)])
def test_other_base_formats_keep_the_adapter(base, adapters, weights, dtype, tolerance):
    """int8 blocks and a bfloat16 base run the same float adapter: their logprobs stay
    within the format's own distance from the float32 base with the adapter."""
    request = requests_for(adapters)["all"]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    reference = LLM(base, enable_lora=True).generate(PROMPTS[:2], params, lora_request=request)
    got = LLM(base, enable_lora=True, weights=weights, dtype=dtype).generate(PROMPTS[:2], params,
                                                                             lora_request=request)
    plain = LLM(base, weights=weights, dtype=dtype).generate(PROMPTS[:2], params)
    for want, out, without in zip(reference, got, plain):
        first_want, first_got = want.outputs[0].logprobs[0], out.outputs[0].logprobs[0]
        token = next(iter(first_want))
        assert first_got[token].logprob == pytest.approx(first_want[token].logprob, abs=tolerance)
        assert out.outputs[0].token_ids[0] == want.outputs[0].token_ids[0]
    assert tokens(got) != tokens(plain)  # the adapter ran


def test_logprobs_are_the_adapted_models(llm, base, adapters):
    """Each sampled token's logprob is peft's log-softmax at that position."""
    import transformers
    from peft import PeftModel

    request = requests_for(adapters)["all"]
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2),
                       lora_request=request)[0].outputs[0]
    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      adapters["all"]).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0] + out.token_ids])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[len(PROMPTS[0]) - 1:-1]
    for step, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        assert logprobs[token].logprob == pytest.approx(float(expected[step, token]), abs=1e-4)


def test_chunked_prefill_n_and_speculation_keep_the_adapter(base, adapters):
    """Chunked prefill, n > 1 and n-gram speculation (the target verifies with the
    request's adapter) give the plain engine's greedy tokens."""
    requests = requests_for(adapters)
    mix = [requests["all"], None, requests["mlp"]]
    prompts = [PROMPTS[i] * 3 for i in range(3)]
    expected = tokens(LLM(base, enable_lora=True).generate(prompts, GREEDY, lora_request=mix))
    chunked = LLM(base, enable_lora=True, max_num_batched_tokens=8, **{"scheduler.name": "chunked-prefill"})
    assert tokens(chunked.generate(prompts, GREEDY, lora_request=mix)) == expected
    speculative = LLM(base, enable_lora=True, **{"drafter.name": "ngram"})
    outs = speculative.generate(prompts, GREEDY, lora_request=mix)
    assert tokens(outs) == expected
    assert sum(out.metrics.num_draft_tokens for out in outs) > 0
    forked = LLM(base, enable_lora=True).generate(prompts[:1], SamplingParams(n=2, max_tokens=8, temperature=0.0,
                                                                              ignore_eos=True), lora_request=mix[0])
    assert [c.token_ids for c in forked[0].outputs] == [expected[0], expected[0]]


def test_structured_output_with_an_adapter(tmp_path):
    """A regex-constrained request with an adapter ends in the pattern, and its first raw
    logprob is the adapted model's (peft's log-softmax), not the base model's."""
    import re
    import transformers
    from peft import PeftModel
    from servelab import StructuredOutput
    from servelab.model.loader import resolve_model

    base = str(resolve_model("builtin:tiny"))
    adapter = build_adapter(base, tmp_path / "tiny-adapter", r=4, seed=21, scale=0.3)
    llm = LLM("builtin:tiny", enable_lora=True, max_model_len=128)
    regex = r"(yes|no) \d{1,3}!"
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=1, structured=StructuredOutput.regex(regex))
    out = llm.generate("The answer is", params, lora_request=LoRARequest("tiny", 1, adapter))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and re.fullmatch(regex, completion.text), completion.text
    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      adapter).eval()
    with torch.no_grad():
        logits = model(torch.tensor([out.prompt_token_ids])).logits[0, -1]
    first = completion.token_ids[0]
    assert completion.logprobs[0][first].logprob == pytest.approx(float(torch.log_softmax(logits, -1)[first]),
                                                                   abs=1e-3)


def test_a_gguf_base_with_an_adapter_equals_peft(tmp_path):
    """An adapter trained on a GGUF model (as transformers reads the file) runs on servelab's
    reading of the same file: greedy tokens equal peft's."""
    pytest.importorskip("gguf")
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model
    from servelab.testing.tiny_gguf import write_tiny_gguf

    folder = tmp_path / "gguf"
    folder.mkdir()
    path = write_tiny_gguf(folder / "tiny.gguf", ("Q8_0", "F32"))

    def hf_model():
        return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32)

    peft_model = get_peft_model(hf_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj",
                                                                                          "down_proj"]))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    reference = PeftModel.from_pretrained(hf_model(), str(tmp_path / "adapter")).eval()
    prompt = [5, 17, 33, 9, 41, 7]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                      pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    llm = LLM(str(path), enable_lora=True)
    got = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       lora_request=LoRARequest("g", 1, str(tmp_path / "adapter")))[0].outputs[0].token_ids
    plain = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert got == expected and got != plain.token_ids


def test_prompt_logprobs_are_the_adapted_models(llm, base, adapters):
    import transformers
    from peft import PeftModel

    request = requests_for(adapters)["all"]
    out = llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                       lora_request=request)[0]
    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      adapters["all"]).eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([PROMPTS[1]])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for position, token in enumerate(PROMPTS[1][1:], start=1):
        got = out.prompt_logprobs[position][token].logprob
        assert got == pytest.approx(float(expected[position - 1, token]), abs=1e-4)
