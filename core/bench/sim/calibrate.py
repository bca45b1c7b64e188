"""Calibrating the CPU profile against real runs of the embedded model.

Run a workload for real, recording each step's shape (tokens, contexts, sampled rows)
and its measured time; fit the roofline's effective FLOP/s, bandwidth and per-step
overhead to those steps; then check the fit on a second, held-out workload: per-step
time error, and the throughput the simulator predicts for the whole run (same
scheduler, same allocator) against the throughput measured."""

from __future__ import annotations

import statistics
from typing import Any

import attrs
import numpy as np

from servelab.bench.driver import StepRecorder, run_workload
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import Accelerator
from servelab.bench.sim.runner import SimInputs, VirtualClock, plan_shape
from servelab.bench.sim.source import SimSource
from servelab.config import EngineConfig
from servelab.registry import PluginRegistry
from servelab.workload import Workload


class _RecordingRunner:
    """Wraps the real runner and notes every step's shape."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.device = runner.device
        self.shapes: list[SimInputs] = []

    def prepare(self, plan, allocator):
        self.shapes.append(plan_shape(plan))  # the same features the simulator sees
        return self.runner.prepare(plan, allocator)

    def execute(self, inputs):
        return self.runner.execute(inputs)

    def __getattr__(self, name):
        return getattr(self.runner, name)


@attrs.frozen
class StepSample:
    flops: float
    bytes: float
    seconds: float


def measure(config: EngineConfig, workload: Workload) -> tuple[list[StepSample], dict[str, float]]:
    """Run `workload` for real; per-step samples and the run's throughput."""
    from servelab.engine import LLMEngine

    registry = PluginRegistry.from_entry_points()
    recorder = StepRecorder()
    registry.register(recorder)
    engine = LLMEngine(config, registry)
    recorder.clock = engine.clock
    run_workload(engine, recorder, Workload("warm-up", workload.requests[:4]), "warm-up")
    engine.runner = _RecordingRunner(engine.runner)
    record = run_workload(engine, recorder, workload, "calibration")
    cost = CostModel(engine.model_config, Accelerator("probe", 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, per_kernel=False),
                     dtype_bytes=4 if config.engine.dtype == "float32" else 2)
    samples = []
    for shape, (_, report) in zip(engine.runner.shapes, record.steps):
        step = cost.step(shape.query_lens, shape.context_lens, len(shape.sampled_seq_rows))
        seconds = (report.schedule_seconds + report.prepare_seconds + report.forward_seconds
                   + report.sample_seconds + report.update_seconds)
        samples.append(StepSample(step.flops, step.bytes, seconds))
    num_output = sum(len(o.token_ids) for o in record.outputs)
    return samples, {"seconds": record.end_time - record.start_time,
                     "output_tokens_per_s": num_output / (record.end_time - record.start_time)}


def fit(samples: list[StepSample]) -> Accelerator:
    """Least squares on log step time over a grid of (FLOP/s, bytes/s, overhead)."""
    flops = np.array([s.flops for s in samples])
    nbytes = np.array([s.bytes for s in samples])
    seconds = np.array([s.seconds for s in samples])
    best = (float("inf"), None)
    grids = (np.logspace(9.5, 12.5, 61), np.logspace(9, 12, 61), np.linspace(0, 0.03, 61))
    for _ in range(3):  # coarse to fine
        for peak in grids[0]:
            compute = flops / peak
            for bandwidth in grids[1]:
                roof = np.maximum(compute, nbytes / bandwidth)
                predicted = roof[None, :] + grids[2][:, None]
                errors = np.square(np.log(predicted + 1e-9) - np.log(seconds)).sum(axis=1)
                index = int(errors.argmin())
                if errors[index] < best[0]:
                    best = (float(errors[index]), (peak, bandwidth, float(grids[2][index])))
        peak, bandwidth, overhead = best[1]
        grids = (np.geomspace(peak / 1.3, peak * 1.3, 21), np.geomspace(bandwidth / 1.3, bandwidth * 1.3, 21),
                 np.linspace(max(0.0, overhead - 0.002), overhead + 0.002, 21))
    peak, bandwidth, overhead = best[1]
    return Accelerator("cpu-here (fitted)", peak, bandwidth, 24e9, overhead, 1.0, 1.0, per_kernel=False)


def simulate(config: EngineConfig, workload: Workload, profile: Accelerator) -> dict[str, float]:
    """The same workload through the same policies, timed by the fitted cost model."""
    from servelab.engine import LLMEngine
    from servelab.model.source import CheckpointSource

    shape = CheckpointSource(config.engine.model).model_config
    clock = VirtualClock()
    source = SimSource(shape, profile, clock, dtype_bytes=4 if config.engine.dtype == "float32" else 2)
    registry = PluginRegistry.from_entry_points()
    recorder = StepRecorder(clock)
    registry.register(recorder)
    engine = LLMEngine(config, registry, clock=clock, source=source)
    record = run_workload(engine, recorder, workload, "sim")
    num_output = sum(len(o.token_ids) for o in record.outputs)
    return {"seconds": record.end_time - record.start_time,
            "output_tokens_per_s": num_output / (record.end_time - record.start_time)}


def calibrate(config: EngineConfig, fit_workload: Workload, check_workload: Workload) -> dict[str, Any]:
    fit_samples, _ = measure(config, fit_workload)
    profile = fit(fit_samples)
    check_samples, measured = measure(config, check_workload)
    step_errors = [abs(_predict(profile, s) - s.seconds) / s.seconds for s in check_samples]
    predicted_median = statistics.median(_predict(profile, s) for s in check_samples)
    measured_median = statistics.median(s.seconds for s in check_samples)
    simulated = simulate(config, check_workload, profile)
    return {
        "profile": {"peak_flops": profile.peak_flops, "memory_bandwidth": profile.memory_bandwidth,
                    "step_overhead_s": profile.step_overhead_s},
        "fit_steps": len(fit_samples),
        "check_steps": len(check_samples),
        "median_step_ms": {"measured": 1000 * measured_median, "predicted": 1000 * predicted_median,
                           "error": abs(predicted_median - measured_median) / measured_median},
        "per_step_abs_error": {"p50": statistics.median(step_errors),
                               "p90": sorted(step_errors)[int(0.9 * (len(step_errors) - 1))]},
        "throughput": {"measured": measured["output_tokens_per_s"], "simulated": simulated["output_tokens_per_s"],
                       "error": abs(simulated["output_tokens_per_s"] - measured["output_tokens_per_s"])
                       / measured["output_tokens_per_s"]},
    }


def _predict(profile: Accelerator, sample: StepSample) -> float:
    return max(sample.flops / profile.peak_flops, sample.bytes / profile.memory_bandwidth) + profile.step_overhead_s
