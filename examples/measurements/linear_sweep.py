"""How fast one decode token's quantized weights stream through the linear kernels alone:
every quantized linear of the model called once on one row, in the model's order (so each
call finds its weights out of cache, as a decode step does), timed per sweep, with one
thread and with two, alternating round by round in one process.

    python examples/measurements/linear_sweep.py --model smollm2-135m --weights int4 --rounds 5

Prints each round and the median and range of the sweep's time and of the rate its bytes
stream at, for every linear (the LM head included) and for the layers' linears alone. The
difference from the model's batch-1 TPOT is the rest of the step (norms, rotary,
attention, the engine); the difference from the machine's read bandwidth is what the
kernels leave on the table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servelab import LLM, SamplingParams
from servelab.model.quantized_linear import QuantizedLinear


def sweep_seconds(linears: list[QuantizedLinear], inputs: list[torch.Tensor], repeats: int = 9) -> float:
    for linear, x in zip(linears, inputs):  # warm: the kernels' first calls
        linear(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for linear, x in zip(linears, inputs):
            linear(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="int4", help="int4 or int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()

    llm = LLM(args.model, weights=args.weights, max_model_len=256,
              **{"attention.name": "cpu-paged", "attention.build": "wait"})
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # the runner hands the linears their kernels
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    if not linears or any(m.kernels is None for m in linears):
        raise SystemExit("no quantized linear runs on the native kernels here (a C++ compiler builds them)")
    head = max(linears, key=lambda m: m.out_features)
    sets = {"every linear": linears, "the layers' linears": [m for m in linears if m is not head]}
    inputs = {name: [torch.randn(1, m.in_features) for m in chosen] for name, chosen in sets.items()}
    threads = [int(t) for t in args.threads.split(",")]
    results: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        for count in threads:
            torch.set_num_threads(count)
            for name, chosen in sets.items():
                seconds = sweep_seconds(chosen, inputs[name])
                results.setdefault((name, count), []).append(seconds)
                print(f"round {round_index + 1}, {count} thread(s), {name}: {seconds * 1e3:.2f} ms", flush=True)
    for (name, count), times in results.items():
        chosen = sets[name]
        nbytes = sum(m.blocks.numel() * m.blocks.element_size() for m in chosen)
        rates = [nbytes / t / 1e9 for t in times]
        print(f"{name}, {count} thread(s): {len(chosen)} calls, {nbytes / 1e6:.1f} MB, "
              f"{statistics.median(times) * 1e3:.2f} ms ({min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}), "
              f"{statistics.median(rates):.1f} GB/s ({min(rates):.1f}-{max(rates):.1f})")


if __name__ == "__main__":
    main()
