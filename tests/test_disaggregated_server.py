"""A disaggregated server on a real local Ray (`servelab serve --prefill-replicas 1
--decode-replicas 1`, builtin:tiny, the shared-files transport): completions and chat,
streamed or not, token-identical to one colocated engine; every request kind (n > 1,
penalties, logit bias, min_tokens, bad words, structured output, logits processors, prompt
logprobs, a LoRA adapter) served as one colocated engine serves it; a client abort
mid-stream leaves no KV block held on either replica; a request an engine refuses is a 400
naming the problem, the requests beside it served and both replicas up; both
replicas throttled (slow, inside their timeouts): the same completions, nothing recomputed;
the prefill replica's process killed mid-stream: every request ends within a bound with its
recomputed completion, and no replica left holds a block; and stopped (SIGSTOP): the
watchdog kills it and the request waiting on it is recomputed; the decode replica's process
killed or stopped: its stream ends with an error naming it and the server exits 1."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import httpx
import pytest

from conftest_server import ServerProcess, Throttle, sse_events

ray = pytest.importorskip("ray", reason="the disaggregated server tests need Ray: pip install 'servelab[ray]'")

MODEL = "builtin:tiny"
ADAPTER = "tiny-lora"  # a LoRA adapter of MODEL the deployment loads at run time
SETTINGS = ("--set", "engine.max_model_len=256", "--set", "engine.max_num_seqs=8", "--engine-threads", "1")
# most of them longer than a block (16 tokens), so KV blocks are handed over; the last is shorter than one
PROMPTS = [" ".join([p] * 6) for p in ("Once upon a time", "The cat sat", "In the beginning", "def add(a, b):")] + \
    ["Hello there"]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def _prefilled(transfer_id: str, handoff):
    """A prefill replica's output for a request it handed on: the first token, no logprobs."""
    from servelab.outputs import CompletionOutput, RequestMetrics, RequestOutput

    return RequestOutput(transfer_id, None, list(handoff.prompt_token_ids),
                         [CompletionOutput(0, [handoff.first_token_id], "", "length")],
                         RequestMetrics(0.0, None, None, 0.0))


def _role_pids(server: ServerProcess) -> dict[str, int]:
    """Each replica's process id, by name ("prefill-0", "decode-0")."""
    return {name: int(pid) for pid, name in re.findall(r"replica\.started\s.*?pid=(\d+) replica=(\S+)", server.log())}


def _transfer_faults(metrics: dict[str, float]) -> dict[str, float]:
    """Every replica's counts of what went wrong with handoffs."""
    faults = ("recomputes", "rejects", "leases_expired", "failures")
    return {name: value for name, value in metrics.items()
            if any(name.startswith(f"servelab_kv_transfer_{fault}_total") for fault in faults)}


def _used(metrics: dict[str, float], replica: str) -> float:
    return metrics[f'servelab_replica_kv_blocks_used{{replica="{replica}"}}']


def _idle(metrics: dict[str, float]) -> bool:
    """No KV block held on either live replica, no hold for a transfer."""
    return (_used(metrics, "decode-0") == 0 and metrics['servelab_kv_blocks{state="used"}'] == 0
            and metrics['servelab_kv_transfer_held_blocks{replica="prefill-0",role="prefill"}'] == 0)


def _colocated():
    """One colocated engine's greedy tokens for each prompt, 12 of them, and 40 (200 for the
    first) with their text; and the engine (serving LoRA adapters too: the base model's
    numbers are the same)."""
    from servelab import LLM, SamplingParams

    llm = LLM(MODEL, max_model_len=256, enable_lora=True)
    short = [list(o.outputs[0].token_ids) for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    longer = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))]
    [longest] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    longer[0] = (list(longest.outputs[0].token_ids), longest.outputs[0].text)  # the stream decoding at the kill
    return llm, short, longer


def _adapter(folder) -> str | None:
    """A LoRA adapter of MODEL, for the deployment to load as ADAPTER (None without peft)."""
    from lora_adapters import build_adapter
    from servelab.model.loader import resolve_model

    try:
        return build_adapter(str(resolve_model(MODEL)), folder / "adapter", r=4, seed=21, scale=0.3)
    except ImportError:  # peft is not installed
        return None


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """The 1P1D server (started while the colocated answers are computed and a LoRA adapter
    built), those answers and the adapter's path."""
    folder = tmp_path_factory.mktemp("pd")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(ServerProcess, MODEL, "--prefill-replicas", "1", "--decode-replicas", "1",
                               "--kv-lease-s", "5", "--set", 'kv_transfer.name="shared-files"',
                               "--set", f'kv_transfer.path="{folder / "kv"}"', "--allow-runtime-lora-updating",
                               *SETTINGS, log_path=folder / "log")
        try:
            answers = _colocated()
            adapter = _adapter(folder)
        finally:
            process = starting.result()
    yield process, answers, adapter
    answers[0].close()
    code = process.terminate(60)
    if not getattr(process, "failed_by_test", False):  # the killed decode replica's test ends the deployment
        assert code == 0, process.log_path.read_text()
        assert "kv_blocks_used=0" in process.log_path.read_text()


