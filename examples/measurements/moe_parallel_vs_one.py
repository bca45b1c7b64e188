"""EP=2 (alone, and with TP=2 on the same ranks) and PP=2 against one process, on this CPU
(docs/parallelism.md): the same greedy requests on a MoE checkpoint
(examples/measurements/moe_checkpoints.py writes one), their tokens compared and their
wall time, median of `--repeats`. On two cores the ranks share the cores (each rank gets
half of torch's threads), so the parallel layouts pay their messages without gaining
compute: the figure measures the overhead. Run on a quiet machine:

    python examples/measurements/moe_checkpoints.py --out path/to/moe
    python examples/measurements/moe_parallel_vs_one.py --model path/to/moe/mixtral-wide
"""

from __future__ import annotations

import argparse
import statistics
import time

from servelab import LLM, SamplingParams

LAYOUTS = {"one process": {}, "EP=2 linear": {"expert_parallel_size": 2},
           "EP=2 round_robin": {"expert_parallel_size": 2, "expert_placement": "round_robin"},
           "EP=2 x TP=2": {"expert_parallel_size": 2, "tensor_parallel_size": 2},
           "PP=2": {"pipeline_parallel_size": 2},
           "PP=2, 1 batch in flight": {"pipeline_parallel_size": 2, "pipeline_batches_in_flight": 1}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompts = [[3 + (i * 7 + j) % 200 for j in range(args.prompt_len)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    reference = None
    for name, engine in LAYOUTS.items():
        with LLM(args.model, max_model_len=args.prompt_len + args.max_tokens + 8, **engine) as llm:
            llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm
            runs, tokens = [], None
            for _ in range(args.repeats):
                start = time.perf_counter()
                tokens = [o.token_ids for o in llm.generate(prompts, params)]
                runs.append(time.perf_counter() - start)
        reference = reference or tokens
        seconds = statistics.median(runs)
        print(f"{name:<18} {seconds:8.3f} s  {args.requests * args.max_tokens / seconds:8.1f} tokens/s  "
              f"same tokens as one process: {tokens == reference}")


if __name__ == "__main__":
    main()
