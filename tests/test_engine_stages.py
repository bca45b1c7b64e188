"""The engine as stages over one request record: incremental text and stop strings
against the tokenizer's own full decode, intake off the step loop (nothing changes until
`admit`), all-or-none admission, one record released whole, and observers that see
every stage without patching the engine."""

from __future__ import annotations

import random

import pytest

import servelab
from servelab import LLM, RequestError, SamplingParams
from servelab.detokenize import IncrementalText
from servelab.request import Drafting, RequestSpec
from servelab.sampling_recipe import SamplingRecipe

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("builtin:tiny", max_model_len=256)


def _earliest_stop(text: str, stops: list[str]) -> int | None:
    """Where the stop string that ends first in `text` begins (the longest on a tie)."""
    best = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0:
            key = (at + len(stop), -len(stop))
            if best is None or key < best[0]:
                best = (key, at)
    return best[1] if best else None


def test_incremental_text_equals_the_full_decode(tiny_llm):
    tokenizer = tiny_llm.engine.tokenizer
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    for _ in range(20):
        token_ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        text = IncrementalText(tokenizer)
        pieces = "".join(text.append([t]) for t in token_ids)
        full = tokenizer.decode(token_ids)
        assert pieces == text.text
        # Held back only while the text ends in an incomplete character.
        assert full.startswith(text.text) and (text.text == full or full.endswith("\ufffd"))


def test_stop_strings_found_as_a_search_of_the_whole_text_finds_them(tiny_llm):
    tokenizer = tiny_llm.engine.tokenizer
    prompt = tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)")
    for stops in (["return"], ["n", "fib"], [":\n", "if n"], ["zzz"], ["(n - 1)", "n - "]):
        text = IncrementalText(tokenizer, stops)
        found = None
        for token_id in prompt:
            added = len(text.append([token_id]))
            found = text.find_stop(added)
            if found is not None:
                break
        expected = _earliest_stop(text.text, stops)
        assert found == expected, (stops, text.text)
        if found is not None:
            assert text.stop_text == text.text[:found]


