"""The simulator: roofline arithmetic, real policies on simulated time, calibration fit."""

from __future__ import annotations

import attrs
import pytest

from servelab.bench.metrics import distribution, percentiles
from servelab.bench.report import format_table
from servelab.bench.session import BenchOptions, run_bench
from servelab.bench.sim.calibrate import StepSample, fit
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import Accelerator, StepTerms, accelerator
from servelab.bench.sim.shapes import model_shape, num_parameters
from servelab.config import EngineConfig
from servelab.errors import ConfigError


def test_llama_3_8b_has_8b_parameters():
    layers, head = num_parameters(model_shape("llama-3-8b"))
    assert 7.4e9 < layers + head < 7.6e9  # 8.0B with the 0.5B input embedding, which is only gathered
    assert head == 4096 * 128256


def _unit_hardware(**overrides) -> Accelerator:
    return Accelerator("unit", **{"peak_flops": 1e15, "memory_bandwidth": 1e12, "memory_bytes": 80 * 2**30,
                                  "step_overhead_s": 0.0, "compute_efficiency": 1.0, "bandwidth_efficiency": 1.0,
                                  **overrides})


def test_decode_step_is_memory_bound_and_prefill_compute_bound():
    model = CostModel(model_shape("llama-3-8b"), _unit_hardware(), dtype_bytes=2)
    decode = model.step([1] * 8, [1000] * 8, 8)
    assert decode.seconds == pytest.approx(decode.bytes / 1e12)  # every kernel class streams
    kv_bytes = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, head_dim 128, bf16
    logits = 3 * 4 * 128256 * 8  # fp32 logits written, read by softmax and by the sampler
    assert decode.bytes == pytest.approx(model.weight_bytes + kv_bytes * 8 * 1001
                                         + model.elementwise_bytes_per_token * 8 + logits)
    prefill = model.step([4096], [4096], 1)
    assert prefill.kernel_seconds["gemm"] == pytest.approx(2 * model.layer_params * 4096 / 1e15)
    assert prefill.kernel_seconds["prefill_attention"] == pytest.approx(
        4 * model.attention_width * 4096 * (4096 + 1) / 2 / 1e15)
    assert prefill.seconds == pytest.approx(sum(prefill.kernel_seconds.values()))


def test_kernel_classes_add_up_so_a_prefill_slows_the_decodes_mixed_with_it():
    model = CostModel(model_shape("llama-3-8b"), accelerator("h100"))
    decodes = model.step([1] * 64, [800] * 64, 64)
    prefill = model.step([2000], [2000], 1)
    mixed = model.step([2000] + [1] * 64, [2000] + [800] * 64, 65)
    assert mixed.seconds > 3 * decodes.seconds  # every decode in the step waits for the prefill
    assert mixed.seconds > prefill.seconds
    assert mixed.kernel_seconds["decode_attention"] == pytest.approx(decodes.kernel_seconds["decode_attention"])


def test_small_gemms_run_below_peak_efficiency():
    model = CostModel(model_shape("llama-3-8b"), _unit_hardware(gemm_half_tokens=200, memory_bandwidth=1e15))
    per_token = [model.step([n], [n], 1).kernel_seconds["gemm"] / n for n in (100, 1000, 8000)]
    assert per_token[0] > per_token[1] > per_token[2]
    assert per_token[0] == pytest.approx(3 * per_token[2], rel=0.05)  # 100 rows: a third of 8000 rows' efficiency


def test_cuda_graphs_hide_launches_of_decode_steps_only():
    graphs, eager = accelerator("h100"), accelerator("h100-eager")
    assert graphs.cuda_graphs and not eager.cuda_graphs and "no CUDA graphs" in eager.behaves_like
    shape = model_shape("llama-3-8b")
    small_decode = ([1] * 4, [500] * 4, 4)
    eager_decode, graphed_decode = (CostModel(shape, a).step(*small_decode).seconds for a in (eager, graphs))
    assert eager_decode > 1.3 * graphed_decode
    big_prefill = ([8000], [8000], 1)  # device work far longer than the launches: they hide behind it
    assert CostModel(shape, eager).step(*big_prefill).seconds == CostModel(shape, graphs).step(*big_prefill).seconds


