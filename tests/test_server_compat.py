"""The compatibility table of docs/serving.md, row by row: `servelab serve` as clients of
vLLM 0.3x and of the OpenAI API use it, through the official `openai` client and raw HTTP.

Each test named in the table's last column is here (tests/test_docs.py-style check at the
end: every row names a test of this module, and every request field the server knows is
a row). Two servers serve the module: `server` (the tiny Llama with a word-level tokenizer
and its own chat template) and `bare` (the same checkpoint without a chat template,
started with --trust-request-chat-template and --stream-interval 3). Logprobs are checked
against transformers' log-softmax; lm-evaluation-harness runs against `server` at the end.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch

from conftest_server import CHAT_TEMPLATE, ServerProcess, served_checkpoint, sse_events  # noqa: F401 (fixture)

MODEL = "tiny"
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def server(served_checkpoint, tmp_path_factory):
    process = ServerProcess(served_checkpoint, "--set", f"engine.max_model_len={MAX_MODEL_LEN}",
                            "--set", "engine.max_num_seqs=16", "--served-model-name", MODEL,
                            log_path=tmp_path_factory.mktemp("compat") / "server.log")
    yield process
    assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def bare_checkpoint(served_checkpoint, tmp_path_factory) -> str:
    """The served checkpoint without a chat template."""
    path = tmp_path_factory.mktemp("bare") / "ckpt"
    shutil.copytree(served_checkpoint, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def bare(bare_checkpoint, tmp_path_factory):
    process = ServerProcess(bare_checkpoint, "--set", f"engine.max_model_len={MAX_MODEL_LEN}",
                            "--served-model-name", MODEL, "--trust-request-chat-template", "--stream-interval", "3",
                            log_path=tmp_path_factory.mktemp("bare") / "server.log")
    yield process
    assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(served_checkpoint):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(served_checkpoint)


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `token_ids` (row i predicts token i + 1)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def greedy(http, prompt, max_tokens=8, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            **extra}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def error_of(reply: httpx.Response, param: str, code: str | None = None) -> dict:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def raw_stream(http, path: str, body: dict) -> tuple[list[str], list]:
    """(the stream's raw lines, its payloads) for one streamed request."""
    with http.stream("POST", f"/v1/{path}", json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    payloads = [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines if line]
    return lines, payloads


# ---------------------------------------------------------------- streaming


def test_plain_stream_loop_completions(client):
    text = ""
    for chunk in client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=6, temperature=0,
                                           stream=True):
        text += chunk.choices[0].text  # the loop every client writes: no chunk without choices
        assert chunk.usage is None
    assert text == greedy_text(client, "w5 w6", 6)


def greedy_text(client, prompt, max_tokens):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def test_plain_stream_loop_chat(client):
    content = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                stream=True):
        content += chunk.choices[0].delta.content or ""
        assert chunk.usage is None
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert content == reply.choices[0].message.content


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_include_usage_adds_the_usage_chunk(client, endpoint):
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                     n=2, stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}))
    else:
        chunks = list(client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=5, temperature=0, n=2,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.total_tokens == last.usage.prompt_tokens + 10
    assert all(chunk.choices and chunk.usage is None for chunk in body)


def test_continuous_usage_stats(http):
    _, payloads = raw_stream(http, "completions", {
        "prompt": "w5 w6", "max_tokens": 4, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *chunks, final, done = payloads
    assert done == "[DONE]" and final["choices"] == [] and final["usage"]["completion_tokens"] == 4
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == [1, 2, 3, 4] and all(chunk["usage"]["prompt_tokens"] == 2 for chunk in chunks)


def test_stream_options_need_stream(http):
    error_of(http.post("/v1/completions", json={"prompt": "w5", "stream_options": {"include_usage": True}}),
             "stream_options")
    error_of(http.post("/v1/completions", json={"prompt": "w5", "stream": True,
                                                "stream_options": {"include_usage": True, "usage": 1}}),
             "stream_options.usage", "unknown_field")


def test_one_token_per_chunk(http):
    _, payloads = raw_stream(http, "completions", {"prompt": "w5 w6", "max_tokens": 12, "ignore_eos": True,
                                                   "temperature": 0})
    texts = [c["choices"][0]["text"] for c in payloads[:-1]]
    assert len(texts) == 12 and all(re.fullmatch(r" ?w\d+", t) for t in texts), texts


def test_stream_interval_groups_tokens(bare):
    with httpx.Client(base_url=bare.url, timeout=60) as http:
        _, payloads = raw_stream(http, "completions", {"prompt": "w5 w6", "max_tokens": 8, "ignore_eos": True,
                                                       "temperature": 0})
    words = [len(c["choices"][0]["text"].split()) for c in payloads[:-1]]
    assert words == [3, 3, 2], words  # --stream-interval 3: the last chunk carries what is left


def test_sse_framing(http):
    lines, payloads = raw_stream(http, "chat/completions", {"messages": MESSAGES, "max_tokens": 3,
                                                            "stream_options": {"include_usage": True}})
    events = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    assert all(line == "" for line in lines[1::2])  # each event ends with a blank line
    first, *middle, finish, usage, _ = payloads
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant",
                                                                                          "content": ""}
    assert finish["choices"][0]["finish_reason"] in ("stop", "length") and "stop_reason" in finish["choices"][0]
    assert {p["id"] for p in payloads[:-1]} == {first["id"]} and usage["choices"] == []


def test_bench_serve_style_load(server):
    """vllm bench serve's request shape, 16 streams at once through openai's async client:
    each gets every token, one chunk each, and its usage."""
    async def one(client, index):
        stream = await client.completions.create(
            model=MODEL, prompt=f"w{5 + index} w6", max_tokens=16, stream=True, logprobs=None,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
        chunks = [chunk async for chunk in stream]
        return [c for c in chunks if c.choices], chunks[-1].usage

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    for chunks, usage in asyncio.run(run()):
        assert usage.completion_tokens == 16 and len(chunks) == 16
        # a sampled EOS (ignore_eos) is a chunk with empty text: it has no text
        assert len("".join(c.choices[0].text for c in chunks).split()) <= 16
        assert chunks[-1].choices[0].finish_reason == "length"


# ---------------------------------------------------------------- structured output


@pytest.mark.parametrize("constraint,check", [
    ({"choice": ["w7", "w9"]}, lambda text: text in ("w7", "w9")),
    ({"regex": "w1[0-9]"}, lambda text: re.fullmatch("w1[0-9]", text)),
])
def test_structured_outputs_field(http, constraint, check):
    for seed in range(3):
        choice = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 4, "seed": seed,
                                                    "structured_outputs": constraint}).json()["choices"][0]
        assert check(choice["text"]), choice


def test_structured_outputs_on_chat(http):
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4,
                                                    "structured_outputs": {"choice": ["w8", "w11"]}})
    assert reply.json()["choices"][0]["message"]["content"] in ("w8", "w11"), reply.text


