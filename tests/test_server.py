"""`servelab serve` as a real process on 127.0.0.1, driven by the official `openai` client
and by plain HTTP: completions and chat, streaming and not, n > 1, stop sequences, the
same tokens as the offline `LLM.generate`, client disconnects that free KV blocks, every
bad input, the overload path, the API key and the metrics.

One server (API key on, 16 sequences, a queue limit of 64) serves the whole module."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from conftest_server import CHAT_TEMPLATE, ServerProcess, served_checkpoint, sse_events  # noqa: F401 (fixture)

API_KEY = "sk-servelab-test"
MODEL = "tiny"
MAX_MODEL_LEN = 256
USED = 'servelab_kv_blocks{state="used"}'
ABORTED = 'servelab_requests_finished_total{finish_reason="abort"}'


@pytest.fixture(scope="module")
def server(served_checkpoint, tmp_path_factory):
    process = ServerProcess(served_checkpoint, "--set", f"engine.max_model_len={MAX_MODEL_LEN}",
                            "--set", "engine.max_num_seqs=16", "--api-key", API_KEY,
                            "--served-model-name", MODEL, "--max-waiting", "64",
                            log_path=tmp_path_factory.mktemp("server") / "server.log")
    yield process
    assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(served_checkpoint):
    from servelab import LLM

    return LLM(served_checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=16)


def reference(offline, prompt, **params):
    from servelab import SamplingParams

    return offline.generate(prompt, SamplingParams(**params))[0]


SEEDED = dict(temperature=0.9, top_p=0.95, top_k=40, min_p=0.02, seed=1234, max_tokens=12)


# ---------------------------------------------------------------- plain endpoints and the key


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")


def test_models_lists_the_served_model(client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.owned_by == "servelab"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_is_enforced(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        response = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "w5"})
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_with_a_wrong_key_is_refused(server):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="w5", max_tokens=2)


# ---------------------------------------------------------------- same tokens as offline


@pytest.mark.parametrize("params", [dict(temperature=0.0, max_tokens=10), SEEDED], ids=["greedy", "seeded"])
def test_completion_equals_offline(client, offline, params):
    extra = {k: params[k] for k in ("top_k", "min_p") if k in params}
    plain = {k: v for k, v in params.items() if k not in extra}
    result = client.completions.create(model=MODEL, prompt="w5 w17 w42", extra_body=extra, **plain)
    expected = reference(offline, "w5 w17 w42", **params)
    [choice] = result.choices
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids) == 3
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_token_ids_equal_offline(http, offline):
    body = {"model": MODEL, "prompt": [5, 17, 42, 99], "return_token_ids": True, **SEEDED}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    expected = reference(offline, [5, 17, 42, 99], **SEEDED)
    assert choice["token_ids"] == expected.token_ids and choice["prompt_token_ids"] == [5, 17, 42, 99]


def test_streaming_completion_equals_offline(client, offline):
    stream = client.completions.create(model=MODEL, prompt="w9 w8 w7", stream=True,
                                       stream_options={"include_usage": True}, extra_body={"top_k": 40, "min_p": 0.02},
                                       **{k: v for k, v in SEEDED.items() if k not in ("top_k", "min_p")})
    chunks = list(stream)
    expected = reference(offline, "w9 w8 w7", **SEEDED)
    texts = [c.choices[0].text for c in chunks if c.choices]
    # One chunk per token (the last one's with the finish reason), however busy the loop
    # was; the disconnect test below reads chunks mid-stream.
    assert all(texts[:-1]) and len(texts) == len(expected.token_ids), texts
    assert "".join(texts) == expected.text, (texts, expected.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_n_choices_equal_offline_n(client, offline):
    params = dict(temperature=1.0, seed=77, max_tokens=8)
    result = client.completions.create(model=MODEL, prompt="w30 w31", n=3, **params)
    expected = reference(offline, "w30 w31", n=3, **params).outputs
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [e.text for e in expected]
    assert len({e.text for e in expected}) > 1  # the choices differ
    assert expected[0].text == reference(offline, "w30 w31", **params).text  # choice 0 is the n = 1 answer
    assert result.usage.prompt_tokens == 2  # counted once per prompt, as OpenAI does
    assert result.usage.completion_tokens == sum(len(e.token_ids) for e in expected)

    stream = client.completions.create(model=MODEL, prompt="w30 w31", n=3, stream=True, **params)
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [e.text for e in expected]


def test_several_prompts_with_n_in_openai_order(http, offline):
    body = {"model": MODEL, "prompt": ["w40 w41", [42, 43, 44]], "n": 2, "seed": 5, "max_tokens": 4,
            "return_token_ids": True}
    result = http.post("/v1/completions", json=body).json()
    expected = [reference(offline, p, n=2, seed=5, max_tokens=4).outputs for p in body["prompt"]]
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in result["choices"]] == [e.token_ids for pair in expected for e in pair]
    assert result["choices"][2]["prompt_token_ids"] == [42, 43, 44]
    assert result["usage"]["prompt_tokens"] == 2 + 3


def test_stop_sequences_end_the_text_before_them(client, offline):
    words = reference(offline, "w11 w12", temperature=0.0, max_tokens=16).text.split()
    k = next(i for i in range(2, len(words)) if words[i] not in words[:i])
    params = dict(temperature=0.0, max_tokens=16, stop=[words[k], "w999"])
    expected = reference(offline, "w11 w12", **params)
    assert expected.finish_reason == "stop" and words[k] not in expected.text
    result = client.completions.create(model=MODEL, prompt="w11 w12", **params)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (expected.text, "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="w11 w12", stream=True, **params) if c.choices)
    assert streamed == expected.text


def test_chat_uses_the_checkpoint_template_and_equals_offline(client, offline, served_checkpoint):
    from transformers import PreTrainedTokenizerFast

    messages = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w6 w7"}]
    hf = PreTrainedTokenizerFast.from_pretrained(served_checkpoint)
    assert hf.chat_template == CHAT_TEMPLATE
    prompt_ids = list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    expected = reference(offline, prompt_ids, **SEEDED)
    extra = {"top_k": 40, "min_p": 0.02}
    plain = {k: v for k, v in SEEDED.items() if k not in extra}
    result = client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra, **plain)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.usage.prompt_tokens == len(prompt_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra, **plain))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_chat_n_and_max_completion_tokens(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "w8"}]}],
            "n": 2, "max_completion_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    result = http.post("/v1/chat/completions", json=body).json()
    assert [c["finish_reason"] for c in result["choices"]] == ["length", "length"]
    assert result["choices"][0]["message"] == result["choices"][1]["message"]  # greedy
    assert result["usage"]["completion_tokens"] == 6


# ---------------------------------------------------------------- bad input


LONG_PROMPT = " ".join(["w5"] * (MAX_MODEL_LEN + 1))
CHAT = {"messages": [{"role": "user", "content": "w5"}]}
BAD_INPUTS = [
    ("completions", b'{"prompt": ', None),
    ("completions", b'["w5"]', None),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": LONG_PROMPT}, "prompt"),
    ("completions", {"prompt": [5, 100000]}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "w5"}]}, "messages[0].role"),
    ("completions", {"prompt": "w5", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "w5", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "w5", "top_k": -3}, "top_k"),
    ("completions", {"prompt": "w5", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "w5", "max_tokens": -1}, "max_tokens"),
    ("chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "w5", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "w5", "n": 0}, "n"),
    ("completions", {"prompt": "w5", "n": 65}, "n"),
    ("completions", {"prompt": "w5", "seed": 1.5}, "seed"),
    ("completions", {"prompt": "w5", "stop": [""]}, "stop"),
    ("completions", {"prompt": "w5", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": "w5", "ignore_eos": "yes"}, "ignore_eos"),
    ("completions", {"prompt": "w5", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "w5", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "w5", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "w5", "logit_bias": {"w5": 1}}, "logit_bias"),
    ("completions", {"prompt": "w5", "response_format": {"type": "xml"}}, "response_format"),
    ("chat/completions", {**CHAT, "temperature": -0.5}, "temperature"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {**CHAT, "guided_regex": "(", "response_format": {"type": "json_object"}}, "guided_regex"),
]


@pytest.mark.parametrize("path,body,param", BAD_INPUTS, ids=[f"{p}:{f}" for p, _, f in BAD_INPUTS])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    if isinstance(body, bytes):
        response = http.post(f"/v1/{path}", content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(f"/v1/{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"] and (param is None or param.split("[")[0] in error["message"])


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="w5", temperature=-1)
    assert info.value.body["param"] == "temperature"


# ---------------------------------------------------------------- disconnects free KV


def test_disconnect_mid_stream_frees_kv_blocks(server, http):
    aborted = server.metrics().get(ABORTED, 0)
    # 16 sequences x 240 tokens: still running when the client has read a few events and
    # asked for the metrics (one sequence of the tiny model could finish in between).
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 240, "ignore_eos": True, "stream": True, "n": 16}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response)
        for _ in range(3):
            next(events)
        during = server.metrics()
        assert during[USED] > 0 and during["servelab_requests_running"] == 16
    after = server.wait_metrics(lambda m: m[USED] == 0 and m["servelab_requests_running"] == 0, timeout=2)
    assert after[ABORTED] == aborted + 16


def test_disconnect_while_waiting_for_a_full_response_aborts_it(server):
    aborted = server.metrics().get(ABORTED, 0)
    # 16 sequences x 240 tokens take far longer than the client waits for a first byte.
    body = {"model": MODEL, "prompt": "w5", "max_tokens": 240, "ignore_eos": True, "n": 16}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.05),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    after = server.wait_metrics(lambda m: m.get(ABORTED, 0) == aborted + 16, timeout=3)
    assert after[USED] == 0


# ---------------------------------------------------------------- overload


def test_overload_gets_429_with_retry_after(server, http, client):
    long = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json={**long, "n": 16}):  # every sequence slot
        server.wait_metrics(lambda m: m["servelab_requests_running"] == 16)
        queued = {**long, "prompt": [[5, 6 + i] for i in range(48)]}  # 48 of the 64 queue slots
        with http.stream("POST", "/v1/completions", json=queued):
            server.wait_metrics(lambda m: m["servelab_requests_waiting"] == 48)
            refused = http.post("/v1/completions", json={**long, "stream": False, "n": 17})
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "overloaded"
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model=MODEL, messages=CHAT["messages"], n=17, max_tokens=1)
            assert server.metrics()['servelab_http_requests_rejected_total{reason="overloaded"}'] >= 2
    server.wait_metrics(lambda m: m[USED] == 0 and m["servelab_requests_running"] == 0
                        and m["servelab_requests_waiting"] == 0, timeout=3)


# ---------------------------------------------------------------- metrics


def test_metrics_cover_the_engine(server, http):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "w5", "max_tokens": 4, "ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("servelab_requests_running", "servelab_requests_waiting", "servelab_kv_cache_usage_ratio",
                 "servelab_kv_blocks", "servelab_prefix_cache_hit_rate", "servelab_spec_decode_acceptance_rate",
                 "servelab_time_to_first_token_seconds_bucket", "servelab_time_per_output_token_seconds_bucket",
                 "servelab_e2e_request_latency_seconds_bucket", "servelab_generation_tokens_total",
                 "servelab_prompt_tokens_total", "servelab_requests_finished_total"):
        assert f"\n{name}" in text, name
    metrics = server.metrics()
    assert metrics["servelab_time_to_first_token_seconds_count"] >= 1
    assert metrics["servelab_generation_tokens_total"] >= 4
    assert metrics['servelab_kv_blocks{state="total"}'] > 0
    assert metrics['servelab_kv_cache_bytes_per_token{kv_cache_dtype="auto"}'] > 0


# ---------------------------------------------------------------- command-line errors


@pytest.mark.parametrize("args,fragment", [
    (["--port", "{port}"], "cannot listen on 127.0.0.1:"),  # taken: fails before the model loads
    (["--max-waiting", "0"], "--max-waiting"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--max-prompt-chars", "0"], "--max-prompt-chars"),
    (["--header-timeout", "0"], "--header-timeout"),
], ids=["port-taken", "max-waiting", "shutdown-timeout", "max-prompt-chars", "header-timeout"])
def test_serve_usage_errors_exit_2(server, args, fragment):
    port = server.url.rsplit(":", 1)[1]
    command = [sys.executable, "-m", "servelab.cli", "serve", "--model", "nowhere",
               *[a.format(port=port) for a in args]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("servelab: error: ") and fragment in result.stderr
    assert "Traceback" not in result.stderr