def test_kv_pool_is_ninety_percent_of_the_memory_weights_and_runtime_leave():
    model = CostModel(model_shape("llama-3-8b"), accelerator("h100"))
    free = 80 * 2**30 - 2 * 2**30 - 8.03e9 * 2  # 80 GiB, 2 GiB for the runtime, weights with the embedding
    assert model.kv_pool_bytes() == pytest.approx(0.9 * free, rel=0.002)
    assert model.kv_blocks(16) == int(model.kv_pool_bytes() // (131072 * 16))


def test_a_model_too_big_for_the_device_says_so_and_suggests_tensor_parallelism():
    with pytest.raises(ConfigError, match="tensor parallelism over 2 or more devices"):
        CostModel(model_shape("llama-3-70b"), accelerator("h100")).kv_blocks(16)
    with pytest.raises(ConfigError, match="tensor parallelism"):
        _sim("a100", sim_model="llama-3-70b")
    assert CostModel(model_shape("llama-3-70b"), accelerator("h200")).kv_blocks(16) > 0  # 131 GiB of 140


def test_unknown_names_are_config_errors():
    with pytest.raises(ConfigError, match="h200"):
        accelerator("tpu-v9")
    with pytest.raises(ConfigError, match="llama-3-8b"):
        model_shape("gpt-5")


def _sim(accel: str, sim_model: str = "llama-3-8b", **engine) -> dict:
    config = EngineConfig().with_overrides({f"engine.{k}": v for k, v in {"max_num_seqs": 64, **engine}.items()})
    options = BenchOptions(workload="skewed:num_requests=300,mean_prompt_len=256,mean_output_len=64,max_len=2048",
                           sim_accelerator=accel, sim_model=sim_model, repeats=1)
    return run_bench([("sim", config)], options)["runs"][0]["metrics"]


def test_faster_hardware_finishes_sooner_with_the_same_policies():
    h200, l4 = _sim("h200"), _sim("l4")
    assert h200["output_tokens"] == l4["output_tokens"] == h200["slot_steps_used"]
    assert h200["output_tokens_per_s"] > 3 * l4["output_tokens_per_s"]


def test_small_simulated_pool_makes_the_real_scheduler_preempt():
    squeezed = _sim("h200", num_kv_blocks=400, max_model_len=2048)
    assert squeezed["preemptions"] > 0
    assert squeezed["num_requests"] == 300


def test_fit_recovers_known_step_terms_from_steps_of_every_shape():
    truth = StepTerms(step_s=3e-3, sequence_s=2e-4, prefill_gemm_flop_s=1 / 80e9, decode_gemm_flop_s=1 / 15e9,
                      prefill_attention_flop_s=1 / 10e9, decode_kv_byte_s=1 / 5e9, lm_head_flop_s=1 / 30e9)
    cost = CostModel(model_shape("tiny-random"), Accelerator("truth", 1.0, 1.0, 1.0, 0.0, terms=truth), 4)
    samples = []
    # prompts (a 150-token one is a chunk of a longer prompt: not sampled), mixed with decodes
    for prompts in ([], [64], [300, 300], [150, 150, 150], [64, 300], [150, 64, 64], [100, 100]):
        for num_decode in (0, 1, 8, 40):
            for context in (20, 400):
                queries = prompts + [1] * num_decode
                if not queries:
                    continue
                contexts = prompts + [context] * num_decode
                sampled = num_decode + sum(1 for p in prompts if p != 150)
                features = cost.features(queries, contexts, sampled)
                samples.append(StepSample(features, cost.step(queries, contexts, sampled).seconds))
    fitted = fit(samples)
    for name, value in attrs.asdict(truth).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6), name


def test_fit_drops_terms_that_would_come_out_negative():
    cost = CostModel(model_shape("tiny-random"), accelerator("cpu-here"), 4)
    samples = [StepSample(cost.features([1] * n, [50] * n, n), 0.002 + 1e-4 * n) for n in (1, 2, 4, 8, 16, 32)]
    samples[0] = attrs.evolve(samples[0], seconds=0.0025)  # noise that would pull some term below zero
    fitted = fit(samples)
    assert all(value >= 0 for value in attrs.asdict(fitted).values())
    assert fitted.seconds(samples[3].features) == pytest.approx(0.0028, rel=0.1)


