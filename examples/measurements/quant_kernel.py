"""The quantized matmul alone (plugins/kernels/cpu_quant.cpp) against the library's float32
matmul on the same shapes: one pass over a decoder's four projections in every layer
(weights cycled through memory, as in a step), min of interleaved repetitions, at 1, 8, 32
and 64 rows; the bytes each format reads, and the rate it reads them at. Each format runs
with int8 activations (integer dot products on the interleaved blocks, `q4_1`) and float32
ones (`q4_1:float`, GGML's layout).

    python examples/measurements/quant_kernel.py --hidden 576 --intermediate 1536 --qkv 960 --layers 30

(the defaults: SmolLM2-135M's decoder shapes).
"""

from __future__ import annotations

import argparse
import time

import torch

from servelab.model.quantized_linear import FORMAT_IDS, INT8_ACTIVATIONS, INTERLEAVED, QuantizedWeight, interleave_blocks
from servelab.plugins.kernels.cpu_build import kernel_build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--qkv", type=int, default=960)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = kernel_build().wait()
    if kernels is None:
        raise SystemExit(f"the kernels did not build: {kernel_build().error}")
    h, i = args.hidden, args.intermediate
    shapes = [(args.qkv, h), (h, h), (2 * i, h), (h, i)]
    generator = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=generator) * 0.05 for n, k in shapes] for _ in range(args.layers)]
    variants = {"float32": [[(kernels.pack_panels(w), w.shape[0]) for w in layer] for layer in weights]}
    for format in ("q8_0", "q4_1", "q4_0"):
        variants[f"{format}:float"] = [[QuantizedWeight.quantize(w, format).blocks for w in layer] for layer in weights]
        variants[format] = [[interleave_blocks(b, format) for b in layer] for layer in variants[f"{format}:float"]]
    del weights
    nbytes = {"float32": sum(n * k * 4 for n, k in shapes) * args.layers}
    for format in ("q8_0", "q4_1", "q4_0"):
        nbytes[format] = nbytes[f"{format}:float"] = sum(b.numel() for layer in variants[format] for b in layer)

    def run(name: str, x_by_k: dict[int, torch.Tensor]) -> None:
        for layer in variants[name]:
            for item, (_, k) in zip(layer, shapes):
                if name == "float32":
                    kernels.panel_linear(x_by_k[k], item[0], None, item[1])
                else:
                    format, _, activations = name.partition(":")
                    kernels.quant_linear(x_by_k[k], item, FORMAT_IDS[format]
                                         + (0 if activations == "float" else INT8_ACTIVATIONS + INTERLEAVED))

    print(f"{args.layers} layers of {shapes}, {args.threads} threads; int8 activations take the "
          f"{kernels.quant_int_path()} path")
    print(f"{'rows':>4} {'format':10} {'MB':>7} {'ms (min)':>9} {'GB/s':>6} {'vs float32':>10}")
    for rows in [int(r) for r in args.rows.split(",")]:
        x_by_k = {k: torch.randn(rows, k, generator=generator) for k in {k for _, k in shapes}}
        best = {name: float("inf") for name in variants}
        for _ in range(args.repeats):  # interleaved: a busy machine slows every format alike
            for name in variants:
                start = time.perf_counter()
                run(name, x_by_k)
                best[name] = min(best[name], time.perf_counter() - start)
        for name in variants:
            print(f"{rows:4} {name:10} {nbytes[name] / 1e6:7.1f} {best[name] * 1e3:9.2f} "
                  f"{nbytes[name] / best[name] / 1e9:6.1f} {best['float32'] / best[name]:9.2f}x")


if __name__ == "__main__":
    main()
