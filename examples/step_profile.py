"""Where a decode step's time goes, by kind of work, for one or more engine settings.

Runs `builtin:tiny-random` (or `--model`, e.g. smollm2-135m) with B running sequences in steady decode, profiles 20 steps
with torch's profiler, and sorts every op's self time into linear layers, LM head,
attention, norms/rotary/activation, sampling and the rest (the engine's Python between
ops is the step's wall time minus all op time). Each variant is a list of --set style
overrides, e.g. to compare today's default with torch's default linear and the reference
attention:

    OMP_NUM_THREADS=2 python examples/step_profile.py --batch 64 \
        --variant "engine.prepack_weights=false,attention.name=torch-paged" --variant ""
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from servelab import LLM, SamplingParams
from servelab.logging_setup import configure_logging

CATEGORIES = {
    "linear layers": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::linear", "cpu_paged::linear"),
    "attention": ("cpu_paged::attend", "aten::index_select", "aten::bmm", "aten::_softmax", "aten::_embedding_bag", "aten::index_copy_",
                  "aten::masked_fill_", "aten::_scaled_dot_product", "aten::_efficient_attention"),
    "norms, rotary, SwiGLU, residual": ("aten::rms_norm", "aten::_fused_rms_norm", "aten::mul", "aten::add", "aten::cat",
                                        "aten::silu", "aten::pow", "aten::mean", "aten::rsqrt", "aten::neg"),
    "sampling": ("aten::argmax",),
}


def parse_variant(text: str) -> dict:
    overrides = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        overrides[key] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    return overrides


def profile_variant(overrides: dict, batch: int, dtype: str, model: str) -> dict[str, float]:
    if overrides.get("attention.name") == "cpu-paged":  # time the kernels, not the fallback
        overrides = {"attention.build": "wait", **overrides}
    llm = LLM(model, dtype=dtype, max_num_seqs=batch, max_model_len=1024,
              max_num_batched_tokens=max(2048, batch * 4), **overrides)
    engine = llm.engine
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, 8000) for _ in range(rng.randint(50, 300))],
                           SamplingParams(max_tokens=600, temperature=0, ignore_eos=True))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in engine.unfinished_sequences()):
        engine.step()  # every prompt prefilled: from here on, pure decode steps
    for _ in range(3):
        engine.step()
    steps = 20
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps * 1000
    buckets = dict.fromkeys([*CATEGORIES, "LM head", "other ops"], 0.0)
    vocab = engine.model_config.vocab_size
    for event in prof.key_averages(group_by_input_shape=True):
        ms = event.self_cpu_time_total / 1000 / steps
        if event.key == "cpu_paged::lm_head":  # the LM head on the library's matmul
            buckets["LM head"] += ms
            continue
        if event.key in ("aten::mm", "mkldnn::_linear_pointwise") and any(
                vocab in shape for shape in event.input_shapes if isinstance(shape, list)):
            buckets["LM head"] += ms
            continue
        if event.key in ("aten::mm", "aten::addmm"):  # torch's default linear
            buckets["linear layers"] += ms
            continue
        for category, names in CATEGORIES.items():
            if any(event.key.startswith(name) for name in names):
                buckets[category] += ms
                break
        else:
            buckets["other ops"] += ms
    buckets["engine Python and unprofiled kernels"] = wall - sum(buckets.values())
    buckets["step"] = wall
    return buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default="builtin:tiny-random")
    parser.add_argument("--variant", action="append", default=[], help="comma-separated key=value overrides")
    args = parser.parse_args()
    configure_logging(0)
    variants = args.variant or [""]
    results = [profile_variant(parse_variant(v), args.batch, args.dtype, args.model) for v in variants]
    print(f"{args.model}: decode step at batch {args.batch}, {args.dtype}, {torch.get_num_threads()} threads: ms per step")
    print(f"{'':40}" + "".join(f"{(v or 'default')[:38]:>40}" for v in variants))
    for key in results[0]:
        print(f"{key:40}" + "".join(f"{r[key]:>40.2f}" for r in results))


if __name__ == "__main__":
    main()
