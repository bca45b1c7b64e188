"""Fixtures and helpers for the server tests (loaded with `pytest_plugins`): a tiny
checkpoint with a word-level tokenizer and a chat template, real `servelab serve`
processes on 127.0.0.1, and a throttle that makes any process a slow peer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

# The checkpoint's own chat template: HF's variables (bos_token, messages, add_generation_prompt).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def add_word_tokenizer(path: Path, vocab_size: int = 211) -> None:
    """A word-level tokenizer.json: "<unk>" 0, "<s>" 1, "</s>" 2, then "w3" .. "w{vocab_size-1}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="session")
def served_checkpoint(llama_checkpoint, tmp_path_factory) -> str:
    """The tiny Llama with a word-level tokenizer and a chat template in tokenizer_config.json."""
    path = tmp_path_factory.mktemp("served") / "ckpt"
    shutil.copytree(llama_checkpoint, path)
    add_word_tokenizer(path)
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


class ServerProcess:
    """A `servelab serve` subprocess on 127.0.0.1 with a free port; stderr goes to a file."""

    def __init__(self, model: str, *args: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        # float32, as the offline engines these tests compare the server with; the server's own
        # default (bfloat16 on a CPU that computes it natively) is test_serving_defaults'.
        pinned = () if any(arg == "--dtype" or arg.startswith("engine.dtype=") for arg in args) else ("--dtype",
                                                                                                       "float32")
        command = [sys.executable, "-m", "servelab.cli", "-v", "serve", "--model", model, "--host", "127.0.0.1",
                   "--port", "0", *pinned, *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self.url = self._wait_ready()

    def _wait_ready(self, timeout: float = 90.0) -> str:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)  # the ready line comes once the server listens; "" if it died first
        if not lines or "on http://" not in lines[0]:
            self.process.kill()
            raise RuntimeError(f"server did not start: {lines!r}\n{self.log()}")
        return lines[0].rsplit(" ", 1)[-1].strip()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        from servelab.server.loadgen import parse_metrics

        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def wait_metrics(self, predicate, timeout: float = 5.0) -> dict[str, float]:
        """Poll /metrics until `predicate(metrics)` holds; fails with the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if predicate(metrics):
                return metrics
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics never satisfied the condition: {metrics}")
            time.sleep(0.01)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code (killed after `timeout` seconds)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.process.stdout.close()
        self._log.close()
        return code


def sse_events(response: httpx.Response):
    """The JSON payloads of a server-sent event stream, then the string "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


class Throttle:
    """A slow peer: process `pid` stopped (SIGSTOP) for `stopped_s`, then running (SIGCONT)
    for `running_s`, over and over, from the `with` block's start (stopped before its
    first statement) to its end (the process then runs on). `stops` counts the pauses."""

    def __init__(self, pid: int, stopped_s: float = 0.05, running_s: float = 0.05) -> None:
        self.pid, self.stopped_s, self.running_s = pid, stopped_s, running_s
        self.stops = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"throttle-{pid}", daemon=True)

    def __enter__(self) -> "Throttle":
        self._pause()
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()
        self._signal(signal.SIGCONT)

    def _run(self) -> None:
        while not self._done.wait(self.stopped_s):
            if not self._signal(signal.SIGCONT) or self._done.wait(self.running_s) or not self._pause():
                return

    def _pause(self) -> bool:
        if not self._signal(signal.SIGSTOP):
            return False
        self.stops += 1
        return True

    def _signal(self, signum: int) -> bool:
        """Whether the process was there to take it."""
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True
