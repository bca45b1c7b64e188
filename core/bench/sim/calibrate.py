"""Calibrating the CPU profile against real runs of the embedded model.

Run workloads for real, recording each step's shape (tokens, contexts, sampled rows)
and the CPU time it took; fit the additive step terms (hardware.StepTerms: per step, per
sequence, per GEMM FLOP of prompt and of decode tokens, per FLOP of prefill attention,
per KV byte of decode attention, per LM-head FLOP) to those steps by least squares on
relative error; then check the fit on held-out workloads, one per kind: per-step time
error, and the throughput the simulator predicts for the whole run (same scheduler, same
allocator) against the throughput measured.

Steps are timed in CPU time of the process (`time.process_time`) with torch on one
thread: on a shared machine, wall-clock time also counts the time other jobs hold the
cores, which no model of this engine can predict. CPU time still varies with what the
neighbours do to the caches and the shared core (±10-30% a step here), always upwards,
so each step is timed in every one of several interleaved repetitions and its fastest
time kept, as timeit does. The spread of the repetitions' throughput and the
wall-clock throughput are reported beside it."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

import attrs
import numpy as np

import servelab
from servelab.bench.driver import StepRecorder, run_workload
from servelab.bench.repetitions import offline, reset_prefix_cache
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import CPU_HERE_TERMS, STEP_FEATURES, Accelerator, StepTerms
from servelab.bench.sim.runner import SimInputs, VirtualClock, plan_shape
from servelab.bench.sim.source import SimSource
from servelab.config import EngineConfig
from servelab.kv_sizing import DTYPE_BYTES
from servelab.registry import PluginRegistry
from servelab.workload import Workload

# The held-out check of `servelab bench --calibrate` (sized for max_model_len 512): each
# kind's seed 0 joins the fit, seed 1 is the check.
KINDS = {
    "skewed": "skewed:num_requests=32",
    "shared-prefix": "shared-prefix:num_groups=2,prefix_len=256,num_requests=32,tail_len=32,output_len=64",
    "long-burst": "long-burst:num_long=4,long_len=384,num_short=40,short_len=32,output_len=64",
}


class StepTimer:
    """An observer plugin noting, for every step that ran the model, its shape (the
    features the simulator sees), the time of the whole step on `clock` (process CPU
    time by default) and when it started on the engine's clock."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.clock = clock
        self.recording = False
        self.timed: list[tuple[SimInputs, float]] = []
        self.starts: list[float] = []
        self._started = 0.0
        self._engine_started = 0.0
        self._shape: SimInputs | None = None

    @servelab.hookimpl
    def servelab_step_started(self, engine: Any) -> None:
        self._started, self._shape = self.clock(), None
        self._engine_started = engine.clock()

    @servelab.hookimpl
    def servelab_step_planned(self, engine: Any, plan: Any) -> None:
        self._shape = plan_shape(plan)

    @servelab.hookimpl
    def servelab_step_finished(self, engine: Any, report: Any) -> None:
        if self.recording and self._shape is not None:
            self.timed.append((self._shape, self.clock() - self._started))
            self.starts.append(self._engine_started)


@attrs.frozen
class StepSample:
    features: dict[str, float]
    seconds: float  # CPU seconds of the whole engine step
    shape: SimInputs | None = None  # the step's tokens and contexts


@attrs.frozen
class Measured:
    samples: list[StepSample]  # per step, the fastest of the repetitions
    output_tokens: int
    repeat_cpu_seconds: list[float]  # each repetition's steps, summed
    wall_seconds: float  # the median repetition, start to end

    @property
    def cpu_seconds(self) -> float:
        return sum(s.seconds for s in self.samples)

    @property
    def cpu_tokens_per_s(self) -> float:
        return self.output_tokens / self.cpu_seconds

    @property
    def wall_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_seconds

    @property
    def repeat_tokens_per_s(self) -> list[float]:
        return [self.output_tokens / seconds for seconds in self.repeat_cpu_seconds]