def test_means_are_reported_beside_percentiles():
    assert distribution([1.0, 2.0, 3.0, 10.0]) == {"mean": 4.0, **percentiles([1.0, 2.0, 3.0, 10.0])}
    config = EngineConfig().with_overrides({"engine.max_num_seqs": 64})
    workload = "fixed:num_requests=200,prompt_len=300,output_len=40,arrival=poisson,rate=50"
    result = run_bench([("sim", config)], BenchOptions(workload=workload, sim_accelerator="h100", repeats=1))
    metrics = result["runs"][0]["metrics"]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert metrics[key]["p50"] is not None and metrics[key]["mean"] > 0
    # Equal output lengths: the mean over all gaps is the mean over requests' TPOT.
    assert metrics["itl_ms"]["mean"] == pytest.approx(metrics["tpot_ms"]["mean"])
    skewed = _sim("h100")  # unequal lengths: long requests weigh more in the ITL mean
    assert skewed["itl_ms"]["mean"] != pytest.approx(skewed["tpot_ms"]["mean"])
    row = next(line for line in format_table(result).splitlines() if line.startswith("TTFT / TPOT / ITL mean ms"))
    assert f"{metrics['ttft_ms']['mean']:.1f}/{metrics['tpot_ms']['mean']:.1f}/{metrics['itl_ms']['mean']:.1f}" in row


def test_calibration_measures_the_steps_the_simulator_plans():
    from servelab.bench.sim.calibrate import check, measure, profile_of
    from servelab.workload import build_workload

    config = EngineConfig().with_overrides({"engine.max_model_len": 256})
    workload = build_workload("long-burst:num_long=1,long_len=100,num_short=5,short_len=12,output_len=6", 4096)
    [measured] = measure(config, [workload], repeats=2)
    assert len(measured.repeat_cpu_seconds) == 2 and all(s.seconds > 0 for s in measured.samples)
    assert sum(s.features["prefill_gemm_flop"] > 0 for s in measured.samples) >= 1
    assert measured.output_tokens == 6 * 6
    terms = fit(measured.samples)
    result = check(config, workload, measured, terms)
    # The simulator runs the same policies on the same workload: the very steps measured,
    # so its time is the fitted terms summed over them.
    predicted = sum(terms.seconds(s.features) for s in measured.samples)
    assert result["throughput"]["simulated"] == pytest.approx(measured.output_tokens / predicted, rel=1e-9)
    assert result["steps"] == len(measured.samples)


def test_tensor_parallelism_splits_each_devices_work_and_pays_for_all_reduces():
    from servelab.bench.sim.hardware import interconnect

    shape = model_shape("llama-3-8b")
    one, two = CostModel(shape, accelerator("h100")), CostModel(shape, accelerator("h100"), tensor_parallel=2)
    # Every layer is split (8 KV heads over 2 ranks), the vocabulary too: half the weights a device.
    assert two.weight_bytes == pytest.approx(one.weight_bytes / 2, rel=1e-6)
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    decode = ([1] * 64, [1024] * 64, 64)
    assert "communication" not in one.step(*decode).kernel_seconds
    comm = two.step(*decode).kernel_seconds["communication"]
    # 65 all-reduces of 64 x 4096 bf16 over NVLink (8 us each + 0.5 MiB / 360 GB/s), plus the logits gather.
    assert comm == pytest.approx(65 * (8e-6 + 64 * 4096 * 2 / 360e9) + 8e-6 + 64 * 4 * 64128 / 360e9, rel=1e-6)
    assert two.step(*decode).seconds < one.step(*decode).seconds
    pcie = CostModel(shape, accelerator("h100"), tensor_parallel=2, link=interconnect("pcie4"))
    assert pcie.step(*decode).kernel_seconds["communication"] > 4 * comm


def test_seventy_billion_fits_four_simulated_h100s_and_runs_faster_on_eight():
    with pytest.raises(ConfigError, match="tensor parallelism over 2 or more devices"):
        _sim("h100", sim_model="llama-3-70b")
    four = _sim("h100", sim_model="llama-3-70b", tensor_parallel_size=4)
    eight = _sim("h100", sim_model="llama-3-70b", tensor_parallel_size=8)
    assert four["output_tokens"] == eight["output_tokens"]
    assert eight["output_tokens_per_s"] > four["output_tokens_per_s"]
    with pytest.raises(ConfigError, match="num_attention_heads=64"):
        _sim("h100", sim_model="llama-3-70b", tensor_parallel_size=3)
