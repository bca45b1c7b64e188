"""`servelab size`: the command line over sizing.py (one tensor-parallel engine of a dense
shape) and layout_table.py (EP/PP layouts, mixtures of experts, `--layouts G`)."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from servelab.bench.metrics import SLO
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import Accelerator, Interconnect, accelerator, interconnect
from servelab.bench.sim.layout_table import (LayoutSettings, compare_layouts, format_layout_plan, format_layouts,
                                             plan_layout)
from servelab.bench.sim.layouts import Layout
from servelab.bench.sim.shapes import model_shape
from servelab.bench.sim.sizing import (ReplicaSimulator, format_size, memory_plan, replicas_needed, speculation,
                                       sustained_rate)
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.model.model_config import ModelConfig
from servelab.pipeline_chunks import CHUNK_SIZINGS

DEFAULT_MAX_NUM_SEQS = 256


def size(args: argparse.Namespace) -> dict[str, Any]:
    """Print the plan and return it as a JSON-ready dict."""
    if args.context_len < 1 or args.spec_batch < 1 or args.max_draft_tokens < 1:
        raise ConfigError("--context-len, --spec-batch and --max-draft-tokens must be positive")
    hardware = accelerator(args.sim)
    shape = model_shape(args.sim_model)
    if args.context_len > shape.max_position_embeddings:
        raise ConfigError(f"--context-len {args.context_len} exceeds {args.sim_model}'s "
                          f"{shape.max_position_embeddings} positions")
    base = EngineConfig.load(args.config) if args.config else EngineConfig.from_dict(
        {"engine": {"max_num_seqs": DEFAULT_MAX_NUM_SEQS}})
    overrides: dict[str, Any] = {"engine.max_model_len": args.context_len}
    if args.kv_cache_dtype is not None:
        overrides["engine.kv_cache_dtype"] = args.kv_cache_dtype
    if args.expert_placement is not None:
        overrides["engine.expert_placement"] = args.expert_placement
    config = base.with_set_options(args.assignments).with_overrides(overrides)
    link = interconnect(args.sim_interconnect) if args.sim_interconnect else None
    if args.layouts is not None:
        if any(size is not None for size in (args.tp, args.pp, args.ep)):
            raise ConfigError("--layouts G compares every layout of G devices: drop --tp, --pp and --ep")
        return _size_layouts(args, shape, hardware, link, config)
    # --tp, --pp, --ep N are engine.tensor_parallel_size, pipeline_parallel_size, expert_parallel_size (set
    # here, not in the config, which refuses the combinations the engine does not run yet)
    engine = config.engine
    layout = _flag_layout(engine.tensor_parallel_size if args.tp is None else args.tp,
                          engine.pipeline_parallel_size if args.pp is None else args.pp,
                          engine.expert_parallel_size if args.ep is None else args.ep)
    if layout.pp > 1 or layout.ep > 1 or shape.moe is not None:
        return _size_layout(args, shape, hardware, link, config, layout)
    config = config.with_overrides({"engine.tensor_parallel_size": layout.tp})
    tensor_parallel = config.engine.tensor_parallel_size
    cost = CostModel(shape, hardware, tensor_parallel=tensor_parallel, link=link,
                     memory_utilization=args.memory_utilization, kv_cache_dtype=config.engine.kv_cache_dtype)
    block_size = config.engine.block_size
    plan = memory_plan(cost, block_size, args.context_len)
    result: dict[str, Any] = {"model": args.sim_model, "accelerator": hardware.name,
                              "tensor_parallel": tensor_parallel, "pipeline_parallel": 1, "expert_parallel": 1,
                              "interconnect": cost.link.name,
                              "kv_cache_dtype": config.engine.kv_cache_dtype,
                              "block_size": block_size, "memory": attrs.asdict(plan),
                              "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}}
    if not args.no_sweep:
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
        simulator = ReplicaSimulator(config, shape, hardware, args.memory_utilization, link)
        rate, points, offline = sustained_rate(simulator.run, args.workload, slo, args.slo_attainment,
                                               duration_s=args.sweep_seconds)
        result["rate"] = {"workload": args.workload, "attainment": args.slo_attainment, "sustained_rps": rate,
                          "offline_rps": offline, "points": [attrs.asdict(p) for p in points]}
        if args.target_rate:
            result["rate"].update(target_rps=args.target_rate,
                                  replicas_needed=replicas_needed(args.target_rate, rate))
    if args.draft_cost is not None:
        draft_cost, source = args.draft_cost, "given"
    else:
        draft = CostModel(model_shape(args.draft_model), hardware)
        context = min(args.context_len, model_shape(args.draft_model).max_position_embeddings)
        batch = args.spec_batch
        draft_cost = (draft.step([1] * batch, [context] * batch, batch).seconds
                      / cost.step([1] * batch, [args.context_len] * batch, batch).seconds)
        source = f"measured on the cost model: {args.draft_model} on one device"
    rows = speculation(cost, args.spec_batch, args.context_len, args.acceptance_rate, draft_cost,
                       args.max_draft_tokens)
    result["speculation"] = {"batch": args.spec_batch, "context_len": args.context_len, "draft_cost": draft_cost,
                             "draft_cost_source": source, "acceptance": args.acceptance_rate,
                             "rows": [attrs.asdict(r) for r in rows]}
    print(format_size(result))
    return result


def _flag_layout(tp: Any, pp: Any, ep: Any) -> Layout:
    """The layout --tp, --pp and --ep name: both TP and EP above 1 is EP x TP on the same
    ranks, as the engine runs tensor_parallel_size = expert_parallel_size (docs/parallelism.md,
    "EP x TP"); a TP x EP grid is only compared, by --layouts G."""
    if isinstance(tp, int) and isinstance(ep, int) and tp > 1 and ep > 1:
        if tp != ep:
            raise ConfigError(f"--tp {tp} with --ep {ep}: together --tp and --ep put EP x TP on the same ranks (the "
                              f"EP ranks split every layer's attention heads, as the engine's tensor_parallel_size = "
                              f"expert_parallel_size and vLLM's --enable-expert-parallel run it), so --tp must equal "
                              f"--ep; a grid of EP ranks that are TP groups (TP{tp}xEP{ep}) is compared by "
                              f"--layouts {tp * ep * (pp if isinstance(pp, int) and pp > 0 else 1)}")
        return Layout(tp=tp, pp=pp, ep=ep, attention_tp=True)
    return Layout(tp=tp, pp=pp, ep=ep)


def layout_settings(args: argparse.Namespace, config: EngineConfig) -> LayoutSettings:
    engine = config.engine
    if args.chunk_sizing not in CHUNK_SIZINGS:
        raise ConfigError(f"--chunk-sizing must be one of {', '.join(CHUNK_SIZINGS)}, got {args.chunk_sizing!r}")
    if args.max_chunk is not None and args.max_chunk < 1:
        raise ConfigError(f"--max-chunk must be positive, got {args.max_chunk}")
    try:
        load = tuple(float(w) for w in args.expert_load.split(",")) if args.expert_load else None
    except ValueError:
        raise ConfigError(f"--expert-load takes comma-separated weights, one per expert, "
                          f"got {args.expert_load!r}") from None
    return LayoutSettings(
        block_size=engine.block_size, context_len=args.context_len, memory_utilization=args.memory_utilization,
        kv_cache_dtype=engine.kv_cache_dtype, max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens or max(2048, args.context_len),
        micro_batches=engine.pipeline_micro_batches, expert_placement=engine.expert_placement,
        redundant_experts=engine.redundant_experts, expert_load=load, chunk_sizing=args.chunk_sizing,
        max_chunk=args.max_chunk)


def _header(args: argparse.Namespace, hardware: Accelerator, link: Interconnect,
            config: EngineConfig) -> dict[str, Any]:
    return {"model": args.sim_model, "accelerator": hardware.name, "interconnect": link.name,
            "kv_cache_dtype": config.engine.kv_cache_dtype, "block_size": config.engine.block_size}


def _size_layout(args: argparse.Namespace, shape: ModelConfig, hardware: Accelerator, link: Interconnect | None,
                 config: EngineConfig, layout: Layout) -> dict[str, Any]:
    """One TP x PP x EP layout, or any layout of a mixture of experts: memory and priced
    steps (parallel_cost); the rate sweep and speculation run servelab's engine on the step
    cost model, which simulates TP of dense shapes only."""
    link = link or interconnect(hardware.interconnect)
    settings = layout_settings(args, config)
    plan = plan_layout(shape, hardware, link, layout, settings)
    print(format_layout_plan(plan, args.sim_model, hardware, link, settings))
    print("  (no rate sweep or speculation table: they simulate servelab's engine over tensor parallelism "
          "on a dense shape; compare layouts with --layouts N)")
    return {**_header(args, hardware, link, config), "tensor_parallel": layout.tp, "pipeline_parallel": layout.pp,
            "expert_parallel": layout.ep, "layout": plan}


def _size_layouts(args: argparse.Namespace, shape: ModelConfig, hardware: Accelerator, link: Interconnect | None,
                  config: EngineConfig) -> dict[str, Any]:
    link = link or interconnect(hardware.interconnect)
    result = compare_layouts(shape, hardware, link, args.layouts, layout_settings(args, config))
    print(format_layouts(result, args.sim_model, hardware, link))
    return {**_header(args, hardware, link, config), "layouts": result}
