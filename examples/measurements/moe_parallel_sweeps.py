"""Simulator sweeps for docs/parallelism.md: pipeline parallelism's bubble against chunk
size (Llama-3-70B over 4 stages) and expert parallelism's throughput against placement
(Mixtral-8x7B over 4 ranks), on the H100 profile over NVLink 4 and PCIe 4.

    python examples/measurements/moe_parallel_sweeps.py [--json out.json]

Analytic (the simulator's cost model), so the figures do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json

from servelab.bench.sim.hardware import accelerator, interconnect
from servelab.bench.sim.parallel_cost import MOE_SHAPES, ep_step, pipeline_schedule
from servelab.bench.sim.shapes import model_shape
from servelab.expert_placement import placement_policy
from servelab.pipeline_chunks import chunk_sizing

# a skewed router, its two hottest experts neighbours (what linear placement puts together)
SKEWED_LOAD = [30, 25, 10, 9, 8, 7, 6, 5]


def pipeline_sweep(prompt_len: int = 16384, stages: int = 4) -> list[dict]:
    shape, hw = model_shape("llama-3-70b"), accelerator("h100")
    rows = []
    for link in ("nvlink4", "pcie4"):
        for sizing in ("fixed", "equal_time"):
            for chunk in (16384, 8192, 4096, 2048, 1024, 512, 256):
                run = pipeline_schedule(shape, hw, interconnect(link), stages, prompt_len, chunk, chunk_sizing(sizing))
                rows.append({"link": link, "sizing": sizing, "max_chunk": chunk, "chunks": len(run.chunks),
                             "makespan_ms": round(1000 * run.makespan_s, 2),
                             "bubble_fraction": round(run.bubble_fraction, 4),
                             "prefill_tokens_per_s_per_gpu": round(prompt_len / run.makespan_s / stages)})
    return rows


def placement_sweep(tokens: int = 4096, ranks: int = 4) -> list[dict]:
    hw = accelerator("h100")
    rows = []
    for link in ("nvlink4", "pcie4"):
        for load_name, load in (("uniform", [1.0] * 8), ("skewed", SKEWED_LOAD)):
            for name, redundant in (("linear", 0), ("round_robin", 0), ("balanced", 0), ("balanced", 4)):
                placement = placement_policy(name, redundant).place(8, ranks, [float(x) for x in load])
                step = ep_step(MOE_SHAPES["mixtral-8x7b"], hw, interconnect(link), tokens, 0, placement, load)
                rows.append({"link": link, "load": load_name, "placement": name, "redundant_experts": redundant,
                             "tokens_per_s": round(step["tokens_per_s"]), "imbalance": round(step["imbalance"], 3),
                             "all_to_all_share": round(step["share_all_to_all"], 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write both sweeps here")
    args = parser.parse_args()
    result = {"pipeline_bubble_vs_chunk": pipeline_sweep(), "ep_throughput_vs_placement": placement_sweep()}
    for name, rows in result.items():
        print(name)
        for row in rows:
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