@pytest.fixture(scope="module")
def server(deployment):
    return deployment[0]


@pytest.fixture(scope="module")
def expected(deployment):
    return deployment[1]


@pytest.fixture(scope="module")
def served_adapter(deployment):
    """The path of the LoRA adapter the deployment serves as ADAPTER (None: none, no peft)."""
    return deployment[2]


def test_completions_streamed_or_not_match_one_colocated_engine(server, expected):
    _, short, _ = expected

    def ask(prompt: str) -> tuple[list[int], list[int], str]:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"prompt": prompt, "max_tokens": 12, **GREEDY}
            whole = client.post("/v1/completions", json=body)
            assert whole.status_code == 200, whole.text
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                events = list(sse_events(response))
        assert events[-1] == "[DONE]"
        choice = whole.json()["choices"][0]
        streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert streamed == choice["text"]
        return choice["token_ids"], [], streamed

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrently: batched on both replicas
        answers = list(pool.map(ask, PROMPTS))
    assert [tokens for tokens, _, _ in answers] == short
    metrics = server.wait_metrics(_idle, timeout=10)
    # every prompt but the short last one moved its full blocks; nothing was recomputed or rejected
    assert metrics['servelab_kv_transfers_total{replica="decode-0",role="decode"}'] >= 2 * (len(PROMPTS) - 1)
    assert metrics['servelab_kv_transfer_bytes_total{replica="decode-0",role="decode"}'] > 0
    assert metrics['servelab_kv_transfer_recomputes_total{replica="decode-0",role="decode"}'] == 0
    assert metrics['servelab_kv_transfer_rejects_total{replica="decode-0",role="decode"}'] == 0
    assert metrics['servelab_replica_generation_tokens_total{replica="prefill-0"}'] == 2 * len(PROMPTS)


def test_chat_streamed_or_not_matches_one_colocated_engine(server, expected):
    from servelab import SamplingParams

    llm, _, _ = expected
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 12, **GREEDY}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            events = list(sse_events(response))
    [colocated] = llm.generate([choice["prompt_token_ids"]], SamplingParams(max_tokens=12, temperature=0.0,
                                                                            ignore_eos=True))
    assert choice["token_ids"] == list(colocated.outputs[0].token_ids)
    assert len(choice["prompt_token_ids"]) > 16  # a block or more handed over
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert events[-1] == "[DONE]" and streamed == choice["message"]["content"]


def test_seeded_sampling_matches_one_colocated_engine(server, expected):
    """The first token is sampled on the prefill replica, the rest on the decode replica from
    the generator state the handoff carries: the same tokens as one engine draws."""
    from servelab import SamplingParams

    llm, _, _ = expected
    seeds = range(7, 7 + len(PROMPTS))
    colocated = [list(o.outputs[0].token_ids) for o in llm.generate(
        PROMPTS, [SamplingParams(max_tokens=16, temperature=0.8, seed=seed) for seed in seeds])]

    def ask(prompt_and_seed) -> list[int]:
        prompt, seed = prompt_and_seed
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 16, "temperature": 0.8, "seed": seed, "return_token_ids": True})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(ask, zip(PROMPTS, seeds))) == colocated


def test_a_request_its_first_token_ends_is_answered_by_the_prefill_replica(server, expected):
    _, short, _ = expected
    before = server.metrics()['servelab_kv_transfers_total{replica="prefill-0",role="prefill"}']
    with httpx.Client(base_url=server.url, timeout=60) as client:
        reply = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1, **GREEDY})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == short[0][:1]
    metrics = server.wait_metrics(_idle, timeout=10)
    assert metrics['servelab_kv_transfers_total{replica="prefill-0",role="prefill"}'] == before  # nothing moved


def test_stop_strings_across_the_handoff_end_as_on_one_engine(server, expected):
    """A stop string that begins in the prefill replica's first token and ends in the decode
    replica's tokens: the answer, streamed or not, is one colocated engine's."""
    from servelab import SamplingParams

    llm, _, longer = expected
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for prompt, (tokens, text) in zip(PROMPTS[:4], longer[:4]):
            k = len(llm.engine.tokenizer.decode(tokens[:1]))
            stop = text[max(k - 1, 0): k + 2]
            [want] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                           stop=[stop]))
            body = {"prompt": prompt, "max_tokens": 12, "stop": [stop], **GREEDY}
            whole = client.post("/v1/completions", json=body)
            assert whole.status_code == 200, whole.text
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                events = list(sse_events(response))
            choice = whole.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == \
                (want.outputs[0].text, "stop", want.outputs[0].stop_reason), stop
            assert choice["token_ids"] == list(want.outputs[0].token_ids)
            assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == choice["text"]
    server.wait_metrics(_idle, timeout=10)


