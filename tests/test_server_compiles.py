"""The grammar compiler and the engine's liveness under a real server: a grammar over its
compile budget is a 400 within about the budget and the compiler is restarted; a client
that leaves while its grammar compiles stops the compilation; past max_pending_compiles
a structured request is a 429 while plain ones are served; SIGTERM during a compilation
ends the server by itself; a stopped engine process with a request to serve turns
/health to 503 after the liveness timeout, and back to 200 once it continues."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest_server import ServerProcess, served_checkpoint  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the tests read Linux's /proc")

# ~100 alternatives of up to 50 words each: xgrammar takes well over 10 s over the test
# tokenizer's vocabulary (SLOW_TOO is another grammar of the same kind, not cached with it)
SLOW = "|".join(f"(w{i}){{1,50}}" for i in range(3, 100))
SLOW_TOO = "|".join(f"(w{i}){{1,49}}" for i in range(3, 100))
CHOICE = {"prompt": "w5", "guided_choice": ["w7", "w9"], "max_tokens": 4}
PLAIN = {"prompt": "w5 w6", "max_tokens": 4, "ignore_eos": True}
BUDGET = 1.0


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live descendant of `pid`."""
    parents, commands = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            command = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] == "Z":
            continue
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
        commands[int(entry.name)] = command
    found, pending = {}, [pid]
    while pending:
        parent = pending.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = commands[child]
                pending.append(child)
    return found


def compilers(server: ServerProcess) -> set[int]:
    return {pid for pid, command in _descendants(server.process.pid).items() if "grammar_worker" in command}


def engine_process(server: ServerProcess) -> int:
    engines = [pid for pid, command in _descendants(server.process.pid).items()
               if "multiprocessing" in command and "resource_tracker" not in command]
    assert len(engines) == 1, _descendants(server.process.pid)
    return engines[0]


def wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def start_server(checkpoint: str, log: Path, *options: str) -> ServerProcess:
    return ServerProcess(checkpoint, "--set", "engine.max_model_len=64", "--set", "engine.max_num_seqs=8", *options,
                         log_path=log)


def post_and_leave(url: str, body: dict, after: float) -> threading.Thread:
    """A client that sends `body` and hangs up after `after` seconds without an answer."""
    def run() -> None:
        with httpx.Client(base_url=url, timeout=after) as client:
            try:
                answers.append(client.post("/v1/completions", json=body))
            except httpx.TimeoutException:
                pass

    answers: list[httpx.Response] = []  # none, if the client left as it should

    thread = threading.Thread(target=run, daemon=True)
    thread.answers = answers
    thread.start()
    return thread


@pytest.fixture(scope="module")
def budget_server(served_checkpoint, tmp_path_factory):
    """A compile budget of BUDGET seconds, and a 2 s liveness timeout."""
    process = start_server(served_checkpoint, tmp_path_factory.mktemp("budget") / "server.log",
                           "--set", f"logits_processors.structured.compile_timeout_s={BUDGET}",
                           "--liveness-timeout", "2")
    yield process
    assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def queue_server(served_checkpoint, tmp_path_factory):
    """One grammar compiling or waiting at a time, with a budget no test reaches, and a
    liveness timeout shorter than the compilations (the loop's heartbeats go on meanwhile)."""
    process = start_server(served_checkpoint, tmp_path_factory.mktemp("queue") / "server.log",
                           "--set", "logits_processors.structured.compile_timeout_s=120",
                           "--set", "logits_processors.structured.max_pending_compiles=1",
                           "--liveness-timeout", "2")
    yield process
    assert process.terminate() == 0, process.log()


def test_a_grammar_over_its_compile_budget_is_a_400_and_the_compiler_restarts(budget_server):
    with httpx.Client(base_url=budget_server.url, timeout=60) as http:
        assert http.post("/v1/completions", json=CHOICE).status_code == 200  # the compiler runs
        before = compilers(budget_server)
        assert before
        start = time.monotonic()
        answer = http.post("/v1/completions", json={"prompt": "w5", "guided_regex": SLOW, "max_tokens": 4})
        elapsed = time.monotonic() - start
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "guided_regex" and "compile_timeout_s" in error["message"], error
        assert BUDGET * 0.9 <= elapsed < BUDGET + 3, elapsed
        assert wait_until(lambda: not compilers(budget_server) & before, 5), "the compiler was not killed"
        # a new compiler takes the next grammar
        answer = http.post("/v1/completions", json={**CHOICE, "guided_choice": ["w8", "w9"]})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] in ("w8", "w9"), answer.text
        assert compilers(budget_server) - before
        # the refusal is remembered: a repeat is refused at once
        start = time.monotonic()
        again = http.post("/v1/completions", json={"prompt": "w5", "guided_regex": SLOW, "max_tokens": 4})
        assert again.status_code == 400 and time.monotonic() - start < BUDGET * 0.9


