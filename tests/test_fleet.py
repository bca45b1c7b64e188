"""Simulated fleets: replicas behind a router, each running the configured scheduler
and allocator on its own simulated clock."""

from __future__ import annotations

import json
import time

import pytest

from servelab import cli
from servelab.bench.driver import StepRecorder, run_workload
from servelab.bench.metrics import SLO, summarize
from servelab.bench.session import BenchOptions, run_bench
from servelab.bench.sim.fleet import SimFleet, fleet_metrics, run_fleet
from servelab.bench.sim.hardware import accelerator
from servelab.bench.sim.runner import VirtualClock
from servelab.bench.sim.shapes import model_shape
from servelab.bench.sim.source import SimSource
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.registry import PluginRegistry
from servelab.workload import build_workload

# Eight caches too small for every prefix: 48 groups of 512 tokens, 2,048 tokens a replica.
SHARED = "shared-prefix:num_groups=48,prefix_len=512,num_requests=400,tail_len=16,output_len=4,shuffle=1," \
         "arrival=poisson,rate=400"


def _config(router: str, **engine) -> EngineConfig:
    return EngineConfig.from_dict({"engine": {"max_num_seqs": 32, "max_model_len": 1024, **engine},
                                   "allocator": {"name": "radix"}, "scheduler": {"name": "chunked-prefill"},
                                   "router": {"name": router}})


def _fleet(router: str, replicas: int = 8, **engine) -> SimFleet:
    return SimFleet(router, _config(router, **engine), replicas, "h100", "llama-3-8b")


def test_eight_replicas_simulate_in_seconds_with_every_request_served_once():
    started = time.perf_counter()
    fleet = _fleet("round-robin", num_kv_blocks=128, block_size=16)
    workload = build_workload(SHARED, fleet.engine.model_config.vocab_size)
    record = run_fleet(fleet, workload)
    assert time.perf_counter() - started < 30
    assert [len(o.token_ids) for o in record.run.outputs] == [r.max_tokens for r in workload.requests]
    assert [o.request_id for o in record.run.outputs] == [f"req-{i}" for i in range(len(workload.requests))]
    assert [record.replica_of.count(i) for i in range(8)] == [50] * 8  # round robin, to the request
    # each replica ran the configured policies, not copies of one engine
    assert {type(r.engine.scheduler).__name__ for r in fleet.replicas} == {"ChunkedPrefillScheduler"}
    assert {type(r.engine.allocator).__name__ for r in fleet.replicas} == {"RadixAllocator"}
    assert len({id(r.engine.allocator) for r in fleet.replicas}) == 8


def test_prefix_affinity_raises_the_hit_rate_over_round_robin():
    rates = {}
    for router in ("round-robin", "least-loaded", "prefix-affinity"):
        fleet = _fleet(router, num_kv_blocks=128, block_size=16)
        record = run_fleet(fleet, build_workload(SHARED, fleet.engine.model_config.vocab_size))
        rates[router] = fleet_metrics(record, SLO(), 8, router)["prefix_hit_rate"]
    assert rates["prefix-affinity"] > 1.5 * rates["round-robin"], rates
    assert rates["prefix-affinity"] > 1.5 * rates["least-loaded"], rates


def test_one_replica_fleet_times_requests_exactly_as_a_single_simulated_engine():
    from servelab.engine import LLMEngine

    spec = "skewed:num_requests=40,arrival=poisson,rate=30"
    fleet = _fleet("round-robin", replicas=1)
    workload = build_workload(spec, fleet.engine.model_config.vocab_size)
    fleet_run = run_fleet(fleet, workload).run

    clock = VirtualClock()
    source = SimSource(model_shape("llama-3-8b"), accelerator("h100"), clock)
    registry = PluginRegistry.from_entry_points()
    recorder = StepRecorder(clock)
    registry.register(recorder)
    engine = LLMEngine(source.fit_config(_config("round-robin")), registry, clock=clock, source=source)
    single = run_workload(engine, recorder, workload, "single")
    ttft = lambda run: [o.metrics.ttft for o in run.outputs]  # noqa: E731
    assert ttft(fleet_run) == pytest.approx(ttft(single), abs=1e-9)
    assert fleet_run.end_time - fleet_run.start_time == pytest.approx(single.end_time - single.start_time)


