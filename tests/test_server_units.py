"""The server's parts in process, without a model: chat templates, request parsing, text
deltas around stop strings, and the engine loop against a fake engine (including an
engine that fails mid-step)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from types import SimpleNamespace

import pytest

from servelab.errors import RequestError
from servelab.interfaces import AllocatorStats, SchedulerStats
from servelab.outputs import CompletionOutput, RequestEvent, RequestMetrics, RequestOutput, StepResult
from servelab.registry import PluginRegistry
from servelab.sampling_params import SamplingParams
from servelab.server.chat import ChatTemplate
from servelab.server.engine_loop import AsyncEngine, EngineUnavailable, NewRequest, ThreadConnection
from servelab.server.generation import TextStreamer
from servelab.server.limits import RequestLimits, parse_body
from servelab.server.protocol import ApiError, PromptBounds, brief, parse_chat, parse_completion

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
BOUNDS = PromptBounds(max_model_len=64, max_prompt_chars=1000, vocab_size=100)


# ---------------------------------------------------------------- chat templates


def test_plain_chat_format_is_role_colon_content():
    rendered = ChatTemplate.plain_format().render(MESSAGES)
    assert rendered.text == "system: be brief\nuser: hi\nassistant:"
    assert rendered.add_special_tokens  # no template wrote the BOS


def test_no_chat_template_is_refused_not_invented():
    with pytest.raises(RequestError, match="no chat template"):
        ChatTemplate(None).render(MESSAGES)


def test_template_from_tokenizer_config_renders_like_transformers(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | tojson }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    rendered = ChatTemplate.from_directory(tmp_path).render(MESSAGES)
    assert rendered.text == '<s><|system|>"be brief"\n<|user|>"hi"\n<|assistant|>'
    assert not rendered.add_special_tokens


def test_chat_template_file_and_named_templates(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert ChatTemplate.from_directory(tmp_path).render(MESSAGES).text == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatTemplate.from_directory(tmp_path).render(MESSAGES).text == "J2"
    assert ChatTemplate.from_directory(tmp_path / "missing").is_missing


def test_template_raise_exception_is_a_request_error():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RequestError, match="roles must alternate"):
        template.render(MESSAGES)


# ---------------------------------------------------------------- request parsing


def test_completion_fields_become_sampling_params():
    parsed = parse_completion({"prompt": ["a", [1, 2]], "max_tokens": 5, "temperature": 0, "top_k": 3,
                               "min_p": 0.1, "seed": 9, "stop": "x", "stop_token_ids": [7], "ignore_eos": True,
                               "n": 2, "stream": True, "user": "ignored", "stream_options": {"include_usage": True}}, BOUNDS)
    assert parsed.prompts == ("a", [1, 2]) and parsed.n == 2 and parsed.stream
    assert parsed.params == SamplingParams(max_tokens=5, temperature=0.0, top_k=3, min_p=0.1, seed=9, stop=("x",),
                                           stop_token_ids=(7,), ignore_eos=True)


def test_chat_defaults_and_max_completion_tokens():
    parsed = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}],
                         "max_completion_tokens": 7}, BOUNDS)
    assert parsed.messages == ({"role": "user", "content": "ab"},) and parsed.params.max_tokens == 7
    assert parse_chat({"messages": MESSAGES}, BOUNDS).params.max_tokens > 10**6  # until max_model_len


@pytest.mark.parametrize("body,param", [
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "temperature": True}, "temperature"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "guided_json": 5}, "guided_json"),
])
def test_bad_completion_fields_are_named(body, param):
    with pytest.raises(ApiError) as info:
        parse_completion(body, BOUNDS)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": MESSAGES, "guided_choice": []}, "guided_choice"),
])
def test_bad_chat_fields_are_named(body, param):
    with pytest.raises(ApiError) as info:
        parse_chat(body, BOUNDS)
    assert info.value.param == param


@pytest.mark.parametrize("constraint,kind", [
    ({"json": {"type": "object"}}, "json"), ({"regex": "a+"}, "regex"), ({"choice": ["a", "b"]}, "regex"),
    ({"grammar": 'root ::= "a"'}, "grammar"), ({"json_object": True}, "json_object")])
def test_structured_outputs_become_the_same_constraints_as_guided_fields(constraint, kind):
    parsed = parse_completion({"prompt": "a", "structured_outputs": constraint}, BOUNDS)
    assert parsed.params.structured.kind == kind
    assert parsed.structured_field == f"structured_outputs.{next(iter(constraint))}"


def test_stream_options_and_compatibility_coercions():
    parsed = parse_completion({"prompt": "a", "stream": True, "max_tokens": 4.0, "logprobs": True,
                               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, BOUNDS)
    assert parsed.include_usage and parsed.continuous_usage and parsed.params.max_tokens == 4
    assert parsed.params.logprobs == 1
    plain = parse_completion({"prompt": "a", "stream": True, "logprobs": False}, BOUNDS)
    assert not plain.include_usage and plain.params.logprobs is None
    assert parse_completion({"prompt": "a", "max_tokens": 10**22}, BOUNDS).params.max_tokens == 64  # clipped


def test_prompt_scoring_asks_the_engine_for_one_token_and_the_prompt_logprobs():
    parsed = parse_completion({"prompt": "a", "max_tokens": 0, "echo": True, "logprobs": 2}, BOUNDS)
    assert parsed.scoring_only and parsed.params.max_tokens == 1 and parsed.params.prompt_logprobs == 2


def test_a_request_template_renders_with_its_variables():
    rendered = ChatTemplate.plain_format().render(MESSAGES, "{{ messages | length }} {{ x }}", {"x": "y"})
    assert rendered.text == "2 y" and not rendered.add_special_tokens


def test_malformed_json():
    with pytest.raises(ApiError) as info:
        parse_body(b"{nope", RequestLimits())
    assert info.value.body()["error"]["code"] == "invalid_json"


# ---------------------------------------------------------------- text deltas


class WordTokenizer:
    """ids -> "w<id>" words joined by spaces; id 2 is a special token (decodes to nothing)."""

    def decode(self, token_ids):
        return " ".join(f"w{t}" for t in token_ids if t != 2)


def output(token_ids, finish_reason, text):
    """A finished completion as the engine sends it: its text decoded (and cut at a stop string)."""
    return CompletionOutput(0, list(token_ids), text, finish_reason)


def test_deltas_hold_back_what_a_stop_string_could_claim():
    streamer = TextStreamer(WordTokenizer(), stop=["w5 w6"])
    sent = [streamer.feed([3], None), streamer.feed([4], None), streamer.feed([5], None)]
    assert "".join(sent) == "w3 w4"[: len("w3 w4 w5") - 4]  # the last 4 characters wait
    final = streamer.feed([6], output([3, 4, 5, 6], "stop", "w3 w4 "))
    assert "".join(sent) + final == "w3 w4 " and streamer.emitted == "w3 w4 "


def test_deltas_without_stop_strings_send_everything_and_end_on_the_full_text():
    streamer = TextStreamer(WordTokenizer(), stop=[])
    assert [streamer.feed([t], None) for t in (3, 2, 4)] == ["w3", "", " w4"]
    assert streamer.feed([7], output([3, 2, 4, 7], "length", "w3 w4 w7")) == " w7"


# ---------------------------------------------------------------- the engine loop


class FakeEngine:
    """Each request gets one token per step until max_tokens; step number `fail_at` raises."""

    def __init__(self, fail_at: int | None = None, stall_at: int | None = None, max_running: int | None = None) -> None:
        self.requests: dict[str, tuple[SamplingParams, list[int]]] = {}
        self.steps = 0
        self.fail_at = fail_at
        self.stall_at = stall_at  # step number that hangs (a stopped process) until `resume` is set
        self.max_running = max_running  # requests past the first max_running wait, queued, for a token
        self.finished_ids: list[str] = []
        self.hang = threading.Event()  # set: the next step hangs until `resume` is set
        self.hang_once_admitted: str | None = None  # or the first step after this request was admitted
        self.hanging = threading.Event()
        self.resume = threading.Event()
        self.scheduler = FakeStats(lambda: SchedulerStats(num_waiting=0, num_running=len(self.requests),
                                                          num_preemptions=0))
        self.allocator = FakeStats(lambda: AllocatorStats(num_blocks=8, num_used_blocks=len(self.requests),
                                                          num_free_blocks=8 - len(self.requests)))
        self.model_config = SimpleNamespace(vocab_size=100)
        self.limits = SimpleNamespace(max_model_len=64)
        self.config = SimpleNamespace(engine=SimpleNamespace(max_logprobs=20))
        self.registry = PluginRegistry()  # observers only: no policies
        self.logits_pipeline = SimpleNamespace(processors={})
        self.runner = None  # no LoRA adapters to report

    def prepare_requests(self, specs):
        """The engine's admission API: records prepared off the loop, then admitted."""
        if any(spec.prompt == "bad" for spec in specs):
            raise RequestError("prompt is bad")
        return [SimpleNamespace(request_id=spec.request_id, params=spec.params, preparing={}) for spec in specs]

    def admit(self, records):
        for record in records:
            self.requests[record.request_id] = (record.params, [])
        return [record.request_id for record in records]

    def discard(self, records):
        pass

    def num_preparing_requests(self):
        return 0

    def abort(self, request_id):
        return self._retire(request_id, "abort") if request_id in self.requests else None

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("boom")
        if self.hang_once_admitted in self.requests:
            self.hang.set()
        if self.steps == self.stall_at or self.hang.is_set():
            self.hanging.set()
            self.resume.wait()
        new, finished = {}, []
        for request_id, (params, tokens) in list(self.requests.items())[:self.max_running]:
            tokens.append(self.steps)
            new[request_id] = RequestEvent((self.steps,))
            if len(tokens) == params.max_tokens:
                finished.append(self._retire(request_id, "length"))
        return StepResult(new, finished)

    def _retire(self, request_id, reason):
        _, tokens = self.requests.pop(request_id)
        if reason != "abort":
            self.finished_ids.append(request_id)
        return RequestOutput(request_id, None, [1], [CompletionOutput(0, tokens, "", reason)],
                             RequestMetrics(0.0, 0.0, 0.0, 0.0))


