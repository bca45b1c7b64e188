"""What a quantized KV cache costs in accuracy and buys in capacity, per `[engine] kv_cache_dtype`.

    python examples/measurements/kv_cache_dtype.py --gen-len 128 --repeats 2 --threads 1 --json kv.json

Accuracy, against the full-precision ("auto") cache on the same model and backend (cpu-paged):

- greedy token agreement: each prompt generates `--gen-len` tokens greedily with each cache;
  reported are the share of positions whose token equals the full-precision run's, and the
  mean length of the identical prefix (a generation that diverges once goes its own way);
- mean KL(p_full || p_quantized) of the next-token distributions along the full-precision
  run's own tokens (teacher-forced: prompt + its greedy output as one prompt, every
  position's full-vocabulary distribution; each position attends the cache's K/V of every
  earlier token, written and read quantized), over the generated positions.

Models: builtin:tiny and the odd-shaped test checkpoints (head dim 12 with GQA 3:1, Qwen2
with biases, multi-head attention, tied embeddings with Llama-3 rope scaling), built here
from seeded random weights (servelab.testing.tiny_model).

Capacity and throughput, builtin:tiny-random, one KV budget for every dtype: the blocks it
holds, sequences of max_model_len that fit at once, the most sequences running at once on
the workload, and output tokens/s; repetitions interleaved (dtypes rotate), each dtype's
throughput as a ratio to auto's in the same repetition (median, min-max).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from servelab import LLM, SamplingParams
from servelab.bench.driver import StepRecorder, run_workload
from servelab.kv_sizing import KV_CACHE_DTYPES, blocks_for
from servelab.testing.tiny_model import tiny_checkpoint
from servelab.workload import build_workload

QUANTIZED = KV_CACHE_DTYPES[1:]
TINY_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef walk(path):", "class Stack:\n    def __init__(self):",
                "The socket module provides", "for line in open(path):", "# Parse the command line\nparser ="]
ODD_SHAPES = ("llama", "qwen2", "llama-mha", "llama3-rope-tied")


def _engine(model: str, kv_cache_dtype: str, **overrides) -> LLM:
    return LLM(model, kv_cache_dtype=kv_cache_dtype, **{"attention.build": "wait"}, **overrides)


def _prompts(llm: LLM, model: str) -> list[list[int]]:
    if model == "builtin:tiny":
        return [llm.engine.tokenizer.encode(p) for p in TINY_PROMPTS]
    generator = torch.Generator().manual_seed(7)
    vocab = llm.engine.model_config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 17, 40, 9, 28, 3)]


def _full_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 next-token logits at every position of `tokens` as one prompt."""
    runner = llm.engine.runner
    captured: list[torch.Tensor] = []
    execute = runner.execute

    def recording(inputs):
        logits = execute(inputs)
        captured.append(logits.detach().clone())
        return logits

    runner.execute = recording
    try:
        llm.generate([tokens], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    finally:
        runner.execute = execute
    # Each prefill chunk's rows: its sampling row (the chunk's last token; for all but the
    # last chunk none) first, then its prompt positions.
    rows = []
    for logits in captured:
        rows.append(logits[1:])
        rows.append(logits[:1])
    out = torch.cat(rows)
    return out[: len(tokens)]


def accuracy(model: str, gen_len: int, max_model_len: int) -> dict:
    full = _engine(model, "auto", max_model_len=max_model_len)
    prompts = _prompts(full, model)
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    reference = [o.token_ids for o in full.generate(prompts, params)]
    sequences = [p + r for p, r in zip(prompts, reference)]
    reference_logprobs = [torch.log_softmax(_full_logits(full, s), -1) for s in sequences]
    del full
    result = {}
    for kv in QUANTIZED:
        llm = _engine(model, kv, max_model_len=max_model_len)
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        same = [sum(a == b for a, b in zip(t, r)) / len(r) for t, r in zip(tokens, reference)]
        prefix = []
        for t, r in zip(tokens, reference):
            n = next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r))
            prefix.append(n)
        kls = []
        for prompt, sequence, ref in zip(prompts, sequences, reference_logprobs):
            logprobs = torch.log_softmax(_full_logits(llm, sequence), -1)
            # position i predicts token i + 1: the generated tokens are predicted from len(prompt) - 1 on
            start, stop = len(prompt) - 1, len(sequence) - 1
            p = ref[start:stop]
            kls.append((p.exp() * (p - logprobs[start:stop])).sum(-1))
        kl = torch.cat(kls)
        result[kv] = {"token_agreement": statistics.mean(same), "identical_prefix_mean": statistics.mean(prefix),
                      "identical_prefix_min": min(prefix), "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
                      "positions": int(kl.numel())}
        del llm
    return result