def test_replicas_run_in_parallel_in_simulated_time():
    spec = "fixed:num_requests=8,prompt_len=512,output_len=64"
    one = _fleet("round-robin", replicas=1)
    four = _fleet("round-robin", replicas=4)
    workload = build_workload(spec, one.engine.model_config.vocab_size)
    one_run, four_run = run_fleet(one, workload).run, run_fleet(four, workload).run
    # four replicas each decode 2 sequences: about as long as one decoding 2, far less than 8 in one
    two = _fleet("round-robin", replicas=1)
    two_run = run_fleet(two, build_workload("fixed:num_requests=2,prompt_len=512,output_len=64",
                                            two.engine.model_config.vocab_size)).run
    span = lambda run: run.end_time - run.start_time  # noqa: E731
    assert span(four_run) == pytest.approx(span(two_run), rel=0.02)
    assert span(four_run) < span(one_run)


def test_bench_compares_routers_side_by_side(tmp_path):
    configs = []
    for router in ("round-robin", "prefix-affinity"):
        path = tmp_path / f"{router}.toml"
        path.write_text(f'[engine]\nmax_num_seqs = 32\nmax_model_len = 1024\nnum_kv_blocks = 128\n\n[allocator]\nname = "radix"\n\n'
                        f'[router]\nname = "{router}"\n')
        configs.append(str(path))
    out = tmp_path / "fleet.json"
    code = cli.main(["bench", "--sim", "h100", "--sim-model", "llama-3-8b", "--replicas", "8",
                     *sum((["--config", c] for c in configs), []), "--workload", SHARED, "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["replicas"] == 8
    by_name = {run["config"]: run["metrics"] for run in result["runs"]}
    assert by_name["prefix-affinity"]["fleet"]["router"] == "prefix-affinity"
    assert sum(by_name["round-robin"]["fleet"]["requests_per_replica"]) == 400
    assert by_name["prefix-affinity"]["prefix_hit_rate"] > by_name["round-robin"]["prefix_hit_rate"]


def test_replicas_without_the_simulator_is_a_usage_error():
    with pytest.raises(ConfigError, match="--sim"):
        run_bench([("default", EngineConfig())], BenchOptions(replicas=2))


def test_summary_of_a_fleet_covers_every_replica():
    fleet = _fleet("least-loaded", replicas=3)
    record = run_fleet(fleet, build_workload("skewed:num_requests=30", fleet.engine.model_config.vocab_size))
    metrics = fleet_metrics(record, SLO(), 3, "least-loaded")
    assert metrics["num_requests"] == 30
    assert sum(metrics["fleet"]["requests_per_replica"]) == 30
    assert metrics["steps"] == sum(len(r.steps) for r in record.per_replica)
    assert summarize(record.run, SLO())["output_tokens"] == sum(len(o.token_ids) for o in record.run.outputs)


def test_fleet_replicas_are_tensor_parallel_as_the_config_says():
    with pytest.raises(ConfigError, match="tensor parallelism over 2 or more devices"):
        SimFleet("one-device", _config("round-robin"), 2, "h100", "llama-3-70b")
    config = _config("round-robin", tensor_parallel_size=4)
    nvlink = SimFleet("nvlink", config, 2, "h100", "llama-3-70b")
    pcie = SimFleet("pcie", config, 2, "h100", "llama-3-70b", "pcie4")
    assert {r.engine.runner.cost_model.tensor_parallel for r in nvlink.replicas + pcie.replicas} == {4}
    workload = build_workload("fixed:num_requests=8,prompt_len=256,output_len=16", 1000)
    spans = {}
    for fleet in (nvlink, pcie):
        run = run_fleet(fleet, workload).run
        assert sum(len(o.token_ids) for o in run.outputs) == 8 * 16
        spans[fleet.name] = run.end_time - run.start_time
    assert spans["pcie"] > spans["nvlink"]  # the same steps plus slower all-reduces