def test_logprobs_streamed_or_not_are_one_engine_s(server, expected):
    """logprobs=2: the first position scored on the prefill replica, the rest on the decode
    replica; streamed or not, one colocated engine's."""
    from servelab import SamplingParams

    llm = expected[0]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for prompt in PROMPTS[:2]:
            [want] = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2))
            body = {"prompt": prompt, "max_tokens": 8, "logprobs": 2, **GREEDY}
            whole = client.post("/v1/completions", json=body)
            assert whole.status_code == 200, whole.text
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                events = list(sse_events(response))
            scores = whole.json()["choices"][0]["logprobs"]
            served = [position[token].logprob for position, token in zip(want.outputs[0].logprobs, want.token_ids)]
            assert scores["token_logprobs"] == pytest.approx(served, abs=1e-4)
            assert all(len(top) == 2 or len(top) == 3 for top in scores["top_logprobs"])
            streamed = [value for e in events[:-1] if e["choices"] and e["choices"][0]["logprobs"]
                        for value in e["choices"][0]["logprobs"]["token_logprobs"]]
            assert streamed == pytest.approx(scores["token_logprobs"], abs=1e-6)
    server.wait_metrics(_idle, timeout=10)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}


def _kind(name: str, short: list[list[int]]) -> tuple[dict, dict, dict]:
    """A request kind: the fields its body and its SamplingParams share, then the body's
    own and SamplingParams' own (the same request in the API's words and the engine's)."""
    from servelab import StructuredOutput

    banned, stop = short[0][1], short[0][2]  # the decode replica's first token; its second
    return {
        "n_seeded": ({"n": 2, "temperature": 0.8, "seed": 3}, {}, {}),
        "penalties_seeded": ({"temperature": 0.8, "seed": 5, "presence_penalty": 0.8, "frequency_penalty": 0.6,
                              "repetition_penalty": 1.3}, {}, {}),
        "bias_min_tokens_bad_words": ({"temperature": 0.0, "min_tokens": 2, "stop_token_ids": [stop],
                                       "bad_words": ["time"]},
                                      {"logit_bias": {str(banned): -100}}, {"logit_bias": {banned: -100}}),
        "structured_json": ({"temperature": 0.0, "max_tokens": 24, "ignore_eos": False},
                            {"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "n", "schema": SCHEMA}}},
                            {"structured": StructuredOutput.json(SCHEMA)}),
        "logits_processor": ({"temperature": 0.0, "logits_processors": ["no-repeat-ngram"],
                              "extra_args": {"no_repeat_ngram_size": 2}}, {}, {}),
        "lora_adapter": ({"temperature": 0.0}, {"model": ADAPTER}, {}),
    }[name]


def _choices(client: httpx.Client, body: dict) -> tuple[list[tuple[list[int], str, str]], dict[int, str]]:
    """(token ids, text, finish reason) of each choice, answered whole, and each choice's
    text streamed."""
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = list(sse_events(response))
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events[-2:]
    streamed: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    return [(c["token_ids"], c["text"], c["finish_reason"]) for c in whole.json()["choices"]], streamed


@pytest.mark.parametrize("kind", ["n_seeded", "penalties_seeded", "bias_min_tokens_bad_words", "structured_json",
                                  "logits_processor", "lora_adapter"])
def test_every_request_kind_is_served_as_one_colocated_engine_serves_it(server, expected, served_adapter, kind):
    """n > 1 (n handoffs, choice i seeded seed + i), penalties, logit bias, min_tokens, bad
    words, structured output, a logits processor and a LoRA adapter, streamed or not: one
    colocated engine's choices, and no block left held."""
    from servelab import LoRARequest, SamplingParams

    llm, short, _ = expected
    shared, fields, params = _kind(kind, short)
    lora = None
    if kind == "lora_adapter":
        if served_adapter is None:
            pytest.skip("LoRA adapters need peft: pip install peft")
        lora = LoRARequest(ADAPTER, 1, served_adapter)
    [want] = llm.generate([PROMPTS[0]], SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **shared, **params}),
                          lora_request=lora)
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "ignore_eos": True, "return_token_ids": True, **shared, **fields}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        if lora is not None:  # both replicas load it by name with the request
            loaded = client.post("/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": served_adapter})
            assert loaded.status_code == 200, loaded.text
        choices, streamed = _choices(client, body)
    assert choices == [(c.token_ids, c.text, c.finish_reason) for c in want.outputs]
    assert streamed == {i: text for i, (_, text, _) in enumerate(choices)}
    if lora is not None:
        assert choices[0][0] != short[0]  # the adapter applied
    server.wait_metrics(_idle, timeout=10)


def test_prompt_logprobs_come_from_the_prefill_replica_whole_or_echoed_in_a_stream(server, expected):
    """prompt_logprobs (answered whole) and echo with logprobs (streamed, the prompt's
    scores in the first chunk): the prefill replica scores the prompt, as one colocated
    engine does, to 1e-4."""
    from servelab import SamplingParams

    llm = expected[0]
    [want] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                       prompt_logprobs=2))
    scores = [None] + [position[token].logprob for position, token in
                       zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])]
    body = {"prompt": PROMPTS[0], "max_tokens": 4, **GREEDY}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        whole = client.post("/v1/completions", json={**body, "prompt_logprobs": 2})
        assert whole.status_code == 200, whole.text
        choice = whole.json()["choices"][0]
        with client.stream("POST", "/v1/completions", json={**body, "echo": True, "logprobs": 1,
                                                            "stream": True}) as response:
            events = list(sse_events(response))
    served = [None if p is None else p[str(t)]["logprob"] for p, t in zip(choice["prompt_logprobs"],
                                                                            want.prompt_token_ids)]
    assert served[0] is None and served[1:] == pytest.approx(scores[1:], abs=1e-4)
    assert choice["token_ids"] == list(want.token_ids)
    echoed = events[0]["choices"][0]
    assert echoed["text"] == PROMPTS[0] and echoed["logprobs"]["token_logprobs"][0] is None
    assert echoed["logprobs"]["token_logprobs"][1:] == pytest.approx(scores[1:], abs=1e-4)
    server.wait_metrics(_idle, timeout=10)