class FakeStats:
    def __init__(self, stats):
        self.stats = stats


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


async def drain(events, count):
    return [await events.get() for _ in range(count)]


def test_engine_loop_streams_events_and_idles():
    async def scenario():
        loop = AsyncEngine(ThreadConnection(FakeEngine()))
        loop.start()
        events = await loop.add([NewRequest("a", "p", SamplingParams(max_tokens=3), 0.0)])
        got = await drain(events, 3)
        assert [e.new_token_ids for _, e in got] == [(1,), (2,), (3,)] and got[-1][1].output is not None
        with pytest.raises(RequestError):  # all or none
            await loop.add([NewRequest("b", "p", SamplingParams(), 0.0), NewRequest("c", "bad", SamplingParams(), 0.0)])
        assert loop.connection.engine.requests == {} and loop.num_waiting == 0
        await loop.shutdown()
        with pytest.raises(EngineUnavailable):
            await loop.add([NewRequest("d", "p", SamplingParams(), 0.0)])

    run(scenario())


def test_abort_and_shutdown_end_requests_with_an_abort_output():
    async def scenario():
        loop = AsyncEngine(ThreadConnection(FakeEngine()))
        loop.start()
        events = await loop.add([NewRequest(r, "p", SamplingParams(max_tokens=10**6), 0.0) for r in "ab"])
        loop.abort(["a"])
        await loop.shutdown()
        finished = {}
        while len(finished) < 2:
            request_id, event = await events.get()
            if event.output is not None:
                finished[request_id] = event.output.finish_reason
        assert finished == {"a": "abort", "b": "abort"}

    run(scenario())


