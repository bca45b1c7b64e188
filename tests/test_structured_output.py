"""Structured output on the embedded model builtin:tiny: every output parses and
validates (jsonschema), matches its regex or grammar; with speculative decoding (greedy
tokens equal the non-speculative ones) and chunked prefill; invalid specs are refused
by name; one compilation per schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from servelab import LLM, RequestError, SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "grace", "linus"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin"],
    "additionalProperties": False,
}
PROMPTS = ["Here is a user record:", "def main():", "{", "The answer is"]


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:tiny", max_model_len=256)


def test_json_schema_outputs_validate(llm):
    params = SamplingParams(n=2, max_tokens=80, temperature=1.0, seed=3, structured=StructuredOutput.json(SCHEMA))
    outputs = llm.generate(PROMPTS, params)
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            jsonschema.validate(json.loads(completion.text), SCHEMA)
    processor = llm.engine.logits_pipeline.processors["structured"]
    assert len([key for key in processor._cache if key[0] == "json"]) == 1  # one compilation for them all


def test_json_object_regex_and_grammar(llm):
    regex = r"(yes|no) \d{1,3}!"
    grammar = 'root ::= "[" item ("," item)* "]"\nitem ::= "a" | "bb" | "ccc"'
    outputs = llm.generate(PROMPTS[:1] + PROMPTS[:2] * 2, [
        # Any JSON object: this model tends to open strings and objects it never closes (bounded
        # only by max_tokens, as in any server), so one seeded request that closes stands for the kind.
        SamplingParams(max_tokens=60, temperature=1.0, seed=2, structured=StructuredOutput.json_object()),
        SamplingParams(max_tokens=20, temperature=1.0, seed=2, structured=StructuredOutput.regex(regex)),
        SamplingParams(max_tokens=20, temperature=0, structured=StructuredOutput.regex(regex)),
        SamplingParams(max_tokens=40, temperature=1.0, seed=4, structured=StructuredOutput.grammar(grammar)),
        SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput.grammar(grammar)),
    ])
    assert all(o.finish_reason == "stop" for o in outputs), [(o.text, o.finish_reason) for o in outputs]
    assert isinstance(json.loads(outputs[0].text), dict)
    for output in outputs[1:3]:
        assert re.fullmatch(regex, output.text), output.text
    for output in outputs[3:]:
        assert re.fullmatch(r"\[(a|bb|ccc)(,(a|bb|ccc))*\]", output.text), output.text


@pytest.mark.parametrize("engine", [
    {"config": {"drafter": {"name": "draft-model", "model": "builtin:tiny-draft", "num_speculative_tokens": 4}}},
    {"scheduler.name": "chunked-prefill", "max_num_batched_tokens": 5},
], ids=["speculative", "chunked-prefill"])
def test_grammar_state_follows_speculation_and_chunked_prefill(engine, llm):
    other = LLM("builtin:tiny", max_model_len=256, **engine)
    long_prompt = "Write the record of a user as JSON, with a name, an age and whether they are an admin: "
    greedy = SamplingParams(max_tokens=80, temperature=0, structured=StructuredOutput.json(SCHEMA))
    # unseeded, so that it is drafted (a seeded request is not)
    sampled = SamplingParams(max_tokens=80, temperature=0.8, structured=StructuredOutput.json(SCHEMA))
    expected = llm.generate([long_prompt, PROMPTS[0]], greedy)
    outputs = other.generate([long_prompt, PROMPTS[0], long_prompt, PROMPTS[0]], [greedy, greedy, sampled, sampled])
    assert [o.token_ids for o in outputs[:2]] == [o.token_ids for o in expected]
    for output in outputs:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), SCHEMA)
    if "config" in engine:
        assert other.engine.speculation_stats().num_draft_tokens > 0
    assert other.engine.allocator.stats().num_used_blocks == 0


@pytest.mark.parametrize("structured,problem", [
    (StructuredOutput.json({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "JSON schema is invalid"),
    (StructuredOutput.regex("(unclosed"), "regex is invalid"),
    (StructuredOutput.grammar("root ::= undefined_rule"), "grammar is invalid"),
])
def test_invalid_specs_are_refused_by_name(llm, structured, problem):
    with pytest.raises(RequestError, match=problem):
        llm.generate("x", SamplingParams(structured=structured))
    assert not llm.engine.has_unfinished()


def test_structured_output_refuses_what_cannot_work(llm, llama_checkpoint):
    with pytest.raises(RequestError, match="ignore_eos"):
        llm.generate("x", SamplingParams(ignore_eos=True, structured=StructuredOutput.json_object()))
    with pytest.raises(RequestError, match="not valid JSON"):
        StructuredOutput.json("{nope")
    with pytest.raises(RequestError, match="needs a tokenizer"):
        LLM(llama_checkpoint, max_model_len=64).generate([5], SamplingParams(structured=StructuredOutput.regex("a")))


def test_a_grammar_that_dead_ends_fails_its_request_alone(llama_checkpoint, tmp_path):
    """A word-level tokenizer's tokens ("w7", "w8") hold no space: after "w7" the regex
    "w7 w8" needs one, which no token spells. The request ends with finish_reason "error"
    naming the dead end instead of sampling a token the grammar forbids; a request in the
    same batch, and a valid choice, end normally."""
    import shutil

    from conftest_server import add_word_tokenizer

    path = tmp_path / "worded"
    shutil.copytree(llama_checkpoint, path)
    add_word_tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    llm = LLM(str(path), max_model_len=64)
    dead_end = SamplingParams(max_tokens=8, temperature=1.0, seed=1, structured=StructuredOutput.regex("w7 w8"))
    choice = SamplingParams(max_tokens=8, temperature=1.0, seed=2, structured=StructuredOutput.regex("(w7)|(w9)"))
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    failed, chosen, other = llm.generate(["w5", "w5 w6", "w5 w6 w7"], [dead_end, choice, plain])
    assert failed.finish_reason == "error", failed
    assert "structured output: the grammar allows no next token" in failed.error
    assert failed.token_ids == [7]  # the one token the grammar allowed, nothing after it
    assert chosen.finish_reason == "stop" and chosen.text in ("w7", "w9"), chosen
    assert other.finish_reason == "length" and len(other.token_ids) == 8
    assert not llm.engine.has_unfinished()


def _nested_schema(levels: int) -> str:
    """A JSON schema of `levels` nested objects, as text (deeper than json.dumps may recurse)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


