"""The library's panel matmul (plugins/kernels/cpu_linear.cpp) against torch's linear on a
real model's shapes: each projection of every decoder layer (weights cycled through memory,
as in a step) and the LM head, min of interleaved repetitions, GFLOP/s and the ratio.

    OMP_NUM_THREADS=2 python examples/measurements/panel_matmul.py --dtype bfloat16

(the defaults: SmolLM2-135M's shapes, 30 layers, 1 and 64 rows, float32).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F

from servelab.plugins.kernels.cpu_build import kernel_build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--qkv", type=int, default=960)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels = kernel_build().wait()
    if kernels is None:
        raise SystemExit(f"the kernels did not build: {kernel_build().error}")
    dtype = getattr(torch, args.dtype)
    h = args.hidden
    shapes = [("qkv", args.qkv, h, args.layers), ("o", h, h, args.layers), ("gate_up", 2 * args.intermediate, h, args.layers),
              ("down", h, args.intermediate, args.layers), ("lm_head", args.vocab, h, 1)]
    generator = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {args.dtype}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'rows':>4} {'layer':8} {'shape':>12} {'panels ms':>9} {'GFLOP/s':>8} {'torch ms':>9} {'GFLOP/s':>8} {'ratio':>6}")
    for rows in [int(r) for r in args.rows.split(",")]:
        for name, n, k, copies in shapes:
            weights = [(torch.randn(n, k, generator=generator) * 0.05).to(dtype) for _ in range(copies)]
            panels = [kernels.pack_panels(w) for w in weights]
            x = torch.randn(rows, k, generator=generator).to(dtype)
            best = {"panels": float("inf"), "torch": float("inf")}
            with torch.inference_mode():
                for _ in range(args.repeats):  # interleaved: a busy machine slows both alike
                    start = time.perf_counter()
                    for p in panels:
                        kernels.panel_linear(x, p, None, n)
                    best["panels"] = min(best["panels"], time.perf_counter() - start)
                    start = time.perf_counter()
                    for w in weights:
                        F.linear(x, w)
                    best["torch"] = min(best["torch"], time.perf_counter() - start)
            flops = 2 * rows * n * k * copies
            print(f"{rows:4} {name:8} {f'{n}x{k}':>12} {best['panels'] * 1e3:9.2f} {flops / best['panels'] / 1e9:8.1f} "
                  f"{best['torch'] * 1e3:9.2f} {flops / best['torch'] / 1e9:8.1f} {best['torch'] / best['panels']:5.2f}x")


if __name__ == "__main__":
    main()
