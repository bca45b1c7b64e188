"""servelab-sjf's policies pass servelab's conformance contracts, plus tests of what makes
each of them what it is. The contracts come from the `servelab.testing` pytest plugin;
nothing here is copied from servelab's own tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from servelab import LLM, SamplingParams
from servelab.interfaces import AllocatorContext, DrafterContext
from servelab.testing import (AllocatorContract, DrafterContract, LogitsProcessorContract, SchedulerContract,
                              SchedulerHarness, check, objectives)
from servelab.testing.drafter import decoding_sequence
from servelab_sjf.lifo import LIFOPagedAllocator
from servelab_sjf.lookup import LookupOptions, RepeatLookupDrafter
from servelab_sjf.sjf import SJFOptions, SJFScheduler

# ---------------------------------------------------------------- the contracts


class TestSJF(SchedulerContract):
    plugin_name = "sjf"
    objectives = (objectives.shortest_job_first(),)  # what SJF is for, beside what every scheduler must do
    options_variants = (SJFOptions(aging_tokens_per_s=0.0), SJFOptions(aging_tokens_per_s=2.0))

    def before_step(self, harness):
        self._waiting = list(harness.scheduler.waiting)

    def after_step(self, harness, plan):
        """SJF's own invariant: nobody is admitted while a better-ranked request waits."""
        admitted = [s for s in self._waiting if s not in harness.scheduler.waiting]
        check(admitted == self._waiting[: len(admitted)], "sjf: admission takes the shortest (aged) job first",
              f"admitted {[s.request_id for s in admitted]} from {[s.request_id for s in self._waiting]}")


class TestPagedLIFO(AllocatorContract):
    plugin_name = "paged-lifo"


class TestRepeatLookup(DrafterContract):
    plugin_name = "repeat-lookup"  # k comes from LookupOptions().num_speculative_tokens
    lookup_drafter = True


class TestNoRepeatNGram(LogitsProcessorContract):
    plugin_name = "no-repeat-ngram"
    prompt = (5, 17, 5, 17, 42)  # a repeated bigram: some tokens are banned from the start
    requests = [SamplingParams(logits_processors=["no-repeat-ngram"]),
                SamplingParams(logits_processors=["no-repeat-ngram"], extra_args={"no_repeat_ngram_size": 1})]


# ---------------------------------------------------------------- shortest job first


def harness(aging: float = 0.0, max_num_seqs: int = 1) -> SchedulerHarness:
    alloc = LIFOPagedAllocator(None, AllocatorContext(num_blocks=64, block_size=4, max_model_len=64))
    return SchedulerHarness(lambda context: SJFScheduler(SJFOptions(aging_tokens_per_s=aging), context), alloc,
                            block_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
                            seconds_per_step=1.0)  # the clock moves one second a step


def test_shortest_expected_job_runs_first():
    h = harness()
    h.add(10, max_tokens=20, request_id="long")  # 30 tokens of work
    h.add(2, max_tokens=1, request_id="tiny")  # 3
    h.add(5, max_tokens=3, request_id="short")  # 8
    h.add(1, max_tokens=40, request_id="short-prompt-long-output")  # 41: output counts too
    h.run()
    h.check_all_done()
    assert h.first_scheduled == ["tiny", "short", "long", "short-prompt-long-output"]


def starve(aging: float, steps: int = 60) -> SchedulerHarness:
    """A 40-token job against a new 2-token job every step, one slot."""
    h = harness(aging)
    h.add(20, max_tokens=20, request_id="long")
    for _ in range(steps):
        h.add(1, max_tokens=1)
        h.step()
    return h


def test_aging_lets_a_long_job_through_a_stream_of_short_ones():
    assert "long" in starve(aging=2.0).first_scheduled
    assert "long" not in starve(aging=0.0).first_scheduled, "pure SJF starves it: the stream is steady enough"


def test_options_come_from_the_config_file(servelab_tiny_checkpoint, tmp_path):
    config = tmp_path / "sjf.toml"
    config.write_text('[engine]\nmax_model_len = 64\n\n[allocator]\nname = "paged-lifo"\n\n'
                      '[scheduler]\nname = "sjf"\naging_tokens_per_s = 0\n')
    llm = LLM(servelab_tiny_checkpoint, config=str(config))
    assert isinstance(llm.engine.scheduler, SJFScheduler) and isinstance(llm.engine.allocator, LIFOPagedAllocator)
    assert llm.engine.scheduler.options == SJFOptions(aging_tokens_per_s=0)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    sjf = [o.token_ids for o in llm.generate([[5, 6, 7], [9] * 20], params)]
    assert sjf == [o.token_ids for o in LLM(servelab_tiny_checkpoint, max_model_len=64).generate(
        [[5, 6, 7], [9] * 20], params)]


