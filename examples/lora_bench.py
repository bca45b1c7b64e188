"""Multi-LoRA throughput and the adapter eviction cliff (docs/lora.md).

    python examples/lora_bench.py --model builtin:tiny-random --out lora.json
    python examples/lora_bench.py --model smollm2-135m --out lora-smollm2.json

Builds its own adapters with `peft` (mixed ranks 4, 8, 16, 32 over every projection; no
download) next to the model, then measures, on one engine per configuration:

- throughput: output tokens per second of a batch of B requests (B = 1, 8, 32), each
  request on one of N adapters (N = 1, 4, 16, round robin; max_loras = N), against the
  base model alone on the same batch and engine; the ratio is the cost of the adapters;
  and the base model on an engine without LoRA (what enabling LoRA costs base requests);
- the eviction cliff: 16 adapters on 4 fast-pool slots (max_loras = 4, max_cpu_loras = 8),
  batches of 8 requests whose adapters follow a Zipf-like popularity, for each residency
  policy (`[adapter_residency]`): tokens per second and fast-pool loads per step.

Each cell is the median of `--repeats` runs after one warm-up. Run it on a quiet machine:
on a shared one the figures are noise.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from servelab import LLM, LoRARequest, SamplingParams
from servelab.model.loader import resolve_model

RANKS = (4, 8, 16, 32)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapters(model: str, count: int, root: Path) -> list[LoRARequest]:
    import transformers
    from peft import LoraConfig, get_peft_model

    base_path = Path(resolve_model(model))
    # a GGUF file (smollm2-135m) is read by transformers from its folder, named by gguf_file
    where, gguf = (base_path.parent, {"gguf_file": base_path.name}) if base_path.suffix == ".gguf" else (base_path, {})
    adapters = []
    for index in range(count):
        base = transformers.AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32, **gguf)
        rank = RANKS[index % len(RANKS)]
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS)))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
        path = root / f"adapter-{index}"
        peft_model.save_pretrained(str(path))
        adapters.append(LoRARequest(f"adapter-{index}", index + 1, str(path)))
    return adapters


def tokens_per_second(llm: LLM, prompts, params, lora, repeats: int) -> float:
    llm.generate(prompts, params, lora_request=lora)  # warm-up: adapters read, kernels built
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=lora)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
    return statistics.median(rates)


def prompts_for(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(batch)]


def throughput(model: str, adapters: list[LoRARequest], repeats: int) -> list[dict]:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    rows = []
    plain = LLM(model, max_num_seqs=32)
    vocab = plain.engine.model_config.vocab_size
    without_lora = {batch: tokens_per_second(plain, prompts_for(batch, vocab), params, None, repeats)
                    for batch in (1, 8, 32)}
    del plain
    for count in (1, 4, 16):
        llm = LLM(model, enable_lora=True, max_loras=count, max_num_seqs=32)
        for batch in (1, 8, 32):
            prompts = prompts_for(batch, vocab)
            base = tokens_per_second(llm, prompts, params, None, repeats)
            lora = [adapters[i % count] for i in range(batch)]
            with_adapters = tokens_per_second(llm, prompts, params, lora, repeats)
            rows.append({"adapters": count, "batch": batch, "no_lora_engine_tok_s": without_lora[batch],
                         "base_tok_s": base, "lora_tok_s": with_adapters, "step_cost_vs_base": base / with_adapters})
            print(rows[-1], flush=True)
    return rows


def eviction_cliff(model: str, adapters: list[LoRARequest], repeats: int) -> list[dict]:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rng = random.Random(1)
    weights = [1 / (rank + 1) for rank in range(len(adapters))]
    rows = []
    policies = {"lru": {}, "lfu": {}, "queue-aware": {},
                "pinned": {"adapter_residency.pinned": [adapters[0].lora_name, adapters[1].lora_name]}}
    for policy, options in policies.items():
        llm = LLM(model, enable_lora=True, max_loras=4, max_cpu_loras=8, max_num_seqs=8,
                  **{"adapter_residency.name": policy, **options})
        prompts = prompts_for(64, llm.engine.model_config.vocab_size, seed=2)
        lora = rng.choices(adapters, weights=weights, k=len(prompts))
        rate = tokens_per_second(llm, prompts, params, lora, repeats)
        manager = llm.engine.runner.lora
        rows.append({"policy": policy, "tok_s": rate, "pool_loads_per_step": manager.num_pool_loads / manager.tick,
                     "disk_reads": manager.num_disk_reads})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:tiny-random")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="lora-bench.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="servelab-lora-bench-") as root:
        adapters = build_adapters(args.model, 16, Path(root))
        result = {"model": args.model, "throughput": throughput(args.model, adapters, args.repeats),
                  "eviction_cliff": eviction_cliff(args.model, adapters, args.repeats)}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
