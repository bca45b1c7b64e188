"""Naive vs paged vs radix KV allocation, measured in one process on two workloads.

    python examples/allocator_figures.py --threads 1      # builtin:tiny-random, a few minutes on 2 cores
    python examples/allocator_figures.py --quick          # smaller workloads, for a smoke run

Each allocator gets the same KV pool (`--pool-seqs` max_model_len sequences' worth) and
runs each workload once, every request arriving at t=0, greedy:

- skewed: prompt and output lengths log-normal (many short, a few long), max_model_len 512;
- shared-prefix: one long system prompt (1,000 tokens) + short distinct questions,
  max_model_len 2048.

Per run it prints: KV memory wasted (reserved-but-empty + free-but-unusable slots) as a
fraction of the pool, averaged over steps and at its peak; the peak share of the pool
held by sequences; the most sequences running at once; prompt tokens actually computed (prefill, recomputation after preemption
included); preemptions; prefix-cache hit rate; TTFT p50; output tokens/s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import servelab
from servelab import LLM, PluginRegistry, SamplingParams
from servelab.logging_setup import configure_logging
from servelab.workload import shared_prefix, skewed

ALLOCATORS = ("naive", "paged", "radix")


class Recorder:
    """Observer plugin: every step's report."""

    def __init__(self) -> None:
        self.reports = []

    @servelab.hookimpl
    def servelab_step_finished(self, engine, report):
        self.reports.append(report)


def run(allocator: str, requests, model: str, max_model_len: int, num_kv_blocks: int, block_size: int) -> dict:
    recorder = Recorder()
    registry = PluginRegistry.from_entry_points()
    registry.register(recorder)
    llm = LLM(model, registry=registry, max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
              block_size=block_size, max_num_seqs=64, **{"allocator.name": allocator})
    vocab = llm.engine.model_config.vocab_size
    llm.generate([[random.Random(1).randrange(3, vocab) for _ in range(16)]], SamplingParams(max_tokens=2))  # warm-up
    recorder.reports.clear()
    stats_before = llm.engine.allocator.stats()
    preemptions_before = llm.engine.scheduler.stats().num_preemptions
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params)
    seconds = time.perf_counter() - start
    stats = llm.engine.allocator.stats()
    reports = recorder.reports
    waste = [r.allocator_stats.waste_fraction for r in reports]
    num_output = sum(len(o.token_ids) for o in outputs)
    # Every output token but each request's first needed one decode token.
    decode_tokens = num_output - len(outputs)
    lookups = stats.prefix_lookup_tokens - stats_before.prefix_lookup_tokens
    return {
        "waste_mean": statistics.fmean(waste),
        "waste_peak": max(waste),
        "used_peak": max(r.allocator_stats.num_used_blocks / r.allocator_stats.num_blocks for r in reports),
        "max_running": max(r.scheduler_stats.num_running for r in reports),
        "prefill_tokens": sum(r.num_scheduled_tokens for r in reports) - decode_tokens,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "preemptions": llm.engine.scheduler.stats().num_preemptions - preemptions_before,
        "hit_rate": (stats.prefix_hit_tokens - stats_before.prefix_hit_tokens) / lookups if lookups else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(o.metrics.ttft for o in outputs),
        "tokens_per_s": num_output / seconds,
        "seconds": seconds,
        "outputs": [o.token_ids for o in outputs],
    }


def table(title: str, results: dict[str, dict]) -> str:
    lines = [f"### {title}", "",
             "| allocator | KV wasted, mean | KV wasted, peak | KV in use, peak | most running "
             "| prefill tokens computed | preemptions | prefix hits | TTFT p50 | out tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['waste_mean']:.1%} | {r['waste_peak']:.1%} | {r['used_peak']:.1%} | {r['max_running']} "
            f"| {r['prefill_tokens']:,} of {r['prompt_tokens']:,} | {r['preemptions']} | {r['hit_rate']:.1%} "
            f"| {r['ttft_p50_ms']:,.0f} ms | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-random")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-seqs", type=int, default=8,
                        help="KV pool size, in max_model_len sequences (naive's concurrency)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--threads", type=int, help="torch threads (1 keeps a shared machine's cores from thrashing)")
    args = parser.parse_args()
    configure_logging()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    vocab = LLM(args.model, max_model_len=64, num_kv_blocks=64).engine.model_config.vocab_size
    quick = args.quick
    workloads = {
        "skewed": (512, skewed(random.Random(0), vocab, num_requests=24 if quick else 64, mean_prompt_len=128,
                               mean_output_len=128 if not quick else 32, sigma=0.8, max_len=512)),
        "shared-prefix": (2048, shared_prefix(random.Random(0), vocab, num_groups=1,
                                              prefix_len=400 if quick else 1000, num_requests=12 if quick else 32,
                                              tail_len=32, output_len=32)),
    }
    for name, (max_model_len, requests) in workloads.items():
        num_kv_blocks = args.pool_seqs * -(-max_model_len // args.block_size)
        print(f"{name}: {len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests):,} prompt tokens, "
              f"{sum(r.max_tokens for r in requests):,} output tokens; max_model_len {max_model_len}, "
              f"pool {num_kv_blocks} blocks x {args.block_size} = {num_kv_blocks * args.block_size:,} slots",
              flush=True)
        results = {}
        for allocator in ALLOCATORS:
            results[allocator] = run(allocator, requests, args.model, max_model_len, num_kv_blocks, args.block_size)
            print(f"  {allocator}: {results[allocator]['seconds']:.1f} s", flush=True)
        same = all(r["outputs"] == results["paged"]["outputs"] for r in results.values())
        print()
        print(table(f"{name} (greedy outputs identical across allocators: {'yes' if same else 'NO'})", results))
        print(flush=True)


if __name__ == "__main__":
    main()
