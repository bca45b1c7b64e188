"""Quantized weights (`[engine] weights = "int8" | "int4"`) against the dequantized model,
in one process on one machine: accuracy, then speed.

    python examples/measurements/quantized_weights.py --model builtin:tiny-random --repeats 3
    python examples/measurements/quantized_weights.py --model smollm2-135m --no-speed   # accuracy only

Each quantized variant runs twice: `int8` / `int4` multiply int8 activations (the default,
`[engine] quantized_activations = "int8"`), `int8:float` / `int4:float` float32 ones (the
dequantized model's math on the blocks' values): the difference between the two is what
quantizing the activations costs, beside what the weights' own quantization costs.

Accuracy, over `--prompts` prompts of the skewed workload (their first 128 tokens):
- teacher-forced: the dequantized model's greedy continuation (`--tokens` tokens) is fed to
  every model in one full-sequence forward through the engine's own layers (the quantized
  kernels included); per position, whether the two argmaxes agree and the KL divergence
  KL(p_dequantized || p_quantized) of the next-token distributions, in nats;
- free-running: each engine's own greedy continuation; the share of positions whose token
  equals the dequantized model's, and the mean length of the common prefix.

Speed, interleaved repetitions (median and min-max): batch-1 TPOT of a 64-token greedy
decode after a 128-token prompt, against the bandwidth roofline of the weight bytes one
decode step reads (the blocks as stored, or the float weights) at the mean read bandwidth
probed before and after each round's TPOTs (it moves by the minute on a shared machine);
then output tokens/s of the 64-request skewed workload (up to 64 sequences a step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from servelab import LLM, SamplingParams
from servelab.model.packed_linear import PackedLinear
from servelab.model.quantized_linear import QuantizedLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from speed_figures import read_bandwidth_gbs  # noqa: E402 (the bandwidth probe of the speed figures)
from servelab.model.rope import apply_rotary
from servelab.workload import Workload, build_workload

WEIGHTS = ("dequantize", "int8", "int4", "int8:float", "int4:float")
WORKLOAD = "skewed:num_requests=64"


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear layer's weight as it is held
    (blocks, or float), the LM head included (the embedding contributes one row)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.blocks.numel()
        elif isinstance(module, (PackedLinear, torch.nn.Linear)):
            total += module.in_features * module.out_features * model.embed_tokens.weight.element_size()
    return total


@torch.inference_mode()
def full_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Next-token logits [T, vocab] at every position of `tokens`, one causal forward over
    the whole sequence through the model's own layers (its linear layers as loaded)."""
    ids = torch.tensor(tokens)
    positions = torch.arange(len(tokens))
    cos, sin = model.rotary.tables(positions)
    hidden = model.embed_tokens(ids)
    for layer in model.layers:
        attention = layer.self_attn
        qkv = attention.qkv_proj(layer.input_layernorm(hidden))
        size = attention.q_size + attention.kv_size
        qk = apply_rotary(qkv[:, :size].view(len(tokens), -1, attention.head_dim), cos, sin)
        q, k = qk.split([attention.num_heads, attention.num_kv_heads], dim=1)
        v = qkv[:, size:].view(len(tokens), attention.num_kv_heads, attention.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, scale=attention.scale, enable_gqa=True)
        hidden = hidden + attention.o_proj(out.transpose(0, 1).reshape(len(tokens), attention.q_size))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.norm(hidden)).float()


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outputs]


def accuracy(llms: dict[str, LLM], prompts: list[list[int]], tokens: int) -> dict[str, dict]:
    reference = greedy(llms["dequantize"], prompts, tokens)
    base_model = llms["dequantize"].engine.runner.model
    result = {}
    for name, llm in llms.items():
        if name == "dequantize":
            continue
        model = llm.engine.runner.model
        own = greedy(llm, prompts, tokens)  # first: a step hands the layers the library's kernel
        agree, kls, total = 0, [], 0
        for prompt, continuation in zip(prompts, reference):
            sequence = prompt + continuation[:-1]
            rows = slice(len(prompt) - 1, len(sequence))  # the positions that predict the continuation
            p = torch.log_softmax(full_logits(base_model, sequence)[rows], -1)
            q = torch.log_softmax(full_logits(model, sequence)[rows], -1)
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            total += p.shape[0]
            kls.append((p.exp() * (p - q)).sum(-1))
        kl = torch.cat(kls)
        same = sum(a == b for ours, theirs in zip(own, reference) for a, b in zip(ours, theirs))
        prefixes = [next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
                    for ours, theirs in zip(own, reference)]
        result[name] = {"teacher_forced_top1_agreement": agree / total, "mean_kl_nats": float(kl.mean()),
                        "p99_kl_nats": float(kl.quantile(0.99)), "max_kl_nats": float(kl.max()),
                        "free_running_token_agreement": same / sum(len(r) for r in reference),
                        "mean_common_prefix": statistics.mean(prefixes), "positions": total}
    return result


def tpot_ms(llm: LLM, prompt: list[int]) -> float:
    out = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    return (out.metrics.e2e_latency - out.metrics.ttft) / 63 * 1000