@contextlib.contextmanager
def threads_of(count: int) -> Iterator[None]:
    """torch on `count` threads for the block."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread():
    return threads_of(1)


def measure(config: EngineConfig, workloads: list[Workload], repeats: int = 7, threads: int = 1) -> list[Measured]:
    """Run every workload for real on `threads` threads, `repeats` times each from an
    empty prefix cache, interleaved (round r runs them all, starting one later each round).
    One thread is timed in process CPU time; several in wall-clock time (CPU time would
    add the threads' times up).

    Offline, the engine plans the same steps every repetition, so each step is timed
    `repeats` times and its fastest time kept: a step slowed by another job's burst on
    the shared cores does not move the figure, and interleaving gives every workload the
    same share of the machine's quiet and busy minutes."""
    from servelab.engine import LLMEngine

    registry = PluginRegistry.from_entry_points()
    recorder = StepRecorder()
    registry.register(recorder)
    timer = StepTimer(time.process_time if threads == 1 else time.perf_counter)
    registry.register(timer)
    with threads_of(threads):
        engine = LLMEngine(config, registry)
        recorder.clock = engine.clock
        # Each workload once, untimed: the first run of a batch shape first-touches its
        # memory, which cost the first wide prefill step twice its later time.
        for workload in workloads:
            reset_prefix_cache(engine)
            run_workload(engine, recorder, offline(workload), "warm-up")
        timer.recording, timed = True, timer.timed
        runs: list[list] = [[] for _ in workloads]
        walls: list[list[float]] = [[] for _ in workloads]
        outputs = [0] * len(workloads)
        for round_index in range(repeats):
            order = list(range(len(workloads)))
            shift = round_index % len(workloads)
            for index in order[shift:] + order[:shift]:
                timed.clear()
                reset_prefix_cache(engine)
                record = run_workload(engine, recorder, offline(workloads[index]), "calibration")
                runs[index].append(list(timed))
                walls[index].append(record.end_time - record.start_time)
                outputs[index] = sum(len(o.token_ids) for o in record.outputs)
    cost = CostModel(engine.model_config, Accelerator("probe", 1.0, 1.0, 1.0, 0.0, terms=CPU_HERE_TERMS),
                     dtype_bytes=DTYPE_BYTES[config.engine.dtype])
    return [_measured(workload, cost, runs[i], walls[i], outputs[i]) for i, workload in enumerate(workloads)]


def _measured(workload: Workload, cost: CostModel, runs: list[list], walls: list[float], num_output: int) -> Measured:
    shapes = [shape for shape, _ in runs[0]]
    if any([shape for shape, _ in run] != shapes for run in runs[1:]):
        raise RuntimeError(f"the engine planned different steps in repetitions of {workload.name}; "
                           "calibration needs a deterministic, offline workload")
    samples = [StepSample(cost.features(shape.query_lens, shape.context_lens, len(shape.sampled_seq_rows)),
                          min(run[index][1] for run in runs), shape)
               for index, shape in enumerate(shapes)]
    return Measured(samples, num_output, [sum(seconds for _, seconds in run) for run in runs],
                    statistics.median(walls))


def fit(samples: list[StepSample]) -> StepTerms:
    """Non-negative least squares on relative error: every step counts alike, whatever
    its length. A term the steps never exercise, or that would come out negative, is
    dropped and the rest refitted."""
    features = np.array([[s.features[name] for name in STEP_FEATURES] for s in samples], dtype=float)
    seconds = np.array([s.seconds for s in samples], dtype=float)
    weighted = features / seconds[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    active = [i for i in range(len(STEP_FEATURES)) if scale[i] > 0]
    coefficients = np.zeros(len(STEP_FEATURES))
    while active:
        columns = weighted[:, active] / scale[active]
        solution, *_ = np.linalg.lstsq(columns, np.ones(len(samples)), rcond=None)
        solution = solution / scale[active]
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return StepTerms.from_coefficients(coefficients)


def profile_of(terms: StepTerms, threads: int = 1) -> Accelerator:
    return Accelerator("cpu-here (fitted)", 1.0, 1.0, 24e9, 0.0, terms=terms, threads=threads, host_link="host-dram")


def simulated_run(config: EngineConfig, workload: Workload, profile: Accelerator, name: str = "sim") -> Any:
    """The workload through the config's policies, timed by `profile`: its RunRecord."""
    from servelab.engine import LLMEngine
    from servelab.model_source import CheckpointSource

    shape = CheckpointSource(config.engine.model).model_config
    clock = VirtualClock()
    source = SimSource(shape, profile, clock, dtype_bytes=DTYPE_BYTES[config.engine.dtype])
    registry = PluginRegistry.from_entry_points()
    recorder = StepRecorder(clock)
    registry.register(recorder)
    engine = LLMEngine(config, registry, clock=clock, source=source)
    return run_workload(engine, recorder, workload, name)


def simulate(config: EngineConfig, workload: Workload, profile: Accelerator) -> dict[str, float]:
    """The same workload through the same policies, timed by the fitted cost model."""
    record = simulated_run(config, workload, profile)
    num_output = sum(len(o.token_ids) for o in record.outputs)
    return {"seconds": record.end_time - record.start_time,
            "output_tokens_per_s": num_output / (record.end_time - record.start_time)}


def check(config: EngineConfig, workload: Workload, measured: Measured, terms: StepTerms,
          threads: int = 1) -> dict[str, Any]:
    """The fitted terms against one measured run: step times and throughput."""
    predicted = [terms.seconds(s.features) for s in measured.samples]
    actual = [s.seconds for s in measured.samples]
    step_errors = [abs(p - a) / a for p, a in zip(predicted, actual)]
    simulated = simulate(config, workload, profile_of(terms, threads))["output_tokens_per_s"]
    return {
        "workload": workload.name,
        "steps": len(actual),
        "median_step_ms": {"measured": 1000 * statistics.median(actual), "predicted": 1000 * statistics.median(predicted),
                           "error": abs(statistics.median(predicted) - statistics.median(actual))
                           / statistics.median(actual)},
        "per_step_abs_error": {"p50": statistics.median(step_errors),
                               "p90": sorted(step_errors)[int(0.9 * (len(step_errors) - 1))]},
        "throughput": {"measured": measured.cpu_tokens_per_s, "simulated": simulated,
                       "error": abs(simulated - measured.cpu_tokens_per_s) / measured.cpu_tokens_per_s,
                       "measured_repeats": measured.repeat_tokens_per_s,
                       "measured_wall_clock": measured.wall_tokens_per_s},
    }


def calibrate(config: EngineConfig, fit_workloads: list[Workload], checks: dict[str, Workload],
              repeats: int = 7, progress: Any = None, threads: int = 1) -> dict[str, Any]:
    """Fit on `fit_workloads`, then check every held-out workload of `checks` (by kind),
    on `threads` threads. (Latency under arrivals is servelab.bench.sim.latency_check's.)"""
    if progress:
        progress(f"measuring {len(fit_workloads) + len(checks)} workloads, {repeats} interleaved repetitions each")
    measured = measure(config, [*fit_workloads, *checks.values()], repeats, threads)
    samples = [sample for m in measured[:len(fit_workloads)] for sample in m.samples]
    terms = fit(samples)
    fitted = [terms.seconds(s.features) for s in samples]
    results = {kind: check(config, workload, m, terms, threads)
               for (kind, workload), m in zip(checks.items(), measured[len(fit_workloads):])}
    result = {
        "terms": attrs.asdict(terms),
        "threads": threads,
        "fit_steps": len(samples),
        "repeats": repeats,
        "fit_workloads": [w.name for w in fit_workloads],
        "fit_per_step_abs_error_p50": statistics.median(abs(f - s.seconds) / s.seconds for f, s in zip(fitted, samples)),
        "kinds": results,
    }
    return result


def step_features(config: EngineConfig) -> Any:
    """A function from a step's shape (SimInputs) to the features StepTerms prices."""
    from servelab.model_source import CheckpointSource

    cost = CostModel(CheckpointSource(config.engine.model).model_config,
                     Accelerator("probe", 1.0, 1.0, 1.0, 0.0, terms=CPU_HERE_TERMS),
                     dtype_bytes=DTYPE_BYTES[config.engine.dtype])
    return lambda shape: cost.features(shape.query_lens, shape.context_lens, len(shape.sampled_seq_rows))
