"""Medusa's token-tree mode against its chain mode, on builtin:tiny's shipped heads:

    OMP_NUM_THREADS=1 nice -n 19 python examples/measurements/medusa_tree.py --repeats 3

For each workload of examples/speculation_figures.py (repetitive, open-ended) and each
batch size, plain decoding, `medusa` (the top-1 chain of its 3 heads) and `medusa` with
`tree_nodes` = N (the static tree chosen from the heads' measured accuracies,
medusa_accuracy.json) run greedy, each on its own engine, interleaved in every repeat
after a warm-up that also checks every configuration reproduces the plain tokens.
Reported per configuration: mean accepted tokens per target step (tokens per step less
the target's own, per sequence) and output tok/s with its ratio to plain decoding, each
as the median over the repeats with min-max (each repeat's ratio against the same
repeat's plain run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
from pathlib import Path

import torch

from servelab import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def figures_module():
    spec = importlib.util.spec_from_file_location("speculation_figures", ROOT / "examples/speculation_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return "unknown"


def configs(tree_sizes: list[int]) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {"none": None, "medusa-chain": {"name": "medusa"}}
    for size in tree_sizes:
        out[f"medusa-tree-{size}"] = {"name": "medusa", "tree_nodes": size}
    return out


def measure(args: argparse.Namespace) -> list[dict]:
    figures = figures_module()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engines = {name: LLM("builtin:tiny", config={"drafter": cfg} if cfg else {}, max_num_seqs=max(args.batches),
                         seed=0) for name, cfg in configs(args.trees).items()}
    rows = []
    for workload in figures.WORKLOADS:
        texts = figures.prompts(workload, args.num_requests)
        for batch in args.batches:
            seconds: dict[str, list[float]] = {name: [] for name in engines}
            accepted_per_step: dict[str, list[float]] = {name: [] for name in engines}
            reference = None
            for name, llm in engines.items():  # warm-up, and the tokens every configuration must reproduce
                _, tokens = figures.run_once(llm, texts, batch, params)
                reference = reference or tokens
                if tokens != reference:
                    raise SystemExit(f"{name} changed the greedy output on {workload}: verification is broken")
            for repeat in range(args.repeats):
                for name, llm in engines.items():
                    before = llm.engine.speculation_stats()
                    elapsed, _ = figures.run_once(llm, texts, batch, params)
                    seconds[name].append(elapsed)
                    after = llm.engine.speculation_stats()
                    if after is not None:
                        steps = after.num_sampling_steps - before.num_sampling_steps
                        accepted_per_step[name].append(
                            (after.num_emitted_tokens - before.num_emitted_tokens) / steps - 1)
                    else:
                        accepted_per_step[name].append(0.0)
                    print(f"{workload:>10} batch {batch:>2} {name:>16} repeat {repeat + 1}: {elapsed:6.2f} s",
                          flush=True)
            num_tokens = len(texts) * args.max_tokens
            for name in engines:
                ratios = [b / w for b, w in zip(seconds["none"], seconds[name])]
                rates = [num_tokens / s for s in seconds[name]]
                rows.append({"workload": workload, "batch": batch, "config": name,
                             "accepted_per_step": statistics.median(accepted_per_step[name]),
                             "accepted_min": min(accepted_per_step[name]),
                             "accepted_max": max(accepted_per_step[name]),
                             "tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates),
                             "tokens_per_s_max": max(rates), "ratio": statistics.median(ratios),
                             "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return rows


def print_table(rows: list[dict]) -> None:
    print("\n| workload | batch | config | accepted / target step (min-max) | output tok/s (min-max) "
          "| vs plain (min-max) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['batch']} | {r['config']} | {r['accepted_per_step']:.2f} "
              f"({r['accepted_min']:.2f}-{r['accepted_max']:.2f}) | {r['tokens_per_s']:.1f} "
              f"({r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}) | {r['ratio']:.2f}x "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", type=int, default=[8, 16], help="tree sizes (tree_nodes) to run")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, torch threads: {args.threads}")
    rows = measure(args)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