def test_a_failing_engine_fails_its_requests_and_refuses_new_ones():
    async def scenario():
        loop = AsyncEngine(ThreadConnection(FakeEngine(fail_at=2)))
        loop.start()
        events = await loop.add([NewRequest("a", "p", SamplingParams(max_tokens=5), 0.0)])
        first, second = await drain(events, 2)
        assert first[1].new_token_ids == (1,) and "boom" in second[1].error
        await asyncio.sleep(0)
        assert loop.error and "boom" in loop.error
        with pytest.raises(EngineUnavailable):
            await loop.add([NewRequest("b", "p", SamplingParams(), 0.0)])
        await loop.shutdown()

    run(scenario())


# ---------------------------------------------------------------- load report arithmetic


def test_percentiles_and_histogram_quantiles():
    from servelab.server.loadgen import LoadReport, parse_metrics, percentile

    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile(list(range(1, 101)), 99) == 99
    report = LoadReport(1, 1, 1)
    report.server = parse_metrics('# HELP x\nservelab_time_to_first_token_seconds_bucket{le="0.1"} 5.0\n'
                                  'servelab_time_to_first_token_seconds_bucket{le="0.2"} 10.0\n'
                                  'servelab_time_to_first_token_seconds_bucket{le="+Inf"} 10.0\n'
                                  'servelab_kv_blocks{state="used"} 0.0\n')
    assert report.server_quantile("time_to_first_token", 0.5) == pytest.approx(0.1)
    assert report.server_quantile("time_to_first_token", 0.75) == pytest.approx(0.15)
    assert report.server_quantile("time_per_output_token", 0.5) is None
    assert report.blocks_leaked == 0


