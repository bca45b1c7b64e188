"""A small driver run by vLLM's own Python (`servelab bench --baseline vllm`).

It imports vLLM, never servelab, so it works in a separate virtual environment whose
pins may clash with servelab's. It starts one offline `vllm.LLM`, then answers commands
read as JSON lines on stdin, one JSON line each on stdout prefixed with RESULT_PREFIX
(vLLM logs to stdout too):

    {"cmd": "run", "workload": "requests.jsonl"}       offline throughput on a saved workload
    {"cmd": "latency", "prompt_len": 128, "max_tokens": 64, "repeats": 5}   batch-1 TTFT / TPOT
    {"cmd": "memory"}                                   peak / current resident memory
    {"cmd": "quit"}

The first line it answers is {"ready": true, "start_seconds": ...} once the engine is up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

RESULT_PREFIX = "@@servelab-vllm@@ "


def _emit(payload: dict) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _load_workload(path: str) -> list[tuple[list[int], int]]:
    requests = []
    with open(path) as handle:
        for line in handle:
            record = json.loads(line)
            if "prompt_token_ids" in record:
                requests.append((record["prompt_token_ids"], int(record["max_tokens"])))
    return requests


def _prompts(requests):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0) for _, n in requests]
    return prompts, params


def run_workload(llm, path: str) -> dict:
    requests = _load_workload(path)
    prompts, params = _prompts(requests)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "num_requests": len(requests), "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / seconds, "requests_per_s": len(requests) / seconds}


def latency(llm, prompt_len: int, max_tokens: int, repeats: int) -> dict:
    """Batch-1 TTFT (a 1-token generation) and TPOT ((e2e - TTFT) / (n - 1)), medians."""
    prompt = [(7 * i) % 8000 + 3 for i in range(prompt_len)]
    ttfts, tpots = [], []
    for _ in range(repeats):
        prompts, params = _prompts([(prompt, 1)])
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        ttft = time.perf_counter() - start
        prompts, params = _prompts([(prompt, max_tokens)])
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        e2e = time.perf_counter() - start
        ttfts.append(ttft * 1000)
        tpots.append((e2e - ttft) / (max_tokens - 1) * 1000)
    return {"ttft_ms": sorted(ttfts), "tpot_ms": sorted(tpots)}


def _children_rss() -> int:
    """Summed current RSS of this process's live descendants (vLLM's engine core and
    workers), read from /proc; 0 where /proc is absent."""
    import os

    total, pending = 0, [os.getpid()]
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as handle:
                children = [int(c) for c in handle.read().split()]
            with open(f"/proc/{pid}/statm") as handle:
                total += int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") if pid != os.getpid() else 0
        except OSError:
            continue
        pending.extend(children)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    from vllm import LLM

    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              skip_tokenizer_init=True, seed=0)
    _emit({"ready": True, "start_seconds": time.perf_counter() - start})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "run":
            _emit(run_workload(llm, command["workload"]))
        elif command["cmd"] == "latency":
            _emit(latency(llm, command["prompt_len"], command["max_tokens"], command.get("repeats", 5)))
        elif command["cmd"] == "memory":  # peak RSS of this process and of its engine processes
            import resource

            _emit({"self_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "children_peak_rss_bytes": _children_rss()})
        elif command["cmd"] == "quit":
            break


if __name__ == "__main__":
    main()