@pytest.mark.parametrize("body,param,code", [
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn", "unknown_field"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "unsupported"),
    ({"structured_outputs": {"choice": ["w7"], "regex": "w7"}}, "structured_outputs.regex", None),
    ({"structured_outputs": {"choice": ["w7"]}, "guided_regex": "w7"}, "guided_regex", None),
    ({"structured_outputs": {}}, "structured_outputs", None),
    ({"structured_outputs": "w7"}, "structured_outputs", None),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", None),
    ({"structured_outputs": {"regex": "w7"}, "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "unsupported"),
])
def test_structured_outputs_refusals_name_the_field(http, body, param, code):
    error_of(http.post("/v1/completions", json={"prompt": "w5", **body}), param, code)


# ---------------------------------------------------------------- prompt scoring


def test_prompt_scoring_with_max_tokens_0(client, hf_model):
    prompt = [5, 17, 42, 99, 7]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == "w5 w17 w42 w99 w7" and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == 5
    expected = hf_logprobs(hf_model, prompt)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == 5
    for position, served in enumerate(choice.logprobs.token_logprobs[1:], start=1):
        assert served == pytest.approx(expected[position - 1, prompt[position]].item(), abs=2e-4)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_prompt_logprobs_field(http, hf_model):
    prompt = [5, 17, 42, 99]
    choice = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2,
                                                "temperature": 0}).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == 4
    expected = hf_logprobs(hf_model, prompt)
    for position in range(1, 4):
        entries = scored[position]
        top2 = torch.topk(expected[position - 1], 2).indices.tolist()
        assert set(map(int, entries)) == {prompt[position], *top2}
        for token, entry in entries.items():
            assert entry["logprob"] == pytest.approx(expected[position - 1, int(token)].item(), abs=2e-4)
            assert entry["decoded_token"] == f"w{token}" and entry["rank"] >= 1
    assert choice["logprobs"] is None  # prompt_logprobs alone scores the prompt only


