"""The CPU speed table (docs/performance.md): servelab vs vLLM's CPU build vs transformers,
in one run on one machine.

For each dtype: offline throughput on the skewed 64-request workload (interleaved
repetitions, median and min-max), batch-1 TTFT and TPOT on a 128-token prompt against the
memory-bandwidth roofline (weights read per token / the mean of the read bandwidth probed
right before and right after the batch-1 runs), then cold start to first token with the
default config and peak memory of a throughput run.

    OMP_NUM_THREADS=2 python examples/speed_figures.py --vllm-python ../peers/vllm/bin/python \
        --json speed.json
    python examples/measurements/gguf_as_hf.py smollm2-135m ../peers/smollm2-hf   # a real model:
    OMP_NUM_THREADS=2 python examples/speed_figures.py --model ../peers/smollm2-hf --vllm-python ...

Without --vllm-python the vLLM column is left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from servelab import LLM, SamplingParams
from servelab.bench.hf_baseline import HfStaticBaseline
from servelab.bench.sim.shapes import num_parameters
from servelab.logging_setup import configure_logging
from servelab.workload import Workload, build_workload

WORKLOAD = "skewed:num_requests=64"
LIMITS = {"max_model_len": 512, "max_num_seqs": 64, "max_num_batched_tokens": 2048}
PROMPT = [(7 * i) % 8000 + 3 for i in range(128)]


def attention_settings(name: str) -> dict[str, str]:
    """The backend, and for cpu-paged its kernels built before timing starts (not mid-run)."""
    return {"attention.name": name, **({"attention.build": "wait"} if name == "cpu-paged" else {})}


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 7) -> float:
    """Best of `repeats` full reads of a tensor far larger than the caches."""
    data = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def weight_bytes_per_token(llm: LLM, dtype: torch.dtype) -> int:
    """Bytes of weights one decode step reads: the decoder layers and the LM head (the
    embedding table contributes one row)."""
    layer_params, head_params = num_parameters(llm.engine.model_config)
    return (layer_params + head_params) * torch.finfo(dtype).bits // 8


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def servelab_latency(llm: LLM, repeats: int) -> dict[str, list[float]]:
    ttft, tpot = [], []
    for _ in range(repeats):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
        ttft.append(out.metrics.ttft * 1000)
        tpot.append((out.metrics.e2e_latency - out.metrics.ttft) / 63 * 1000)
    return {"ttft_ms": sorted(ttft), "tpot_ms": sorted(tpot)}


def hf_latency(model, repeats: int) -> dict[str, list[float]]:
    ids = torch.tensor([PROMPT])
    ttft, tpot = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None)
            first = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
            ttft.append(first * 1000)
            tpot.append((time.perf_counter() - start - first) / 63 * 1000)
    return {"ttft_ms": sorted(ttft), "tpot_ms": sorted(tpot)}


def servelab_run(llm: LLM, workload: Workload) -> float:
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate([list(r.prompt_token_ids) for r in workload.requests], params)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def measure_dtype(dtype: str, args) -> dict:
    engines = {}
    llm = LLM(args.model, dtype=dtype, **LIMITS, **attention_settings(args.attention))
    workload = build_workload(WORKLOAD, llm.engine.model_config.vocab_size)
    warm = Workload("warm-up", tuple(sorted(workload.requests, key=lambda r: -len(r.prompt_token_ids))[:8]))
    servelab_run(llm, warm)
    engines["servelab"] = (lambda: servelab_run(llm, workload), lambda: servelab_latency(llm, args.repeats))
    path = str(llm.engine.source.path)
    if not args.no_transformers:
        hf = HfStaticBaseline(path, dtype, 8, list(warm.requests))
        engines["transformers (static batch 8)"] = (lambda: hf.run(workload)["output_tokens_per_s"],
                                                     lambda: hf_latency(hf.model, args.repeats))
    vllm = None
    if args.vllm_python:
        from servelab.bench.vllm_baseline import VllmBaseline

        vllm = VllmBaseline(args.vllm_python, path, dtype, LIMITS["max_model_len"], LIMITS["max_num_seqs"],
                            LIMITS["max_num_batched_tokens"], threads=args.threads)
        vllm.run(warm)
        engines["vLLM CPU"] = (lambda: vllm.run(workload)["output_tokens_per_s"],
                               lambda: vllm.latency(len(PROMPT), 64, args.repeats))
    throughput = {name: [] for name in engines}
    for repeat in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
        for name, (run, _) in engines.items():
            if not name.startswith("transformers") or repeat < args.hf_repeats:
                throughput[name].append(run())
                progress(f"{dtype} repetition {repeat + 1}/{args.repeats}: {name} {throughput[name][-1]:.1f} tok/s")
    latency = {}
    # The host's read bandwidth moves by the minute (35 to 64 GB/s within an hour on a shared
    # machine): the roofline is probed right before and after the batch-1 runs it divides.
    around = [read_bandwidth_gbs()]
    for name, (_, measure) in engines.items():
        latency[name] = measure()
        progress(f"{dtype} batch 1: {name} TPOT {statistics.median(latency[name]['tpot_ms']):.2f} ms")
    around.append(read_bandwidth_gbs())
    bandwidth = statistics.mean(around)
    result = {"roofline_tpot_ms": weight_bytes_per_token(llm, getattr(torch, dtype)) / bandwidth / 1e6,
              "read_bandwidth_gbs_around_batch_1": around,
              "weight_bytes_per_token": weight_bytes_per_token(llm, getattr(torch, dtype)),
              "vllm_start_seconds": vllm.start_seconds if vllm else None, "engines": {}}
    for name in engines:
        result["engines"][name] = {"output_tokens_per_s": sorted(throughput[name]), **latency[name]}
    if vllm:
        result["vllm_memory"] = vllm.memory()
        vllm.close()
    return result


def cold_start_seconds() -> float:
    """A fresh process with the default config, from launch to its first generated token."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "servelab.cli", "generate", "--prompt", "def f(x):",
                                "--max-tokens", "1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    process.stdout.read(1)
    elapsed = time.perf_counter() - start
    process.wait()
    return elapsed