def test_api_key_comes_from_the_flag_a_file_or_the_environment(tmp_path):
    from servelab.cli import _parser
    from servelab.server.options import api_key

    def key(argv, environ):
        return api_key(_parser().parse_args(["serve", *argv]), environ)

    (tmp_path / "key").write_text("from-file\n")
    assert key([], {"SERVELAB_API_KEY": "from-env"}) == "from-env"
    assert key(["--api-key-file", str(tmp_path / "key")], {"SERVELAB_API_KEY": "from-env"}) == "from-file"
    assert key(["--api-key", "flag"], {"SERVELAB_API_KEY": "from-env"}) == "flag"
    assert key([], {}) is None


@pytest.mark.parametrize("argv,environ,source", [
    ([], {"SERVELAB_API_KEY": ""}, "SERVELAB_API_KEY"),
    ([], {"SERVELAB_API_KEY": "  "}, "SERVELAB_API_KEY"),
    (["--api-key", ""], {}, "--api-key"),
    (["--api-key-file", "{empty}"], {}, "--api-key-file"),
])
def test_an_empty_api_key_is_refused_wherever_it_comes_from(tmp_path, argv, environ, source):
    from servelab.cli import _parser
    from servelab.errors import ServelabError
    from servelab.server.options import api_key

    (tmp_path / "empty").write_text("\n")
    argv = [a.format(empty=tmp_path / "empty") for a in argv]
    with pytest.raises(ServelabError, match="empty") as info:
        api_key(_parser().parse_args(["serve", *argv]), environ)
    assert source in str(info.value)


# ---------------------------------------------------------------- failure isolation in process


def test_a_failing_decode_fails_its_request_alone():
    def broken(events):
        raise ValueError("cannot decode")

    def working(events):
        return [sum(len(event.new_token_ids) for event in events.values())]

    async def scenario():
        loop = AsyncEngine(ThreadConnection(FakeEngine()))
        loop.start()
        bad = await loop.add([NewRequest("bad", "p", SamplingParams(max_tokens=2), 0.0)], decode=broken)
        good = await loop.add([NewRequest("good", "p", SamplingParams(max_tokens=2), 0.0)], decode=working)
        (_, bad_event), = await drain(bad, 1)
        good_events = await drain(good, 2)
        assert "ValueError: cannot decode" in bad_event.decode_error and not bad_event.deltas
        assert [e.deltas for _, e in good_events] == [(1,), (1,)] and good_events[-1][1].output is not None
        await loop.shutdown()

    run(scenario())


