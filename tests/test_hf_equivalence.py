"""Token-for-token equality with Hugging Face `transformers` greedy generation."""

from __future__ import annotations

import random

import pytest
import torch

from servelab import LLM, SamplingParams


def hf_greedy(checkpoint: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def mixed_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


LENGTHS = [1, 5, 17, 33, 9, 64, 2, 40]
MAX_NEW = [12, 20, 7, 16, 25, 9, 30, 14]


@pytest.fixture(scope="module")
def hf_outputs(checkpoint_factory):
    """Reference completions per checkpoint kind, computed once."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            path = checkpoint_factory(kind)
            vocab = __import__("json").load(open(f"{path}/config.json"))["vocab_size"]
            prompts = mixed_prompts(vocab, LENGTHS)
            cache[kind] = (path, prompts, [hf_greedy(path, p, n) for p, n in zip(prompts, MAX_NEW)])
        return cache[kind]

    return get


def run_servelab(path: str, prompts, **engine) -> list[list[int]]:
    llm = LLM(path, max_model_len=128, **engine)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
    outputs = llm.generate(prompts, params)
    stats = llm.engine.allocator.stats()
    assert stats.num_used_blocks == 0, "blocks leaked after every request finished"
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3-rope-tied", "mistral"])
def test_batched_greedy_matches_transformers(kind, hf_outputs):
    path, prompts, expected = hf_outputs(kind)
    assert run_servelab(path, prompts) == expected


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("allocator,attention", [("naive", "sdpa-contiguous"), ("naive", "torch-paged")])
def test_each_attention_backend_matches_transformers(kind, allocator, attention, hf_outputs):
    path, prompts, expected = hf_outputs(kind)
    assert run_servelab(path, prompts, **{"allocator.name": allocator, "attention.name": attention}) == expected


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_preemption_keeps_tokens_identical(kind, hf_outputs):
    path, prompts, expected = hf_outputs(kind)
    # 14 blocks of 8 slots (112 tokens) cannot hold all eight sequences at once
    # (they need ~330 slots), so the scheduler must preempt and recompute.
    preemptions = []
    llm = LLM(path, max_model_len=112, num_kv_blocks=14, block_size=8)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
    outputs = llm.generate(prompts, params)
    preemptions = llm.engine.scheduler.stats().num_preemptions
    assert preemptions > 0, "the KV pool was meant to be too small to avoid preemption"
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.allocator.stats().num_used_blocks == 0


def test_small_max_num_seqs_and_block_size_one(hf_outputs):
    path, prompts, expected = hf_outputs("llama")
    assert run_servelab(path, prompts, max_num_seqs=3, block_size=1) == expected


def test_eos_stops_generation_like_transformers(llama_checkpoint):
    import transformers

    prompt = mixed_prompts(211, [6], seed=3)[0]
    free_run = hf_greedy(llama_checkpoint, prompt, 10)
    eos = free_run[4]  # pretend the fifth generated token is EOS
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=eos,
                        pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(llama_checkpoint, max_model_len=64)
    out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[eos]))[0]
    assert out.token_ids == hf[: hf.index(eos) + 1]
    assert out.finish_reason == "stop"
