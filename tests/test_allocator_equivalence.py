"""The allocators are interchangeable: greedy outputs are token-identical across naive,
paged, radix and hash, and equal to `transformers`, for prompts sharing long prefixes, over
several `generate` calls of one engine, and with a KV pool small enough to force
eviction and preemption. Parallel sampling (n > 1) forks one prefill n ways."""

from __future__ import annotations

import random

import pytest
import torch

import servelab
from servelab import LLM, AllocatorPlugin, PluginRegistry, RequestError, SamplingParams
from servelab.interfaces import AllocatorContext

ALLOCATORS = ["naive", "paged", "radix", "hash"]
PREFIX_CACHES = ["radix", "hash"]
BLOCK_SIZE = 8


def make_prompts(vocab: int = 211) -> list[list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(3, vocab) for _ in range(48)]  # six full blocks

    def tail(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    return [
        prefix + tail(5),
        prefix + tail(16),  # ends on a block boundary
        prefix,  # the prefix alone: fully cached on the second call, yet one token is computed
        prefix[:20] + tail(9),  # parts from the others inside the third block
        tail(11),
        prefix + tail(1),
    ]


MAX_NEW = [10, 6, 12, 8, 9, 7]


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    """transformers' greedy completions of make_prompts(), computed once."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)
    out = []
    for prompt, max_new in zip(make_prompts(), MAX_NEW):
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)


def generate(llm, prompts=None):
    prompts = prompts or make_prompts()
    return [o.token_ids for o in llm.generate(prompts, [greedy(m) for m in MAX_NEW[: len(prompts)]])]


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_greedy_matches_transformers_across_generate_calls(llama_checkpoint, reference, allocator):
    llm = LLM(llama_checkpoint, max_model_len=128, block_size=BLOCK_SIZE, **{"allocator.name": allocator})
    assert generate(llm) == reference
    assert generate(llm) == reference, "a second call (radix, hash: served from the prefix cache) changed tokens"
    stats = llm.engine.allocator.stats()
    assert stats.num_used_blocks == 0
    if allocator in PREFIX_CACHES:
        # The first call admits every prompt in its first step, so nothing hits; the second
        # hits each prompt's full blocks but its last token's: 6 + 7 + 5 + 3 + 1 + 6 blocks.
        assert stats.prefix_hit_tokens == 28 * BLOCK_SIZE
        assert stats.num_prefix_lookups == 12 and stats.num_cached_blocks > 0


@pytest.mark.parametrize("allocator", PREFIX_CACHES)
@pytest.mark.parametrize("scheduler", ["chunked-prefill", "static"])
def test_prefix_caches_under_other_schedulers(llama_checkpoint, reference, scheduler, allocator):
    # Chunks of 12 tokens end inside blocks and inside cached prefixes.
    budget = {"chunked-prefill": 12, "static": 128}[scheduler]
    llm = LLM(llama_checkpoint, max_model_len=128, block_size=BLOCK_SIZE, max_num_batched_tokens=budget,
              **{"allocator.name": allocator, "scheduler.name": scheduler})
    assert generate(llm) == reference
    assert generate(llm) == reference
    assert llm.engine.allocator.stats().prefix_hit_tokens > 0


@pytest.mark.parametrize("allocator", PREFIX_CACHES)
def test_prefix_caches_compute_fewer_prefill_tokens_and_keep_them_across_calls(llama_checkpoint, allocator):
    recorder = _StepRecorder()
    registry = PluginRegistry.from_entry_points()
    registry.register(recorder)
    llm = LLM(llama_checkpoint, max_model_len=128, block_size=BLOCK_SIZE, registry=registry,
              **{"allocator.name": allocator})
    prompts = make_prompts()
    first = generate(llm, prompts[:1])
    computed_alone = recorder.take_scheduled_tokens()
    assert generate(llm, prompts[:1]) == first
    assert recorder.take_scheduled_tokens() == computed_alone - 48, "the six cached blocks are not recomputed"
    stats = recorder.last_stats
    assert stats.prefix_hit_tokens == 48 and stats.num_prefix_lookups == 2 and stats.block_size == BLOCK_SIZE


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_small_pool_evicts_and_preempts_without_changing_tokens(llama_checkpoint, reference, allocator):
    # 14 blocks of 8 slots: naive fits one sequence at a time; the others preempt, and
    # the prefix caches must evict cached prefixes to make room.
    llm = LLM(llama_checkpoint, max_model_len=112, num_kv_blocks=14, block_size=BLOCK_SIZE,
              **{"allocator.name": allocator})
    evicted = []
    if allocator in PREFIX_CACHES:  # both are the kit's prefix cache: count what its eviction frees
        evict_blocks = llm.engine.allocator._evict
        cached = llm.engine.allocator.stats

        def counting_evict_blocks(count):
            before = cached().num_cached_blocks
            evict_blocks(count)
            evicted.extend(range(before - cached().num_cached_blocks))

        llm.engine.allocator._evict = counting_evict_blocks
    assert generate(llm) == reference
    assert generate(llm) == reference
    assert llm.engine.allocator.stats().num_used_blocks == 0
    if allocator in PREFIX_CACHES:
        assert evicted, "the pool was meant to be too small to keep every prefix cached"
    if allocator != "naive":
        assert llm.engine.scheduler.stats().num_preemptions > 0


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_a_request_that_can_never_fit_is_refused_up_front(llama_checkpoint, allocator):
    from servelab import ConfigError

    # The pool must hold one max_model_len sequence, so any admissible prompt fits alone.
    with pytest.raises(ConfigError, match="fewer than max_model_len=64"):
        LLM(llama_checkpoint, max_model_len=64, num_kv_blocks=7, block_size=BLOCK_SIZE,
            **{"allocator.name": allocator})
    llm = LLM(llama_checkpoint, max_model_len=64, num_kv_blocks=8, block_size=BLOCK_SIZE,
              **{"allocator.name": allocator})
    with pytest.raises(RequestError, match="65 tokens, more than max_model_len=64"):
        llm.generate([[5] * 65])
    # A prompt filling the whole pool runs; three of them queue and run one after another.
    outputs = llm.generate([[5] * 63, [6] * 63, [7] * 63], greedy(1))
    assert [len(o.token_ids) for o in outputs] == [1, 1, 1]
    assert llm.engine.allocator.stats().num_used_blocks == 0


# ---------------------------------------------------------------- parallel sampling


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_n_greedy_completions_are_identical(llama_checkpoint, reference, allocator):
    llm = LLM(llama_checkpoint, max_model_len=128, block_size=BLOCK_SIZE, **{"allocator.name": allocator})
    prompts = make_prompts()[:3]
    outputs = llm.generate(prompts, [greedy(m, n=3) for m in MAX_NEW[:3]])
    for output, expected in zip(outputs, reference):
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert [c.token_ids for c in output.outputs] == [expected] * 3
        assert all(c.finish_reason == "length" for c in output.outputs)
    assert llm.engine.allocator.stats().num_used_blocks == 0


def test_n_forks_one_prefill(llama_checkpoint):
    recorder = _StepRecorder()
    registry = PluginRegistry.from_entry_points()
    registry.register(recorder)
    llm = LLM(llama_checkpoint, max_model_len=128, block_size=BLOCK_SIZE, registry=registry)
    prompt = make_prompts()[0]  # 53 tokens
    llm.generate([prompt], greedy(4, n=4))
    # One prefill of 53 tokens, then 3 decode steps of 4 sequences.
    assert recorder.take_scheduled_tokens() == 53 + 3 * 4


def test_n_seeded_completions_differ_and_reproduce(llama_checkpoint):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
    prompts = make_prompts()[:2]
    runs = []
    for allocator, neighbours in (("paged", []), ("radix", [[5, 6, 7]]), ("hash", [[5, 6, 7]]), ("naive", [])):
        llm = LLM(llama_checkpoint, max_model_len=128, block_size=BLOCK_SIZE, **{"allocator.name": allocator})
        outputs = llm.generate(prompts + neighbours, [params] * 2 + [greedy(3)] * len(neighbours))
        runs.append([[c.token_ids for c in o.outputs] for o in outputs[:2]])
    assert runs[0] == runs[1] == runs[2] == runs[3], "seeded parallel samples must not depend on allocator or batch"
    for completions in runs[0]:
        assert len({tuple(c) for c in completions}) == 3, "the n seeded completions should differ"


def test_abort_returns_every_completion_and_frees_the_forks(llama_checkpoint):
    llm = LLM(llama_checkpoint, max_model_len=128, block_size=BLOCK_SIZE, **{"allocator.name": "radix"})
    engine = llm.engine
    request_id = engine.add_request(make_prompts()[0], greedy(50, n=3))
    for _ in range(3):
        engine.step()
    output = engine.abort(request_id)
    assert [c.finish_reason for c in output.outputs] == ["abort"] * 3
    assert all(len(c.token_ids) == 3 for c in output.outputs)
    assert not engine.has_unfinished() and engine.allocator.stats().num_used_blocks == 0
    assert engine.abort(request_id) is None


def test_n_needs_an_allocator_that_forks(llama_checkpoint):
    registry = PluginRegistry.from_entry_points()
    registry.register(_MinimalAllocatorPlugin())
    llm = LLM(llama_checkpoint, max_model_len=64, registry=registry, **{"allocator.name": "minimal"})
    with pytest.raises(RequestError, match="allocator 'minimal' cannot fork"):
        llm.generate([[5, 6, 7]], greedy(3, n=2))
    assert llm.generate([[5, 6, 7]], greedy(3))[0].token_ids  # n = 1 is fine
    with pytest.raises(RequestError, match="n must be"):
        SamplingParams(n=0)


# ---------------------------------------------------------------- helpers


class _StepRecorder:
    def __init__(self) -> None:
        self.scheduled: list[int] = []
        self.last_stats = None

    @servelab.hookimpl
    def servelab_step_finished(self, engine, report):
        self.scheduled.append(report.num_scheduled_tokens)
        self.last_stats = report.allocator_stats

    def take_scheduled_tokens(self) -> int:
        total, self.scheduled = sum(self.scheduled), []
        return total


class _Minimal:
    """Only the four core KVAllocator methods: no fork, no prefix cache."""

    def __init__(self, options, context: AllocatorContext) -> None:
        from servelab.kit import PagedAllocator

        self._inner = PagedAllocator(options, context)

    def allocate(self, seq_id, num_tokens):
        return self._inner.allocate(seq_id, num_tokens)

    def free(self, seq_id):
        self._inner.free(seq_id)

    def block_table(self, seq_id):
        return self._inner.block_table(seq_id)

    def stats(self):
        return self._inner.stats()


class _MinimalAllocatorPlugin:
    @servelab.hookimpl
    def servelab_register_allocators(self):
        return [AllocatorPlugin(name="minimal", factory=_Minimal, description="no capabilities")]