def test_a_failed_engine_answers_500_naming_the_cause_and_health_503():
    import httpx

    from servelab.server.app import ServerState, build_app
    from servelab.server.codec import TextCodec
    from servelab.server.metrics import ServerMetrics

    failures = []
    engine = FakeEngine(fail_at=1)
    engine.clock = lambda: 0.0
    state = ServerState(engine=AsyncEngine(ThreadConnection(engine), on_failure=failures.append), metrics=ServerMetrics(),
                        codec=TextCodec(None, ChatTemplate(None)), model_name="fake", max_model_len=64, max_waiting=8)

    async def scenario():
        state.engine.start()
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            failed = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
            health = await client.get("/health")
            refused = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        await state.engine.shutdown()
        return failed, health, refused

    failed, health, refused = run(scenario())
    assert failed.status_code == 500 and "the engine failed: RuntimeError: boom" in failed.json()["error"]["message"]
    assert health.status_code == 503 and "boom" in health.json()["error"]
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert failures and "boom" in failures[0]


# ---------------------------------------------------------------- replica sets (engines on threads)


class RecordingRouter:
    """The built-in round-robin, also noting which requests it was told finished."""

    def __init__(self):
        from servelab.interfaces import RouterContext
        from servelab.plugins.routers.round_robin import RoundRobinRouter

        self.inner = RoundRobinRouter(None, RouterContext(num_replicas=2))
        self.finished = []

    def route(self, request, replicas):
        return self.inner.route(request, replicas)

    def request_finished(self, request_id, replica_id):
        self.finished.append((request_id, replica_id))


def test_a_replica_set_routes_and_a_failed_replica_fails_only_its_requests():
    from servelab.server.metrics import ServerMetrics
    from servelab.server.replica_set import ReplicaSet

    router, failures, metrics = RecordingRouter(), [], ServerMetrics()
    engines = [FakeEngine(), FakeEngine(fail_at=3)]
    replicas = ReplicaSet([AsyncEngine(ThreadConnection(e), name=f"replica {i}") for i, e in enumerate(engines)],
                          router, "recording", block_size=16, metrics=metrics)
    replicas.on_failure = failures.append

    async def finish(events):
        while True:
            _, event = await events.get()
            if event.is_last:
                return event

    async def scenario():
        replicas.start()
        first = await replicas.add([NewRequest("a", [1, 2], SamplingParams(max_tokens=10), 0.0)])
        second = await replicas.add([NewRequest("b", [1, 2], SamplingParams(max_tokens=10), 0.0)])
        ended = await asyncio.gather(finish(first), finish(second))
        assert ended[0].output.finish_reason == "length" and "boom" in ended[1].error  # replica 1 failed at step 3
        assert replicas.dead == {1} and replicas.error is None and not failures
        later = await replicas.add([NewRequest("c", [1], SamplingParams(max_tokens=2), 0.0)])  # replica 0 only
        assert (await finish(later)).output is not None
        assert sorted(router.finished) == [("a", 0), ("b", 1), ("c", 0)]
        await replicas.shutdown()

    run(scenario())
    text = metrics.render().decode()
    assert 'servelab_replica_up{replica="1"} 0.0' in text
    assert 'servelab_replica_requests_routed_total{replica="0"} 2.0' in text