# ---------------------------------------------------------------- LIFO allocator


def test_the_most_recently_freed_block_is_reused_first():
    alloc = LIFOPagedAllocator(None, AllocatorContext(num_blocks=8, block_size=4, max_model_len=32))
    assert alloc.allocate("a", 8) and alloc.allocate("b", 4)
    assert (alloc.block_table("a"), alloc.block_table("b")) == ([0, 1], [2])
    alloc.free("a")  # pushes 0, then 1: block 1 is on top
    assert alloc.allocate("c", 12)
    assert alloc.block_table("c") == [1, 0, 3]


def test_fork_shares_and_the_first_shared_write_copies():
    alloc = LIFOPagedAllocator(None, AllocatorContext(num_blocks=8, block_size=4, max_model_len=32))
    assert alloc.allocate("p", 6) and alloc.fork("p", "c")
    assert alloc.block_table("c") == [0, 1] and alloc.ref_count(1) == 2
    assert alloc.allocate("c", 7)
    assert alloc.block_table("c") == [0, 2] and alloc.take_block_copies() == [(1, 2)]
    assert alloc.allocate("p", 7) and alloc.take_block_copies() == [], "p is block 1's only holder now"


# ---------------------------------------------------------------- prompt lookup


def test_lookup_proposes_what_followed_the_last_ngram():
    drafter = RepeatLookupDrafter(LookupOptions(num_speculative_tokens=3),
                                  DrafterContext(vocab_size=100, max_model_len=64))
    seqs = [decoding_sequence("a", [5, 8, 2, 9, 4, 7, 5, 8], []),
            decoding_sequence("b", [1, 2, 3], [4]),
            decoding_sequence("c", [3, 1, 3, 2, 3], [])]
    assert drafter.propose(seqs) == {"a": [2, 9, 4], "b": [], "c": [2, 3]}


# ---------------------------------------------------------------- installed


def test_servelab_plugins_lists_the_package():
    result = subprocess.run([sys.executable, "-m", "servelab.cli", "plugins", "--json"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    found = {(kind, e["name"]): e["distribution"] for kind, entries in listing.items() for e in entries}
    assert found[("schedulers", "sjf")] == "servelab-sjf"
    assert found[("allocators", "paged-lifo")] == "servelab-sjf"
    assert found[("drafters", "repeat-lookup")] == "servelab-sjf"
    assert found[("logits_processors", "no-repeat-ngram")] == "servelab-sjf"


# ---------------------------------------------------------------- no-repeat-ngram


@pytest.mark.parametrize("size", [2, 3])
def test_no_repeat_ngram_equals_transformers(servelab_tiny_checkpoint, size):
    import torch
    import transformers

    prompt = [5, 17, 5, 17, 42, 9, 5]
    llm = LLM(servelab_tiny_checkpoint, max_model_len=64)
    output = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                 logits_processors=["no-repeat-ngram"],
                                                 extra_args={"no_repeat_ngram_size": size}))[0].token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(servelab_tiny_checkpoint, dtype=torch.float32)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0, no_repeat_ngram_size=size)[0, len(prompt):].tolist()
    assert output == expected
    tokens = prompt + output
    for end in range(len(prompt) + 1, len(tokens) + 1):  # no generated token completes an earlier n-gram
        gram = tuple(tokens[end - size:end])
        assert gram not in {tuple(tokens[i:i + size]) for i in range(end - size)}


@pytest.mark.parametrize("key, value, message", [
    ("aging_tokens_per_s", -1, r"\[scheduler\] aging_tokens_per_s must be a number >= 0"),
    ("aging", 1, r"unknown option \[scheduler\] 'aging' for scheduler 'sjf'; valid options: .*aging_tokens_per_s"),
])
def test_bad_options_are_config_errors_naming_the_key(servelab_tiny_checkpoint, key, value, message):
    from servelab import ConfigError

    with pytest.raises(ConfigError, match=message):
        LLM(servelab_tiny_checkpoint, **{"scheduler.name": "sjf", f"scheduler.{key}": value})
