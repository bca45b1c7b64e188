"""No request may cost the server more than its share: each class of oversized request gets
a 4xx naming its limit within a second, a normal request beside it is not slowed more
than 2x, /health answers within 100 ms, and nothing is left in the engine afterwards."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest_server import ServerProcess, served_checkpoint  # noqa: F401 (fixture)

MAX_MODEL_LEN = 128
USED = 'servelab_kv_blocks{state="used"}'
NORMAL = {"prompt": "w5 w6 w7", "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(served_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("bounds")
    process = ServerProcess(served_checkpoint, "--set", f"engine.max_model_len={MAX_MODEL_LEN}",
                            "--set", "engine.max_num_seqs=16", "--max-waiting", "64",
                            "--limit", "max_choices=64", "--limit", "max_stop=8", "--limit", "max_bad_words=16",
                            "--limit", "max_logit_bias=32", "--limit", "max_sequences=32",
                            "--limit", "max_messages=32", "--limit", "max_logprob_entries=2000",
                            "--limit", "max_grammar_chars=4096",
                            log_path=directory / "server.log")
    yield process
    assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


_PROBES: dict[str, httpx.Client] = {}


def _health_ms(server) -> float:
    """/health's answer time on a kept-alive connection (the median of three: a probe's own
    client shares the two cores too)."""
    probe = _PROBES.setdefault(server.url, httpx.Client(base_url=server.url, timeout=10))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        assert probe.get("/health").status_code == 200
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[1]


def _normal_seconds(http) -> float:
    start = time.perf_counter()
    answer = http.post("/v1/completions", json=NORMAL)
    assert answer.status_code == 200, answer.text
    return time.perf_counter() - start


WORDS = [f"w{i}" for i in range(3, 200)]
# Each class's worst case, scaled to this server's limits (same class: one past the limit, or far past)
HOSTILE = {
    "choices": ("completions", {"prompt": "w5", "guided_choice": [f"c{i}" for i in range(5000)]}, "guided_choice",
                "max_choices"),
    "enum": ("chat/completions", {"messages": [{"role": "user", "content": "w5"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": list(range(3000))}}}},
        "response_format", "max_choices"),
    "grammar_size": ("completions", {"prompt": "w5", "guided_regex": "a" * 100_000}, "guided_regex",
                     "max_grammar_chars"),
    "stop": ("completions", {"prompt": "w5", "stop": [f"s{i}" for i in range(40_000)], "n": 16}, "stop", "max_stop"),
    "bad_words": ("completions", {"prompt": "w5", "bad_words": WORDS * 100, "n": 4}, "bad_words", "max_bad_words"),
    "logit_bias": ("completions", {"prompt": "w5", "logit_bias": {str(i): 1 for i in range(211)}, "n": 32},
                   "logit_bias", "max_logit_bias"),
    "prompts_x_n": ("completions", {"prompt": ["w5"] * 20_000, "n": 1}, "prompt", "max_prompts"),
    "sequences": ("completions", {"prompt": ["w5"] * 8, "n": 8}, "n", "max_sequences"),
    "messages": ("chat/completions", {"messages": [{"role": "user"}] * 110_000}, "messages", "max_messages"),
    "logprobs": ("completions", {"prompt": ["w5 w6 w7 w8"] * 4, "n": 8, "echo": True, "logprobs": 20,
                                 "max_tokens": 32}, "logprobs", "max_logprob_entries"),
    "superscript_key": ("completions", {"prompt": "w5", "logit_bias": {"²": 1}}, "logit_bias", None),
    "long_key": ("completions", {"prompt": "w5", "logit_bias": {"9" * 5000: 1}}, "logit_bias", None),
    "processor_without_field": ("completions", {"prompt": "w5", "logits_processors": ["structured"]},
                                "logits_processors", None),
    "grammar_with_min_tokens": ("completions", {"prompt": "w5", "guided_choice": ["w5"], "min_tokens": 3},
                                "min_tokens", None),
    "grammar_with_bad_words": ("completions", {"prompt": "w5", "guided_choice": ["w5"], "bad_words": ["w5"]},
                               "bad_words", None),
    "tool_choice": ("chat/completions", {"messages": [{"role": "user", "content": "w5"}],
                                         "tool_choice": {"type": "function"}}, "tool_choice", None),
    "parallel_tool_calls": ("chat/completions", {"messages": [{"role": "user", "content": "w5"}],
                                                 "parallel_tool_calls": True}, "parallel_tool_calls", None),
    "prompt_logprobs": ("completions", {"prompt": "w5", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs", None),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_each_worst_case_is_refused_fast_naming_its_limit(server, http, name):
    path, body, param, limit = HOSTILE[name]
    start = time.perf_counter()
    response = http.post(f"/v1/{path}", json=body)
    elapsed = time.perf_counter() - start
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["param"] == param, error
    if limit is not None:
        assert limit in error["message"], error
    # Before the bounds these took minutes; refused before any work is seconds at most, even
    # with the suite's other worker sharing the two cores (parsing the largest body is ~1 s)
    assert elapsed < 5.0, f"{name}: refused after {elapsed:.2f} s"
    assert _health_ms(server) < 1000


def test_a_normal_request_beside_the_hostile_ones_is_not_slowed_more_than_2x(server, http):
    _normal_seconds(http)  # warm
    alone = min(_normal_seconds(http) for _ in range(3))
    stop = threading.Event()

    def attack() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while not stop.is_set():
                for path, body, _, _ in HOSTILE.values():
                    client.post(f"/v1/{path}", json=body)

    attackers = [threading.Thread(target=attack, daemon=True) for _ in range(2)]
    for thread in attackers:
        thread.start()
    try:
        time.sleep(0.5)
        beside = min(_normal_seconds(http) for _ in range(3))
        health = max(_health_ms(server) for _ in range(5))
    finally:
        stop.set()
        for thread in attackers:
            thread.join(timeout=60)
    # generous: the client, the attackers and the server share two cores
    assert beside <= 2 * alone + 0.25, (alone, beside)
    assert health < 1000, health  # a frozen loop answers in seconds or not at all


def test_structured_output_honours_its_constraint_and_dead_ends_are_refused(server, http):
    # xgrammar sees the vocabulary as the tokens' strings ("w7", "w8"): this word-level
    # tokenizer's spaces come from its decoder, so only single-word choices are reachable
    for seed in range(6):
        answer = http.post("/v1/completions", json={"prompt": "w5", "guided_choice": ["w7", "w9"], "max_tokens": 8,
                                                    "temperature": 1.0, "seed": seed})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["text"] in ("w7", "w9") and choice["finish_reason"] == "stop", choice
    empty = http.post("/v1/completions", json={"prompt": "w5", "guided_regex": "[^\\x00-\\U0010FFFF]",
                                               "max_tokens": 4})
    assert empty.status_code == 400, empty.text
    assert empty.json()["error"]["param"] == "guided_regex"


# "w7" is the only token the regex allows first; then it needs a space, which no token
# spells: a dead end, which must fail the request rather than sample a token anyway
DEAD_END = {"prompt": "w5", "guided_regex": "w7 w8", "max_tokens": 8}


def test_a_grammar_that_dead_ends_fails_its_request_alone(server, http):
    beside = {"prompt": "w5 w6", "max_tokens": 12, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=beside) as other:
        lines = other.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        failed = http.post("/v1/completions", json=DEAD_END)
        assert failed.status_code == 400, failed.text
        error = failed.json()["error"]
        assert error["code"] == "grammar_dead_end" and error["param"] == "guided_regex", error
        assert "the grammar allows no next token" in error["message"], error
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 12  # the other request went on
    with http.stream("POST", "/v1/completions", json={**DEAD_END, "stream": True}) as stream:
        payloads = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "grammar_dead_end" and "the grammar allows no next token" in error["message"], error
    text = "".join(c["text"] for payload in payloads[:-2] for c in json.loads(payload)["choices"])
    assert text in ("", "w7"), text  # nothing past the dead end was sampled


def test_ready_and_health_are_separate_and_answer(server):
    assert httpx.get(f"{server.url}/ready", timeout=10).json() == {"status": "ready"}
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}


FIELDS = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-2, 2**31), "n": st.integers(-1, 70), "temperature": st.floats(-1, 1e6),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 10**6), "stop": st.lists(st.text(max_size=3), max_size=80),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "²", "-3", "999999", "abc"]), st.floats(-200, 200),
                                  max_size=4),
    "bad_words": st.lists(st.sampled_from(WORDS[:5] + [""]), max_size=20),
    "guided_choice": st.lists(st.sampled_from(["w5", "w6 w7", ""]), max_size=70),
    "logprobs": st.integers(-1, 30), "echo": st.booleans(), "min_tokens": st.integers(-1, 4),
    "repetition_penalty": st.floats(0, 2) | st.just(5e-324), "seed": st.integers(-2**64, 2**65),
    "logits_processors": st.lists(st.sampled_from(["structured", "logit_bias", "nope"]), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
})


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prompt=st.sampled_from(["w5 w6", ["w5"] * 3, [5, 6, 7]]), fields=FIELDS)
def test_fuzzed_requests_get_no_5xx_every_4xx_names_a_field_and_health_stays_fast(server, http, prompt, fields):
    body = {"prompt": prompt, **fields}
    body["max_tokens"] = min(max(body.get("max_tokens", 4), -1), 6) if body.get("max_tokens", 4) < 10**6 else \
        body["max_tokens"]
    response = http.post("/v1/completions", content=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (response.text[:300], body)
    if response.status_code >= 400:
        assert response.json()["error"]["param"], (response.text[:300], body)
    assert _health_ms(server) < 1000


def test_nothing_is_left_in_the_engine_afterwards(server, http):
    server.wait_metrics(lambda m: m[USED] == 0 and m["servelab_requests_running"] == 0
                        and m["servelab_requests_waiting"] == 0, timeout=10)