def test_a_stopped_engine_process_fails_health_within_the_liveness_timeout(budget_server):
    engine = engine_process(budget_server)
    answers = []
    with httpx.Client(base_url=budget_server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        os.kill(engine, signal.SIGSTOP)
        try:
            asked = time.monotonic()  # work for the stopped engine: it never answers
            client = threading.Thread(target=lambda: answers.append(http.post("/v1/completions", json=PLAIN)),
                                      daemon=True)
            client.start()
            assert wait_until(lambda: http.get("/health").status_code == 503, 8)
            took = time.monotonic() - asked
            health = http.get("/health")
            assert "liveness timeout" in health.json()["error"], health.text
            assert http.get("/ready").status_code == 503
        finally:
            os.kill(engine, signal.SIGCONT)
        assert 2 <= took < 6, took
        assert wait_until(lambda: http.get("/health").status_code == 200, 5)
        client.join(30)
        assert answers and answers[0].status_code == 200, answers  # served once it went on
        assert answers[0].json()["usage"]["completion_tokens"] == 4
        assert http.get("/ready").status_code == 200


def test_a_client_that_leaves_while_its_grammar_compiles_stops_the_compilation(queue_server):
    with httpx.Client(base_url=queue_server.url, timeout=60) as http:
        assert http.post("/v1/completions", json=CHOICE).status_code == 200
        before = compilers(queue_server)
        leaving = post_and_leave(queue_server.url, {"prompt": "w5", "guided_regex": SLOW, "max_tokens": 4}, 1.0)
        leaving.join(30)
        assert not leaving.answers, leaving.answers[0].text
        left = time.monotonic()
        assert wait_until(lambda: not compilers(queue_server) & before, 5), "the compilation outlived its client"
        assert time.monotonic() - left < 3
        answer = http.post("/v1/completions", json={**CHOICE, "guided_choice": ["w8", "w9"]})
        assert answer.status_code == 200, answer.text
        queue_server.wait_metrics(lambda m: m["servelab_requests_waiting"] == 0, timeout=10)


def test_past_max_pending_compiles_a_structured_request_is_a_429_and_plain_ones_are_served(queue_server):
    with httpx.Client(base_url=queue_server.url, timeout=60) as http:
        leaving = post_and_leave(queue_server.url, {"prompt": "w5", "guided_regex": SLOW_TOO, "max_tokens": 4}, 4.0)
        queue_server.wait_metrics(lambda m: m["servelab_requests_waiting"] >= 1, timeout=3)  # it compiles
        refused = http.post("/v1/completions", json={"prompt": "w5", "guided_regex": "w5|w6", "max_tokens": 4})
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "overloaded" and "max_pending_compiles" in error["message"], error
        assert error["param"] == "guided_regex"
        for _ in range(3):
            start = time.monotonic()
            plain = http.post("/v1/completions", json=PLAIN)
            assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 4, plain.text
            assert time.monotonic() - start < 2
        assert http.get("/ready").status_code == 200
        while leaving.is_alive():  # a compilation longer than the liveness timeout is no stall
            assert http.get("/health").status_code == 200, http.get("/health").text
            time.sleep(0.1)
        leaving.join(30)
        queue_server.wait_metrics(lambda m: m["servelab_requests_waiting"] == 0, timeout=10)
        answer = http.post("/v1/completions", json={"prompt": "w5", "guided_regex": "w5|w6", "max_tokens": 4})
        assert answer.status_code == 200, answer.text


def test_sigterm_during_a_compilation_ends_the_server_by_itself(served_checkpoint, tmp_path):
    server = start_server(served_checkpoint, tmp_path / "server.log", "--shutdown-timeout", "3",
                          "--set", "logits_processors.structured.compile_timeout_s=120")
    try:
        answers = []
        client = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "w5", "guided_regex": SLOW, "max_tokens": 4},
            timeout=60)), daemon=True)
        client.start()
        assert wait_until(lambda: compilers(server), 10)
        server.wait_metrics(lambda m: m["servelab_requests_waiting"] >= 1, timeout=5)
        workers = compilers(server)
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=30)  # no SIGKILL: it ends by itself
        assert code == 0, server.log()
        assert time.monotonic() - start < 3 + 5
        client.join(10)
        assert answers and answers[0].status_code in (499, 500, 503), answers and answers[0].text
        assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in workers), 5)
    finally:
        server.terminate()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