def test_a_silent_replica_leaves_the_rotation_and_its_requests_fail_over_fast():
    """A replica whose loop hangs (a stopped process: no output, no heartbeat) is taken
    out of rotation after the liveness timeout: its requests end with a retryable error
    naming it instead of hanging, new requests go to the live replica, /health's measure
    stays below the timeout, and the replica comes back once it is heard from again."""
    from servelab.server.metrics import ServerMetrics
    from servelab.server.replica_set import ReplicaSet

    router, metrics = RecordingRouter(), ServerMetrics()
    engines = [FakeEngine(), FakeEngine(stall_at=2)]
    replicas = ReplicaSet([AsyncEngine(ThreadConnection(e), name=f"replica {i}") for i, e in enumerate(engines)],
                          router, "recording", block_size=16, metrics=metrics, liveness_timeout=0.5)

    async def finish(events):
        while True:
            _, event = await events.get()
            if event.is_last:
                return event

    async def scenario():
        replicas.start()
        first = await replicas.add([NewRequest("a", [1, 2], SamplingParams(max_tokens=3), 0.0)])
        second = await replicas.add([NewRequest("b", [1, 2], SamplingParams(max_tokens=50), 0.0)])
        assert (await asyncio.wait_for(finish(first), 5)).output.finish_reason == "length"
        stuck = await asyncio.wait_for(finish(second), 5)  # hung for good before the watchdog
        assert "engine replica 1 stopped answering" in stuck.error and "retry" in stuck.error
        assert replicas.live_replicas() == [0] and replicas.dead == set()
        assert replicas.stalled_seconds() < 0.5  # /health answers 200: replica 0 serves
        later = await replicas.add([NewRequest("c", [1], SamplingParams(max_tokens=2), 0.0)])
        assert (await asyncio.wait_for(finish(later), 5)).output is not None
        assert 'servelab_replica_up{replica="1"} 0.0' in metrics.render().decode()
        engines[1].resume.set()  # the process continues: heard from again, back in rotation
        for _ in range(100):
            if replicas.live_replicas() == [0, 1] and "b" not in engines[1].requests:
                break
            await asyncio.sleep(0.05)
        assert replicas.live_replicas() == [0, 1]
        assert "b" not in engines[1].requests  # aborted there: it does not run for nobody
        await replicas.shutdown()

    run(scenario())
    assert 'servelab_replica_up{replica="1"} 1.0' in metrics.render().decode()


def test_requests_a_silent_replica_never_started_fail_over_to_a_live_one():
    """A replica stops (its loop hangs) holding a request it never answered the add of and
    one it admitted but had queued: once the watchdog finds it silent, both are routed
    again to the live replica and their readers get every token and the end, from the
    same queue; the request it had started ends with the retryable error; it runs none of
    them when it resumes."""
    from servelab.server.metrics import ServerMetrics
    from servelab.server.replica_set import ReplicaSet

    router, metrics = RecordingRouter(), ServerMetrics()
    engines = [FakeEngine(), FakeEngine(max_running=1)]
    engines[1].hang_once_admitted = "d"
    replicas = ReplicaSet([AsyncEngine(ThreadConnection(e), name=f"replica {i}") for i, e in enumerate(engines)],
                          router, "recording", block_size=16, metrics=metrics, liveness_timeout=0.5)

    async def finish(events):
        tokens = []
        while True:
            _, event = await events.get()
            tokens.extend(event.new_token_ids)
            if event.is_last:
                return event, tokens

    async def until(condition):
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def scenario():
        replicas.start()  # the round-robin router alternates: replica 0, 1, 0, 1, ...
        await replicas.add([NewRequest("a", [1], SamplingParams(max_tokens=2), 0.0)])
        started = await replicas.add([NewRequest("b", [1], SamplingParams(max_tokens=10**5), 0.0)])
        await replicas.add([NewRequest("c", [1], SamplingParams(max_tokens=2), 0.0)])
        queued = await replicas.add([NewRequest("d", [1], SamplingParams(max_tokens=4), 0.0)])  # behind "b"
        await until(engines[1].hanging.is_set)
        await replicas.add([NewRequest("f", [1], SamplingParams(max_tokens=2), 0.0)])
        unanswered = asyncio.create_task(replicas.add([NewRequest("e", [1], SamplingParams(max_tokens=3), 0.0)]))
        ended, _ = await asyncio.wait_for(finish(started), 5)
        assert "engine replica 1 stopped answering" in ended.error
        queued_end, queued_tokens = await asyncio.wait_for(finish(queued), 5)
        unanswered_end, unanswered_tokens = await asyncio.wait_for(finish(await unanswered), 5)
        assert queued_end.output.finish_reason == "length" and len(queued_tokens) == 4
        assert unanswered_end.output.finish_reason == "length" and len(unanswered_tokens) == 3
        assert queued_end.output.outputs[0].token_ids == queued_tokens  # every token reached the reader
        assert "d" in engines[0].finished_ids and "e" in engines[0].finished_ids
        engines[1].hang.clear()
        engines[1].resume.set()
        for _ in range(100):
            if not engines[1].requests:
                break
            await asyncio.sleep(0.05)
        assert not engines[1].requests  # aborted there: nothing runs for nobody
        assert replicas.num_in_flight == 0 and not replicas._groups and not replicas._group_left
        await replicas.shutdown()

    run(scenario())
    text = metrics.render().decode()
    assert 'servelab_requests_failed_over_total{replica="1"} 2.0' in text
    assert sorted(router.finished) == [("a", 0), ("b", 1), ("c", 0), ("d", 0), ("d", 1), ("e", 0), ("e", 1),
                                       ("f", 0)]


