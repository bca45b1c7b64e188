"""`servelab serve` under load, and its graceful shutdown.

A bounded load test: a few hundred concurrent streaming completions from this process,
loopback only, must end with every request answered in full or cleanly refused (429 with
Retry-After), and no KV block leaked. Then SIGTERM while requests are in flight: new
connections are refused, in-flight requests finish (or are aborted at the deadline), and
the process exits 0. `examples/load_test.py` runs the same load at larger sizes."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from conftest_server import ServerProcess, served_checkpoint, sse_events  # noqa: F401 (fixture)
from servelab.server.loadgen import run_load

SHUTDOWN_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def server(served_checkpoint, tmp_path_factory):
    process = ServerProcess(served_checkpoint, "--set", "engine.max_model_len=128", "--set", "engine.max_num_seqs=32",
                            "--max-waiting", "128", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                            log_path=tmp_path_factory.mktemp("load") / "server.log")
    yield process
    process.terminate()  # the shutdown test below has usually stopped it already


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


def test_graceful_shutdown_finishes_in_flight_requests_and_exits_0(server):
    body = {"prompt": "w5 w6", "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 12}) as short, \
                client.stream("POST", "/v1/completions", json={**body, "max_tokens": 120, "n": 40}) as long:
            started = time.monotonic()
            server.process.terminate()  # SIGTERM
            events = list(sse_events(short))
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 12
            assert _refuses_new_connections(server.url)
            try:  # finished within the deadline, or cut off at it: either way it ends
                list(sse_events(long))
            except httpx.HTTPError:
                pass
    assert server.process.wait(SHUTDOWN_TIMEOUT + 15) == 0, server.log()
    assert time.monotonic() - started < SHUTDOWN_TIMEOUT + 15
    assert "server.stopped" in server.log()


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
