"""`servelab size`: the command line over sizing.py."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from servelab.bench.metrics import SLO
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import accelerator, interconnect
from servelab.bench.sim.shapes import model_shape
from servelab.bench.sim.sizing import (ReplicaSimulator, format_size, memory_plan, replicas_needed, speculation,
                                       sustained_rate)
from servelab.config import EngineConfig
from servelab.errors import ConfigError

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
    if args.tp is not None:  # --tp N is engine.tensor_parallel_size
        overrides["engine.tensor_parallel_size"] = args.tp
    if args.kv_cache_dtype is not None:
        overrides["engine.kv_cache_dtype"] = args.kv_cache_dtype
    config = base.with_set_options(args.assignments).with_overrides(overrides)
    tensor_parallel = config.engine.tensor_parallel_size
    link = interconnect(args.sim_interconnect) if args.sim_interconnect else None
    cost = CostModel(shape, hardware, tensor_parallel=tensor_parallel, link=link,
                     memory_utilization=args.memory_utilization, kv_cache_dtype=config.engine.kv_cache_dtype)
    block_size = config.engine.block_size
    plan = memory_plan(cost, block_size, args.context_len)
    result: dict[str, Any] = {"model": args.sim_model, "accelerator": hardware.name,
                              "tensor_parallel": tensor_parallel, "interconnect": cost.link.name,
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