def test_a_client_abort_mid_stream_frees_both_replicas(server):
    before = server.metrics().get('servelab_requests_finished_total{finish_reason="abort"}', 0.0)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"prompt": PROMPTS[1], "max_tokens": 200, "stream": True, **GREEDY}
        with client.stream("POST", "/v1/completions", json=body) as response:
            stream = sse_events(response)
            next(stream), next(stream), next(stream)  # the first token from P, then D's; leaving hangs up
    server.wait_metrics(lambda m: m.get('servelab_requests_finished_total{finish_reason="abort"}') == before + 1
                        and _idle(m), timeout=10)


REFUSED = {"JSON schema is invalid": {"response_format": {"type": "json_schema", "json_schema": {
               "name": "n", "schema": {"type": "nonsense"}}}},
           "regex is invalid": {"structured_outputs": {"regex": "((("}}}  # bad input only an engine finds


def _refusal(client: httpx.Client, fields: dict) -> tuple[int, str]:
    reply = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.0,
                                                 **fields})
    return reply.status_code, reply.json()["error"]["message"] if reply.status_code != 200 else reply.text


def test_a_request_a_replica_refuses_is_a_400_naming_it_and_the_others_are_served(server, expected):
    """Requests the prefill replica's engine refuses (a JSON schema it cannot compile, a regex
    that does not parse), sent while others are in flight: each a 400 naming the problem;
    the others one colocated engine's tokens, both replicas up, no block left held."""
    _, short, _ = expected

    def ask(prompt: str) -> list[int]:
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, **GREEDY},
                           timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    with httpx.Client(base_url=server.url, timeout=60) as client, \
            concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = [pool.submit(ask, prompt) for prompt in PROMPTS]
        refusals = [_refusal(client, fields) for fields in REFUSED.values()]
        assert [answer.result() for answer in answers] == short
    for reason, (status, message) in zip(REFUSED, refusals):
        assert status == 400 and reason in message, (status, message)
    metrics = server.wait_metrics(_idle, timeout=10)
    assert metrics['servelab_replica_up{replica="prefill-0"}'] == 1
    assert metrics['servelab_replica_up{replica="decode-0"}'] == 1


def test_slow_prefill_and_decode_replicas_answer_as_one_engine_and_nothing_fails_over(server, expected):
    """Both replicas throttled at once (each stopped 0.2 s at a time, inside the lease and
    the liveness timeout): every completion is one colocated engine's, no handoff is
    recomputed, rejected or lapsed, both stay up, and no block is left held."""
    _, short, _ = expected
    pids = _role_pids(server)
    before = server.wait_metrics(_idle, timeout=10)

    def ask(prompt: str) -> list[int]:
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, **GREEDY},
                           timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    with Throttle(pids["prefill-0"], stopped_s=0.2, running_s=0.03) as prefill, \
            Throttle(pids["decode-0"], stopped_s=0.2, running_s=0.03) as decode, \
            concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    assert answers == short
    assert prefill.stops >= 2 and decode.stops >= 2, (prefill.stops, decode.stops)
    metrics = server.wait_metrics(_idle, timeout=10)
    assert _transfer_faults(metrics) == _transfer_faults(before)
    assert metrics['servelab_replica_up{replica="prefill-0"}'] == 1
    assert metrics['servelab_replica_up{replica="decode-0"}'] == 1
    assert metrics['servelab_kv_transfers_total{replica="decode-0",role="decode"}'] > \
        before['servelab_kv_transfers_total{replica="decode-0",role="decode"}']  # handed over, not recomputed