def test_an_unread_stream_is_buffered_within_a_bound_and_loses_nothing():
    """A reader that does not read while its request runs: the events waiting for it stay
    within the buffer's bound (merged), and once read they carry every token, in order,
    with the request's end last."""
    from servelab.server.stream_buffer import STREAM_BUFFER_EVENTS

    engine = AsyncEngine(ThreadConnection(FakeEngine()))

    async def scenario():
        engine.start()
        events = await engine.add([NewRequest("a", [1], SamplingParams(max_tokens=2000), 0.0)])
        for _ in range(400):
            if engine.num_in_flight == 0:
                break
            await asyncio.sleep(0.025)
        assert engine.num_in_flight == 0  # finished, nothing read yet
        assert events.qsize() <= STREAM_BUFFER_EVENTS
        tokens, last = [], None
        while not events.empty():
            _, last = events.get_nowait()
            tokens.extend(last.new_token_ids)
        assert last.is_last and last.output.outputs[0].token_ids == list(range(1, 2001))
        assert tokens == list(range(1, 2001))
        await engine.shutdown()

    run(scenario())


def test_merged_deltas_keep_each_choice_s_text_in_order():
    from servelab.server.engine_loop import RequestEvent
    from servelab.server.generation import ChoiceDelta
    from servelab.server.stream_buffer import StreamBuffer

    async def scenario():
        buffer = StreamBuffer(limit=4)
        for i in range(10):
            buffer.put_nowait(("r", RequestEvent(deltas=(ChoiceDelta(0, f"a{i} ", None, num_tokens=1),
                                                         ChoiceDelta(1, f"b{i} ", None, num_tokens=1)))))
        buffer.put_nowait(("r#1", RequestEvent(new_token_ids=(7,))))
        buffer.put_nowait(("r", RequestEvent(deltas=(ChoiceDelta(0, "end", "stop", num_tokens=1),),
                                             error="gone")))
        assert buffer.qsize() <= 4
        items = [await buffer.get() for _ in range(buffer.qsize())]
        assert items[-1][0] == "r" and items[-1][1].is_last  # the request's end after what came before it
        assert [key for key, _ in items].index("r#1") < len(items) - 1
        texts, counts = {0: "", 1: ""}, {0: 0, 1: 0}
        for _, event in items:
            for delta in event.deltas:
                texts[delta.index] += delta.text
                counts[delta.index] += delta.num_tokens
        assert texts[0] == "".join(f"a{i} " for i in range(10)) + "end" and counts[0] == 11
        assert texts[1] == "".join(f"b{i} " for i in range(10)) and counts[1] == 10

    run(scenario())


def test_a_replica_set_fails_once_every_replica_has():
    from servelab.server.replica_set import ReplicaSet

    engine = FakeEngine(fail_at=1)
    failures = []
    replicas = ReplicaSet([AsyncEngine(ThreadConnection(engine))], RecordingRouter(), "recording", block_size=16)
    replicas.on_failure = failures.append

    async def scenario():
        replicas.start()
        events = await replicas.add([NewRequest("a", [1], SamplingParams(max_tokens=5), 0.0)])
        assert "boom" in (await events.get())[1].error
        await asyncio.sleep(0)
        with pytest.raises(EngineUnavailable, match="every engine replica has failed"):
            await replicas.add([NewRequest("b", [1], SamplingParams(), 0.0)])
        await replicas.shutdown()

    run(scenario())
    assert failures and "every engine replica has failed" in failures[0]


