"""`servelab serve` on builtin:tiny through the official `openai` client: logprobs
(completions with echo, chat with top_logprobs, streamed and not) equal to the Python
API's, schema-valid JSON from response_format, vLLM's structured_outputs and its older
guided fields, the penalties
and logit_bias, and a 400 naming an invalid schema."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from conftest_server import ServerProcess

from servelab import LLM, SamplingParams

MODEL = "builtin:tiny"
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["paris", "oslo", "lima"]},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999},
                         "capital": {"type": "boolean"}},
          "required": ["city", "population", "capital"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(MODEL, "--set", "engine.max_model_len=256",
                            log_path=tmp_path_factory.mktemp("server") / "server.log")
    yield process
    assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, max_model_len=256)


def test_completion_logprobs_with_echo_equal_the_python_api(client, offline):
    prompt = "import os\nimport"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                         echo=True)
    choice = response.choices[0]
    expected = offline.generate(prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=3,
                                                       prompt_logprobs=3))[0]
    assert choice.text == prompt + expected.text
    tokens = expected.prompt_token_ids + expected.token_ids
    positions = expected.prompt_logprobs + expected.outputs[0].logprobs
    assert len(choice.logprobs.tokens) == len(tokens)
    assert choice.logprobs.token_logprobs[0] is None
    for served, token, position in zip(choice.logprobs.token_logprobs[1:], tokens[1:], positions[1:]):
        assert served == pytest.approx(position[token].logprob, abs=1e-5)
    generated = choice.logprobs.top_logprobs[len(expected.prompt_token_ids):]
    for served, token, position in zip(generated, expected.token_ids, expected.outputs[0].logprobs):
        assert served == {lp.decoded_token: pytest.approx(lp.logprob, abs=1e-5) for lp in position.values()}
        assert max(served.values()) == pytest.approx(position[token].logprob, abs=1e-5)  # greedy: the top one
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset == [sum(len(t) for t in choice.logprobs.tokens[:i])
                                           for i in range(len(tokens))]


def test_chat_logprobs_streamed_and_not(client):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=8,
                   temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**request).choices[0]
    content = whole.logprobs.content
    assert len(content) == 8 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == entry.top_logprobs[0].logprob for entry in content)  # greedy: the top token
    assert all(bytes(entry.bytes).decode() == entry.token for entry in content)
    streamed = [entry for chunk in client.chat.completions.create(**request, stream=True) for c in chunk.choices
                if c.logprobs is not None for entry in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_streamed_completion_logprobs_with_echo(client):
    request = dict(model=MODEL, prompt="for i in", max_tokens=5, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**request).choices[0]
    chunks = [c for chunk in client.completions.create(**request, stream=True) for c in chunk.choices]
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs is not None for t in c.logprobs.tokens]
    token_logprobs = [t for c in chunks if c.logprobs is not None for t in c.logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens and token_logprobs == whole.logprobs.token_logprobs
    offsets = [t for c in chunks if c.logprobs is not None for t in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


def test_response_format_json_schema_gives_valid_json(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city as JSON"}], max_tokens=80, n=3,
        temperature=1.0, seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    streamed = client.completions.create(model=MODEL, prompt="City:", max_tokens=80, temperature=0, stream=True,
                                         extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads("".join(c.text for chunk in streamed for c in chunk.choices)), SCHEMA)


def test_guided_regex_choice_and_grammar(client):
    regex = client.completions.create(model=MODEL, prompt="Version:", max_tokens=12, temperature=1.0, seed=3,
                                      extra_body={"guided_regex": r"v[0-9]\.[0-9]{1,2}"}).choices[0]
    assert re.fullmatch(r"v[0-9]\.[0-9]{1,2}", regex.text)
    choice = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["yes (sure)", "no."]}).choices[0]
    assert choice.text in ("yes (sure)", "no.")
    grammar = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a list"}], max_tokens=30, temperature=0,
        extra_body={"guided_grammar": 'root ::= "(" ("a" | "b")+ ")"'}).choices[0]
    assert re.fullmatch(r"\([ab]+\)", grammar.message.content)


def test_structured_outputs_json_grammar_and_json_object(client):
    """vLLM's current field, `structured_outputs`, beside the guided_* ones it replaced."""
    schema = client.completions.create(model=MODEL, prompt="City:", max_tokens=80, temperature=1.0, seed=5,
                                       extra_body={"structured_outputs": {"json": SCHEMA}}).choices[0]
    jsonschema.validate(json.loads(schema.text), SCHEMA)
    grammar = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a list"}], max_tokens=30, temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= "[" ("x" | "y")+ "]"'}}).choices[0]
    assert re.fullmatch(r"\[[xy]+\]", grammar.message.content)
    anything = client.completions.create(model=MODEL, prompt="Data:", max_tokens=40, temperature=0,
                                         extra_body={"structured_outputs": {"json_object": True}}).choices[0]
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.text), dict)
    else:  # cut by max_tokens: still the start of one JSON object
        assert anything.text.lstrip().startswith("{")


def test_penalties_and_logit_bias_equal_the_python_api(client, offline):
    fields = dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={"13": 5.0})
    response = client.completions.create(model=MODEL, prompt="class Foo:", max_tokens=10,
                                         extra_body={"repetition_penalty": 1.3, "min_tokens": 4,
                                                     "return_token_ids": True}, **fields)
    expected = offline.generate("class Foo:", SamplingParams(
        max_tokens=10, temperature=0, presence_penalty=0.5, frequency_penalty=0.4, logit_bias={13: 5.0},
        repetition_penalty=1.3, min_tokens=4))[0]
    assert response.choices[0].model_extra["token_ids"] == expected.token_ids


def test_invalid_schema_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "object", "properties": {
                                               "a": {"type": "no-such-type"}}}}})
    error = info.value.body
    assert error["param"] == "response_format" and "JSON schema is invalid" in error["message"]
    assert "no-such-type" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "(a"})
    assert info.value.body["param"] == "guided_regex" and "regex is invalid" in info.value.body["message"]
