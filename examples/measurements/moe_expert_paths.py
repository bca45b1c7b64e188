"""The grouped expert path against the per-expert loop, on this CPU (docs/parallelism.md).

Times one sparse block's routed experts (router excluded) both ways over batches of
1 to 2048 tokens, on a Mixtral-8x7B-shaped block scaled down (8 experts, top-2, hidden
512, width 1024: `--hidden`, `--width` to change), in float32, the median of `--repeats`
runs each. Run it on a quiet machine:

    python examples/measurements/moe_expert_paths.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servelab.model.moe import Expert, grouped_experts, loop_experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(Expert(args.hidden, args.width) for _ in range(args.experts))
    print(f"{'tokens':>7} {'loop ms':>9} {'grouped ms':>11} {'speedup':>8}")
    for tokens in (1, 4, 16, 64, 256, 1024, 2048):
        x = torch.randn(tokens, args.hidden)
        weights, ids = torch.softmax(torch.randn(tokens, args.experts), -1).topk(args.top_k, dim=-1)
        times = {}
        with torch.inference_mode():
            for name, path in (("loop", loop_experts), ("grouped", grouped_experts)):
                path(x, weights, ids, experts)  # warm
                runs = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    path(x, weights, ids, experts)
                    runs.append(time.perf_counter() - start)
                times[name] = statistics.median(runs) * 1000
        print(f"{tokens:>7} {times['loop']:>9.3f} {times['grouped']:>11.3f} {times['loop'] / times['grouped']:>7.2f}x")


if __name__ == "__main__":
    main()
