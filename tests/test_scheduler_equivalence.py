"""The schedulers are interchangeable: greedy outputs are token-identical across
static, continuous and chunked-prefill, and equal to `transformers`, with token budgets
small enough to chunk every long prompt and KV pools small enough to force preemption;
parallel sampling (n > 1) forks under every scheduler; priority reaches the scheduler
through the engine."""

from __future__ import annotations

import random

import pytest
import torch

from servelab import LLM, PluginRegistry, SamplingParams, hookimpl

LENGTHS = [1, 5, 17, 33, 9, 64, 2, 40]
MAX_NEW = [12, 20, 7, 16, 25, 9, 30, 14]


def prompts(vocab: int = 211) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    """transformers' greedy completions of prompts(), computed once."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)
    out = []
    for prompt, max_new in zip(prompts(), MAX_NEW):
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


class StepRecorder:
    def __init__(self) -> None:
        self.reports = []

    @hookimpl
    def servelab_step_finished(self, engine, report):
        self.reports.append(report)


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)


# name -> (overrides, must preempt, must chunk). 14 blocks of 8 slots (112 tokens) cannot
# hold the eight sequences at once (~330 slots); a 16-token budget chunks 17/33/40/64-token prompts.
SMALL_KV = {"max_model_len": 112, "num_kv_blocks": 14, "block_size": 8}
CASES = {
    "static": ({"scheduler.name": "static", "max_num_seqs": 3, **SMALL_KV}, True, False),
    "continuous": ({"scheduler.name": "continuous", **SMALL_KV}, True, False),
    "continuous-decode-first": ({"scheduler.name": "continuous", "scheduler.policy": "decode-first",
                                 "max_num_batched_tokens": 112, "max_num_seqs": 5, **SMALL_KV}, True, False),
    "chunked-prefill": ({"scheduler.name": "chunked-prefill", "max_num_batched_tokens": 16, **SMALL_KV}, True, True),
    "chunked-prefill-radix": ({"scheduler.name": "chunked-prefill", "allocator.name": "radix",
                               "max_num_batched_tokens": 16, **SMALL_KV}, True, True),
    "chunked-prefill-naive": ({"scheduler.name": "chunked-prefill", "allocator.name": "naive",
                               "max_num_batched_tokens": 24, "max_model_len": 112, "num_kv_blocks": 28,
                               "block_size": 8}, False, True),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_outputs_match_transformers_under_every_scheduler(llama_checkpoint, reference, case):
    overrides, must_preempt, must_chunk = CASES[case]
    recorder = StepRecorder()
    registry = PluginRegistry.from_entry_points()
    registry.register(recorder)
    llm = LLM(llama_checkpoint, registry=registry, **overrides)
    outputs = llm.generate(prompts(), [greedy(n) for n in MAX_NEW])
    assert [o.token_ids for o in outputs] == reference
    stats = llm.engine.scheduler.stats()
    assert (stats.num_preemptions > 0) == must_preempt
    budget = llm.engine.limits.max_num_batched_tokens
    assert all(r.num_scheduled_tokens <= budget for r in recorder.reports)
    if must_chunk:
        assert budget < max(LENGTHS), "the longest prompt must have been prefilled in chunks"
    assert stats.slot_steps_used == sum(r.num_seqs for r in recorder.reports)
    assert stats.slot_steps_wasted == sum(r.scheduler_stats.num_idle_slots for r in recorder.reports)
    assert llm.engine.allocator.stats().num_used_blocks == 0
    assert not llm.engine.has_unfinished()
    if case == "chunked-prefill-radix":  # a second round starts from the prompts' cached prefixes
        assert [o.token_ids for o in llm.generate(prompts(), [greedy(n) for n in MAX_NEW])] == reference
        assert llm.engine.allocator.stats().prefix_hit_tokens > 0


def test_static_wastes_the_slots_of_finished_members(llama_checkpoint, reference):
    results = {}
    for name in ("static", "continuous"):
        llm = LLM(llama_checkpoint, max_model_len=128, max_num_seqs=4, **{"scheduler.name": name})
        outputs = llm.generate(prompts(), [greedy(n) for n in MAX_NEW])
        assert [o.token_ids for o in outputs] == reference
        results[name] = llm.engine.scheduler.stats()
    # Every generated token but the first of each request is one decode slot-step.
    assert results["static"].slot_steps_used == results["continuous"].slot_steps_used == sum(MAX_NEW)
    assert results["continuous"].slot_steps_wasted == 0
    assert results["static"].slot_steps_wasted > 0
    assert results["static"].num_steps > results["continuous"].num_steps


@pytest.mark.parametrize("scheduler", ["static", "chunked-prefill"])
def test_parallel_sampling_forks_under_every_scheduler(llama_checkpoint, reference, scheduler):
    llm = LLM(llama_checkpoint, max_model_len=128, max_num_seqs=6, max_num_batched_tokens=128,
              **{"scheduler.name": scheduler})
    outputs = llm.generate(prompts()[:3], [greedy(n, n=3) for n in MAX_NEW[:3]])
    for output, expected in zip(outputs, reference):
        assert [c.token_ids for c in output.outputs] == [expected] * 3
    assert llm.engine.allocator.stats().num_used_blocks == 0


@pytest.mark.parametrize("scheduler", ["continuous", "chunked-prefill"])
def test_engine_passes_priority_to_the_scheduler(llama_checkpoint, scheduler):
    llm = LLM(llama_checkpoint, max_model_len=64, max_num_seqs=1, **{"scheduler.name": scheduler})
    engine = llm.engine
    order = []
    for name, priority in (("low", 3), ("high", 0), ("mid", 1)):
        engine.add_request([5, 6, 7], greedy(2), request_id=name, priority=priority)
    while engine.has_unfinished():
        order.extend(output.request_id for output in engine.step().finished)
    assert order == ["high", "mid", "low"]


def test_generate_takes_priorities(llama_checkpoint):
    from servelab import RequestError

    llm = LLM(llama_checkpoint, max_model_len=64, max_num_seqs=1, **{"scheduler.name": "chunked-prefill"})
    outputs = llm.generate([[5, 6, 7], [8, 9], [10]], greedy(3), priority=[2, 0, 1])
    first_tokens = [o.metrics.first_token_time for o in outputs]
    assert first_tokens[1] < first_tokens[2] < first_tokens[0]
    for output in outputs:
        metrics = output.metrics
        assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finish_time
        assert metrics.queue_time >= 0 and output.tpot == pytest.approx(
            (metrics.finish_time - metrics.first_token_time) / 2)
    with pytest.raises(RequestError, match="2 priorities for 3 prompts"):
        llm.generate([[5], [6], [7]], greedy(1), priority=[0, 1])
    with pytest.raises(RequestError, match="priority must be an int"):
        llm.generate([[5]], greedy(1), priority=[0.5])
    assert not llm.engine.has_unfinished()
