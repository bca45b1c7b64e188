"""LoRA adapters in `servelab bench`: workloads that name adapters, real runs that read the
adapters the bench writes, and the simulator that prices them (shrink/expand and pool
loads over the host link) with the engine's own residency policies."""

from __future__ import annotations

import collections

import pytest

from servelab.bench.bench_adapters import adapter_rank, write_bench_adapters
from servelab.bench.report import format_table
from servelab.bench.session import BenchOptions, run_bench
from servelab.bench.sim.cost_model import CostModel, lora_work
from servelab.bench.sim.hardware import accelerator
from servelab.bench.sim.shapes import model_shape
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.model.lora_adapter import adapter_shapes, load_adapter
from servelab.workload import Workload, build_workload

LORA = {"engine.enable_lora": True, "engine.max_num_seqs": 16}


def test_requests_draw_their_adapters_by_zipf_popularity_and_the_rest_is_unchanged():
    plain = build_workload("skewed:num_requests=400,arrival=poisson,rate=4", 1000)
    spec = "skewed:num_requests=400,arrival=poisson,rate=4,adapters=8,adapter_zipf=1.5,base_fraction=0.25"
    mixed = build_workload(spec, 1000)
    assert mixed == build_workload(spec, 1000)  # seeded
    assert [(r.prompt_token_ids, r.max_tokens, r.arrival_time) for r in mixed.requests] == \
        [(r.prompt_token_ids, r.max_tokens, r.arrival_time) for r in plain.requests]
    counts = collections.Counter(r.adapter for r in mixed.requests)
    assert counts[None] == 100 and mixed.num_adapters == 8
    assert counts[0] > counts[1] > counts[3] > counts[7] > 0  # weights 1 / (k + 1) ** 1.5
    uniform = collections.Counter(r.adapter for r in build_workload("fixed:num_requests=800,adapters=4,adapter_zipf=0",
                                                                    1000).requests)
    assert min(uniform.values()) > 150


