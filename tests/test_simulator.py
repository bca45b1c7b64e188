"""The simulator: roofline arithmetic, real policies on simulated time, calibration fit."""

from __future__ import annotations

import pytest

from servelab.bench.session import BenchOptions, run_bench
from servelab.bench.sim.calibrate import StepSample, _predict, fit
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import Accelerator, accelerator
from servelab.bench.sim.shapes import model_shape, num_parameters
from servelab.config import EngineConfig
from servelab.errors import ConfigError


def test_llama_3_8b_has_8b_parameters():
    layers, head = num_parameters(model_shape("llama-3-8b"))
    assert 7.4e9 < layers + head < 7.6e9  # 8.0B with the 0.5B input embedding, which is only gathered
    assert head == 4096 * 128256


def test_decode_step_is_memory_bound_and_prefill_compute_bound():
    hw = Accelerator("unit", peak_flops=1e15, memory_bandwidth=1e12, memory_bytes=80e9, step_overhead_s=0.0,
                     compute_efficiency=1.0, bandwidth_efficiency=1.0)
    model = CostModel(model_shape("llama-3-8b"), hw, dtype_bytes=2)
    decode = model.step([1] * 8, [1000] * 8, 8)
    assert decode.seconds == pytest.approx(decode.bytes / 1e12)
    kv_bytes = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, head_dim 128, bf16
    assert decode.bytes == pytest.approx(model.weight_bytes + kv_bytes * 8 * 1001)
    prefill = model.step([4096], [4096], 1)
    assert prefill.seconds == pytest.approx(prefill.flops / 1e15)
    assert prefill.flops > 2 * model.layer_params * 4096


def test_unknown_names_are_config_errors():
    with pytest.raises(ConfigError, match="h200"):
        accelerator("tpu-v9")
    with pytest.raises(ConfigError, match="llama-3-8b"):
        model_shape("gpt-5")


def _sim(accel: str, **engine) -> dict:
    config = EngineConfig().with_overrides({f"engine.{k}": v for k, v in {"max_num_seqs": 64, **engine}.items()})
    options = BenchOptions(workload="skewed:num_requests=300,mean_prompt_len=256,mean_output_len=64,max_len=2048",
                           sim_accelerator=accel, sim_model="llama-3-8b", repeats=1)
    return run_bench([("sim", config)], options)["runs"][0]["metrics"]


def test_faster_hardware_finishes_sooner_with_the_same_policies():
    h200, l4 = _sim("h200"), _sim("l4")
    assert h200["output_tokens"] == l4["output_tokens"] == h200["slot_steps_used"]
    assert h200["output_tokens_per_s"] > 3 * l4["output_tokens_per_s"]


def test_small_simulated_pool_makes_the_real_scheduler_preempt():
    squeezed = _sim("h200", num_kv_blocks=400, max_model_len=2048)
    assert squeezed["preemptions"] > 0
    assert squeezed["num_requests"] == 300


def test_fit_recovers_a_known_profile():
    truth = Accelerator("truth", 80e9, 20e9, 24e9, 0.004, 1.0, 1.0)
    samples = []
    for tokens in (1, 4, 16, 64, 256, 1024, 2048):
        for context in (0, 100, 400):
            flops = 5.6e7 * tokens
            nbytes = 1.3e8 + 16_384 * tokens * context
            samples.append(StepSample(flops, nbytes, _predict(truth, StepSample(flops, nbytes, 0))))
    fitted = fit(samples)
    for sample in samples:
        assert _predict(fitted, sample) == pytest.approx(sample.seconds, rel=0.03)
