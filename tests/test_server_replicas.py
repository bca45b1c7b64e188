"""Engine replicas on a real local Ray (`servelab serve --replicas 2`, builtin:tiny):
answers equal to one engine, streaming and aborts through replicas, routing by the
configured router (prefix-affinity keeps shared prefixes cache hits where round-robin
spreads them), a slow replica (throttled) answering as an unthrottled one, a replica killed
mid-stream failing only its own requests, and a stopped one (SIGSTOP) taken out of rotation
instead of hanging requests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from conftest_server import ServerProcess, Throttle, sse_events

ray = pytest.importorskip("ray", reason="the replica tests need Ray: pip install 'servelab[ray]'")

MODEL = "builtin:tiny"
SETTINGS = ("--set", "engine.max_model_len=256", "--set", "engine.max_num_seqs=8", "--engine-threads", "1")
PROMPTS = ["Once upon a time", "The cat sat", "In the beginning", "def add(a, b):", "Hello there", "Rain fell"]


def _replica_pids(server: ServerProcess) -> dict[int, int]:
    found = re.findall(r"replica\.started\s.*?pid=(\d+) replica=(\d+)", server.log())
    return {int(replica): int(pid) for pid, replica in found}


def file_backed_tier(path: Path) -> tuple[str, ...]:
    """16 blocks a replica (three ~10-block prompts cannot all stay on the device), a radix
    prefix cache and a host tier in the file `path`."""
    return ("--set", "engine.num_kv_blocks=16", "--set", "engine.block_size=16", "--set", 'allocator.name="radix"',
            "--set", "kv_offload.host_blocks=64", "--set", f'kv_offload.path="{path}"')


@pytest.fixture(scope="module")
def tier_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tier") / "kv.bin"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tier_path):
    """Two replicas, each with a file-backed host tier (the tests below answer as one plain
    engine does through it)."""
    process = ServerProcess(MODEL, "--replicas", "2", *SETTINGS, *file_backed_tier(tier_path),
                            log_path=tmp_path_factory.mktemp("replicas") / "log")
    yield process
    assert process.terminate(60) == 0, process.log_path.read_text()
    assert "kv_blocks_used=0" in process.log_path.read_text()


def test_two_replicas_answer_as_one_engine_does_and_share_the_requests(server):
    from servelab import LLM, SamplingParams

    expected = [o.outputs[0].token_ids for o in LLM(MODEL, max_model_len=256).generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]

    async def ask_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}) for prompt in PROMPTS))
        return [reply.json()["choices"][0]["token_ids"] for reply in replies]

    assert asyncio.run(ask_all()) == [list(ids) for ids in expected]
    metrics = server.metrics()
    routed = [metrics[f'servelab_replica_requests_routed_total{{replica="{i}"}}'] for i in (0, 1)]
    assert routed[0] >= 3 and routed[1] >= 3, routed  # round-robin, the default router
    generated = [metrics[f'servelab_replica_generation_tokens_total{{replica="{i}"}}'] for i in (0, 1)]
    assert sum(generated) == metrics["servelab_generation_tokens_total"] and min(generated) > 0


def test_streams_and_aborts_go_through_the_replicas(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = list(sse_events(response))
        assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == whole
        aborted_before = server.metrics().get('servelab_requests_finished_total{finish_reason="abort"}', 0.0)
        with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 200, "stream": True}) as response:
            stream = sse_events(response)
            next(stream), next(stream)  # it runs; leaving the block hangs up
    server.wait_metrics(lambda m: m.get('servelab_requests_finished_total{finish_reason="abort"}') == aborted_before + 1
                        and m['servelab_kv_blocks{state="used"}'] == 0, timeout=10)


def test_a_slow_replica_answers_as_unthrottled_and_stays_in_rotation(server):
    """Replica 0 throttled (stopped 0.3 s at a time, inside the liveness timeout) while
    both serve: every answer is the unthrottled one, nothing fails over or ends with an
    error, both replicas stay up, and no block is left held."""
    bodies = [{"prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
              for prompt in PROMPTS]

    def ask_all() -> list[list[int]]:
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda body: httpx.post(f"{server.url}/v1/completions", json=body, timeout=60),
                                    bodies))
        assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
        return [reply.json()["choices"][0]["token_ids"] for reply in replies]

    expected = ask_all()
    before = server.metrics()
    with Throttle(_replica_pids(server)[0], stopped_s=0.3, running_s=0.03) as slow:
        answers = ask_all()
    assert answers == expected
    assert slow.stops >= 2, slow.stops
    metrics = server.wait_metrics(lambda m: m['servelab_kv_blocks{state="used"}'] == 0, timeout=10)
    routed = 'servelab_replica_requests_routed_total{replica="0"}'
    assert metrics[routed] > before[routed]  # the slow replica took its share
    for name in ('servelab_replica_up{replica="0"}', 'servelab_replica_up{replica="1"}'):
        assert metrics[name] == 1, name
    for name in ('servelab_requests_failed_over_total{replica="0"}',
                 'servelab_requests_finished_total{finish_reason="error"}'):
        assert metrics.get(name, 0.0) == before.get(name, 0.0), name
    assert "replica.silent" not in server.log()


@contextlib.contextmanager
def one_stream_on_each_replica(client: httpx.Client, body: dict):
    """Two streamed requests, each past its first event: both run, one on each replica
    (round-robin)."""
    with client.stream("POST", "/v1/completions", json=body) as first, \
            client.stream("POST", "/v1/completions", json=body) as second:
        streams = [sse_events(first), sse_events(second)]
        for stream in streams:
            next(stream)
        yield streams


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    """Two replicas for the fault tests, which run in this order: one replica stopped and
    continued, then killed (a server start saved; the stop test needs the fresh server's
    round-robin start, the kill test only that both replicas serve)."""
    process = ServerProcess(MODEL, "--replicas", "2", *SETTINGS, "--liveness-timeout", "2",
                            log_path=tmp_path_factory.mktemp("faults") / "log")
    yield process
    assert process.terminate(60) == 0, process.log_path.read_text()


def test_a_stopped_replica_leaves_the_rotation_and_its_requests_do_not_hang(faulty_server):
    """SIGSTOP of one replica: its request in flight ends with an error naming it within
    about the liveness timeout (not when the client gives up), /health stays 200, new
    requests all go to the other replica, and after SIGCONT it serves again."""
    import time

    server = faulty_server
    pids = _replica_pids(server)
    assert sorted(pids) == [0, 1], server.log()
    body = {"prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with one_stream_on_each_replica(client, body) as streams:
            os.kill(pids[0], signal.SIGSTOP)
            start = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # round-robin: to the stopped replica
                unanswered = pool.submit(client.post, "/v1/completions",
                                         json={**body, "max_tokens": 4, "stream": False}, timeout=60)
                endings = [list(stream) for stream in streams]
                failed_over = unanswered.result()
            waited = time.monotonic() - start
        try:
            errors = [events[-2]["error"]["message"] for events in endings if "error" in events[-2]]
            assert len(errors) == 1 and "engine replica 0 stopped answering" in errors[0], endings
            assert waited < 30, waited
            # the request the stopped replica never took was routed again: answered, not refused
            assert failed_over.status_code == 200, failed_over.text
            assert len(failed_over.json()["choices"][0]["text"]) > 0
            assert client.get("/health").status_code == 200
            for _ in range(4):  # every new request goes to the live replica, none hangs
                reply = client.post("/v1/completions", json={**body, "max_tokens": 4, "stream": False}, timeout=30)
                assert reply.status_code == 200, reply.text
            assert server.metrics()['servelab_replica_up{replica="0"}'] == 0
            assert server.metrics()['servelab_requests_failed_over_total{replica="0"}'] == 1
        finally:
            os.kill(pids[0], signal.SIGCONT)
        server.wait_metrics(lambda m: m['servelab_replica_up{replica="0"}'] == 1, timeout=30)
        assert "replica.silent" in server.log() and "replica.recovered" in server.log()


def test_a_killed_replica_fails_only_its_requests_and_the_others_keep_serving(faulty_server):
    """Replica 0 killed (SIGKILL) with a stream on each replica: its stream ends with an error
    naming it, the other's finishes, and every new request goes to the live replica."""
    server = faulty_server
    pids = _replica_pids(server)
    assert sorted(pids) == [0, 1], server.log()
    body = {"prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with one_stream_on_each_replica(client, body) as streams:
            os.kill(pids[0], signal.SIGKILL)
            endings = [list(stream) for stream in streams]
        errors = [events[-2]["error"]["message"] for events in endings if "error" in events[-2]]
        finished = [events for events in endings if "usage" in events[-2]]
        assert all(events[-1] == "[DONE]" for events in endings)
        assert len(errors) == 1 and "engine replica 0 failed" in errors[0] and "Ray actor died" in errors[0]
        assert len(finished) == 1 and finished[0][-2]["usage"]["completion_tokens"] == 200
        for _ in range(3):  # every new request goes to the live replica
            reply = client.post("/v1/completions", json={**body, "max_tokens": 4, "stream": False,
                                                          "stream_options": None})
            assert reply.status_code == 200, reply.text
        assert client.get("/health").status_code == 200
    metrics = server.metrics()
    assert metrics['servelab_replica_up{replica="0"}'] == 0 and metrics['servelab_replica_up{replica="1"}'] == 1
    assert "replica.failed" in server.log()


def test_replicas_with_a_file_backed_host_tier_each_map_their_own_file(server, tier_path):
    """[kv_offload] path with --replicas 2: each replica maps <path>.replica<i> (one shared
    file handed the same host blocks to both, and repeated greedy answers changed), and
    repeated answers through the tier equal one engine's."""
    from servelab import LLM, SamplingParams

    prompts = [" ".join([p] * 30) for p in PROMPTS]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(MODEL, max_model_len=256).generate(prompts, params)]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(2):  # the second round finds the prompts on the device or in the tier
            for prompt, tokens in zip(prompts, expected):
                reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                                                             "ignore_eos": True, "return_token_ids": True})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["token_ids"] == list(tokens)
    assert sorted(p.name for p in tier_path.parent.glob("kv.bin*")) == ["kv.bin.replica0", "kv.bin.replica1"]
    metrics = server.metrics()  # the replicas' tiers, summed
    assert metrics['servelab_kv_tier_moves{kind="offload"}'] > 0 and metrics['servelab_kv_tier_moves{kind="load"}'] > 0
    assert metrics['servelab_kv_tier_blocks{state="free",tier="host"}'] + \
        metrics['servelab_kv_tier_blocks{state="cached",tier="host"}'] == 2 * 64


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             object_store_memory=128 * 1024 * 1024)
    yield
    ray.shutdown()