def test_max_tokens_0_is_for_completions(http):
    error_of(http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 0}), "max_tokens")
    error_of(http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 0, "min_tokens": 1}), "min_tokens")


# ---------------------------------------------------------------- stops


def _fresh_position(token_ids: list[int]) -> int:
    """The first position > 0 whose token came nowhere before it."""
    return next(i for i, t in enumerate(token_ids) if i > 0 and t not in token_ids[:i])


def test_include_stop_str_in_output(http):
    free = greedy(http, "w5 w6", ignore_eos=True)
    words = free["text"].split()
    at = _fresh_position(free["token_ids"])
    stop = words[at]
    cut = greedy(http, "w5 w6", stop=[stop], ignore_eos=True)
    assert cut["text"] == " ".join(words[:at]) + " " and cut["stop_reason"] == stop
    kept = greedy(http, "w5 w6", stop=[stop], include_stop_str_in_output=True, ignore_eos=True)
    assert kept["text"] == " ".join(words[: at + 1]) and kept["finish_reason"] == "stop"
    assert kept["stop_reason"] == stop


def test_stop_token_ids_text_excluded(http):
    free = greedy(http, "w5 w6", ignore_eos=True)
    at = _fresh_position(free["token_ids"])
    stop_id = free["token_ids"][at]
    cut = greedy(http, "w5 w6", stop_token_ids=[stop_id], ignore_eos=True)
    assert cut["token_ids"] == free["token_ids"][: at + 1]  # the token stays in token_ids, as vLLM
    assert cut["text"] == " ".join(free["text"].split()[:at]) and cut["stop_reason"] == stop_id
    kept = greedy(http, "w5 w6", stop_token_ids=[stop_id], include_stop_str_in_output=True, ignore_eos=True)
    assert kept["text"] == " ".join(free["text"].split()[: at + 1])


def test_stop_reason(http, client):
    free = greedy(http, "w5 w6", max_tokens=3, ignore_eos=True)
    assert free["finish_reason"] == "length" and free["stop_reason"] is None
    stop_id = free["token_ids"][_fresh_position(free["token_ids"])]
    streamed = list(client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, temperature=0,
                                              stream=True, extra_body={"stop_token_ids": [stop_id],
                                                                       "ignore_eos": True}))
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert streamed[-1].choices[0].model_extra["stop_reason"] == stop_id
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
    assert "stop_reason" in chat.choices[0].model_extra


def test_stop_reason_and_stop_text_in_the_engine(served_checkpoint):
    """The engine side of the stop fields, through the Python API (LLM.generate)."""
    from servelab import LLM, SamplingParams

    llm = LLM(served_checkpoint, max_model_len=64)
    free = llm.generate("w5 w6", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    at = _fresh_position(free.token_ids)
    stop_id, words = free.token_ids[at], free.text.split()
    by_token = llm.generate("w5 w6", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                    stop_token_ids=[stop_id]))[0].outputs[0]
    assert (by_token.token_ids, by_token.text, by_token.stop_reason) == (free.token_ids[: at + 1],
                                                                         " ".join(words[:at]), stop_id)
    by_string = llm.generate("w5 w6", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[words[at]],
                                                     include_stop_str_in_output=True))[0].outputs[0]
    assert (by_string.text, by_string.stop_reason) == (" ".join(words[: at + 1]), words[at])
    assert free.outputs[0].stop_reason is None


# ---------------------------------------------------------------- chat templates


def test_chat_without_template_is_a_400(bare):
    with httpx.Client(base_url=bare.url, timeout=60) as http:
        error = error_of(http.post("/v1/chat/completions", json={"messages": MESSAGES}), "messages",
                         "chat_template_missing")
        assert "no chat template" in error["message"] and "--chat-template" in error["message"]
        assert http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2}).status_code == 200


def test_request_chat_template_needs_the_trust_flag(http, bare, hf_tokenizer):
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{{ greeting }}"
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template": template,
            "chat_template_kwargs": {"greeting": "w9 w10"}}
    error_of(http.post("/v1/chat/completions", json=body), "chat_template", "untrusted_chat_template")
    with httpx.Client(base_url=bare.url, timeout=60) as trusting:
        reply = trusting.post("/v1/chat/completions", json={**body, "return_token_ids": True})
        assert reply.status_code == 200, reply.text
        rendered = hf_tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                                    add_generation_prompt=True, greeting="w9 w10")
        assert reply.json()["choices"][0]["prompt_token_ids"] == hf_tokenizer.encode(rendered)
        error_of(trusting.post("/v1/chat/completions", json={**body, "chat_template": "{% if %}"}),
                 "chat_template")


