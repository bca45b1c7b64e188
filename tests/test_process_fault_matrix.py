"""The fault matrix of the server's processes: the engine process, the grammar compiler,
the codec workers (threads of the server's own process), the tensor-parallel ranks,
Ray replicas and prefill/decode replicas, each crossed with SIGKILL, SIGSTOP and a slow
peer. docs/serving.md ("Failure model") maps every cell to its test; this module holds
the cells no other module covers (the Ray ones sit beside their modules' servers).

A slow peer is a process throttled with SIGSTOP / SIGCONT (conftest_server.Throttle)
that stays inside its timeouts: every request is answered as without the throttle
(greedy tokens equal), nothing fails or restarts, /health stays 200, no KV block is
left held. A killed or hung process fails only what it held, by name."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

import conftest_server
from conftest_server import CHAT_TEMPLATE, ServerProcess, Throttle
from test_server_compiles import SLOW, _alive, _descendants, compilers, engine_process, post_and_leave, wait_until

served_checkpoint = conftest_server.served_checkpoint  # the fixture

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the tests read Linux's /proc")

LIVENESS_TIMEOUT = 4.0  # well above the throttles' pauses, so a busy machine's delays are no silence
GREEDY = {"temperature": 0.0, "return_token_ids": True}
PROMPTS = ["w5 w6 w7", "w8 w9", "w10 w11 w12 w13", "w14"]
MESSAGES = [{"role": "user", "content": "w5 w6"}]
USED_BLOCKS = 'servelab_kv_blocks{state="used"}'
FINISHED_WITH_ERROR = 'servelab_requests_finished_total{finish_reason="error"}'
# ~0.5 s of a compiler's CPU time over the test tokenizer (37 alternatives of up to 8 words)
GRAMMAR_ALTERNATIVES = [f"(w{i}){{1,8}}" for i in range(3, 40)]


@pytest.fixture(scope="module")
def server(served_checkpoint, tmp_path_factory):
    """One engine process on one thread (a throttled process's torch threads would wait for each
    other), a short liveness timeout, request chat templates trusted."""
    process = ServerProcess(served_checkpoint, "--set", "engine.max_model_len=256", "--set", "engine.max_num_seqs=8",
                            "--engine-threads", "1", "--liveness-timeout", str(LIVENESS_TIMEOUT),
                            "--trust-request-chat-template",
                            log_path=tmp_path_factory.mktemp("matrix") / "server.log")
    yield process
    code = process.terminate()
    if not getattr(process, "killed_by_test", False):
        log = process.log_path.read_text()
        assert code == 0 and "kv_blocks_used=0" in log, log


def ask_all(server: ServerProcess, bodies: list[dict], path: str = "/v1/completions") -> list[httpx.Response]:
    """Every body posted at once (one batch in the engine)."""
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: httpx.post(f"{server.url}{path}", json=body, timeout=60), bodies))


def token_ids(reply: httpx.Response) -> list[int]:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settled(metrics: dict[str, float]) -> bool:
    """No KV block held, no request ended with an error."""
    return metrics[USED_BLOCKS] == 0 and metrics.get(FINISHED_WITH_ERROR, 0.0) == 0


class HealthWatch:
    """/health polled on a thread for as long as the `with` block runs; `codes` are its answers."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.codes: list[int] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._done.wait(0.05):
                self.codes.append(client.get("/health").status_code)


# ---------------------------------------------------------------- the engine process


def test_a_throttled_engine_process_answers_as_unthrottled_and_stays_live(server):
    """Stopped most of the time, 0.3 s at a time (under the liveness timeout): the same
    tokens, /health 200 throughout, no error, no block held."""
    bodies = [{"prompt": prompt, "max_tokens": 64, "ignore_eos": True, **GREEDY} for prompt in PROMPTS]
    expected = [token_ids(reply) for reply in ask_all(server, bodies)]
    with HealthWatch(server.url) as health, Throttle(engine_process(server), stopped_s=0.3, running_s=0.03) as slow:
        answers = ask_all(server, bodies)
    assert [token_ids(reply) for reply in answers] == expected
    assert slow.stops >= 2, slow.stops  # it was stopped while it served them
    assert health.codes and set(health.codes) == {200}, health.codes
    server.wait_metrics(settled, timeout=10)


