"""vLLM as a bench baseline, run by vLLM's own Python in a subprocess.

vLLM's pins (torch above all) may clash with servelab's, so it lives in its own virtual
environment; `--baseline-python PATH` names that environment's interpreter. The
subprocess runs `vllm_driver.py` (which imports vLLM only), starts one offline engine
with the same limits as the servelab config, and answers run / latency commands, so its
repetitions interleave with servelab's like any other config's.

vLLM's CPU engine keeps a core busy polling for about a second and a half after each
command (measured: half of a 2-core machine busy for 1-1.5 s, then idle). Each command
therefore returns only once the machine has gone quiet, so that whatever is timed next
does not share it with that polling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from servelab.errors import ConfigError
from servelab.workload import Workload

DRIVER = Path(__file__).with_name("vllm_driver.py")
RESULT_PREFIX = "@@servelab-vllm@@ "
INSTALL_HINT = ("install vLLM's CPU build in its own virtual environment (see docs/bench.md, "
                "'vLLM baseline') and pass its interpreter with --baseline-python PATH")


def vllm_environment(python: str, threads: int | None = None) -> dict[str, str]:
    """The environment vLLM's CPU build wants: CPU target, a small KV space, threads bound
    to every core (or to cores 0..threads-1), offline hub, and tcmalloc + Intel OpenMP
    preloaded where present."""
    bind = "auto" if threads is None else ("0" if threads == 1 else f"0-{threads - 1}")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0", HF_HUB_OFFLINE="1")
    preload = [path for path in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                 str(Path(python).resolve().parent.parent / "lib" / "libiomp5.so"),
                                 str(Path(python).parent.parent / "lib" / "libiomp5.so"))
               if Path(path).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(dict.fromkeys(preload))
    return env


def check_python(python: str | None) -> str:
    """The interpreter to run vLLM with, or a ConfigError that says how to get one."""
    if python is None:
        raise ConfigError(f"--baseline vllm needs vLLM's interpreter: {INSTALL_HINT}")
    if not Path(python).exists():
        raise ConfigError(f"--baseline-python {python!r} does not exist; {INSTALL_HINT}")
    probe = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
                           capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
        raise ConfigError(f"{python} cannot import vllm; {INSTALL_HINT}")
    return python


class VllmBaseline:
    """One vLLM engine in a subprocess, with servelab's limits, answering bench commands."""

    name = "vllm"

    def __init__(self, python: str, model_dir: str, dtype: str, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, log_path: Path | None = None, threads: int | None = None) -> None:
        self._log = open(log_path, "w") if log_path else tempfile.TemporaryFile("w+")
        command = [check_python(python), str(DRIVER), "--model", model_dir, "--dtype", dtype,
                   "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                   "--max-num-batched-tokens", str(max_num_batched_tokens)]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._log, text=True, env=vllm_environment(python, threads))
        self.start_seconds = self._read()["start_seconds"]
        self._workload_dir = tempfile.TemporaryDirectory(prefix="servelab-vllm-")

    def run(self, workload: Workload) -> dict[str, Any]:
        """Offline throughput on `workload` (greedy, ignore_eos, every request at once)."""
        path = Path(self._workload_dir.name) / "workload.jsonl"
        workload.save(path)
        return self._ask({"cmd": "run", "workload": str(path)})

    def latency(self, prompt_len: int, max_tokens: int, repeats: int) -> dict[str, Any]:
        """Batch-1 TTFT and TPOT in ms, one entry per repetition, sorted."""
        return self._ask({"cmd": "latency", "prompt_len": prompt_len, "max_tokens": max_tokens, "repeats": repeats})

    def memory(self) -> dict[str, Any]:
        """The driver's peak RSS and its engine processes' current RSS, in bytes."""
        return self._ask({"cmd": "memory"})

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self._process.stdin.flush()
                self._process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
        self._workload_dir.cleanup()
        self._log.close()

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        answer = self._read()
        wait_until_idle()
        return answer

    def _read(self) -> dict[str, Any]:
        for line in self._process.stdout:
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX):])
            if os.environ.get("SERVELAB_VLLM_VERBOSE"):
                sys.stderr.write(line)
        self._log.flush()
        raise RuntimeError(f"the vLLM driver exited (code {self._process.wait()}) before answering; "
                           f"its log: {getattr(self._log, 'name', 'stderr')}")


def wait_until_idle(threshold: float = 0.15, period_s: float = 0.25, limit_s: float = 5.0) -> None:
    """Return once the machine's CPUs were less than `threshold` busy over one `period_s`
    (read from /proc/stat), or after `limit_s`; elsewhere than Linux, after 2 s."""
    if not os.path.exists("/proc/stat"):
        time.sleep(2.0)
        return
    deadline = time.monotonic() + limit_s
    before = _cpu_times()
    while time.monotonic() < deadline:
        time.sleep(period_s)
        after = _cpu_times()
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0 and busy / total < threshold:
            return
        before = after


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs: user, nice, system, irq, softirq, steal are busy."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:9]]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]
    return busy, sum(fields)