# ---------------------------------------------------------------- endpoints


def test_tokenize(http, hf_tokenizer):
    answer = http.post("/tokenize", json={"model": MODEL, "prompt": "w5 w17 w42"}).json()
    assert answer == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [5, 17, 42], "token_strs": None}
    chat = http.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    assert chat["tokens"] == hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)
    assert chat["token_strs"] == hf_tokenizer.convert_ids_to_tokens(chat["tokens"])
    error_of(http.post("/tokenize", json={"prompt": "w5", "truncate": 3}), "truncate", "unknown_field")


def test_detokenize(http):
    assert http.post("/detokenize", json={"tokens": [5, 17, 42]}).json() == {"prompt": "w5 w17 w42"}
    error_of(http.post("/detokenize", json={"tokens": [5, 10**6]}), "tokens")


def test_tokenizer_info(http):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["chat_template"] == CHAT_TEMPLATE
    assert info["model_max_length"] == MAX_MODEL_LEN


def test_version_and_ping(http):
    from importlib.metadata import version

    assert http.get("/version").json() == {"version": version("servelab")}
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_vllm_metric_names(server, http):
    greedy(http, "w5", max_tokens=3, ignore_eos=True)
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    label = f'model_name="{MODEL}"'
    assert values[f"vllm:generation_tokens_total{{{label}}}"] == values["servelab_generation_tokens_total"] > 0
    assert values[f"vllm:num_requests_running{{{label}}}"] == values["servelab_requests_running"]
    assert values[f'vllm:request_success_total{{finished_reason="length",{label}}}'] == values[
        'servelab_requests_finished_total{finish_reason="length"}']
    assert f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",{label}}}' in values
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:num_preemptions_total", "vllm:e2e_request_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count"):
        assert f"{name}{{{label}}}" in values, name


# ---------------------------------------------------------------- strictness decisions


def test_unknown_fields_are_refused_by_name(http):
    error = error_of(http.post("/v1/completions", json={"prompt": "w5", "temprature": 0}), "temprature",
                     "unknown_field")
    assert "temprature" in error["message"]
    error_of(http.post("/v1/chat/completions", json={"messages": MESSAGES, "echo": True}), "echo", "unsupported")
    error_of(http.post("/v1/chat/completions", json={"messages": MESSAGES, "prompt": "w5"}), "prompt",
             "unknown_field")


NEUTRAL_FIELDS = [  # (endpoint, field, its neutral value, a value servelab cannot honour)
    ("completions", "use_beam_search", False, True), ("completions", "skip_special_tokens", True, False),
    ("completions", "spaces_between_special_tokens", True, False), ("completions", "suffix", "", "w9"),
    ("completions", "add_special_tokens", True, False), ("completions", "length_penalty", 1.0, 2.0),
    ("completions", "early_stopping", False, True), ("completions", "truncate_prompt_tokens", None, 3),
    ("completions", "allowed_token_ids", None, [5]), ("completions", "guided_whitespace_pattern", None, " "),
    ("completions", "priority", 0, 1), ("completions", "return_tokens_as_token_ids", False, True),
    ("completions", "store", False, True), ("completions", "service_tier", "auto", "flex"),
    ("chat/completions", "modalities", ["text"], ["audio"]), ("chat/completions", "tools", [], [{"type": "x"}]),
    ("chat/completions", "functions", [], [{"name": "f"}]), ("chat/completions", "tool_choice", "none", "required"),
    ("chat/completions", "function_call", "auto", {"name": "f"}),
    ("chat/completions", "parallel_tool_calls", None, True),
    ("chat/completions", "add_generation_prompt", True, False),
    ("chat/completions", "continue_final_message", False, True), ("chat/completions", "echo", False, True),
    ("chat/completions", "add_special_tokens", False, True), ("chat/completions", "prompt_logprobs", None, 1),
]


@pytest.mark.parametrize("path,field,neutral,other", NEUTRAL_FIELDS, ids=[f"{p}:{f}" for p, f, _, _ in NEUTRAL_FIELDS])
def test_neutral_only_fields(http, path, field, neutral, other):
    body = {"prompt": "w5"} if path == "completions" else {"messages": MESSAGES}
    assert http.post(f"/v1/{path}", json={**body, "max_tokens": 1, field: neutral}).status_code == 200
    error_of(http.post(f"/v1/{path}", json={**body, field: other}), field, "unsupported")