# ---------------------------------------------------------------- the grammar compiler process


def test_a_killed_compiler_fails_only_the_grammar_it_compiled_and_is_restarted(server):
    """SIGKILL of the compiler while idle: the next grammar gets a new one. While it
    compiles: that request is a 500 naming the death, the grammar is not remembered as
    refused, and plain and structured requests go on being served."""
    choice = {"prompt": "w5", "max_tokens": 4, "guided_choice": ["w7", "w9"]}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/v1/completions", json=choice).status_code == 200  # a compiler runs
        [idle] = compilers(server)
        os.kill(idle, signal.SIGKILL)
        answer = http.post("/v1/completions", json={**choice, "guided_choice": ["w8", "w11"]})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] in ("w8", "w11"), answer.text
        [compiler] = compilers(server)
        assert compiler != idle
        slow = {"prompt": "w5", "guided_regex": SLOW, "max_tokens": 4}
        asking = post_and_leave(server.url, slow, 60.0)
        started = cpu_seconds(compiler)
        assert wait_until(lambda: cpu_seconds(compiler) > started + 0.2, 10), "the compiler never got the grammar"
        os.kill(compiler, signal.SIGKILL)
        asking.join(30)
        [failed] = asking.answers
        assert failed.status_code == 500, failed.text
        message = failed.json()["error"]["message"]
        assert "the grammar compiler process died (killed by SIGKILL) while it compiled the regex" in message
        assert "retry" in message
        # not remembered as the grammar's fault: a repeat compiles again, not a 400 at once
        # (its client leaves after a second, which stops that compilation)
        again = post_and_leave(server.url, slow, 1.0)
        again.join(30)
        assert not again.answers, again.answers[0].text
        assert wait_until(lambda: not compilers(server), 5), "the abandoned compilation went on"
        assert http.post("/v1/completions", json=choice).status_code == 200  # cached: no compiler needed
        plain = http.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 4, "ignore_eos": True})
        assert plain.status_code == 200, plain.text
        assert http.get("/health").status_code == 200
    server.wait_metrics(lambda m: m[USED_BLOCKS] == 0 and m["servelab_requests_waiting"] == 0, timeout=10)


def test_a_throttled_compiler_compiles_as_unthrottled_and_is_not_restarted(server):
    """A compiler stopped half the time compiles a grammar inside its budget: the same
    greedy output as the same language compiled unthrottled, and it is not taken for a
    stalled compiler (same process, no error)."""
    body = {"prompt": "w5", "max_tokens": 6, **GREEDY}
    expected = token_ids(httpx.post(f"{server.url}/v1/completions", timeout=60,
                                    json={**body, "guided_regex": "|".join(GRAMMAR_ALTERNATIVES)}))
    [compiler] = compilers(server)
    before = cpu_seconds(compiler)
    with Throttle(compiler, stopped_s=0.05, running_s=0.05) as slow:
        # the same language spelt in another order: another grammar to compile
        answer = httpx.post(f"{server.url}/v1/completions", timeout=60,
                            json={**body, "guided_regex": "|".join(reversed(GRAMMAR_ALTERNATIVES))})
    assert token_ids(answer) == expected
    assert cpu_seconds(compiler) - before > 0.1 and slow.stops >= 3  # it compiled while throttled
    assert compilers(server) == {compiler}
    server.wait_metrics(settled, timeout=10)


# ---------------------------------------------------------------- the codec workers (threads)


def test_a_request_template_that_raises_fails_its_request_alone_as_the_client_s_fault(server):
    """A codec worker is a thread: it cannot be killed alone. An exception in one (a
    request's own template dividing by zero) fails that request with a 400 naming it."""
    chat = {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True, **GREEDY}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        failed = http.post("/v1/chat/completions", json={**chat, "chat_template": "{{ 1 / 0 }}"})
        assert failed.status_code == 400, failed.text
        assert "ZeroDivisionError: division by zero" in failed.json()["error"]["message"]
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        assert http.get("/health").status_code == 200