def throughput(llm: LLM, workload: Workload) -> float:
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in workload.requests]
    start = time.perf_counter()
    outputs = llm.generate([list(r.prompt_token_ids) for r in workload.requests], params)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-random", help="checkpoint directory, builtin:<name> or a "
                                                                        "model file the engine loads")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=16, help="prompts for the accuracy figures")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt for the accuracy figures")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", default=",".join(WEIGHTS), help="comma-separated; dequantize always runs")
    parser.add_argument("--workload", default=WORKLOAD, help=f"the throughput workload (default {WORKLOAD})")
    parser.add_argument("--no-throughput", action="store_true", help="skip the batch-64 workload")
    parser.add_argument("--no-speed", action="store_true", help="accuracy only")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    names = ["dequantize"] + [w for w in args.weights.split(",") if w and w != "dequantize"]

    bandwidth = read_bandwidth_gbs()
    llms = {name: LLM(args.model, dtype=args.dtype, weights=name.partition(":")[0],
                      quantized_activations=name.partition(":")[2] or "int8", max_model_len=512, max_num_seqs=64,
                      max_num_batched_tokens=2048, **{"attention.name": "cpu-paged", "attention.build": "wait"})
            for name in names}
    vocab = llms["dequantize"].engine.model_config.vocab_size
    workload = build_workload(args.workload, vocab)
    warm = Workload("warm-up", tuple(sorted(workload.requests, key=lambda r: -len(r.prompt_token_ids))[:8]))
    if not args.no_speed:  # accuracy alone needs no warm engines
        for llm in llms.values():
            throughput(llm, warm)  # the kernels handed out, oneDNN's kernels generated
    print("loaded" + ("" if args.no_speed else " and warmed up"), flush=True)
    accuracy_prompts = build_workload(WORKLOAD, vocab).requests  # the same prompts whatever --workload is
    prompts = [list(r.prompt_token_ids[:128]) for r in accuracy_prompts[:args.prompts]]
    figures = {"model": args.model, "dtype": args.dtype, "read_bandwidth_gbs": bandwidth,
               "threads": torch.get_num_threads(), "accuracy": accuracy(llms, prompts, args.tokens), "speed": {}}

    print(f"{args.model}, {args.dtype}, {figures['threads']} threads, read bandwidth {bandwidth:.1f} GB/s at the start")
    print(f"{'weights':11} {'top-1 agree':>11} {'mean KL':>9} {'p99 KL':>9} {'free-run agree':>14} {'prefix':>7}")
    for name, a in figures["accuracy"].items():
        print(f"{name:11} {a['teacher_forced_top1_agreement']:11.4f} {a['mean_kl_nats']:9.2e} "
              f"{a['p99_kl_nats']:9.2e} {a['free_running_token_agreement']:14.4f} {a['mean_common_prefix']:7.1f}",
              flush=True)
    if args.no_speed:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=2)
        return
    prompt = prompts[0]
    tpots = {name: [] for name in names}
    rates = {name: [] for name in names}
    probes = []  # the host's read bandwidth moves by the minute: probed around each round's TPOTs
    for _ in range(args.repeats):  # interleaved: drift on a shared machine hits every variant alike
        probes.append(read_bandwidth_gbs())
        for name, llm in llms.items():
            tpots[name].append(tpot_ms(llm, prompt))
        probes.append(read_bandwidth_gbs())
        print("tpot", {name: f"{values[-1]:.2f}" for name, values in tpots.items()},
              f"read bandwidth {probes[-2]:.1f} before, {probes[-1]:.1f} after", flush=True)
        if not args.no_throughput:
            for name, llm in llms.items():
                rates[name].append(throughput(llm, workload))
            print("tok/s", {name: f"{values[-1]:.0f}" for name, values in rates.items()}, flush=True)
    figures["read_bandwidth_gbs_around_tpot"] = probes
    around = statistics.mean(probes)
    print(f"rooflines at {around:.1f} GB/s, the mean read bandwidth around the TPOT rounds "
          f"({min(probes):.1f}-{max(probes):.1f})")
    for name, llm in llms.items():
        nbytes = weight_bytes_per_step(llm.engine.runner.model)
        figures["speed"][name] = {"weight_bytes_per_step": nbytes, "roofline_tpot_ms": nbytes / around / 1e6,
                                  "tpot_ms": sorted(tpots[name]), "output_tokens_per_s": sorted(rates[name])}

    base = figures["speed"]["dequantize"]
    print(f"{'weights':11} {'MB/step':>8} {'roofline ms':>11} {'TPOT ms (min-max)':>20} {'/roofline':>9} "
          f"{'TPOT vs deq':>11} {'out tok/s (min-max)':>24} {'vs deq':>7}")
    for name, s in figures["speed"].items():
        tpot = statistics.median(s["tpot_ms"])
        rate = f"{spread(s['output_tokens_per_s']):>24} {statistics.median(s['output_tokens_per_s']) / statistics.median(base['output_tokens_per_s']):6.2f}x" if s["output_tokens_per_s"] else ""
        print(f"{name:11} {s['weight_bytes_per_step'] / 1e6:8.1f} {s['roofline_tpot_ms']:11.3f} "
              f"{spread(s['tpot_ms']):>20} {tpot / s['roofline_tpot_ms']:8.2f}x "
              f"{statistics.median(base['tpot_ms']) / tpot:10.2f}x {rate}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