def _hit_rate_with(router: str) -> float:
    """Four system prompts of 4 blocks, each followed by 4 questions, sent one at a time to 2
    replicas with a radix prefix cache: the prompt tokens found in the caches / looked up."""
    from servelab.config import EngineConfig
    from servelab.sampling_params import SamplingParams
    from servelab.server.engine_core import NewRequest
    from servelab.server.replicas import launch_replicas

    config = EngineConfig().with_set_options([f"engine.model={MODEL}", "engine.max_model_len=256",
                                              "engine.max_num_seqs=4", "allocator.name=radix", f"router.name={router}"])
    prompts = [[10 + p] * 64 + [100 + 7 * q + p, 200 + q] for p in range(4) for q in range(4)]

    async def run() -> float:
        replicas, _ = launch_replicas([config, config], threads=1)
        replicas.start()
        try:
            for index, prompt in enumerate(prompts):
                events = await replicas.add([NewRequest(f"r{index}", prompt, SamplingParams(max_tokens=1), 0.0)])
                while not (await events.get())[1].is_last:
                    pass
            await asyncio.sleep(0.2)  # the last snapshot
            kv = replicas.snapshot.allocator
            return kv.prefix_hit_tokens / kv.prefix_lookup_tokens
        finally:
            await replicas.shutdown()

    return asyncio.run(run())


def test_prefix_affinity_finds_more_cached_prefixes_than_round_robin(local_ray):
    round_robin, prefix_affinity = _hit_rate_with("round-robin"), _hit_rate_with("prefix-affinity")
    # round-robin sends each system prompt to both replicas (two misses of 4 blocks), prefix-affinity to one
    assert prefix_affinity > round_robin + 0.1, (round_robin, prefix_affinity)