def capacity(model: str, spec: str, kv_cache_memory: str, max_model_len: int, max_num_seqs: int,
             repeats: int) -> dict:
    engines, recorders = {}, {}
    for kv in KV_CACHE_DTYPES:
        llm = _engine(model, kv, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      kv_cache_memory=kv_cache_memory)
        recorder = StepRecorder()
        llm.engine.registry.register(recorder, name="recorder")
        engines[kv], recorders[kv] = llm, recorder
    vocab = engines["auto"].engine.model_config.vocab_size
    throughput = {kv: [] for kv in KV_CACHE_DTYPES}
    running = {kv: 0 for kv in KV_CACHE_DTYPES}
    order = list(KV_CACHE_DTYPES)
    for repeat in range(repeats + 1):  # the first round warms up
        for kv in order:
            recorder = recorders[kv]
            recorder.reports.clear()
            record = run_workload(engines[kv].engine, recorder, build_workload(spec, vocab), kv)
            tokens = sum(len(o.token_ids) for o in record.outputs)
            if repeat:
                throughput[kv].append(tokens / (record.end_time - record.start_time))
            running[kv] = max(running[kv], max(r.num_seqs for _, r in record.steps))
        order = order[1:] + order[:1]
    block_size = engines["auto"].engine.config.engine.block_size
    result = {}
    for kv in KV_CACHE_DTYPES:
        engine = engines[kv].engine
        blocks = engine.allocator.stats().num_blocks
        ratios = [x / a for x, a in zip(throughput[kv], throughput["auto"])]
        result[kv] = {"kv_bytes_per_token": engine.model_config.kv_bytes_per_token(
                          torch.tensor([], dtype=engine.runner.model.embed_tokens.weight.dtype).element_size(), kv),
                      "num_blocks": blocks, "fit_max_model_len": blocks // blocks_for(max_model_len, block_size),
                      "most_running": running[kv], "tok_s_median": statistics.median(throughput[kv]),
                      "tok_s_min": min(throughput[kv]), "tok_s_max": max(throughput[kv]),
                      "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen-len", type=int, default=256, help="greedy tokens per prompt (accuracy)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--capacity-model", default="builtin:tiny-random")
    parser.add_argument("--kv-cache-memory", default="24MiB")
    parser.add_argument("--workload", default="skewed:num_requests=64,mean_prompt_len=256,mean_output_len=128,max_len=1024")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"accuracy": {}, "capacity": None}
    for name in ("builtin:tiny", *ODD_SHAPES):
        model = name if name.startswith("builtin:") else tiny_checkpoint(name)
        max_model_len = 256 if name in ODD_SHAPES else 1024
        gen_len = min(args.gen_len, max_model_len - 48)
        results["accuracy"][name] = accuracy(model, gen_len, max_model_len)
        for kv, r in results["accuracy"][name].items():
            print(f"{name:>18} {kv:>9}: token agreement {100 * r['token_agreement']:5.1f}%, identical prefix "
                  f"{r['identical_prefix_mean']:.0f} of {gen_len} (min {r['identical_prefix_min']}), mean KL "
                  f"{r['mean_kl']:.5f} (max {r['max_kl']:.4f}) over {r['positions']} positions", flush=True)
    if not args.skip_capacity:
        results["capacity"] = capacity(args.capacity_model, args.workload, args.kv_cache_memory, 1024, 256,
                                       args.repeats)
        for kv, r in results["capacity"].items():
            print(f"{kv:>9}: {r['kv_bytes_per_token']:,} B/token, {r['num_blocks']} blocks, "
                  f"{r['fit_max_model_len']} sequences of 1024 fit, at most {r['most_running']} running, "
                  f"{r['tok_s_median']:.0f} out tok/s ({r['tok_s_min']:.0f}-{r['tok_s_max']:.0f}), vs auto "
                  f"{r['ratio_median']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
