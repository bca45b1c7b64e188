"""Bad requests are rejected with a RequestError naming the field, before anything is
queued, and never disturb requests already in flight; abort frees KV at once."""

from __future__ import annotations

import pytest

from servelab import LLM, RequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]


@pytest.fixture
def llm(llama_checkpoint):
    return LLM(llama_checkpoint, max_model_len=64)  # cheap: the checkpoint is tiny


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    """Token ids of PROMPTS run alone, undisturbed."""
    return [o.token_ids for o in LLM(llama_checkpoint, max_model_len=64).generate(PROMPTS, GREEDY)]


def assert_idle(llm):
    assert not llm.engine.has_unfinished(), "a request was left queued in the engine"
    assert llm.engine.allocator.stats().num_used_blocks == 0, "KV blocks are still in use"


BAD_REQUESTS = {
    "too long": (lambda llm: llm.generate([[5] * 65]), "max_model_len"),
    "good then too long": (lambda llm: llm.generate([[5, 6], [5] * 65]), "max_model_len"),
    "empty prompt": (lambda llm: llm.generate([[]]), "empty"),
    "no prompts": (lambda llm: llm.generate([]), "no prompts"),
    "token id = vocab": (lambda llm: llm.generate([[5, 211]]), "token id 211"),
    "negative token id": (lambda llm: llm.generate([[5, -1]]), "token id -1"),
    "token id not int": (lambda llm: llm.generate([[5, 6.0]]), "token ids"),
    "max_tokens 0": (lambda llm: llm.generate([[5]], SamplingParams(max_tokens=0)), "max_tokens"),
    "temperature -1": (lambda llm: llm.generate([[5]], SamplingParams(temperature=-1)), "temperature"),
    "top_p 0": (lambda llm: llm.generate([[5]], SamplingParams(top_p=0)), "top_p"),
    "top_p 1.5": (lambda llm: llm.generate([[5]], SamplingParams(top_p=1.5)), "top_p"),
    "top_k -5": (lambda llm: llm.generate([[5]], SamplingParams(top_k=-5)), "top_k"),
    "min_p 2": (lambda llm: llm.generate([[5]], SamplingParams(min_p=2)), "min_p"),
    "params list too long": (lambda llm: llm.generate([[5], [6]], [SamplingParams()] * 3), "3 SamplingParams"),
    "params list too short": (lambda llm: llm.generate([[5], [6]], [SamplingParams()]), "1 SamplingParams"),
    "params not SamplingParams": (lambda llm: llm.generate([[5]], [{"max_tokens": 3}]), "SamplingParams"),
    "text without tokenizer": (lambda llm: llm.generate("hello"), "tokenizer"),
    "stop string without tokenizer": (
        lambda llm: llm.generate([[5, 6], [7]], [SamplingParams(), SamplingParams(stop="x")]), "stop"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_rejected_before_queueing(llm, case):
    call, field = BAD_REQUESTS[case]
    with pytest.raises(RequestError, match=field) as excinfo:
        call(llm)
    assert isinstance(excinfo.value, ValueError)
    assert_idle(llm)


def test_prompt_of_exactly_max_model_len_gets_one_token(llm):
    [output] = llm.generate([[5] * 64], GREEDY)
    assert len(output.token_ids) == 1 and output.finish_reason == "length"
    assert_idle(llm)


def step_until_done(engine, finished: dict) -> None:
    while engine.has_unfinished():
        for output in engine.step().finished:
            finished[output.request_id] = output


def test_bad_add_request_leaves_requests_in_flight_unaffected(llm, reference):
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    finished = {}
    for _ in range(3):
        for output in engine.step().finished:
            finished[output.request_id] = output
    used = engine.allocator.stats().num_used_blocks
    assert used > 0 and not finished
    bad_adds = [
        lambda: engine.add_request([5] * 65, GREEDY),
        lambda: engine.add_request([300], GREEDY),
        lambda: engine.add_request([], GREEDY),
        lambda: engine.add_request("text", GREEDY),
        lambda: engine.add_request([5], SamplingParams(stop="x")),
        lambda: engine.add_request([5], {"max_tokens": 2}),
        lambda: engine.add_request([5], GREEDY, request_id=ids[0]),  # id already in flight
    ]
    for bad in bad_adds:
        with pytest.raises(RequestError):
            bad()
    assert engine.allocator.stats().num_used_blocks == used
    assert engine.scheduler.stats().num_running == 2 and engine.scheduler.stats().num_waiting == 0
    step_until_done(engine, finished)
    assert sorted(finished) == sorted(ids)
    assert [finished[i].token_ids for i in ids] == reference
    assert all(len(t) == GREEDY.max_tokens for t in reference)
    assert_idle(llm)


def test_abort_frees_blocks_at_once_and_others_finish(llm, reference):
    engine = llm.engine
    long_prompt = list(range(60, 100))  # 40 tokens: three blocks of 16 once it decodes
    ids = [engine.add_request(PROMPTS[0], GREEDY), engine.add_request(long_prompt, GREEDY),
           engine.add_request(PROMPTS[1], GREEDY)]
    finished = {}
    for _ in range(3):
        for output in engine.step().finished:
            finished[output.request_id] = output
    victim_blocks = len(engine.allocator.block_table(ids[1]))
    used = engine.allocator.stats().num_used_blocks
    assert victim_blocks == 3

    aborted = engine.abort(ids[1])
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 3
    assert aborted.prompt_token_ids == long_prompt
    assert engine.allocator.stats().num_used_blocks == used - victim_blocks
    assert list(engine.allocator.block_table(ids[1])) == []
    assert engine.abort(ids[1]) is None  # already gone
    assert engine.abort("no-such-request") is None

    step_until_done(engine, finished)
    assert sorted(finished) == sorted([ids[0], ids[2]])
    assert [finished[ids[0]].token_ids, finished[ids[2]].token_ids] == reference
    assert_idle(llm)


def test_abort_of_a_waiting_request(llm):
    engine = llm.engine
    request_id = engine.add_request([5, 6, 7], GREEDY)
    output = engine.abort(request_id)
    assert output.finish_reason == "abort" and output.token_ids == []
    assert engine.step().finished == []
    assert_idle(llm)


def test_stop_strings_set_but_a_stop_token_ends_the_request_keeps_its_text():
    """A request with stop strings that ends on a stop token id still gets its decoded text,
    up to the stop token: as in vLLM, the stop token's id stays in token_ids, its text is
    not in the text."""
    from servelab import LLM, SamplingParams

    llm = LLM("builtin:tiny-random", max_model_len=64, max_num_seqs=2)
    free = llm.generate("def f", SamplingParams(max_tokens=6, temperature=0))[0]
    stop_id = free.token_ids[3]
    out = llm.generate("def f", SamplingParams(max_tokens=6, temperature=0, stop=["\x00never"],
                                               stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[:4]
    expected = llm.tokenizer.decode(free.token_ids[:3])
    assert expected and out.text == expected


def test_sequence_ids_are_written_and_read_by_one_rule():
    from servelab.sequence import owner_of, sequence_id

    for request_id in ("req-1", "a#b", "x#1", "#", "cmpl-7#"):
        for index in (0, 1, 12):
            written = sequence_id(request_id, index)
            assert written == (request_id if index == 0 else f"{request_id}#{index}")
            if index:
                assert owner_of(written) == request_id
    assert owner_of("a#b") == "a#b" and owner_of("plain") == "plain" and owner_of("q#3#2") == "q#3"
