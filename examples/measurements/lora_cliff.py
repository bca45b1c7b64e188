"""The LoRA eviction cliff under arrivals, real and simulated (docs/lora.md).

    python examples/measurements/lora_cliff.py --rates 2,4,8 --out lora-cliff.json

1. Fits a served `cpu-here`-style profile to the base model alone, as `servelab bench
   --calibrate` does (offline step terms in CPU time, then speed, per-step overhead,
   admission and wake-up on continuous batching at 2 and 8 requests/s), at one thread.
2. For each residency policy and rate: more adapters than fast-pool slots (`--adapters`
   over `--slots`, Zipf popularity, Poisson arrivals) served for real in wall-clock time,
   and the same requests through the simulator with the same policy objects and the
   fitted profile, which never saw an adapter: what LoRA adds (each step's shrink and
   expand, each pool load over the host link) is the cost model's own pricing.

Prints, real / simulated (ratio): output tok/s, TTFT and TPOT p50 and p90, and pool loads
a step. Run it on a quiet machine; it takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import attrs

from servelab.bench.bench_adapters import write_bench_adapters
from servelab.bench.metrics import SLO
from servelab.bench.sim.calibrate import KINDS, fit, measure, step_features
from servelab.bench.sim.latency_check import (FIT, default_cases, fit_served, latency_figures, latency_profile,
                                              serve_real, serve_sim)
from servelab.config import EngineConfig
from servelab.model_source import CheckpointSource
from servelab.workload import build_workload

POLICIES = ("lru", "lfu", "queue-aware", "pinned")
FIGURES = ("output_tokens_per_s", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "loads_per_step")


def base_config(model: str) -> EngineConfig:
    return EngineConfig().with_overrides({"engine.model": model, "engine.max_model_len": 512,
                                          "engine.max_num_seqs": 16})


def lora_config(model: str, policy: str, slots: int) -> EngineConfig:
    pinned = {"adapter_residency.pinned": ["adapter-0"], "engine.max_loras_per_batch": slots - 1}
    return base_config(model).with_overrides({"engine.enable_lora": True, "engine.max_loras": slots,
                                              "engine.max_cpu_loras": 2 * slots, "adapter_residency.name": policy,
                                              **(pinned if policy == "pinned" else {})})


def fitted_profile(model: str):
    """The base model's served profile at one thread (what --calibrate fits)."""
    config = base_config(model)
    vocab = CheckpointSource(model).model_config.vocab_size
    measured = measure(config, [build_workload(spec, vocab) for spec in KINDS.values()], repeats=3)
    terms = fit([sample for m in measured for sample in m.samples])
    served = [serve_real(config.with_overrides(case.overrides), build_workload(case.workload, vocab), 1)
              for case in default_cases(60) if case.role == FIT]
    served_fit = fit_served(served, terms, step_features(config))
    return latency_profile(terms, served_fit.speed, served_fit.step_overhead_s, 1, served_fit.admission_s,
                           served_fit.residuals_s, served_fit.wake_s)


def figures(record) -> dict:
    latency = latency_figures(record, SLO())
    seconds = record.end_time - record.start_time
    return {"output_tokens_per_s": sum(len(o.token_ids) for o in record.outputs) / seconds,
            **{k: latency[k] for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")},
            "loads_per_step": record.adapters.get("adapter_loads_per_step")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:tiny-random")
    parser.add_argument("--rates", default="2,4,8")
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--out", default="lora-cliff.json")
    args = parser.parse_args()
    shape = CheckpointSource(args.model).model_config
    print("fitting the base model's served profile (one thread) ...", flush=True)
    profile = fitted_profile(args.model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="servelab-lora-cliff-") as root:
        adapters = tuple(write_bench_adapters(args.adapters, shape, Path(root)))
        for policy in POLICIES:
            for rate in (float(r) for r in args.rates.split(",")):
                spec = (f"skewed:num_requests={args.requests},mean_prompt_len=80,mean_output_len=48,max_len=400,"
                        f"adapters={args.adapters},arrival=poisson,rate={rate},seed=1")
                workload = attrs.evolve(build_workload(spec, shape.vocab_size), lora_requests=adapters)
                config = lora_config(args.model, policy, args.slots)
                real = figures(serve_real(config, workload, 1).record)
                sim = figures(serve_sim(config, workload, profile))
                rows.append({"policy": policy, "rate": rate, "real": real, "sim": sim})
                print(_row(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "profile": attrs.asdict(profile), "rows": rows},
                                         indent=2, default=str))


def _row(row: dict) -> str:
    cells = []
    for name in FIGURES:
        measured, simulated = row["real"][name], row["sim"][name]
        ratio = f"{simulated / measured:.2f}x" if measured and simulated is not None else "-"
        cells.append(f"{name} {_fmt(measured)}/{_fmt(simulated)} ({ratio})")
    return f"{row['policy']:11} {row['rate']:4.1f}/s  " + "  ".join(cells)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}" if value < 1 else f"{value:.1f}"


if __name__ == "__main__":
    main()
