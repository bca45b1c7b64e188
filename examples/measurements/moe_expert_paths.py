"""The grouped and native expert paths against the per-expert loop, on this CPU (docs/parallelism.md).

Times one sparse block's routed experts (router excluded) four ways over batches of 1 to
2048 tokens, on a Mixtral-8x7B-shaped block scaled down (8 experts, top-2, hidden 512,
width 1024: `--hidden`, `--width` to change), in float32 (`--dtype bfloat16` too):

- `loop`: the per-expert loop as `transformers` runs it (servelab.model.moe.loop_experts),
  on torch's linear layers;
- `grouped`: servelab.model.moe.grouped_experts on the same layers;
- `panels`: grouped_experts on the same weights packed into the cpu-paged library's
  panels (servelab.model.packed_linear.use_panel_linears): what a served model's sparse
  block ran before the native call, its linears one by one on the library's matmul;
- `native`: the library's one call (plugins/kernels/cpu_moe.cpp) on those panels, what a
  served model's sparse block runs once the kernels are built.

Each round runs every path once, the paths in turn (so a slow spell of the machine falls on
all of them); a path's figure is the median over `--repeats` rounds with the fastest and
slowest round beside it, and its speedup is the loop's median over its own, with the
spread of the round-by-round ratio. Before every timed call the script reads `--flush-mb`
of other memory, so each path finds the experts' weights out of the caches, as a served
model larger than the caches has them at every step (and no path finds them warm from the
path before, the paths sharing weights); `--flush-mb 0` leaves them cached. Run it on a
quiet machine:

    python examples/measurements/moe_expert_paths.py --threads 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from servelab.model.moe import Expert, grouped_experts, loop_experts, native_experts, prepare_native_experts
from servelab.model.packed_linear import prepack_linears, use_panel_linears
from servelab.plugins.kernels.cpu_build import kernel_build

TOKENS = (1, 4, 16, 64, 256, 1024, 2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=20, help="rounds per batch size")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--flush-mb", type=int, default=512,
                        help="memory read before every timed call, to push the weights out of the caches (0: none)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(Expert(args.hidden, args.width) for _ in range(args.experts)).to(dtype)
    paths = {"loop": lambda x, w, ids: loop_experts(x, w, ids, experts),
             "grouped": lambda x, w, ids: grouped_experts(x, w, ids, experts)}
    kernels = kernel_build().wait()
    packed, native = _on_panels(experts, kernels) if kernels is not None else (None, None)
    if native is not None:
        paths["panels"] = lambda x, w, ids: grouped_experts(x, w, ids, packed)
        paths["native"] = lambda x, w, ids: native_experts(x, w, ids, native)
    else:
        reason = f"takes no {args.dtype} panels on this CPU" if kernels else f"did not build ({kernel_build().error})"
        print(f"no panels or native columns: the cpu-paged library {reason}")
    flush = torch.ones((args.flush_mb << 20) // 4) if args.flush_mb else None
    print(f"{args.experts} experts, top-{args.top_k}, hidden {args.hidden}, width {args.width}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, {args.repeats} rounds, weights "
          f"{f'out of cache ({args.flush_mb} MB read before each call)' if flush is not None else 'cached'}; "
          f"ms: median [min-max]; speedup over the loop: the medians' ratio [min-max of the rounds' ratios]")
    header = f"{'tokens':>6}" + "".join(f" {name + ' ms':>23}" for name in paths)
    header += "".join(f" {name + ' x':>18}" for name in paths if name != "loop")
    print(header)
    for tokens in TOKENS:
        x = torch.randn(tokens, args.hidden).to(dtype)
        weights, ids = torch.softmax(torch.randn(tokens, args.experts), -1).topk(args.top_k, dim=-1)
        runs: dict[str, list[float]] = {name: [] for name in paths}
        with torch.inference_mode():
            for path in paths.values():
                path(x, weights, ids)  # warm
            for round_ in range(args.repeats):
                names = list(paths)
                names = names[round_ % len(names):] + names[:round_ % len(names)]  # each path first in turn
                for name in names:
                    if flush is not None:
                        flush.sum()
                    start = time.perf_counter()
                    paths[name](x, weights, ids)
                    runs[name].append((time.perf_counter() - start) * 1000)
        line = f"{tokens:>6}"
        for name in paths:
            line += f" {statistics.median(runs[name]):>7.3f} [{min(runs[name]):.3f}-{max(runs[name]):.3f}]".rjust(24)
        for name in paths:
            if name == "loop":
                continue
            ratios = [loop / mine for loop, mine in zip(runs["loop"], runs[name])]
            speedup = statistics.median(runs["loop"]) / statistics.median(runs[name])
            line += f" {speedup:>5.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
        print(line)


def _on_panels(experts: torch.nn.ModuleList, kernels):
    """A copy of the experts on the library's panels, and the library's one call over them
    (None where the library takes no panels of their dtype on this CPU)."""
    packed = copy.deepcopy(experts)
    prepack_linears(packed, onednn=False)
    use_panel_linears(packed, kernels)
    return packed, prepare_native_experts(packed)


if __name__ == "__main__":
    main()