def test_a_killed_prefill_replica_ends_each_request_within_the_bound_and_leaks_nothing(server, expected):
    """SIGKILL of the prefill replica's process while one stream decodes on the decode
    replica and others wait on the prefill replica: the handed-on stream completes, the others are
    recomputed on the decode replica (the failure policy), each within the bound; the
    decode replica holds no block afterwards, and the server keeps answering."""
    _, _, longer = expected
    found = re.findall(r"replica\.started\s.*?pid=(\d+) replica=prefill-0", server.log())
    assert found, server.log()
    pid = int(found[0])
    body = {"max_tokens": 40, "stream": True, **GREEDY}

    def stream(prompt: str) -> list:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as response:
                return list(sse_events(response))

    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=60) as client, \
            concurrent.futures.ThreadPoolExecutor(len(PROMPTS) - 1) as pool:
        with client.stream("POST", "/v1/completions", json={**body, "prompt": PROMPTS[0], "max_tokens": 200}) as first:
            events = sse_events(first)
            head = [next(events), next(events)]  # it decodes on the decode replica
            routed = server.metrics()['servelab_replica_requests_routed_total{replica="prefill-0"}']
            os.kill(pid, signal.SIGSTOP)  # so that the others are surely on it, not prefilled, when it dies
            others = [pool.submit(stream, prompt) for prompt in PROMPTS[1:]]
            server.wait_metrics(lambda m: m['servelab_replica_requests_routed_total{replica="prefill-0"}']
                                == routed + len(others), timeout=10)
            os.kill(pid, signal.SIGKILL)
            head += list(events)
        endings = [head] + [future.result(timeout=60) for future in others]
    waited = time.monotonic() - started
    assert waited < 30, waited  # within the lease (5 s) and a margin, not a client's timeout
    for events, (_, text) in zip(endings, longer):
        assert events[-1] == "[DONE]"
        assert "error" not in events[-2], events[-2]  # failure policy recompute: every request answered
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == text
    metrics = server.wait_metrics(lambda m: m['servelab_replica_up{replica="prefill-0"}'] == 0, timeout=10)
    assert metrics['servelab_kv_transfer_recomputes_total{replica="decode-0",role="decode"}'] == len(others)
    server.wait_metrics(lambda m: _used(m, "decode-0") == 0 and m['servelab_kv_blocks{state="used"}'] == 0,
                        timeout=10)
    log = server.log()
    assert "disagg.replica_died" in log and log.count("kv_transfer.prefill_lost") == len(others)
    with httpx.Client(base_url=server.url, timeout=60) as client:  # served whole on the decode replica now
        for reason, fields in REFUSED.items():  # which refuses bad input by name, as the prefill replica did
            status, message = _refusal(client, fields)
            assert status == 400 and reason in message, (status, message)
        reply = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 40, **GREEDY})
        assert reply.status_code == 200 and reply.json()["choices"][0]["token_ids"] == longer[2][0]
        assert client.get("/health").status_code == 200


def test_a_killed_decode_replica_fails_its_stream_by_name_and_the_server_exits_1(server):
    """SIGKILL of the last decode replica's process while a stream decodes on it (this
    module's last test on its server): the stream ends with an error naming the replica,
    then [DONE]; with no decode replica left the deployment has failed, as one engine's
    death does: exit code 1."""
    pid = _role_pids(server)["decode-0"]
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "stream": True, **GREEDY}
    server.failed_by_test = True
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            events = sse_events(response)
            next(events), next(events)  # it decodes on decode-0
            os.kill(pid, signal.SIGKILL)
            rest = list(events)
    assert rest[-1] == "[DONE]" and "decode replica decode-0 died" in rest[-2]["error"]["message"], rest[-3:]
    assert server.process.wait(30) == 1, server.log()
    assert "every decode replica has failed" in server.log()


@pytest.fixture(scope="module")
def watched_server(tmp_path_factory):
    """A 1P1D server with a short liveness timeout, whose watchdog kills a stopped replica
    (its tests stop one replica, then the other)."""
    folder = tmp_path_factory.mktemp("watched")
    process = ServerProcess(MODEL, "--prefill-replicas", "1", "--decode-replicas", "1", "--liveness-timeout", "2",
                            "--set", 'kv_transfer.name="shared-files"', "--set", f'kv_transfer.path="{folder / "kv"}"',
                            *SETTINGS, log_path=folder / "log")
    pids = _role_pids(process)
    yield process
    for pid in pids.values():  # a replica a failed test left stopped
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.terminate(60)


def test_a_stopped_prefill_replica_is_killed_by_the_watchdog_and_its_request_answered(watched_server, expected):
    """SIGSTOP of the prefill replica's process (silent, not dead) on a server with a short
    liveness timeout: a request waiting on it is recomputed on the decode replica and
    answered as one engine answers it, within the timeout and a margin; the stopped replica
    is killed (up 0), /health stays 200, and the decode replica holds no block."""
    _, _, longer = expected
    server = watched_server
    pid = _role_pids(server)["prefill-0"]
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        reply = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 40, **GREEDY})
        assert reply.status_code == 200 and reply.json()["choices"][0]["token_ids"] == longer[1][0]
        assert time.monotonic() - started < 20
        assert client.get("/health").status_code == 200
    metrics = server.wait_metrics(lambda m: m['servelab_replica_up{replica="prefill-0"}'] == 0, timeout=10)
    assert metrics['servelab_kv_transfer_recomputes_total{replica="decode-0",role="decode"}'] == 1
    server.wait_metrics(lambda m: _used(m, "decode-0") == 0, timeout=10)
    assert "disagg.replica_silent" in server.log()


def test_a_stopped_decode_replica_is_killed_by_the_watchdog_and_its_stream_ends_by_name(watched_server):
    """SIGSTOP of the (last) decode replica's process while a stream decodes on it: within
    the liveness timeout and a margin, not a client's timeout, the watchdog kills it, the
    stream ends with an error naming it, then [DONE], and with no decode replica left the
    server exits with code 1, its shutdown not held by the stopped or dead replicas."""
    server = watched_server
    pid = _role_pids(server)["decode-0"]
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "stream": True, **GREEDY}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            events = sse_events(response)
            next(events), next(events)  # it decodes on decode-0
            os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            rest = list(events)
    assert time.monotonic() - started < 20
    assert rest[-1] == "[DONE]", rest[-3:]
    message = rest[-2]["error"]["message"]
    assert "decode replica decode-0 died (not heard from for" in message and "liveness timeout 2 s" in message
    assert server.process.wait(30) == 1, server.log()
    assert "disagg.replica_silent" in server.log() and "every decode replica has failed" in server.log()


