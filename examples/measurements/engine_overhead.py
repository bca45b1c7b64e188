"""The engine's own cost per step, where the model costs nothing: the simulator's runner
(a cost model on a virtual clock) under 256 greedy requests, so the wall time of a step
is scheduling, sampling and bookkeeping alone. Compare two commits by running it with
each on PYTHONPATH (laid out as before_after.py lays them out).

    python examples/measurements/engine_overhead.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from servelab.bench.sim.runner import VirtualClock
from servelab.bench.sim.source import SimSource
from servelab.config import EngineConfig
from servelab.engine import LLMEngine
from servelab.sampling_params import SamplingParams


def one_run(model: str, accelerator: str, num_requests: int) -> tuple[float, int]:
    clock = VirtualClock()
    config = EngineConfig.from_dict({"engine": {"model": "sim", "max_num_seqs": 256, "max_model_len": 2048,
                                                "device": "cpu"}, "attention": {"name": "torch-paged"}})
    engine = LLMEngine(config, clock=clock, source=SimSource.named(model, accelerator, clock))
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for j in range(num_requests):
        engine.add_request([3 + (j * 7 + i) % 100 for i in range(64)], params)
    started, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return (time.perf_counter() - started) / steps * 1e6, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sim-model", default="llama-3-8b")
    parser.add_argument("--sim", default="h100")
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    runs = [one_run(args.sim_model, args.sim, args.requests) for _ in range(args.repeats)]
    per_step = [us for us, _ in runs]
    print(f"engine overhead: {statistics.median(per_step):.0f} us/step (median of {args.repeats}; "
          f"runs {', '.join(f'{us:.0f}' for us in per_step)}; {runs[0][1]} steps each)")


if __name__ == "__main__":
    main()