def test_adapters_survive_a_saved_workload(tmp_path):
    workload = build_workload("fixed:num_requests=6,adapters=3,base_fraction=0.5", 500)
    workload.save(tmp_path / "w.jsonl")
    assert Workload.load(tmp_path / "w.jsonl").requests == workload.requests
    (tmp_path / "bad.jsonl").write_text('{"prompt_token_ids": [5], "max_tokens": 2, "adapter": -1}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: adapter must be an adapter index"):
        Workload.load(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("spec, message", [("fixed:adapters=-2", "adapters must be an integer"),
                                           ("fixed:adapters=2,adapter_zipf=-1", "adapter_zipf"),
                                           ("fixed:adapters=2,base_fraction=2", "base_fraction"),
                                           ("fixed:base_fraction=0.5", "need adapters=N")])
def test_bad_adapter_options_are_named(spec, message):
    with pytest.raises(ConfigError, match=message):
        build_workload(spec, 100)


def test_the_bench_adapters_load_and_their_shapes_match_without_the_weights(tmp_path):
    """What a real run reads and what the simulator reads (the config alone) agree."""
    shape = model_shape("tiny-random")
    requests = write_bench_adapters(2, shape, tmp_path)
    for index, request in enumerate(requests):
        loaded = load_adapter(request.lora_name, request.lora_path, shape, 64)
        shapes = adapter_shapes(request.lora_name, request.lora_path, shape, 64)
        assert loaded.max_rank == adapter_rank(index)
        assert {key: (m.lora_a.shape, m.lora_b.shape, m.scale) for key, m in loaded.modules.items()} == \
            {key: (m.lora_a.shape, m.lora_b.shape, m.scale) for key, m in shapes.modules.items()}
        assert loaded.nbytes == shapes.nbytes
    config_only = write_bench_adapters(1, model_shape("llama-3-8b"), tmp_path / "big", weights=False)[0]
    big = adapter_shapes("a", config_only.lora_path, model_shape("llama-3-8b"), 64)
    assert big.modules[(0, "q_proj")].lora_a.device.type == "meta"


def test_the_cost_model_prices_each_adapters_weights_once_and_its_rows_flops():
    shape, hardware = model_shape("llama-3-8b"), accelerator("h100")
    cost = CostModel(shape, hardware)
    assert lora_work([(80, 3, 1000), (0, 1, 500)]) == (2.0 * 80 * 1000, 2.0 * (3 * 1000 + 1 * 500), 4.0 * 1500)
    queries, contexts = [1] * 8, [500] * 8
    base = cost.step(queries, contexts, 8)
    one = cost.step(queries, contexts, 8, [(0, 8, 20_000_000)])
    four = cost.step(queries, contexts, 8, [(0, 2, 20_000_000)] * 4)
    # decode steps are memory-bound: four adapters read four times the adapter bytes
    assert base.seconds < one.seconds < four.seconds
    assert four.kernel_seconds["lora"] == pytest.approx(4 * one.kernel_seconds["lora"], rel=0.01)
    assert four.kernel_seconds["lora"] == pytest.approx(4 * 4 * 20e6 / (hardware.memory_bandwidth
                                                                         * hardware.bandwidth_efficiency))


def _sim(workload: str, accelerator_name: str = "h100", policy: str = "lru", **engine) -> dict:
    config = EngineConfig().with_overrides({**LORA, **{f"engine.{k}": v for k, v in engine.items()},
                                            "adapter_residency.name": policy})
    options = BenchOptions(workload=workload, sim_accelerator=accelerator_name, sim_model="llama-3-8b", repeats=1)
    return run_bench([("sim", config)], options)


def test_the_simulator_pays_for_adapters_and_their_swaps():
    """The same requests: on the base model, on adapters that all fit the pool, and on more
    adapters than slots (every policy's swaps cross the host link before the step)."""
    workload = "fixed:num_requests=64,prompt_len=128,output_len=32,arrival=poisson,rate=40"
    base = _sim(workload)["runs"][0]["metrics"]
    fits = _sim(workload + ",adapters=4", max_loras=4)["runs"][0]["metrics"]
    swaps = _sim(workload + ",adapters=16", max_loras=2)["runs"][0]["metrics"]
    assert "adapter_pool_loads" not in base
    assert fits["adapter_pool_loads"] == 0  # all four stayed in the pool after the warm-up run
    assert swaps["adapter_pool_loads"] > 4 and swaps["adapter_loads_per_step"] > 0 and swaps["adapter_disk_reads"] > 0
    assert base["tpot_ms"]["p50"] < fits["tpot_ms"]["p50"]
    assert base["output_tokens"] == fits["output_tokens"] == swaps["output_tokens"]
    for policy in ("lfu", "queue-aware"):
        other = _sim(workload + ",adapters=16", policy=policy, max_loras=2)
        assert other["runs"][0]["metrics"]["output_tokens"] == swaps["output_tokens"]


def test_a_workload_with_adapters_needs_enable_lora():
    config = EngineConfig().with_overrides({"engine.max_num_seqs": 16})
    with pytest.raises(ConfigError, match="enable_lora"):
        run_bench([("sim", config)], BenchOptions(workload="fixed:num_requests=4,adapters=2", sim_accelerator="h100",
                                                  repeats=1))


def test_a_real_run_serves_the_written_adapters():
    """builtin:tiny-random with 6 adapters on 2 slots: every request finishes with its
    adapter, the report counts the swaps."""
    config = EngineConfig().with_overrides({"engine.model": "builtin:tiny-random", **LORA, "engine.max_loras": 2,
                                            "engine.max_model_len": 256})
    result = run_bench([("real", config)], BenchOptions(
        workload="fixed:num_requests=12,prompt_len=16,output_len=4,adapters=6,adapter_zipf=0", repeats=1))
    metrics = result["runs"][0]["metrics"]
    assert metrics["num_requests"] == 12 and metrics["output_tokens"] == 48
    assert metrics["adapter_pool_loads"] >= 4 and metrics["adapter_disk_reads"] > 0
    assert "LoRA pool loads / step" in format_table(result)


def test_a_simulated_fleet_routes_by_resident_adapter():
    """Two replicas of 2 slots each, 4 adapters: the adapter-affinity router sends requests
    where their adapter already is, so the fleet swaps far fewer adapters than round robin
    (each replica reports its resident adapters through the same snapshot as live ones)."""
    workload = "fixed:num_requests=96,prompt_len=64,output_len=16,arrival=poisson,rate=2,adapters=4,adapter_zipf=0"
    loads, ttft = {}, {}
    for router in ("round-robin", "adapter-affinity"):
        config = EngineConfig().with_overrides({**LORA, "engine.max_loras": 2, "router.name": router})
        result = run_bench([(router, config)], BenchOptions(workload=workload, sim_accelerator="h100",
                                                            sim_model="llama-3-8b", repeats=1, replicas=2))
        metrics = result["runs"][0]["metrics"]
        assert metrics["num_requests"] == 96
        loads[router], ttft[router] = metrics["adapter_pool_loads"], metrics["ttft_ms"]["p50"]
        assert sum(metrics["fleet"]["adapter_pool_loads_per_replica"]) == loads[router]
    assert loads["adapter-affinity"] * 3 < loads["round-robin"]
    assert ttft["adapter-affinity"] < ttft["round-robin"]  # a request no longer waits for its adapter's load