# ---------------------------------------------------------------- the front end alone, its replicas faked


class _FakeReplica:
    """A RoleReplica without Ray: the commands it was sent, nothing run."""

    def __init__(self, role: str, name: str) -> None:
        from servelab.server.engine_core import EMPTY_SNAPSHOT, EngineInfo

        self.role, self.name, self.index = role, name, 0
        self.info = EngineInfo(256, 1000)
        self.snapshot, self.transfer_metrics, self.prefix_summary = EMPTY_SNAPSHOT, {}, None
        self.dead, self.last_heard = False, time.monotonic()
        self.sent: list[tuple] = []

    def start(self, on_poll, on_exit) -> None:
        pass

    def send(self, command: tuple) -> None:
        self.sent.append(command)

    def stop(self, timeout: float) -> None:
        self.stopped = True


def _front_end(failure_policy: str, liveness_timeout: float | None = None):
    from servelab.disagg.routing import PDRouter
    from servelab.registry import PluginRegistry
    from servelab.server.disaggregated import DisaggregatedEngine
    from servelab.server.role_replicas import CONSUMER, PRODUCER

    prefill, decode = _FakeReplica(PRODUCER, "prefill-0"), _FakeReplica(CONSUMER, "decode-0")
    router = PDRouter(PluginRegistry.from_entry_points(), 1, 1, 16, 0)
    engine = DisaggregatedEngine([prefill], [decode], router, 16, failure_policy, liveness_timeout=liveness_timeout)
    failures: list[str] = []
    engine.on_failure = failures.append
    return engine, prefill, decode, failures


async def _added(engine, prefill, request_id: str = "r0", max_tokens: int = 8):
    """Add one request and answer its add as the prefill replica does; its events' queue."""
    import asyncio

    from servelab import SamplingParams
    from servelab.server.engine_core import EMPTY_SNAPSHOT, NewRequest

    request = NewRequest(request_id, list(range(5, 25)), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                         engine.clock())
    adding = asyncio.ensure_future(engine.add([request]))
    await asyncio.sleep(0)
    kind, transfer_id, *_ = prefill.sent[-1]
    assert kind == "add" and transfer_id.startswith("xfer-")
    engine._handle(prefill, [("added", transfer_id, None)], (EMPTY_SNAPSHOT, {}, None))
    return await adding, transfer_id


async def _last_event(events):
    import asyncio

    while True:
        _, event = await asyncio.wait_for(events.get(), 5)
        if event.is_last:
            return event


