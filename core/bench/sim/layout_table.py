"""`servelab size` over parallel layouts: one layout's plan (memory per device, KV
capacity, priced decode and prefill), and every layout of G devices a model admits side
by side, the best named by decode throughput."""

from __future__ import annotations

from typing import Any

import attrs

from servelab.bench.sim.hardware import GIB, Accelerator, Interconnect
from servelab.bench.sim.layout_cost import LayoutCost
from servelab.bench.sim.layouts import (Layout, admissible_layouts, check_layout, engine_refusal, expert_placement,
                                        layer_kv_bytes_per_token, layout_memory)
from servelab.errors import ConfigError
from servelab.model.model_config import ModelConfig
from servelab.pipeline_chunks import chunk_sizing

BEST_CRITERION = "the most decode tokens/s among the layouts that fit"


@attrs.frozen
class LayoutSettings:
    """What every layout is sized and priced with (the engine config's and the command's)."""

    block_size: int
    context_len: int  # each decoding sequence's context, and the prompt prefilled
    memory_utilization: float
    kv_cache_dtype: str
    max_num_seqs: int  # the decode batch, where the KV holds as many
    max_num_batched_tokens: int  # the most prompt tokens one step runs
    micro_batches: int  # a step cut into this many pipelined chunks (0: one per stage)
    expert_placement: str
    redundant_experts: int
    expert_load: tuple[float, ...] | None  # per expert (None: uniform)
    chunk_sizing: str
    max_chunk: int | None  # None: the step's tokens over its micro-batches
    dtype_bytes: int = 2

    def chunk_limit(self, layout: Layout) -> int:
        if self.max_chunk is not None:
            return self.max_chunk
        step_tokens = min(self.context_len, self.max_num_batched_tokens)
        return -(-step_tokens // (self.micro_batches or layout.pp))


def check_expert_load(shape: ModelConfig, load: tuple[float, ...] | None) -> None:
    if load is None:
        return
    if shape.moe is None:
        raise ConfigError("--expert-load weighs a mixture of experts' experts; this shape is dense")
    if len(load) != shape.moe.num_experts or min(load) < 0 or not sum(load) > 0:
        raise ConfigError(f"--expert-load needs {shape.moe.num_experts} non-negative weights (one per expert, "
                          f"not all zero), got {len(load)}")


def plan_layout(shape: ModelConfig, hardware: Accelerator, link: Interconnect, layout: Layout,
                settings: LayoutSettings) -> dict[str, Any]:
    """One layout's JSON-ready plan; `price` is None where a sequence of the context does not fit."""
    check_layout(shape, layout, hardware)
    check_expert_load(shape, settings.expert_load)
    load = list(settings.expert_load) if settings.expert_load is not None else None
    placement = expert_placement(shape, layout.ep, settings.expert_placement, settings.redundant_experts, load)
    memory = layout_memory(shape, hardware, layout, placement, settings.block_size, settings.context_len,
                           settings.memory_utilization, settings.kv_cache_dtype, settings.dtype_bytes)
    refusal = engine_refusal(shape, layout)
    plan = {"layout": layout.name, "tensor_parallel": layout.tp, "pipeline_parallel": layout.pp,
            "expert_parallel": layout.ep, "attention_tp": layout.attention_tp, "devices": layout.devices,
            "fits": memory.fits,
            "servelab_runs": refusal is None, "servelab_refusal": refusal,
            "placement": None if placement is None else [list(r) for r in placement.ranks],
            "memory": attrs.asdict(memory), "price": None}
    if memory.fits:
        per_layer_kv = layer_kv_bytes_per_token(shape, layout, settings.kv_cache_dtype, settings.dtype_bytes)
        cost = LayoutCost(shape, hardware, link, layout, placement, load, per_layer_kv, settings.dtype_bytes)
        batch = min(memory.max_concurrent_seqs, settings.max_num_seqs)
        price = cost.price(batch, settings.context_len, settings.context_len, settings.chunk_limit(layout),
                           chunk_sizing(settings.chunk_sizing))
        plan["price"] = attrs.asdict(price)
    return plan


def compare_layouts(shape: ModelConfig, hardware: Accelerator, link: Interconnect, devices: int,
                    settings: LayoutSettings) -> dict[str, Any]:
    """Every layout of `devices` devices the model admits, planned, and the best by BEST_CRITERION."""
    rows = [plan_layout(shape, hardware, link, layout, settings)
            for layout in admissible_layouts(shape, devices, hardware)]
    priced = [row for row in rows if row["price"] is not None]
    best = max(priced, key=lambda row: row["price"]["decode_tokens_per_s"], default=None)
    return {"devices": devices, "criterion": BEST_CRITERION, "best": best["layout"] if best else None,
            "settings": attrs.asdict(settings), "rows": rows}


def format_layout_rows(rows: list[dict[str, Any]], best: str | None = None) -> str:
    header = (f"  {'layout':<15} {'servelab':>8} {'weights/dev':>11} {'KV tok/dev':>11} {'max seqs':>9} "
              f"{'batch':>6} {'step ms':>8} {'tok/s':>9} {'prefill ms':>10} {'chunks':>6} {'bubble':>7} "
              f"{'a2a MiB/dev':>11} {'EP imbal':>8}")
    lines = [header]
    for row in rows:
        m, p = row["memory"], row["price"]
        start = (f"  {row['layout']:<15} {'yes' if row['servelab_runs'] else 'not yet':>8} "
                 f"{m['weight_bytes'] / GIB:>7.1f} GiB {m['kv_tokens_per_device']:>11,} {m['max_concurrent_seqs']:>9,}")
        if p is None:
            lines.append(f"{start}  does not fit: no sequence of {m['context_len']} tokens")
            continue
        mark = "  <- best" if row["layout"] == best else ""
        lines.append(f"{start} {p['decode_batch']:>6} {1000 * p['decode_step_s']:>8.2f} "
                     f"{p['decode_tokens_per_s']:>9,.0f} {1000 * p['prefill_s']:>10.1f} {p['prefill_chunks']:>6} "
                     f"{100 * p['bubble_fraction']:>6.1f}% {p['all_to_all_bytes'] / 2**20:>11.2f} "
                     f"{p['expert_imbalance']:>8.2f}{mark}")
    refusals = sorted({row["servelab_refusal"] for row in rows if row["servelab_refusal"]})
    lines += [f"  servelab not yet: {reason}" for reason in refusals]
    if any(row["servelab_runs"] and row["expert_parallel"] > 1 and not row["attention_tp"]
           for row in rows):  # docs/parallelism.md
        lines.append("  servelab's EP alone (EPn) replicates attention: every rank attends to all the sequences, so it "
                     "holds max seqs / n of them; EPn+TP-attn splits the heads, and holds its max seqs")
    return "\n".join(lines)


def format_layouts(result: dict[str, Any], model: str, hardware: Accelerator, link: Interconnect) -> str:
    s = result["settings"]
    with_ep = any(row["expert_parallel"] > 1 for row in result["rows"])
    moe = f" under the {s['expert_placement']} placement" if with_ep else ""
    kinds = "TP x PP (x EP, and EP splitting attention TP-style on the same ranks: +TP-attn)" if with_ep else "TP x PP"
    lines = [f"{model} on {result['devices']} x {hardware.name} over {link.name}: every {kinds} layout, "
             f"context {s['context_len']} tokens, blocks of {s['block_size']}, KV {s['kv_cache_dtype']}",
             f"  decode: a batch of up to {s['max_num_seqs']} sequences at the context{moe}; prefill: one prompt of "
             f"the context, {s['chunk_sizing']} chunks",
             format_layout_rows(result["rows"], result["best"]),
             f"best ({result['criterion']}): {result['best'] or 'none fits'}"]
    return "\n".join(lines)


def format_layout_plan(plan: dict[str, Any], model: str, hardware: Accelerator, link: Interconnect,
                       settings: LayoutSettings) -> str:
    m, p = plan["memory"], plan["price"]
    joined = f", over {link.name}" if plan["devices"] > 1 else ""
    if plan["attention_tp"]:
        grid = (f"EP {plan['expert_parallel']} splitting attention TP {plan['tensor_parallel']} on the same ranks x "
                f"PP {plan['pipeline_parallel']}")
    else:
        grid = f"TP {plan['tensor_parallel']} x PP {plan['pipeline_parallel']} x EP {plan['expert_parallel']}"
    lines = [
        f"{model} on {plan['devices']} x {hardware.name} as {plan['layout']} ({grid}{joined}), context "
        f"{m['context_len']} tokens, blocks of {settings.block_size} tokens",
        f"  per device (the fullest): {m['memory_bytes'] / GIB:.1f} GiB = weights {m['weight_bytes'] / GIB:.1f} GiB "
        f"+ runtime {m['reserved_bytes'] / GIB:.1f} GiB + free {m['free_bytes'] / GIB:.1f} GiB",
    ]
    if plan["pipeline_parallel"] > 1:
        lines.append("  weights a device, stage by stage: "
                     + ", ".join(f"{w / GIB:.1f}" for w in m["stage_weight_bytes"]) + " GiB")
    if m["free_bytes"] <= 0:
        lines.append(f"  does not fit: the weights and the runtime exceed the device's {m['memory_bytes'] / GIB:.1f} "
                     f"GiB; spread the model over more devices (--tp, --pp, --ep; compare them with --layouts N)")
        return "\n".join(lines)
    lines += [
        f"  KV pool: {m['memory_utilization']:.2f} x {m['free_bytes'] / GIB:.1f} GiB = "
        f"{m['kv_pool_bytes'] / GIB:.1f} GiB / {m['block_bytes'] / 2**20:.2f} MiB a block "
        f"({m['kv_bytes_per_token'] / 1024:.0f} KiB a token on this device, KV {settings.kv_cache_dtype}) = "
        f"{m['num_blocks']:,} blocks = {m['kv_tokens_per_device']:,} tokens",
        f"  concurrent sequences of {m['context_len']} tokens: {m['max_concurrent_seqs']:,} ("
        + (f"{plan['expert_parallel']} EP ranks, each attending to its own; "
           if plan["expert_parallel"] > 1 and not plan["attention_tp"] else "")
        + ("every rank attends to all of them with its heads; " if plan["attention_tp"] else "")
        + f"{m['blocks_per_sequence']} blocks each)",
    ]
    if p is None:
        lines.append(f"  does not fit: the KV pool holds no sequence of {m['context_len']} tokens")
    else:
        ep = ""
        if plan["expert_parallel"] > 1:
            ep = (f"; all-to-all {p['all_to_all_bytes'] / 2**20:.2f} MiB a device a step, busiest EP rank "
                  f"{p['expert_imbalance']:.2f}x the mean ({settings.expert_placement} placement, "
                  f"{'given' if settings.expert_load else 'uniform'} expert load)")
        lines += [
            f"  decode, {p['decode_batch']} sequences at {m['context_len']} tokens: {1000 * p['decode_step_s']:.2f} ms "
            f"a token, {p['decode_tokens_per_s']:,.0f} tokens/s{ep}",
            f"  prefill of a {p['prompt_len']}-token prompt: {1000 * p['prefill_s']:.1f} ms in {p['prefill_chunks']} "
            f"{settings.chunk_sizing} chunk{'s' if p['prefill_chunks'] > 1 else ''} of at most "
            f"{settings.chunk_limit(_layout(plan))} tokens, "
            f"bubble {100 * p['bubble_fraction']:.1f}%",
        ]
    if not plan["servelab_runs"]:
        lines.append(f"  servelab's engine does not run it yet: {plan['servelab_refusal']}")
    elif plan["attention_tp"]:  # docs/parallelism.md, "EP x TP"
        lines.append("  servelab's engine runs it (EP x TP: each rank its experts and its heads of every layer)")
    elif plan["expert_parallel"] > 1:  # docs/parallelism.md, "Expert parallelism"
        lines.append(f"  servelab's engine runs it with attention replicated: every rank attends to all the sequences, "
                     f"so it holds one rank's, {m['max_concurrent_seqs'] // plan['expert_parallel']:,}")
    else:
        lines.append("  servelab's engine runs it")
    return "\n".join(lines)


def _layout(plan: dict[str, Any]) -> Layout:
    return Layout(plan["tensor_parallel"], plan["pipeline_parallel"], plan["expert_parallel"], plan["attention_tp"])