def test_min_tokens_and_bad_words(http):
    free = greedy(http, "w5 w6", ignore_eos=True)
    first = free["token_ids"][0]
    held = greedy(http, "w5 w6", stop_token_ids=[first], min_tokens=3, ignore_eos=True)
    assert len(held["token_ids"]) >= 3 and first not in held["token_ids"][:3]
    banned = greedy(http, "w5 w6", bad_words=[f"w{first}"], ignore_eos=True)
    assert first not in banned["token_ids"]


def test_logits_processors_and_extra_args(http):
    pytest.importorskip("servelab_sjf", reason="the example plugin package (examples/servelab-sjf)")
    choice = greedy(http, "w5 w6", max_tokens=24, logits_processors=["no-repeat-ngram"],
                    extra_args={"no_repeat_ngram_size": 1}, ignore_eos=True)
    assert len(set(choice["token_ids"])) == len(choice["token_ids"])  # no token twice
    error_of(http.post("/v1/completions", json={"prompt": "w5", "logits_processors": ["no-such"]}),
             "logits_processors")
    error_of(http.post("/v1/completions", json={"prompt": "w5", "extra_args": [1]}), "extra_args")


def test_user_is_a_no_op(http):
    assert greedy(http, "w5 w6", user="someone")["text"] == greedy(http, "w5 w6")["text"]


def test_best_of(http):
    assert http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 1, "n": 2, "best_of": 2}).status_code \
        == 200
    error_of(http.post("/v1/completions", json={"prompt": "w5", "best_of": 2}), "best_of", "unsupported")


def test_completion_logprobs_true(http):
    one = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2, "logprobs": True,
                                             "ignore_eos": True}).json()
    logprobs = one["choices"][0]["logprobs"]  # as vLLM's logprobs 1: the most likely, and the chosen token
    assert len(logprobs["token_logprobs"]) == 2
    assert all(1 <= len(top) <= 2 and token in top for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]))
    assert http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2,
                                              "logprobs": False}).json()["choices"][0]["logprobs"] is None


def test_integral_floats_are_integers(http):
    choice = greedy(http, "w5", max_tokens=4.0, ignore_eos=True)
    assert len(choice["token_ids"]) == 4
    error_of(http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 4.5}), "max_tokens")


def test_numbers_as_strings_are_refused(http):
    error_of(http.post("/v1/completions", json={"prompt": "w5", "n": "1"}), "n")
    error_of(http.post("/v1/completions", json={"prompt": "w5", "temperature": "0"}), "temperature")


def test_n_with_temperature_0(http):
    choices = http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 4, "n": 3,
                                                 "temperature": 0}).json()["choices"]
    assert len(choices) == 3 and len({c["text"] for c in choices}) == 1


def test_empty_prompt_is_refused(http):
    error_of(http.post("/v1/completions", json={"prompt": ""}), "prompt")
    error_of(http.post("/v1/completions", json={"prompt": ["w5", ""]}), "prompt")


def test_nulls_are_defaults(http):
    nulls = {"top_p": None, "stop": None, "n": None, "seed": None, "logprobs": None,
             "stream": None, "stream_options": None, "best_of": None, "response_format": None, "user": None}
    assert greedy(http, "w5 w6", **nulls)["text"] == greedy(http, "w5 w6")["text"]


def test_more_than_4_stop_strings(http):
    free = greedy(http, "w5 w6", ignore_eos=True)
    at = _fresh_position(free["token_ids"])
    stops = ["w250", "w251", "w252", "w253", "w254", free["text"].split()[at]]
    assert greedy(http, "w5 w6", stop=stops, ignore_eos=True)["text"] == " ".join(free["text"].split()[:at]) + " "


def test_prompt_plus_max_tokens_over_the_context_is_clipped(http):
    prompt = " ".join(["w5"] * (MAX_MODEL_LEN - 4))
    choice = greedy(http, prompt, max_tokens=100, ignore_eos=True)
    assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"


# ---------------------------------------------------------------- lm-evaluation-harness


LL_DOCS = [{"context": "w5 w6", "continuation": " w7"}, {"context": "w9 w8 w7", "continuation": " w6 w5"},
           {"context": "w20", "continuation": " w21"}]
GEN_DOCS = [{"context": "w5 w6", "target": "w7"}, {"context": "w30 w31 w32", "target": "w33"}]


