"""How close a throughput run comes to what the host allows, step by step: the speed table's
skewed workload served once, each step's work read from its plan, and each step's floor,
max(FLOPs / the host's matmul peak, bytes / its read bandwidth), summed over the run. The
ceiling (output tokens over the summed floor) is a throughput no engine can pass on this
host with this model, dtype and schedule; an engine's figure over it is the share of the
hardware it uses.

    OMP_NUM_THREADS=2 python examples/measurements/throughput_floor.py --model ../peers/smollm2-hf \
        --dtype float32 --compare "vLLM CPU=290"

The peak is the best rate measured of torch's linear and the library's panel matmul on the
model's projections at 64, 512 and 2,048 rows (the floor is then a true lower bound: no
step's matmuls run faster than the fastest measured); the bandwidth is the best of full
reads of 512 MB. A step's FLOPs: the decoder's linears for each token, the LM head for each
sampled row, attention's two products over each query's keys; its bytes: every weight once,
each sequence's K/V once per layer, the new K/V written.

Then the last served run's steps by kind (steps with prompt tokens; decode steps by rows),
each kind's time against its floor: where the run loses to the ceiling.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from servelab import LLM, SamplingParams
from servelab.bench.sim.shapes import num_parameters
from servelab.plugins.kernels.cpu_build import kernel_build
from servelab.workload import build_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speed_figures import read_bandwidth_gbs, weight_bytes_per_token  # noqa: E402 (the speed table's probe and bytes)

WORKLOAD = "skewed:num_requests=64"
LIMITS = {"max_model_len": 512, "max_num_seqs": 64, "max_num_batched_tokens": 2048}  # the speed table's


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def matmul_peak_gflops(shape, dtype_name: str, repeats: int = 5) -> float:
    """The best rate of torch's linear and the library's panels on the model's projections."""
    kernels = kernel_build().wait()
    dtype = getattr(torch, dtype_name)
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, i = shape.hidden_size, shape.intermediate_size
    best = 0.0
    for out_features, in_features in ((q + 2 * kv, h), (h, q), (2 * i, h), (h, i)):
        weight = torch.randn(out_features, in_features).to(dtype)
        panels = kernels.pack_panels(weight) if kernels is not None and dtype_name in kernels.panel_dtypes() else None
        for rows in (64, 512, 2048):
            x = torch.randn(rows, in_features).to(dtype)
            calls = [lambda: F.linear(x, weight)]
            if panels is not None:
                calls.append(lambda: kernels.panel_linear(x, panels, None, out_features))
            for call in calls:
                call()
                seconds = min(_seconds(call) for _ in range(repeats))
                best = max(best, 2 * rows * in_features * out_features / seconds / 1e9)
    return best


class StepWork:
    """Each step's FLOPs, bytes and kind, from the plan the scheduler returned (wraps
    `schedule`), and each step's wall time (wraps the engine's `step`)."""

    def __init__(self, llm: LLM, dtype: torch.dtype) -> None:
        shape = llm.engine.model_config
        self.layer_params, self.head_params = num_parameters(shape)
        self.shape = shape
        self.weight_bytes = weight_bytes_per_token(llm, dtype)
        self.kv_bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * \
            torch.finfo(dtype).bits // 8
        self.steps: list[tuple[float, float]] = []  # (FLOPs, bytes)
        self.kinds: list[str] = []
        self.seconds: list[float] = []
        engine = llm.engine
        schedule, step = engine.scheduler.schedule, engine.step

        def recorded():
            plan = schedule()
            if not plan.is_empty:
                self.steps.append(self.work(plan))
                self.kinds.append(step_kind(plan))
            return plan

        def timed():
            start = time.perf_counter()
            result = step()
            self.seconds.append(time.perf_counter() - start)
            return result

        engine.scheduler.schedule = recorded
        engine.step = timed

    def clear(self) -> None:
        self.steps.clear()
        self.kinds.clear()
        self.seconds.clear()

    def work(self, plan) -> tuple[float, float]:
        shape = self.shape
        tokens = sampled = keys_attended = keys_read = 0
        for seq, num_new in plan.scheduled:
            start = seq.num_computed_tokens
            tokens += num_new
            sampled += start + num_new == seq.num_tokens
            keys_attended += num_new * start + num_new * (num_new + 1) // 2  # query p sees p + 1 keys
            keys_read += start + num_new
        attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * keys_attended
        flops = 2 * self.layer_params * tokens + 2 * self.head_params * sampled + attention
        return flops, self.weight_bytes + self.kv_bytes_per_token * (keys_read + tokens)