def test_a_slow_request_template_is_answered_as_the_server_s_own_beside_other_requests(server):
    """A request's template that takes a while (inside its 2 s budget) holds one codec
    worker: its answer is the server's own template's, and the requests beside it are
    answered as without it."""
    chat = {"messages": MESSAGES, "max_tokens": 8, "ignore_eos": True, **GREEDY}
    plain = [{"prompt": prompt, "max_tokens": 8, "ignore_eos": True, **GREEDY} for prompt in PROMPTS]
    expected_chat = token_ids(httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60))
    expected_plain = [token_ids(reply) for reply in ask_all(server, plain)]
    slow_template = "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}" + CHAT_TEMPLATE
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, f"{server.url}/v1/chat/completions",
                           json={**chat, "chat_template": slow_template}, timeout=60)
        beside = ask_all(server, plain)
        assert token_ids(slow.result()) == expected_chat
    assert [token_ids(reply) for reply in beside] == expected_plain
    server.wait_metrics(settled, timeout=10)


# ---------------------------------------------------------------- tensor-parallel ranks


def test_a_throttled_tensor_parallel_rank_gives_the_same_tokens(checkpoint_factory):
    """Rank 1 stopped most of the time, far inside tensor_parallel_timeout_s: rank 0 waits
    for it at each collective, and the tokens are the unthrottled ones."""
    from servelab import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    with LLM(checkpoint_factory("llama"), max_model_len=96, tensor_parallel_size=2,
             tensor_parallel_timeout_s=30) as llm:
        expected = [output.token_ids for output in llm.generate(prompts, params)]
        (rank,) = llm.engine.runner._ranks.workers.processes.values()
        with Throttle(rank.pid, stopped_s=0.05, running_s=0.02) as slow:
            answers = [output.token_ids for output in llm.generate(prompts, params)]
        assert answers == expected
        assert slow.stops >= 3, slow.stops
        assert llm.engine.allocator.stats().num_used_blocks == 0
        assert rank.poll() is None  # still serving


# ---------------------------------------------------------------- refused at start


@pytest.mark.parametrize("arguments,message", [
    (["--liveness-timeout", "0.5"], "--liveness-timeout must be at least 1 s for an engine, got 0.5"),
    (["--replicas", "2", "--liveness-timeout", "0.9"], "--liveness-timeout must be at least 1 s for an engine"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--liveness-timeout", "1.5"],
     "--liveness-timeout must be at least 2 s for prefill and decode replicas, got 1.5"),
], ids=["engine", "replicas", "prefill-decode"])
def test_a_liveness_timeout_live_engines_cannot_meet_is_refused_at_start(arguments, message, capsys):
    """Shorter than a live engine's silences (a heartbeat, a replica's poll), the watchdogs
    would take healthy engines for stopped ones: /health 503, replicas out of rotation,
    prefill and decode replicas killed. Refused before anything starts."""
    from servelab.cli import main

    assert main(["serve", "--model", "builtin:tiny", *arguments]) == 2
    error = capsys.readouterr().err
    assert error.startswith("servelab: error: ") and message in error, error


# ---------------------------------------------------------------- the server's own process (runs last: it kills it)


def test_a_killed_server_process_leaves_no_engine_or_compiler_behind(server):
    """The codec workers live in the server's own process. Killed with SIGKILL (no
    shutdown runs), its engine process and grammar compiler end by themselves: the engine
    sees its command pipe close, the compiler its parent die."""
    reply = httpx.post(f"{server.url}/v1/completions", timeout=60,  # a grammar no test compiled: a compiler runs
                       json={"prompt": "w5", "max_tokens": 4, "guided_choice": ["w7", "w12"]})
    assert reply.status_code == 200, reply.text
    children = _descendants(server.process.pid)
    assert engine_process(server) in children and compilers(server), children
    server.killed_by_test = True
    server.process.kill()
    assert server.process.wait(10) == -signal.SIGKILL
    assert wait_until(lambda: not any(_alive(pid) for pid in children), 10), \
        {pid: command for pid, command in children.items() if _alive(pid)}
