"""`servelab size`: memory arithmetic from the model shape, the sustained-rate search,
replicas for a target, the speculative-decoding breakeven, and tensor parallelism in
the cost model."""

from __future__ import annotations

import json

import pytest

from servelab import cli
from servelab.bench.metrics import SLO
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import GIB, accelerator
from servelab.bench.sim.shapes import model_shape
from servelab.bench.sim.sizing import (_with_arrivals, expected_tokens, memory_plan, replicas_needed, speculation,
                                       sustained_rate)
from servelab.errors import ConfigError
from servelab.workload import build_workload


def test_memory_plan_is_utilisation_times_free_memory_over_block_bytes():
    cost = CostModel(model_shape("llama-3-8b"), accelerator("h100"), memory_utilization=0.8)
    plan = memory_plan(cost, block_size=16, context_len=8192)
    # Llama-3-8B: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 128 KiB a token
    assert plan.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 128 * 1024
    assert plan.block_bytes == 16 * 128 * 1024
    # 8.03 B parameters in bf16, embedding and LM head untied
    assert 14.5 * GIB < plan.weight_bytes < 15.5 * GIB
    assert plan.free_bytes == pytest.approx(80 * GIB - 2 * GIB - plan.weight_bytes)
    assert plan.num_blocks == int(0.8 * plan.free_bytes // plan.block_bytes)
    assert plan.blocks_per_sequence == 512
    assert plan.max_concurrent_seqs == plan.num_blocks // 512


def test_tensor_parallelism_splits_weights_and_kv_heads_and_adds_all_reduces():
    shape, h100 = model_shape("llama-3-70b"), accelerator("h100")
    with pytest.raises(ConfigError, match="tensor parallelism over 2 or more"):
        CostModel(shape, h100).kv_blocks(16)
    two, four = CostModel(shape, h100, tensor_parallel=2), CostModel(shape, h100, tensor_parallel=4)
    assert four.resident_weight_bytes == pytest.approx(two.resident_weight_bytes / 2)
    assert four.kv_bytes_per_token == two.kv_bytes_per_token / 2  # 8 KV heads: 4 then 2 a device
    # past 8 devices each holds a copy of one of the 8 KV heads
    assert (CostModel(shape, h100, tensor_parallel=16).kv_bytes_per_token
            == CostModel(shape, h100, tensor_parallel=8).kv_bytes_per_token)
    step = four.step([1] * 8, [1000] * 8, 8)
    assert step.kernel_seconds["communication"] > 0
    # a decode step on 4 devices beats 2: half the weights to stream per device
    assert step.seconds < two.step([1] * 8, [1000] * 8, 8).seconds
    with pytest.raises(ConfigError, match="does not divide"):
        CostModel(shape, h100, tensor_parallel=3)
    with pytest.raises(ConfigError, match="positive integer"):
        CostModel(shape, h100, tensor_parallel=True)
    with pytest.raises(ConfigError, match="interconnect"):
        CostModel(model_shape("tiny-random"), accelerator("cpu-here"), tensor_parallel=2)


def test_size_tp_is_the_engine_tensor_parallel_size(tmp_path):
    """`--tp N` and `--set engine.tensor_parallel_size=N` plan the same; a slower link
    leaves the memory plan alone and lowers the sustained rate."""
    base = ["size", "--sim", "h100", "--sim-model", "llama-3-70b", "--context-len", "2048",
            "--workload", "fixed:num_requests=8,prompt_len=256,output_len=16", "--sweep-seconds", "1"]
    plans = {}
    for name, extra in {"tp": ["--tp", "4"], "set": ["--set", "engine.tensor_parallel_size=4"],
                        "pcie": ["--tp", "4", "--sim-interconnect", "pcie4"]}.items():
        out = tmp_path / f"{name}.json"
        assert cli.main([*base, *extra, "--json", str(out)]) == 0
        plans[name] = json.loads(out.read_text())
    assert plans["tp"]["tensor_parallel"] == plans["set"]["tensor_parallel"] == 4
    assert plans["tp"]["memory"] == plans["set"]["memory"] == plans["pcie"]["memory"]
    assert plans["tp"]["rate"]["sustained_rps"] == plans["set"]["rate"]["sustained_rps"]
    assert plans["pcie"]["interconnect"].startswith("PCIe 4")
    assert plans["pcie"]["rate"]["offline_rps"] < plans["tp"]["rate"]["offline_rps"]


def test_speculation_speedup_is_expected_tokens_over_step_cost():
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    cost = CostModel(model_shape("llama-3-8b"), accelerator("h100"))
    rows = speculation(cost, batch=1, context_len=2048, acceptance=0.8, draft_cost=0.1, max_k=4)
    for row in rows:
        assert row.speedup == pytest.approx(expected_tokens(0.8, row.k) / (row.k * 0.1 + row.verify_cost))
        assert expected_tokens(row.breakeven_acceptance, row.k) == pytest.approx(row.k * 0.1 + row.verify_cost)
    # at a large batch, verifying k + 1 tokens per sequence costs more than one decode
    big = speculation(cost, batch=256, context_len=2048, acceptance=0.8, draft_cost=0.1, max_k=4)
    assert all(b.verify_cost > r.verify_cost for b, r in zip(big, rows))
    never = speculation(cost, batch=1, context_len=2048, acceptance=0.8, draft_cost=1.5, max_k=2)
    assert [row.breakeven_acceptance for row in never] == [None, None]


def test_sustained_rate_is_the_highest_rate_meeting_the_slo():
    capacity = 7.3  # requests/s this fake replica serves within the SLO

    def simulate(spec, slo):
        workload = build_workload(spec, 100)
        rate = float(spec.partition("rate=")[2].split(",")[0]) if "rate=" in spec else None
        good = 1.0 if rate is None or rate <= capacity else 0.5
        return {"requests_per_s": 10.0, "goodput_rps": good, "seconds": len(workload.requests),
                "num_requests": len(workload.requests), "ttft_ms": {"p99": 1.0}, "tpot_ms": {"p99": 1.0},
                "output_tokens_per_s": 1.0}

    rate, points, offline = sustained_rate(simulate, "fixed:num_requests=10,prompt_len=4,output_len=2", SLO(),
                                           iterations=10)
    assert offline == 10.0
    assert capacity - 15 / 2**10 < rate <= capacity
    assert all((p.attainment >= 0.9) == (p.rate <= capacity) for p in points)
    assert replicas_needed(50, rate) == 7


def test_sweep_points_run_long_enough_to_show_a_queue():
    assert "num_requests=600" in _with_arrivals("fixed:num_requests=10,arrival=bursty,rate=1", 10.0, 60.0)
    assert "arrival=poisson,rate=10" in _with_arrivals("fixed:num_requests=10", 10.0, 60.0)
    assert _with_arrivals("fixed:num_requests=10,arrival=poisson,rate=3", None) == "fixed:num_requests=10"


def test_size_command_prints_the_plan(tmp_path, capsys):
    out = tmp_path / "size.json"
    code = cli.main(["size", "--sim", "h100", "--sim-model", "llama-3-8b", "--context-len", "2048",
                     "--workload", "fixed:num_requests=20,prompt_len=512,output_len=32", "--sweep-seconds", "2",
                     "--target-rate", "100", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert f"{result['memory']['num_blocks']:,} blocks" in printed
    rate = result["rate"]
    assert rate["sustained_rps"] > 0 and rate["replicas_needed"] == -(-100 // rate["sustained_rps"])
    assert f"needs {rate['replicas_needed']} replicas" in printed
    assert len(result["speculation"]["rows"]) == 6


def test_size_names_bad_input():
    assert cli.main(["size", "--sim", "h100", "--context-len", "100000", "--no-sweep"]) == 2
    assert cli.main(["size", "--sim", "h100", "--tp", "3", "--no-sweep"]) == 2