KINDS = ("with prompt tokens", "decode, 1-8 rows", "decode, 9-32 rows", "decode, 33+ rows")


def step_kind(plan) -> str:
    if any(num_new > 1 for _, num_new in plan.scheduled):
        return KINDS[0]
    rows = len(plan.scheduled)
    return KINDS[1] if rows <= 8 else KINDS[2] if rows <= 32 else KINDS[3]


def print_by_kind(work: StepWork, floors: list[float]) -> None:
    """The last run's steps by kind: count, time, floor and their ratio. (A step's time
    includes its share of the engine's work around the model; empty steps are not counted.)"""
    if len(work.seconds) != len(floors):  # a step with an empty plan (nothing scheduled) was timed too
        print(f"(by kind: {len(work.seconds)} steps timed against {len(floors)} planned; not split)")
        return
    print(f"{'steps':<20}{'count':>6}{'time s':>9}{'floor s':>9}{'ratio':>8}")
    for kind in KINDS:
        picked = [i for i, k in enumerate(work.kinds) if k == kind]
        if picked:
            seconds, floor = sum(work.seconds[i] for i in picked), sum(floors[i] for i in picked)
            print(f"{kind:<20}{len(picked):>6}{seconds:>9.2f}{floor:>9.2f}{seconds / floor:>7.2f}x")


def serve(llm: LLM, workload) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate([list(r.prompt_token_ids) for r in workload.requests], params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="served runs (the floor is the same each time)")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="read bandwidth in GB/s to use instead of probing (another run's probe, say)")
    parser.add_argument("--compare", action="append", default=[],
                        help="NAME=TOK_S: another engine's figure on the same workload, to set against the ceiling")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    llm = LLM(args.model, dtype=args.dtype, **LIMITS)
    workload = build_workload(WORKLOAD, llm.engine.model_config.vocab_size)
    serve(llm, workload)  # warm-up
    peak = matmul_peak_gflops(llm.engine.model_config, args.dtype)
    bandwidth = args.bandwidth or read_bandwidth_gbs()
    work = StepWork(llm, dtype)
    runs = []
    for _ in range(args.repeats):
        work.clear()
        seconds, output_tokens = serve(llm, workload)
        runs.append(output_tokens / seconds)
    floors = [max(flops / peak / 1e9, nbytes / bandwidth / 1e9) for flops, nbytes in work.steps]
    compute_bound = sum(flops / peak / 1e9 >= nbytes / bandwidth / 1e9 for flops, nbytes in work.steps)
    ceiling = output_tokens / sum(floors)
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} threads, {WORKLOAD}: {len(floors)} steps "
          f"({compute_bound} bound by compute), {sum(f for f, _ in work.steps) / 1e12:.2f} TFLOP, "
          f"{sum(b for _, b in work.steps) / 1e9:.1f} GB")
    print(f"host: matmul peak {peak:.0f} GFLOP/s, read bandwidth {bandwidth:.1f} GB/s")
    print(f"floor {sum(floors):.2f} s for {output_tokens} output tokens: ceiling {ceiling:.0f} tok/s")
    print(f"servelab {statistics.median(runs):.0f} tok/s ({min(runs):.0f}-{max(runs):.0f}): "
          f"{statistics.median(runs) / ceiling:.0%} of the ceiling")
    print_by_kind(work, floors)
    for item in args.compare:
        name, figure = item.rsplit("=", 1)
        print(f"{name} {float(figure):.0f} tok/s: {float(figure) / ceiling:.0%} of the ceiling; 1.5x it would be "
              f"{1.5 * float(figure) / ceiling:.0%}")


if __name__ == "__main__":
    main()