def _lm_eval_tasks(folder: Path) -> None:
    (folder / "ll.jsonl").write_text("".join(json.dumps(d) + "\n" for d in LL_DOCS))
    (folder / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "servelab_ll.yaml").write_text(
        f"task: servelab_ll\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'll.jsonl'}\n"
        "output_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    (folder / "servelab_gen.yaml").write_text(
        f"task: servelab_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['w100', 'w101', 'w102', 'w103', 'w104']\n  max_gen_toks: 6\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")


_LM_EVAL_RUN = """
import json, pathlib
import lm_eval
from lm_eval.tasks import TaskManager

folder = pathlib.Path(FOLDER)
tasks = TaskManager(include_path=str(folder), include_defaults=False)
results = lm_eval.simple_evaluate(model="local-completions", model_args=MODEL_ARGS,
                                  tasks=["servelab_ll", "servelab_gen"], task_manager=tasks, log_samples=True)
(folder / "samples.json").write_text(json.dumps(results["samples"], default=str))
"""


def test_lm_eval_local_completions(server, hf_model, hf_tokenizer, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the test extra (pip install -e '.[test]')")
    _lm_eval_tasks(tmp_path)
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    # lm-eval's own CLI indexes its thousands of built-in tasks first (half a minute here):
    # its Python API, in a process of its own, with only the local tasks. It tokenizes
    # through the server (/tokenizer_info, /tokenize, /detokenize: its remote backend).
    code = (_LM_EVAL_RUN.replace("FOLDER", repr(str(tmp_path)))
            .replace("MODEL_ARGS", repr(f"model={MODEL},base_url={server.url}/v1/completions,num_concurrent=2,"
                                        f"max_retries=1,max_length={MAX_MODEL_LEN},tokenizer_backend=remote")))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    samples = json.loads((tmp_path / "samples.json").read_text())
    assert len(samples["servelab_ll"]) == len(LL_DOCS) and len(samples["servelab_gen"]) == len(GEN_DOCS)
    for sample in samples["servelab_ll"]:
        context = hf_tokenizer.encode(sample["doc"]["context"])
        continuation = hf_tokenizer.encode(sample["doc"]["continuation"])
        logprobs = hf_logprobs(hf_model, context + continuation)
        expected = sum(logprobs[len(context) + i - 1, token].item() for i, token in enumerate(continuation))
        greedy_match = all(logprobs[len(context) + i - 1].argmax().item() == token
                           for i, token in enumerate(continuation))
        loglikelihood, is_greedy = sample["resps"][0][0]
        assert float(loglikelihood) == pytest.approx(expected, abs=5e-4)
        assert is_greedy in (greedy_match, str(greedy_match))
    for sample in samples["servelab_gen"]:
        prompt = hf_tokenizer.encode(sample["doc"]["context"])
        tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                   eos_token_id=None)[0, len(prompt):].tolist()
        text = hf_tokenizer.decode(tokens)
        for stop in ("w100", "w101", "w102", "w103", "w104"):
            text = text.split(stop)[0]
        assert sample["resps"][0][0] == text


# ---------------------------------------------------------------- the table is the tests


def _table_rows() -> list[list[str]]:
    text = DOCS.read_text()
    section = text[text.index("## Compatibility with vLLM and OpenAI clients"):]
    section = section[: section.index("\n## ", 3)] if "\n## " in section[3:] else section
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| field")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows if not set(row) <= set("|- ")]


def test_every_compatibility_row_is_a_test():
    names = {name for name in globals() if name.startswith("test_")}
    rows = _table_rows()
    assert len(rows) >= 30
    for row in rows:
        tests = re.findall(r"`(test_\w+)`", row[-1])
        assert tests, row
        for test in tests:
            assert test in names or _elsewhere(test), (row[0], test)


def _elsewhere(test: str) -> bool:
    """Rows may name a test of another module of tests/."""
    return any(re.search(rf"def {test}\(", path.read_text()) for path in Path(__file__).parent.glob("test_*.py"))


def test_every_known_field_is_in_the_table():
    from servelab.server.fields import CHAT, CHAT_NEUTRAL, COMPLETIONS, COMPLETIONS_NEUTRAL, NEUTRAL, NO_OP

    listed = " ".join(row[0] for row in _table_rows())
    for field in sorted(CHAT | COMPLETIONS | set(NEUTRAL) | set(NO_OP) | set(CHAT_NEUTRAL) | set(COMPLETIONS_NEUTRAL)):
        assert f"`{field}`" in listed, field