def test_empty_string_lists_are_taken_as_none_given():
    """A fuzzed body once got a 500 for `bad_words: []` (the longest of no strings)."""
    parsed = parse_completion({"model": "m", "prompt": "w5 w6", "bad_words": [], "stop": [], "max_tokens": 4}, BOUNDS)
    assert parsed.params.bad_words == () and parsed.params.stop == ()


# ---------------------------------------------------------------- JSON schemas sent as text


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
@pytest.mark.parametrize("case,limit", [
    ("text-enum", "max_choices"), ("text-depth", "max_schema_depth"), ("text-30000-levels", "max_schema_depth"),
    ("object-depth", "max_schema_depth")])
def test_a_schema_is_bounded_alike_as_text_and_as_an_object(field, case, limit):
    """The depth and max_choices limits apply to a schema sent as JSON text as to one sent
    as an object; text nested past what json.loads can recurse is a 400, not a 500."""
    schema = {"text-enum": json.dumps({"enum": list(range(2000))}),
              "text-depth": json.dumps(_deep_schema(40)),
              "text-30000-levels": "[" * 30000 + "]" * 30000,
              "object-depth": _deep_schema(40)}[case]
    body = {"prompt": "a", "guided_json": schema} if field == "guided_json" else \
        {"prompt": "a", "structured_outputs": {"json": schema}}
    with pytest.raises(ApiError) as info:
        parse_completion(body, BOUNDS)
    assert info.value.status == 400, info.value
    assert limit in str(info.value), info.value
    name = "guided_json" if field == "guided_json" else "structured_outputs.json"
    assert info.value.param == name


def test_a_schema_within_the_limits_passes_as_text_and_as_an_object():
    for schema in (_deep_schema(10), json.dumps(_deep_schema(10)), json.dumps({"enum": ["[", "{", "]"]})):
        assert parse_completion({"prompt": "a", "guided_json": schema}, BOUNDS).params.structured.kind == "json"


def test_tokenize_with_messages_has_the_chat_prompt_bound():
    """/tokenize renders and tokenizes messages as chat does, so it takes chat's bound."""
    from servelab.server.tokenize import parse_tokenize

    big = [{"role": "user", "content": "w5 " * 400}]  # 1200 characters, BOUNDS allows 1000
    with pytest.raises(ApiError) as info:
        parse_tokenize({"messages": big}, BOUNDS)
    assert info.value.status == 400 and info.value.param == "messages"
    assert "more than this server tokenizes (1000" in str(info.value)
    with pytest.raises(ApiError):
        parse_chat({"messages": big}, BOUNDS)
    assert parse_tokenize({"messages": MESSAGES}, BOUNDS).messages is not None


def test_a_request_template_that_loops_is_stopped_within_its_budget(monkeypatch):
    """A request's own template looping (nearly) for good: refused after the budget, so it
    cannot hold a codec worker (nor the process's exit) for good."""
    import threading
    import time

    from servelab.server import chat

    monkeypatch.setattr(chat, "REQUEST_TEMPLATE_SECONDS", 0.5)
    loop = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
            "{% endfor %}{% endfor %}{% endfor %}")
    results, tracer = [], sys.gettrace()  # a coverage tool's, or None

    def render():
        try:
            results.append(ChatTemplate.plain_format().render(MESSAGES, loop))
        except RequestError as exc:
            results.append(exc)

    start = time.monotonic()
    worker = threading.Thread(target=render, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the template still renders"
    assert isinstance(results[0], RequestError) and "took longer than 0.5 s" in str(results[0])
    assert time.monotonic() - start < 5
    assert sys.gettrace() is tracer
    # a request's template that is quick renders as before
    assert ChatTemplate.plain_format().render(MESSAGES, "{{ messages | length }}").text == "2"