def test_front_end_hands_the_first_token_on_and_fails_requests_by_the_fail_policy():
    """Policy fail: a request the dead prefill replica had not handed on ends with an error
    naming it, a handed-on one goes on decoding, and the deployment stops (on_failure)
    only once that one has ended; a decode replica's death fails its requests."""
    import asyncio
    import types

    from servelab.outputs import CompletionOutput, RequestEvent, RequestMetrics, RequestOutput
    from servelab.server.engine_core import EMPTY_SNAPSHOT

    async def run():
        engine, prefill, decode, failures = _front_end("fail")
        engine.start()
        try:
            handed, handed_id = await _added(engine, prefill, "r0")
            lost, _ = await _added(engine, prefill, "r1")
            handoff = types.SimpleNamespace(first_token_id=42, prompt_token_ids=tuple(range(5, 25)))
            engine._handle(prefill, [("prefilled", handed_id, _prefilled(handed_id, handoff), handoff)],
                           (EMPTY_SNAPSHOT, {}, None))
            _, first = await asyncio.wait_for(handed.get(), 5)
            assert first.new_token_ids == (42,)  # streamed before the decode replica's tokens
            assert decode.sent[-1][0] == "accept" and decode.sent[-1][1] is handoff
            engine._replica_died(prefill, "killed")
            ended = await _last_event(lost)
            assert ended.output.finish_reason == "error" and "prefill replica prefill-0 died" in ended.output.error
            assert failures == [] and engine.num_in_flight == 1  # r0 decodes on
            with pytest.raises(Exception, match="every prefill replica has failed"):
                await engine.add([])
            now = engine.clock()
            final = RequestOutput(handed_id, None, list(range(5, 25)), [CompletionOutput(0, [42, 43], "", "length")],
                                  RequestMetrics(now, None, None, now))
            engine._handle(decode, [("step", {handed_id: RequestEvent((43,))}, [final])], (EMPTY_SNAPSHOT, {}, None))
            done = await _last_event(handed)
            assert done.output.token_ids == [42, 43] and done.output.request_id == "r0"
            await asyncio.sleep(0.1)
            assert len(failures) == 1 and "every prefill replica has failed" in failures[0]
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_front_end_aborts_on_both_replicas_and_fails_requests_of_a_dead_decode_replica():
    import asyncio
    import types

    from servelab.errors import RequestError
    from servelab.server.engine_core import EMPTY_SNAPSHOT

    async def run():
        engine, prefill, decode, failures = _front_end("recompute")
        engine.start()
        try:
            events, transfer_id = await _added(engine, prefill, "r0")
            handoff = types.SimpleNamespace(first_token_id=42, prompt_token_ids=tuple(range(5, 25)))
            engine._handle(prefill, [("prefilled", transfer_id, _prefilled(transfer_id, handoff), handoff)],
                           (EMPTY_SNAPSHOT, {}, None))
            engine.abort(["r0"])
            ended = await _last_event(events)
            assert ended.output.finish_reason == "abort" and ended.output.token_ids == [42]
            assert ("abort", [transfer_id]) in prefill.sent and ("abort", [transfer_id]) in decode.sent
            assert engine.num_in_flight == 0
            # a prefill replica that refuses a request: RequestError (a 400), nothing left behind
            from servelab import SamplingParams
            from servelab.server.engine_core import NewRequest

            adding = asyncio.ensure_future(engine.add([NewRequest("r1", [5] * 20, SamplingParams(max_tokens=4),
                                                                  engine.clock())]))
            await asyncio.sleep(0)
            engine._handle(prefill, [("added", prefill.sent[-1][1], "too long")], (EMPTY_SNAPSHOT, {}, None))
            with pytest.raises(RequestError, match="too long"):
                await adding
            assert engine.num_in_flight == 0
            # the decode replica dies with a request on it: an error naming it, and the deployment has failed
            events, transfer_id = await _added(engine, prefill, "r2")
            engine._handle(prefill, [("prefilled", transfer_id, _prefilled(transfer_id, handoff), handoff)],
                           (EMPTY_SNAPSHOT, {}, None))
            engine._replica_died(decode, "killed")
            ended = await _last_event(events)
            assert ended.output.finish_reason == "error" and "decode replica decode-0 died" in ended.output.error
            assert failures and "every decode replica has failed" in failures[0]
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_front_end_splits_n_into_handoffs_and_merges_their_outputs():
    """n=2: two transfers on one prefill replica (seeds seed and seed + 1, prompt logprobs
    asked of the first), the prompt logprobs streamed with the first token and handed on,
    each completion's tokens under its own key, none lost when the request's output comes
    in the step that brings both completions' last tokens, and one merged output; an abort
    ends both."""
    import asyncio
    import types

    import attrs

    from servelab import SamplingParams
    from servelab.outputs import CompletionOutput, Logprob, RequestEvent, RequestMetrics, RequestOutput
    from servelab.server.engine_core import EMPTY_SNAPSHOT, NewRequest

    report = (EMPTY_SNAPSHOT, {}, None)
    prompt = list(range(5, 25))

    async def add(engine, prefill, request_id: str):
        params = SamplingParams(n=2, max_tokens=4, temperature=0.8, seed=7, prompt_logprobs=1)
        adding = asyncio.ensure_future(engine.add([NewRequest(request_id, prompt, params, engine.clock())]))
        await asyncio.sleep(0)
        adds = [command for command in prefill.sent if command[0] == "add" and command[1] not in engine.seen]
        engine.seen.update(command[1] for command in adds)
        engine._handle(prefill, [("added", command[1], None) for command in adds], report)
        return await adding, adds

    async def run():
        engine, prefill, decode, failures = _front_end("recompute")
        engine.seen = set()
        engine.start()
        try:
            events, adds = await add(engine, prefill, "r0")
            assert [(c[3].n, c[3].seed, c[3].prompt_logprobs) for c in adds] == [(1, 7, 1), (1, 8, None)]
            ids = [c[1] for c in adds]
            scored = [None] + [{t: Logprob(-1.0, 1)} for t in prompt[1:]]
            handoffs = [types.SimpleNamespace(first_token_id=40 + i, prompt_token_ids=tuple(prompt)) for i in (0, 1)]
            engine._handle(prefill, [("prefilled", ids[0], attrs.evolve(_prefilled(ids[0], handoffs[0]),
                                                                         prompt_logprobs=scored), handoffs[0]),
                                     ("prefilled", ids[1], _prefilled(ids[1], handoffs[1]), handoffs[1])], report)
            accepts = [command for command in decode.sent if command[0] == "accept"]
            assert [c[5] for c in accepts] == [scored, None]  # the prompt's logprobs handed on with completion 0

            def final(i: int, tokens: list[int]) -> RequestOutput:
                now = engine.clock()
                return RequestOutput(ids[i], None, prompt, [CompletionOutput(0, tokens, "", "length")],
                                     RequestMetrics(now, None, None, now))

            engine._handle(decode, [("step", {ids[0]: RequestEvent((50,))}, [])], report)
            engine._handle(decode, [("step", {ids[0]: RequestEvent((52,)), ids[1]: RequestEvent((51,))},
                                     [final(0, [40, 50, 52]), final(1, [41, 51])])], report)
            received = [await asyncio.wait_for(events.get(), 5)]
            while not any(e.is_last for _, e in received) or not events.empty():  # and those queued with it
                received.append(await asyncio.wait_for(events.get(), 5))
            streamed: dict[str, list[int]] = {}
            for key, event in received:
                streamed.setdefault(key, []).extend(event.new_token_ids)
            assert streamed == {"r0": [40, 50, 52], "r0#1": [41, 51]}
            assert [list(e.prompt_logprobs) for _, e in received if e.prompt_logprobs] == [scored]
            [output] = [e.output for _, e in received if e.output is not None]
            assert output.request_id == "r0" and [(c.index, c.token_ids) for c in output.outputs] == \
                [(0, [40, 50, 52]), (1, [41, 51])]
            assert engine.num_in_flight == 0
            events, adds = await add(engine, prefill, "r1")
            engine.abort(["r1"])
            ended = await _last_event(events)
            assert [c.finish_reason for c in ended.output.outputs] == ["abort", "abort"]
            assert all(("abort", [c[1]]) in prefill.sent for c in adds) and engine.num_in_flight == 0
            assert failures == []
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_a_silent_prefill_replica_is_killed_and_its_requests_recomputed_not_left_waiting():
    """A replica not heard from past the liveness timeout (a stopped or hung process: a live
    one answers its poll every second) is killed and handled as a dead one: under
    `recompute` its request goes whole to the decode replica, which streams it; a replica
    that keeps answering is left alone."""
    import asyncio

    from servelab.outputs import CompletionOutput, RequestEvent, RequestMetrics, RequestOutput
    from servelab.server.engine_core import EMPTY_SNAPSHOT

    async def run():
        engine, prefill, decode, failures = _front_end("recompute", liveness_timeout=0.3)
        engine.start()
        try:
            events, transfer_id = await _added(engine, prefill, "r0")
            for _ in range(8):  # the decode replica keeps answering its polls; the prefill replica is silent
                await asyncio.sleep(0.1)
                engine._handle(decode, [], (EMPTY_SNAPSHOT, {}, None))
            assert prefill.dead and getattr(prefill, "stopped", False) and not decode.dead
            assert decode.sent[-1][0] == "recompute" and decode.sent[-1][1] == transfer_id
            now = engine.clock()
            final = RequestOutput(transfer_id, None, list(range(5, 25)), [CompletionOutput(0, [7, 8], "", "length")],
                                  RequestMetrics(now, None, None, now))
            engine._handle(decode, [("step", {transfer_id: RequestEvent((7, 8))}, [final])], (EMPTY_SNAPSHOT, {}, None))
            done = await _last_event(events)
            assert done.output.token_ids == [7, 8] and done.output.finish_reason == "length"
            assert failures == [] and engine.stalled_seconds() < 1.0  # /health stays 200
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_a_request_the_decode_replica_refuses_when_recomputing_ends_with_its_reason():
    """Recomputed on the decode replica, a request its engine refuses: a new one (no prefill
    replica left) is refused at its add (a 400), one taken in before its prefill replica
    died ends with an error naming the problem; nothing is left in flight."""
    import asyncio

    from servelab import SamplingParams
    from servelab.errors import RequestError
    from servelab.server.engine_core import EMPTY_SNAPSHOT, NewRequest

    report = (EMPTY_SNAPSHOT, {}, None)

    async def run():
        engine, prefill, decode, failures = _front_end("recompute")
        engine.start()
        try:
            events, transfer_id = await _added(engine, prefill, "r0")
            engine._replica_died(prefill, "killed")
            assert decode.sent[-1][:2] == ("recompute", transfer_id)
            engine._handle(decode, [("added", transfer_id, "structured output regex is invalid")], report)
            ended = await _last_event(events)
            assert ended.output.finish_reason == "error" and "regex is invalid" in ended.output.error
            adding = asyncio.ensure_future(engine.add([NewRequest("r1", [5] * 20, SamplingParams(max_tokens=4),
                                                                  engine.clock())]))
            await asyncio.sleep(0)
            assert decode.sent[-1][0] == "recompute"
            engine._handle(decode, [("added", decode.sent[-1][1], "structured output regex is invalid")], report)
            with pytest.raises(RequestError, match="regex is invalid"):
                await adding
            assert engine.num_in_flight == 0 and failures == []
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_the_options_go_together():
    from servelab.errors import ServelabError
    from servelab.server.serve import ServerOptions

    ServerOptions(prefill_replicas=2, decode_replicas=1, kv_failure_policy="fail", ray_address="10.0.0.5:6379")
    for options, message in (({"prefill_replicas": 1}, "give both"),
                             ({"prefill_replicas": 1, "decode_replicas": 1, "replicas": 2}, "does not go with"),
                             ({"prefill_replicas": 0, "decode_replicas": 1}, "--prefill-replicas must be > 0"),
                             ({"prefill_replicas": 1, "decode_replicas": 1, "kv_lease_s": 0}, "--kv-lease-s"),
                             ({"prefill_replicas": 1, "decode_replicas": 1, "kv_failure_policy": "retry"},
                              "--kv-failure-policy")):
        with pytest.raises(ServelabError, match=message):
            ServerOptions(**options)