def test_engine_stop_string_cuts_the_output(tiny_llm):
    free = tiny_llm.generate(["def add(a, b):"], GREEDY)[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    cut = tiny_llm.generate(["def add(a, b):"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                               stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]


def test_prepare_requests_changes_nothing_until_admit(tiny_llm):
    engine = tiny_llm.engine
    prepared = engine.prepare_requests([RequestSpec("x = 1", GREEDY), RequestSpec([5, 6, 7], GREEDY)])
    assert not engine.has_unfinished() and engine.unfinished_sequences() == []
    ids = engine.admit(prepared)
    assert len(engine.unfinished_sequences()) == 2
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step().finished)
    assert sorted(done) == sorted(ids)
    assert engine.allocator.stats().num_used_blocks == 0


def test_admission_is_all_or_none(tiny_llm):
    engine = tiny_llm.engine
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_requests([RequestSpec([5, 6], GREEDY), RequestSpec([5] * 300, GREEDY)])
    assert not engine.has_unfinished()
    with pytest.raises(RequestError, match="already in flight"):
        engine.add_requests([RequestSpec([5, 6], GREEDY, request_id="same"),
                             RequestSpec([7, 8], GREEDY, request_id="same")])
    assert not engine.has_unfinished()
    engine.add_request([5, 6], SamplingParams(max_tokens=4, n=2), request_id="parent")
    with pytest.raises(RequestError, match="already in flight"):  # the id of parent's second completion
        engine.add_request([5, 6], GREEDY, request_id="parent#1")
    engine.abort("parent")
    assert not engine.has_unfinished() and engine.allocator.stats().num_used_blocks == 0


def test_a_finished_request_leaves_nothing_behind(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(max_tokens=6, n=3, seed=7, stop=["\n\n"], logprobs=2, presence_penalty=0.5)
    request_id = engine.add_request("import os", params)
    request = engine.requests.get(request_id)
    assert all(request.processor_states) and all(request.texts) and all(request.generators)
    while engine.has_unfinished():
        engine.step()
    assert request_id not in engine.requests and len(engine.requests) == 0
    assert request.released and not any(request.processor_states) and not any(request.texts)


class StageObserver:
    def __init__(self) -> None:
        self.events: list[str] = []

    @servelab.hookimpl
    def servelab_step_started(self, engine):
        self.events.append("started")

    @servelab.hookimpl
    def servelab_step_planned(self, engine, plan):
        self.events.append(f"planned:{plan.num_scheduled_tokens}")

    @servelab.hookimpl
    def servelab_runner_executed(self, engine, plan, inputs):
        self.events.append(f"executed:{len(inputs.sampled_seq_rows)}")

    @servelab.hookimpl
    def servelab_step_finished(self, engine, report):
        self.events.append("finished")


def test_observers_see_every_stage_of_every_step():
    observer = StageObserver()
    registry = servelab.PluginRegistry.from_entry_points()
    registry.register(observer)
    llm = LLM("builtin:tiny", registry=registry, max_model_len=128)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    steps = [observer.events[i:i + 4] for i in range(0, len(observer.events), 4)]
    assert steps[0] == ["started", "planned:3", "executed:1", "finished"]
    assert steps[1:] == [["started", "planned:1", "executed:1", "finished"]] * 2


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(), SamplingRecipe()),
    (SamplingParams(n=2), SamplingRecipe(forks=True)),
    (SamplingParams(seed=3), SamplingRecipe(seeded=True)),
    (SamplingParams(logprobs=1), SamplingRecipe(logits_work=True)),
    (SamplingParams(presence_penalty=0.5), SamplingRecipe(logits_work=True)),
    (SamplingParams(prompt_logprobs=1), SamplingRecipe(logits_work=True, scores_prompt=True)),
])
def test_the_recipe_is_decided_at_intake_and_the_table_follows_it(tiny_llm, params, expected):
    engine = tiny_llm.engine
    request_id = engine.add_request([5, 6, 7], params)
    request = engine.requests.get(request_id)
    assert request.recipe == expected
    assert engine.requests.all_plain is expected.plain
    while engine.has_unfinished():
        engine.step()
    assert request.recipe == expected  # a frozen record: nothing on the way changed it
    assert engine.requests.all_plain and len(engine.requests) == 0


def test_a_plain_batch_samples_as_the_mixed_path_does(tiny_llm):
    """The one-call path of a plain batch and the mixed path give the same greedy tokens:
    a request with logprobs beside it sends the whole batch down the mixed path."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12], [3]]
    alone = [o.token_ids for o in tiny_llm.generate(prompts, greedy)]
    mixed = tiny_llm.generate(prompts + [[4, 4]], [greedy] * 3 + [SamplingParams(max_tokens=8, temperature=0,
                                                                                  ignore_eos=True, logprobs=1)])
    assert [o.token_ids for o in mixed[:3]] == alone
    assert len(mixed[3].outputs[0].logprobs) == 8


def test_drafts_and_their_state_live_one_step_on_the_request():
    llm = LLM("builtin:tiny", max_model_len=256, config={"drafter": {"name": "ngram"}})
    engine = llm.engine
    request_id = engine.add_request([11, 12, 13, 14, 15] * 6, SamplingParams(max_tokens=12, temperature=0))
    request = engine.requests.get(request_id)
    drafted = 0
    while engine.has_unfinished():
        engine.proposing.propose()
        seq = request.first
        drafted += bool(seq.draft_token_ids)
        assert engine.speculator.drafted == ([(seq, request.drafts[0])] if seq.draft_token_ids else [])
        engine.speculator.end_step()  # what the step does with unverified drafts
        assert seq.draft_token_ids == [] and request.drafts[0].probs is None and engine.speculator.drafted == []
        engine.step()
    assert drafted and engine.speculation_stats().num_draft_tokens > 0
    assert request.released and request.drafts == [Drafting()]
    with pytest.raises(KeyError):
        engine.requests.of(request.first)
