"""Pipeline parallelism with one batch in flight against two, on this CPU
(docs/parallelism.md): the same greedy requests arriving as a Poisson process in wall-clock
time, served by PP=2 with `pipeline_batches_in_flight` 1 and 2 (and one process for
reference), the layouts alternating round by round. Reports output tokens/s, TTFT and TPOT
percentiles, rank 0's bubble and how many batches overlapped another, each as the median
and min-max over the rounds, and whether the tokens equal one process's. Run it on a quiet
machine:

    python examples/measurements/moe_checkpoints.py --out path/to/moe
    python examples/measurements/pp_batches_in_flight.py --model path/to/moe/mixtral-wide
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from servelab import LLM, SamplingParams

LAYOUTS = {"one process": {},
           "PP=2, 1 batch in flight": {"pipeline_parallel_size": 2, "pipeline_batches_in_flight": 1},
           "PP=2, 2 batches in flight": {"pipeline_parallel_size": 2, "pipeline_batches_in_flight": 2}}


def serve(llm: LLM, prompts: list[list[int]], arrivals: list[float], params: SamplingParams) -> dict:
    """Feed the requests at their arrival times and step the engine; per-request times."""
    engine = llm.engine
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, tuple[float, list[int]]] = {}
    added: dict[str, float] = {}
    order: list[str] = []
    next_request = 0
    while next_request < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_request < len(prompts) and arrivals[next_request] <= now:
            request_id = engine.add_request(prompts[next_request], params)
            added[request_id] = arrivals[next_request]
            order.append(request_id)
            next_request += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[next_request] - now))
            continue
        result = engine.step()
        now = time.perf_counter() - start
        for seq_id, event in result.events.items():
            if event.new_token_ids:
                first.setdefault(seq_id, now)
        for output in result.finished:
            done[output.request_id] = (now, output.token_ids)
    makespan = time.perf_counter() - start
    ttft = [first[r] - added[r] for r in order]
    tpot = [(done[r][0] - first[r]) / max(1, len(done[r][1]) - 1) for r in order]
    tokens = sum(len(done[r][1]) for r in order)
    stats = engine.pipeline_stats()
    return {"tokens_per_s": tokens / makespan, "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90),
            "tpot_p50": _pct(tpot, 50), "bubble": stats.bubble_fraction if stats else None,
            "overlapped": stats.overlapped_batches if stats else None, "tokens": [done[r][1] for r in order]}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals, requests per second")
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--budget", type=int, default=64, help="chunked prefill's max_num_batched_tokens")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[3 + rng.randrange(200) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    arrivals, clock = [], 0.0
    for _ in range(args.requests):
        arrivals.append(clock)
        clock += rng.expovariate(args.rate)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    results: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for round_index in range(args.rounds):
        for name, layout in LAYOUTS.items():
            with LLM(args.model, max_model_len=args.prompt_len + args.max_tokens + 8,
                     max_num_batched_tokens=args.budget, **{"scheduler.name": "chunked-prefill"}, **layout) as llm:
                llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm
                results[name].append(serve(llm, prompts, arrivals, params))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    reference = results["one process"][0]["tokens"]
    print(f"{'layout':<26} {'tok/s':>18} {'TTFT p50 ms':>18} {'TTFT p90 ms':>18} {'TPOT p50 ms':>16} "
          f"{'bubble':>14} {'overlapped':>10} same tokens")
    for name, runs in results.items():
        def cell(key: str, scale: float = 1.0, digits: int = 1) -> str:
            values = [run[key] * scale for run in runs if run[key] is not None]
            if not values:
                return "-"
            return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-"
                    f"{max(values):.{digits}f})")
        same = all(run["tokens"] == reference for run in runs)
        print(f"{name:<26} {cell('tokens_per_s'):>18} {cell('ttft_p50', 1000):>18} {cell('ttft_p90', 1000):>18} "
              f"{cell('tpot_p50', 1000):>16} {cell('bubble', 1, 2):>14} {cell('overlapped', 1, 0):>10} {same}")


if __name__ == "__main__":
    main()
