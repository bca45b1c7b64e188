"""Logprobs and prompt logprobs against transformers' log-softmax on a tiny checkpoint:
greedy (the chosen token is the argmax, exactly), sampled with n > 1, chunked prefill
with a prefix-caching allocator, speculative decoding (the target's logprobs), and the
"processed" mode (after the request's logits processors)."""

from __future__ import annotations

import random

import pytest
import torch

from servelab import LLM, RequestError, SamplingParams

VOCAB = 211
ATOL = 2e-4


def prompts(lengths, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position: row i scores token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_output_logprobs(model, prompt, completion, k, greedy):
    reference = hf_logprobs(model, prompt + completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert token in position and len(position) in (k, k + 1)
        assert position[token].logprob == pytest.approx(float(row[token]), abs=ATOL)
        if greedy:
            assert token == int(row.argmax()) and position[token].rank == 1
        top_values, top_ids = row.topk(k)
        ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank <= k))
        assert [t for _, t, _ in ranked] == top_ids.tolist()
        assert [v for _, _, v in ranked] == pytest.approx(top_values.tolist(), abs=ATOL)


def check_prompt_logprobs(model, prompt, scored, k):
    reference = hf_logprobs(model, prompt)
    assert len(scored) == len(prompt) and scored[0] is None
    for j in range(1, len(prompt)):
        row = reference[j - 1]
        assert scored[j][prompt[j]].logprob == pytest.approx(float(row[prompt[j]]), abs=ATOL)
        assert scored[j][prompt[j]].rank == int((row > row[prompt[j]]).sum()) + 1
        top = sorted((lp.rank, t) for t, lp in scored[j].items() if lp.rank <= k)
        assert [t for _, t in top] == row.topk(k).indices.tolist()


SETTINGS = {
    "continuous": {},
    # prompts cut into 7-token chunks, and a prefix cache the prompt-scored requests must not skip
    "chunked-radix": {"scheduler.name": "chunked-prefill", "max_num_batched_tokens": 7, "allocator.name": "radix"},
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_logprobs_match_transformers(setting, llama_checkpoint, hf_model):
    llm = LLM(llama_checkpoint, max_model_len=128, block_size=4, **SETTINGS[setting])
    batch = prompts([9, 1, 23, 14])
    batch[3] = batch[2][:12] + batch[3][:2]  # shares cached blocks with prompt 2
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    # A plain request rides in the same batches: it gets no logprobs and the same tokens as alone.
    plain = llm.generate(batch[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    outputs = llm.generate(batch + [batch[0]], [params] * 4 + [SamplingParams(max_tokens=6, temperature=0,
                                                                               ignore_eos=True)])
    for prompt, output in zip(batch, outputs):
        check_output_logprobs(hf_model, prompt, output.outputs[0], 4, greedy=True)
        check_prompt_logprobs(hf_model, prompt, output.prompt_logprobs, 3)
    assert outputs[4].outputs[0].logprobs is None and outputs[4].prompt_logprobs is None
    assert outputs[4].token_ids == plain.token_ids == outputs[0].token_ids
    assert llm.engine.allocator.stats().num_used_blocks == 0


def test_sampled_parallel_logprobs_are_each_completions_own(llama_checkpoint, hf_model):
    llm = LLM(llama_checkpoint, max_model_len=128)
    prompt = prompts([11])[0]
    output = llm.generate(prompt, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True,
                                                 logprobs=2))[0]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1, "n=3 sampled the same completion thrice"
    for completion in output.outputs:
        check_output_logprobs(hf_model, prompt, completion, 2, greedy=False)


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_speculative_logprobs_come_from_the_target(drafter, llama_checkpoint, checkpoint_factory, hf_model):
    config = {"ngram": {"name": "ngram", "num_speculative_tokens": 4, "max_ngram": 3},
              "draft-model": {"name": "draft-model", "model": checkpoint_factory("llama-draft"),
                              "num_speculative_tokens": 3}}[drafter]
    llm = LLM(llama_checkpoint, config={"drafter": config}, max_model_len=128, block_size=8)
    passage = prompts([12], seed=9)[0]
    batch = [passage * 2 + passage[:4], prompts([6], seed=4)[0]]
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, seed=2, ignore_eos=True, logprobs=1)
    outputs = llm.generate(batch + batch, [greedy, greedy, sampled, sampled])
    assert llm.engine.speculation_stats().num_draft_tokens > 0
    for prompt, output in zip(batch + batch, outputs):
        check_output_logprobs(hf_model, prompt, output.outputs[0], 3 if output.request_id in
                              (outputs[0].request_id, outputs[1].request_id) else 1,
                              greedy=output.request_id in (outputs[0].request_id, outputs[1].request_id))


def test_processed_logprobs_follow_the_processors(llama_checkpoint, hf_model):
    bias = {7: 4.0, 50: -3.0}
    llm = LLM(llama_checkpoint, max_model_len=128, logprobs_mode="processed")
    prompt = prompts([8])[0]
    output = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2,
                                                 logit_bias=bias))[0].outputs[0]
    tokens = prompt + output.token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].float()
    logits[:, list(bias)] += torch.tensor(list(bias.values()))
    reference = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(output.token_ids):
        row = reference[len(prompt) - 1 + i]
        assert token == int(row.argmax())
        assert output.logprobs[i][token].logprob == pytest.approx(float(row[token]), abs=ATOL)


def test_logprobs_limits(llama_checkpoint):
    llm = LLM(llama_checkpoint, max_model_len=64, max_logprobs=3)
    with pytest.raises(RequestError, match="logprobs must be <= 3"):
        llm.generate([5, 6], SamplingParams(logprobs=4))
    with pytest.raises(RequestError, match="prompt_logprobs must be an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
