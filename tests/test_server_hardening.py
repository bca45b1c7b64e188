"""`servelab serve` against hostile requests, as a real process on 127.0.0.1: every case
of the hardening issue is refused with a clear 4xx (or timed out) while the server stays
healthy, serves the next request, and holds no KV block afterwards; plus a bounded
hypothesis fuzz run of request bodies against the same process.

One server (API key from a file, 256-token context, small body limit and short
timeouts) serves the whole module.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest_server import ServerProcess, served_checkpoint  # noqa: F401 (fixture)

API_KEY = "sk-hardening"
MODEL = "tiny"
MAX_MODEL_LEN = 256
MAX_BODY = 256 * 1024
MAX_PROMPT_CHARS = 16 * MAX_MODEL_LEN  # the default bound: 16 characters per token of context
USED = 'servelab_kv_blocks{state="used"}'


@pytest.fixture(scope="module")
def server(served_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hardening")
    (directory / "key").write_text(API_KEY + "\n")
    process = ServerProcess(served_checkpoint, "--set", f"engine.max_model_len={MAX_MODEL_LEN}",
                            "--set", "engine.max_num_seqs=16", "--api-key-file", str(directory / "key"),
                            "--served-model-name", MODEL, "--max-waiting", "64", "--max-body-bytes", str(MAX_BODY),
                            "--header-timeout", "1", "--body-timeout", "1",
                            log_path=directory / "server.log")
    yield process
    assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
        yield client


def post_raw(http, path: str, raw: bytes) -> httpx.Response:
    return http.post(f"/v1/{path}", content=raw, headers={"Content-Type": "application/json"})


def assert_healthy(server, http) -> None:
    """/health is 200 and a plain request is answered in full."""
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    answer = http.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 2, "ignore_eos": True})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2, answer.text


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# ---------------------------------------------------------------- values the engine cannot take

SURROGATE_PROMPT = b'{"prompt": "w5 \\ud800 w6", "max_tokens": 2}'
SURROGATE_CHAT = b'{"messages": [{"role": "user", "content": "w5 \\udfff"}], "max_tokens": 2}'
REFUSED_VALUES = [
    ("completions", SURROGATE_PROMPT, "prompt", "invalid_unicode"),
    ("chat/completions", SURROGATE_CHAT, "messages[0].content", "invalid_unicode"),
    ("completions", b'{"prompt": "w5", "seed": 18446744073709551616}', "seed", None),  # 2**64
    ("completions", b'{"prompt": "w5", "seed": 18446744073709551615, "n": 2}', "seed", None),  # 2**64-1, n=2
    ("completions", b'{"prompt": "w5", "top_k": 9223372036854775808, "temperature": 1}', "top_k", None),
    ("completions", b'{"prompt": "w5", "top_k": 212}', "top_k", None),  # the vocabulary is 211
    ("completions", b'{"prompt": "w5", "temperature": NaN}', None, "invalid_json"),
    ("completions", b'{"prompt": "w5", "temperature": Infinity}', None, "invalid_json"),
    ("completions", b'{"prompt": "w5", "top_p": -Infinity}', None, "invalid_json"),
    ("completions", b'{"prompt": "w5", "temperature": 1e400}', "temperature", None),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "w5"}], "min_p": 1e999}', "min_p", None),
]


@pytest.mark.parametrize("path,raw,param,code", REFUSED_VALUES, ids=[r[1].decode()[:48] for r in REFUSED_VALUES])
def test_values_the_engine_cannot_take_are_a_400_and_harm_nothing(server, http, path, raw, param, code):
    assert_error(post_raw(http, path, raw), 400, param, code)
    assert_healthy(server, http)


def test_the_largest_seeds_are_served(http):
    for seed, n in ((2**64 - 1, 1), (2**64 - 2, 2), (-(2**63), 1)):
        body = {"prompt": "w5", "seed": seed, "n": n, "max_tokens": 2, "temperature": 1.0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, (seed, response.text)


def test_a_stream_in_flight_outlives_a_poisoned_request(server, http):
    body = {"prompt": "w5", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert_error(post_raw(http, "completions", SURROGATE_PROMPT), 400, "prompt")
        assert_error(post_raw(http, "completions", b'{"prompt": "w5", "seed": 18446744073709551616}'), 400)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 40


# ---------------------------------------------------------------- sizes


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    with socket.create_connection(urlparts(server.url)) as sock:
        sock.settimeout(10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {55 * 2**20}\r\n\r\n".encode()
                     + b'{"prompt": "')
        assert read_response(sock).startswith(b"HTTP/1.1 413 ")  # without the other 55 MB


def test_a_chunked_body_over_the_limit_is_a_413(http):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"w5 " * 1365

    assert_error(http.post("/v1/completions", content=chunks()), 413, code="body_too_large")


def test_a_prompt_too_long_for_any_tokenization_is_refused_by_its_length(http):
    words = "w5 " * (MAX_PROMPT_CHARS // 3 + 1)
    error = assert_error(http.post("/v1/completions", json={"prompt": words}), 400, "prompt")
    assert f"{len(words)} characters" in error["message"]
    chat = {"messages": [{"role": "user", "content": words}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "messages")
    too_many_ids = {"prompt": [5] * (MAX_MODEL_LEN + 1)}
    assert_error(http.post("/v1/completions", json=too_many_ids), 400, "prompt")


def test_error_messages_quote_a_bad_value_briefly(http):
    huge = "x" * 100_000
    for body in ({"prompt": "w5", "max_tokens": huge}, {"prompt": "w5", "stop": [huge, ""]},
                 {"prompt": "w5", "model": huge}, {"prompt": "w5", "temperature": [huge]}):
        response = http.post("/v1/completions", json=body)
        assert 400 <= response.status_code < 500 and len(response.content) < 1000, response.text[:300]


@pytest.mark.parametrize("depth", [33, 100_000])
def test_deeply_nested_json_is_a_400(server, http, depth):
    raw = b'{"prompt": "w5", "user": ' + b"[" * depth + b"]" * depth + b"}"
    if len(raw) > MAX_BODY:
        raw = b'{"prompt": "w5", "user": ' + b"[" * depth  # unterminated: the limit still answers first
        assert post_raw(http, "completions", raw).status_code in (400, 413)
    else:
        assert_error(post_raw(http, "completions", raw), 400, code="invalid_json")
    assert_healthy(server, http)


def test_max_tokens_beyond_the_context_is_clipped_to_it(http):
    # as vLLM 0.3x: the output ends with finish_reason "length" when the context is full
    for max_tokens in (254, 2**31 - 1, 10**22):
        reply = http.post("/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": max_tokens,
                                                   "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 3
        assert reply.json()["choices"][0]["finish_reason"] == "length"
    error = assert_error(http.post("/v1/completions", json={"prompt": " ".join(["w5"] * MAX_MODEL_LEN)}),
                         400, "prompt")
    assert str(MAX_MODEL_LEN) in error["message"] and "no room" in error["message"]


# ---------------------------------------------------------------- OpenAI conventions


@pytest.mark.parametrize("path,body", [("completions", {"prompt": "w5"}),
                                       ("chat/completions", {"messages": [{"role": "user", "content": "w5"}]})])
def test_an_unknown_model_is_a_404(http, path, body):
    assert_error(http.post(f"/v1/{path}", json={**body, "model": "gpt-4"}), 404, "model", "model_not_found")


def test_unknown_paths_and_methods_get_json_errors(server, http):
    assert_error(http.get("/v1/nowhere"), 404, code="not_found")
    assert_error(httpx.get(f"{server.url}/nowhere"), 404, code="not_found")
    assert_error(http.get("/v1/completions"), 405)


# ---------------------------------------------------------------- slow clients and the API key


def test_half_sent_requests_are_timed_out(server, http):
    connections = []
    for i in range(50):
        sock = socket.create_connection(urlparts(server.url))
        sock.settimeout(10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")  # half the headers, or none
        connections.append(sock)
    for i, sock in enumerate(connections):
        with sock:
            answer = read_response(sock)  # "" once the server closes the connection
            assert answer.startswith(b"HTTP/1.1 408 ") if i % 2 else answer == b"", answer[:100]
    assert_healthy(server, http)


def test_a_body_sent_too_slowly_is_a_408(server):
    with socket.create_connection(urlparts(server.url)) as sock:
        sock.settimeout(10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n".encode() + b'{"prompt"')
        assert read_response(sock).startswith(b"HTTP/1.1 408 ")


def test_the_key_from_a_file_is_enforced(server):
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "w5"}).status_code == 401


@pytest.mark.parametrize("argv,environ", [([], {"SERVELAB_API_KEY": ""}), (["--api-key", " "], {})],
                         ids=["environment", "flag"])
def test_an_empty_api_key_is_refused_before_the_model_loads(argv, environ):
    command = [sys.executable, "-m", "servelab.cli", "serve", "--model", "nowhere", "--port", "0", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                            env={**_inherited_environment(), **environ})
    assert result.returncode == 2, result.stderr
    assert "API key" in result.stderr and "empty" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------- fuzzing

FIELDS = ("prompt", "messages", "model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
          "stop", "stop_token_ids", "ignore_eos", "stream", "return_token_ids", "logprobs", "best_of")
SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.lists(st.one_of(st.sampled_from(["w5 ", "w17 ", " "]), st.characters(), SURROGATES),
                max_size=12).map("".join)
EXTREME_INTS = st.one_of(st.integers(-3, 300), st.sampled_from([2**31, 2**63, 2**64 - 1, 2**64, -(2**63) - 1,
                                                                 10**30]))
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, 1e-308, -0.0])
SCALARS = st.one_of(st.none(), st.booleans(), EXTREME_INTS, FLOATS, TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                      max_leaves=6)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "wizard"]),
                                           "content": st.one_of(TEXT, VALUES)}), max_size=3)
SMALL = {"max_tokens": st.one_of(st.integers(-1, 4), EXTREME_INTS, VALUES), "n": st.one_of(st.integers(0, 3), VALUES),
         "prompt": st.one_of(TEXT, st.lists(EXTREME_INTS, max_size=4), VALUES), "messages": MESSAGES}


@st.composite
def bodies(draw):
    """A request body: chosen fields with extreme or wrongly typed values, sometimes nested deep."""
    fields = draw(st.lists(st.sampled_from(FIELDS), max_size=8, unique=True))
    body = {field: draw(SMALL.get(field, st.one_of(EXTREME_INTS, FLOATS, VALUES))) for field in fields}
    if draw(st.integers(0, 9)) == 0:
        depth = draw(st.integers(1, 300))
        body["user"] = json.loads("[" * depth + "]" * depth)
    if body.get("max_tokens") not in range(-1, 5):
        body["max_tokens"] = draw(st.integers(1, 4))  # valid requests stay short
    return body


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from(["completions", "chat/completions"]), body=bodies())
def test_fuzzed_bodies_get_no_5xx_and_leave_the_server_healthy(server, http, path, body):
    raw = json.dumps(body, allow_nan=True).encode()
    response = post_raw(http, path, raw)
    assert response.status_code < 500, (response.status_code, response.text[:500], raw[:300])
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_no_kv_block_is_held_after_the_fuzzing(server, http):
    assert_healthy(server, http)
    server.wait_metrics(lambda m: m[USED] == 0 and m["servelab_requests_running"] == 0, timeout=5)


# ---------------------------------------------------------------- helpers


def urlparts(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def read_response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the socket's timeout)."""
    received = b""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    return received


def _inherited_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "SERVELAB_API_KEY"}