def test_a_large_schema_is_checked_inside_the_compile_budget():
    """xgrammar's parse of a 450-level schema takes about 15 s: at admission it held
    the caller far past compile_timeout_s. Now the compiler process checks a large spec,
    within the budget, and the request fails about when the budget ends."""
    import time

    llm = LLM("builtin:tiny", max_model_len=64, **{"logits_processors.structured.compile_timeout_s": 1.0})
    llm.generate("x", SamplingParams(max_tokens=2, structured=StructuredOutput.json_object()))  # compiler started
    start = time.monotonic()
    output = llm.generate("x", SamplingParams(max_tokens=2, structured=StructuredOutput.json(_nested_schema(450))))[0]
    assert time.monotonic() - start < 8.0
    assert output.outputs[0].finish_reason == "error"
    assert "did not compile within 1 s (compile_timeout_s)" in output.error


def test_a_schema_text_too_deep_to_parse_is_a_request_error():
    with pytest.raises(RequestError, match="nests too deep"):
        StructuredOutput.json("[" * 30000 + "]" * 30000)


def _stopped_compiler(llm):
    """The structured processor, its compiler process started and then stopped (SIGSTOP)."""
    import os
    import signal

    llm.generate("x", SamplingParams(max_tokens=2, structured=StructuredOutput.json_object()))
    processor = llm.engine.logits_pipeline.processors["structured"]
    pid = processor._compiler._process.pid
    os.kill(pid, signal.SIGSTOP)
    return processor, pid


@pytest.mark.parametrize("spec_chars", [100, 200_000], ids=["small", "larger-than-the-pipe"])
def test_a_stalled_compiler_is_not_the_grammar_s_fault(spec_chars):
    """A compiler that does not run (stopped) times the grammar out, but the grammar is not
    remembered as refused: the next request for it compiles on the restarted compiler. A
    spec larger than the pipe to the stopped compiler does not hold the dispatcher past
    the budget either."""
    import time

    llm = LLM("builtin:tiny", max_model_len=64, **{"logits_processors.structured.compile_timeout_s": 1.0})
    processor, pid = _stopped_compiler(llm)
    regex = "(w5|w6)" + "|(" + "a" * (spec_chars - 12) + ")"
    params = SamplingParams(max_tokens=2, structured=StructuredOutput.regex(regex))
    start = time.monotonic()
    ticket = processor.prepare(params)
    with pytest.raises(RuntimeError, match="compiler stalled") as info:
        ticket.result(timeout=30)
    assert not isinstance(info.value, RequestError)
    assert time.monotonic() - start < 5.0
    assert processor._compiler._process is None or processor._compiler._process.pid != pid
    # not remembered: the restarted compiler works on it (the small one compiles, the large
    # one takes its whole budget, as it would have on a running compiler)
    start = time.monotonic()
    again = processor.prepare(params)
    if spec_chars < 1000:
        assert again.result(timeout=60) is not None
    else:
        with pytest.raises(RequestError, match="did not compile within 1 s"):
            again.result(timeout=60)
        assert time.monotonic() - start >= 0.9
