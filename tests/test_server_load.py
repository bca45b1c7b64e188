"""`servelab serve` under load, and its graceful shutdown.

A bounded load test: a few hundred concurrent streaming completions from this process,
loopback only, must end with every request answered in full or cleanly refused (429 with
Retry-After), and no KV block leaked. Then SIGTERM while requests are in flight: new
requests get 503 with Retry-After, in-flight requests finish or, at the deadline, end
with finish_reason "abort" and [DONE], and the process exits 0. `examples/load_test.py` runs the same load at larger sizes."""

from __future__ import annotations

import asyncio
import time
import httpx
import pytest

from conftest_server import ServerProcess, served_checkpoint, sse_events  # noqa: F401 (fixture)
from servelab.server.loadgen import run_load

SHUTDOWN_TIMEOUT = 2.0
LONG_PROMPTS = [[5, 6 + i] for i in range(60)]  # x 250 tokens, 2 at a time: far more than the deadline allows


@pytest.fixture(scope="module")
def server(served_checkpoint, tmp_path_factory):
    process = ServerProcess(served_checkpoint, "--set", "engine.max_model_len=256", "--set", "engine.max_num_seqs=32",
                            "--max-waiting", "128", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                            log_path=tmp_path_factory.mktemp("load") / "server.log")
    yield process
    assert process.terminate() == 0, process.log()


def test_concurrent_streams_are_answered_or_refused_and_leak_nothing(server):
    report = asyncio.run(run_load(server.url, num_requests=200, concurrency=200, max_tokens=8, timeout=60))
    print("\n" + report.format())
    assert set(report.outcomes) <= {"ok", "http_429"}, report.outcomes  # nothing incomplete, no transport error
    assert sum(report.outcomes.values()) == 200
    assert report.outcomes["ok"] >= 32  # at least a full batch was served
    assert report.blocks_leaked == 0
    assert report.server["servelab_requests_running"] == 0 and report.server["servelab_requests_waiting"] == 0
    assert report.seconds < 60
    assert len(report.ttft) == report.outcomes["ok"]


def test_graceful_shutdown_drains_then_aborts_open_streams_and_exits_0(served_checkpoint, tmp_path):
    server = ServerProcess(served_checkpoint, "--set", "engine.max_model_len=256", "--set", "engine.max_num_seqs=2",
                           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), log_path=tmp_path / "server.log")
    body = {"prompt": "w5 w6", "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 4}) as short, \
                client.stream("POST", "/v1/completions", json={**body, "prompt": LONG_PROMPTS,
                                                               "max_tokens": 250}) as long:
            server.process.terminate()  # SIGTERM
            events = list(sse_events(short))  # in flight: finishes within the deadline
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 4
            refused = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=10)
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "shutting_down"
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
            events = list(sse_events(long))
    assert events[-1] == "[DONE]"
    reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert len(reasons) == 60 and "abort" in reasons and set(reasons) <= {"abort", "length"}, reasons
    assert events[-2]["usage"]["completion_tokens"] < 60 * 250
    assert server.process.wait(SHUTDOWN_TIMEOUT + 15) == 0, server.log()
    assert "server.drain_deadline" in server.log() and "server.stopped" in server.log()
    assert _refuses_new_connections(server.url)


def _refuses_new_connections(url: str, wait: float = 3.0) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/health", timeout=1)
        except httpx.ConnectError:
            return True
        assert response.status_code in (200, 503)  # accepted before the listener closed
        time.sleep(0.05)
    return False