PEAK_SCRIPT = """
import math, torch
torch.set_num_threads({threads})
from safetensors import safe_open
from servelab import LLM, SamplingParams
from servelab.workload import build_workload
llm = LLM("{model}", dtype="{dtype}", max_model_len=512, max_num_seqs=64, max_num_batched_tokens=2048,
          **{attention})
w = build_workload("{workload}", llm.engine.model_config.vocab_size)
llm.generate([list(r.prompt_token_ids) for r in w.requests],
             [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in w.requests])
with safe_open(str(llm.engine.source.path / "model.safetensors"), "pt") as f:
    weights = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * torch.finfo(torch.{dtype}).bits // 8
kv = sum(c.numel() * c.element_size() for pair in llm.engine.runner.kv_caches for c in pair)
# VmHWM: this process's own peak (ru_maxrss can carry the parent's peak across fork + exec)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(peak * 1024, weights, kv)
"""


def peak_memory(model: str, dtype: str, attention: str, threads: int) -> dict:
    """Peak RSS of a fresh process running the workload once, against the model's weights
    (checkpoint parameters in `dtype`) plus the KV pool."""
    script = PEAK_SCRIPT.format(model=model, dtype=dtype, workload=WORKLOAD, attention=attention_settings(attention), threads=threads)
    out = subprocess.run([sys.executable, "-c", script],
                         capture_output=True, text=True, check=True).stdout.split()
    rss, weights, kv = map(int, out[-3:])
    return {"peak_rss_bytes": rss, "weights_bytes": weights, "kv_pool_bytes": kv,
            "rss_over_weights_plus_kv": rss / (weights + kv)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="Python of a venv with vLLM's CPU build (docs/bench.md)")
    parser.add_argument("--model", default="builtin:tiny-random",
                        help="an HF checkpoint directory every engine loads (examples/measurements/gguf_as_hf.py "
                             "writes one from a GGUF model)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-repeats", type=int, default=1, help="transformers is slow: fewer repetitions")
    parser.add_argument("--no-transformers", action="store_true",
                        help="leave transformers out (on a 30-layer model its runs take longer than the rest)")
    parser.add_argument("--attention", default="cpu-paged", help="attention backend (default: the engine's default)")
    parser.add_argument("--threads", type=int, help="threads for every engine (default: torch's, one per core)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    configure_logging(0)
    args.bandwidth = read_bandwidth_gbs()
    figures = {"model": args.model, "read_bandwidth_gbs": args.bandwidth, "workload": WORKLOAD, "limits": LIMITS,
               "threads": torch.get_num_threads(), "dtypes": {}}
    for dtype in args.dtypes.split(","):
        figures["dtypes"][dtype] = measure_dtype(dtype, args)
        figures["dtypes"][dtype]["memory"] = peak_memory(args.model, dtype, args.attention, torch.get_num_threads())
    figures["cold_start_to_first_token_s"] = sorted(cold_start_seconds() for _ in range(3))
    print_table(figures)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)


def print_table(figures: dict) -> None:
    print(f"read bandwidth {figures['read_bandwidth_gbs']:.1f} GB/s at the start, {figures['threads']} threads, "
          f"workload {figures['workload']}")
    print(f"{'dtype':9} {'engine':30} {'out tok/s (min-max)':>24} {'TTFT ms':>8} {'TPOT ms (min-max)':>20} {'/roofline':>9}")
    for dtype, result in figures["dtypes"].items():
        roofline = result["roofline_tpot_ms"]
        for name, m in result["engines"].items():
            tput, tpot = m["output_tokens_per_s"], m["tpot_ms"]
            print(f"{dtype:9} {name:30} {statistics.median(tput):8.1f} ({min(tput):.0f}-{max(tput):.0f}){'':6} "
                  f"{statistics.median(m['ttft_ms']):8.1f} {statistics.median(tpot):8.2f} ({min(tpot):.1f}-{max(tpot):.1f})"
                  f"{statistics.median(tpot) / roofline:8.2f}x")
        around = result["read_bandwidth_gbs_around_batch_1"]
        print(f"{dtype:9} {'roofline':30} {'':24} {'':8} {roofline:8.2f}  (read bandwidth "
              f"{around[0]:.1f} before the batch-1 runs, {around[1]:.1f} after)")
        memory = result["memory"]
        print(f"{dtype:9} servelab peak RSS {memory['peak_rss_bytes'] / 2**20:.0f} MiB = "
              f"{memory['rss_over_weights_plus_kv']:.2f}x (weights + KV pool)")
        if "vllm_memory" in result:
            vllm_rss = result["vllm_memory"]["self_peak_rss_bytes"] + result["vllm_memory"]["children_peak_rss_bytes"]
            print(f"{dtype:9} vLLM resident memory {vllm_rss / 2**20:.0f} MiB (driver peak + engine processes now); "
                  f"start {result['vllm_start_seconds']:.0f} s")
    print(f"cold start to first token (default config): {figures['cold_start_to_first_token_s']}")


if __name__ == "__main__":
    main()
