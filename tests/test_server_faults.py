"""Engine faults in a real `servelab serve` process: a scheduler plugin that raises in
`schedule()` and a drafter that raises in `propose()`, each once a request with the
poison token (id 13, "w13") is in the batch.

The documented failure model: the requests in flight fail with an error naming the cause
(a 500 body, or an error event and [DONE] on a stream), and the process exits with
code 1 so that a supervisor restarts it."""

from __future__ import annotations

import os
import textwrap

import httpx
import pytest

from conftest_server import ServerProcess, served_checkpoint, sse_events  # noqa: F401 (fixture)

POISON = 13
EXIT_ENGINE_FAILED = 1

FAULTY_PLUGIN = """
    import servelab
    from servelab.plugin_types import DrafterPlugin, SchedulerPlugin
    from servelab.plugins.drafters.ngram import NgramDrafter
    from servelab.plugins.drafters.options import NgramOptions
    from servelab.kit import ContinuousOptions, ContinuousScheduler

    POISON = 13


    class FaultyScheduler(ContinuousScheduler):
        poisoned = False

        def add(self, seq):
            self.poisoned = self.poisoned or POISON in seq.prompt_token_ids
            super().add(seq)

        def schedule(self):
            if self.poisoned:
                raise RuntimeError("injected fault in schedule()")
            return super().schedule()


    class FaultyDrafter(NgramDrafter):
        def propose(self, seqs, **kwargs):
            if any(POISON in seq.prompt_token_ids for seq in seqs):
                raise RuntimeError("injected fault in propose()")
            return super().propose(seqs, **kwargs)


    @servelab.hookimpl
    def servelab_register_schedulers():
        return [SchedulerPlugin(name="faulty-schedule", factory="faulty_servelab_plugin:FaultyScheduler",
                                options=ContinuousOptions,
                                description="raises in schedule() once it holds the poison token")]


    @servelab.hookimpl
    def servelab_register_drafters():
        return [DrafterPlugin(name="faulty-propose", factory="faulty_servelab_plugin:FaultyDrafter",
                              options=NgramOptions, description="raises in propose() on the poison token")]
"""


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A distribution on disk whose servelab.plugins entry point is the faulty module."""
    path = tmp_path_factory.mktemp("faulty-plugin")
    info = path / "faulty_servelab-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-servelab\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[servelab.plugins]\nfaulty = faulty_servelab_plugin\n")
    (path / "faulty_servelab_plugin.py").write_text(textwrap.dedent(FAULTY_PLUGIN))
    return path


@pytest.mark.parametrize("policy,cause", [(("scheduler.name", "faulty-schedule"), "injected fault in schedule()"),
                                          (("drafter.name", "faulty-propose"), "injected fault in propose()")],
                         ids=["schedule", "propose"])
def test_an_engine_fault_fails_the_requests_in_flight_and_exits_1(served_checkpoint, plugin_path, tmp_path,
                                                                   policy, cause):
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])}
    server = ServerProcess(served_checkpoint, "--set", "engine.max_model_len=256", "--set", f"{policy[0]}={policy[1]}",
                           log_path=tmp_path / "server.log", env=environment)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            healthy = {"prompt": "w5 w6", "max_tokens": 3, "ignore_eos": True}
            assert client.post("/v1/completions", json=healthy).status_code == 200  # the plugin works until poisoned
            stream = {**healthy, "max_tokens": 240, "stream": True}
            with client.stream("POST", "/v1/completions", json=stream) as in_flight:
                events = sse_events(in_flight)
                next(events)  # it runs
                poisoned = client.post("/v1/completions", json={"prompt": f"w5 w{POISON}", "max_tokens": 3})
                rest = list(events)
        assert poisoned.status_code == 500, poisoned.text
        error = poisoned.json()["error"]
        assert error["type"] == "server_error" and cause in error["message"] and "engine failed" in error["message"]
        assert rest[-1] == "[DONE]" and cause in rest[-2]["error"]["message"], rest[-3:]
        assert server.process.wait(30) == EXIT_ENGINE_FAILED, server.log()
        assert "server.engine_failed" in server.log()
    finally:
        server.terminate()



def test_a_killed_engine_process_fails_the_requests_in_flight_and_exits_1(served_checkpoint, tmp_path):
    """The engine runs in a process of its own: when that process dies (killed, out of
    memory, a crash in native code) the server says so instead of hanging."""
    import re
    import signal

    server = ServerProcess(served_checkpoint, "--set", "engine.max_model_len=256", log_path=tmp_path / "server.log")
    try:
        engine_pid = int(re.search(r"engine\.process_started\s.*?pid=(\d+)", server.log()).group(1))
        with httpx.Client(base_url=server.url, timeout=30) as client:
            stream = {"prompt": "w5 w6", "max_tokens": 240, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=stream) as in_flight:
                events = sse_events(in_flight)
                next(events)  # it runs
                os.kill(engine_pid, signal.SIGKILL)
                rest = list(events)
            assert rest[-1] == "[DONE]" and "engine process exited unexpectedly" in rest[-2]["error"]["message"]
            assert "SIGKILL" in rest[-2]["error"]["message"]
        assert server.process.wait(30) == EXIT_ENGINE_FAILED, server.log()
        assert "server.engine_failed" in server.log()
    finally:
        server.terminate()
