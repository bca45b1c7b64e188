"""Latency under arrivals on this machine: the fitted `cpu-here` profile against real runs.

`servelab bench --calibrate` first fits the step terms offline (servelab.bench.sim.
calibrate: CPU time, fastest of several repetitions). A served request sees more: wall
time at the thread count the engine runs with, and the work between two steps (the
driver admitting arrivals, handing out outputs, the scheduler's bookkeeping outside the
timed step). So the latency check runs workloads with Poisson and bursty arrivals for
real, in wall-clock time, and:

1. on the *fit* cases, fits three numbers by least squares over every busy step (one
   after which a request was still unfinished, so the next step followed at once): the
   factor from the offline terms to a served step's wall time (`speed`), the seconds
   between one step's start and the next's that no step term explains
   (`step_overhead_s`, the server's and engine's per-step overhead) and the seconds each
   request admitted between them adds (`admission_s`). The fit is refitted without the
   steps far above it (the machine's stalls: a thread of the engine preempted by other
   work); what is left over of every busy step, stalls included, is kept as the
   profile's step noise, one residual drawn per simulated step (seeded), so the
   simulated tails carry the machine's stalls as often and as long as the fit saw them;
   and the steps after a wait for an arrival, less their fitted time, give the profile's
   wake-up (what the first step after idling costs: threads and caches waking), which
   grows with how long the engine slept: a + b ln(wait), fitted through the medians of
   those steps grouped by their wait (`fit_wake`; the median of them all, `wake_s`, where
   it does not grow or there are too few), which the simulator adds to every step that
   follows a wait, priced by that wait, with one of the same group's deviations from the
   line drawn on top (`wake_spread`, seeded): at a low rate most requests arrive at an
   idle engine, so TTFT's p90 is the wake-ups' p90, which a line through medians misses;
2. on the *held-out* cases (other rates, past saturation among them, bursty arrivals,
   the chunked-prefill scheduler, a workload kind the fit never saw), simulates the same
   workload through the same config with the profile so fitted and reports, per case,
   TTFT and TPOT p50 / p90 / p99 and goodput, measured, simulated and their error, and
   the median error over the held-out cases per figure."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import attrs
import numpy as np

from servelab.bench.driver import RunRecord, StepRecorder, run_workload
from servelab.bench.metrics import SLO, summarize
from servelab.bench.repetitions import offline
from servelab.bench.sim.calibrate import StepTimer, simulated_run, threads_of
from servelab.bench.sim.hardware import Accelerator, StepTerms
from servelab.config import EngineConfig
from servelab.registry import PluginRegistry
from servelab.workload import Workload, build_workload

FIT, HELD_OUT = "fit", "held-out"
CHUNKED = {"scheduler.name": "chunked-prefill", "engine.max_num_batched_tokens": 64}
CONTINUOUS = {"scheduler.name": "continuous"}
_BASE = "skewed:num_requests={n},mean_prompt_len=80,mean_output_len=48"
# Requests a case: a measured TTFT p90 of 60 requests (the 6th-largest) has a relative standard
# error of 10% by itself, the whole error target; at 120, 8% (bootstrapped from real two-thread
# runs; docs/bench.md, "Latency under arrivals").
LATENCY_REQUESTS = 120
LATENCY_FIGURES = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99", "goodput_rps")


@attrs.frozen
class LatencyCase:
    name: str
    workload: str  # a workload spec with its arrivals
    overrides: dict[str, Any]  # scheduler (and its budget) for this case
    role: str  # FIT or HELD_OUT


def default_cases(num_requests: int = LATENCY_REQUESTS) -> list[LatencyCase]:
    """The plan `--calibrate` runs (for max_model_len 512), in this order: continuous
    batching at 2 req/s (fit, seed 0); held out (seed 1): 4, 12 and 24 req/s (past
    saturation), bursts at 8 req/s, chunked prefill at 4 and 12, long-burst traffic at 6;
    continuous at 8 req/s (fit). The fit cases open and close the run, so a machine that
    speeds up or slows down while it runs moves the fit as it moves the held-out cases."""
    base = _BASE.format(n=num_requests)

    def case(name: str, spec: str, overrides: dict[str, Any], role: str) -> LatencyCase:
        return LatencyCase(name, spec, overrides, role)

    return [
        case("continuous poisson 2/s", f"{base},arrival=poisson,rate=2,seed=0", CONTINUOUS, FIT),
        case("continuous poisson 4/s", f"{base},arrival=poisson,rate=4,seed=1", CONTINUOUS, HELD_OUT),
        case("continuous poisson 12/s", f"{base},arrival=poisson,rate=12,seed=1", CONTINUOUS, HELD_OUT),
        case("continuous poisson 24/s", f"{base},arrival=poisson,rate=24,seed=1", CONTINUOUS, HELD_OUT),
        case("continuous bursty 8/s", f"{base},arrival=bursty,rate=8,burst_size=8,seed=1", CONTINUOUS, HELD_OUT),
        case("chunked poisson 4/s", f"{base},arrival=poisson,rate=4,seed=1", CHUNKED, HELD_OUT),
        case("chunked poisson 12/s", f"{base},arrival=poisson,rate=12,seed=1", CHUNKED, HELD_OUT),
        case("long-burst poisson 6/s", f"long-burst:num_long=4,long_len=384,num_short={max(1, num_requests - 4)},"
             f"short_len=32,output_len=48,arrival=poisson,rate=6,seed=1", CONTINUOUS, HELD_OUT),
        case("continuous poisson 8/s", f"{base},arrival=poisson,rate=8,seed=0", CONTINUOUS, FIT),
    ]


@attrs.frozen
class ServedRun:
    record: RunRecord | None
    steps: list[tuple[Any, float]]  # (SimInputs, wall seconds) per step that ran the model
    starts: list[float]  # per such step, its start on the engine's clock
    busy: list[bool]  # per such step, whether a request was still unfinished when it ended
    admitted: list[int] = attrs.field(factory=list)  # per such step, requests arriving before the next one


@attrs.frozen
class ServedFit:
    """Wall time from one busy step's start to the next's ~= speed x the offline terms'
    step time + step_overhead_s + admission_s x the requests admitted between them."""

    speed: float = 1.0
    step_overhead_s: float = 0.0
    admission_s: float = 0.0
    residuals_s: tuple[float, ...] = ()  # every busy step's observed - fitted (stalls included)
    wake_s: float = 0.0  # the median step after a wait for an arrival, less its fitted time
    woken_s: tuple[float, ...] = ()  # each such step, less its fitted time
    wake_log: tuple[float, float] | None = None  # (a, b): a wake-up of a + b ln(wait), where it grows with the wait
    wake_spread: tuple[tuple[float, tuple[float, ...]], ...] = ()  # per wait group: its longest wait, wake-ups less the line


def busy_after(starts: list[float], steps: list[tuple[Any, float]], spans: list[tuple[float, float]]) -> list[bool]:
    """Per step, whether some request (arrival, finish) had arrived and not finished when
    the step ended: the engine went straight on to the next step, rather than idling
    until the next arrival."""
    return [any(arrival <= start + seconds < finish for arrival, finish in spans)
            for start, (_, seconds) in zip(starts, steps)]


def serve_real(config: EngineConfig, workload: Workload, threads: int) -> ServedRun:
    """The workload through the real engine in wall-clock time, on `threads` threads,
    after an untimed offline pass of it (first touches of memory)."""
    from servelab.engine import LLMEngine

    registry = PluginRegistry.from_entry_points()
    recorder = StepRecorder()
    registry.register(recorder)
    timer = StepTimer(clock=time.perf_counter)
    registry.register(timer)
    with threads_of(threads):
        engine = LLMEngine(config, registry)
        recorder.clock = engine.clock
        run_workload(engine, recorder, offline(workload), "warm-up")
        timer.recording = True
        record = run_workload(engine, recorder, workload, workload.name)
    steps, starts = list(timer.timed), list(timer.starts)
    spans = [(o.metrics.arrival_time, o.metrics.finish_time) for o in record.outputs]
    return ServedRun(record, steps, starts, busy_after(starts, steps, spans),
                     admitted_between(starts, [arrival for arrival, _ in spans]))


def admitted_between(starts: list[float], arrivals: list[float]) -> list[int]:
    """Per step, the requests that arrived after it started and by the next step's start:
    the driver admitted them between the two (the last step: none)."""
    ends = [*starts[1:], starts[-1]] if starts else []
    return [sum(1 for a in arrivals if start < a <= end) for start, end in zip(starts, ends)]


def serve_sim(config: EngineConfig, workload: Workload, profile: Accelerator) -> RunRecord:
    """The workload through the same config, timed by `profile`."""
    return simulated_run(config, workload, profile, workload.name)


STALL_MADS = 5.0  # a busy step this many robust deviations above the first fit is a stall


def fit_served(runs: list[ServedRun], terms: StepTerms, features: Callable[[Any], dict[str, float]]) -> ServedFit:
    """The ServedFit of the busy steps (the others were followed by a wait for an arrival)
    that did not follow a wait themselves (those pay the wake-up, fitted apart): least
    squares, then again without the steps more than STALL_MADS robust deviations above the
    first fit (stalls would drag speed up), and the residuals of all of them."""
    predicted, observed, admitted = [], [], []
    for run in runs:
        counts = run.admitted or [0] * len(run.steps)
        for index in range(1, len(run.steps) - 1):
            if run.busy[index] and run.busy[index - 1]:
                predicted.append(terms.seconds(features(run.steps[index][0])))
                observed.append(run.starts[index + 1] - run.starts[index])
                admitted.append(counts[index])
    if len(predicted) < 2:
        return ServedFit()
    x, y, n = np.array(predicted), np.array(observed), np.array(admitted, dtype=float)
    keep = np.ones_like(y, dtype=bool)
    for _ in range(2):
        speed, overhead, admission = _least_squares(x[keep], y[keep], n[keep])
        residuals = y - (speed * x + overhead + admission * n)
        deviation = 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))
        keep = residuals <= np.median(residuals) + STALL_MADS * max(deviation, 1e-6)
    woken, waits = [], []
    for run in runs:
        for i in range(1, len(run.steps)):
            if not run.busy[i - 1]:
                woken.append(run.steps[i][1] - speed * terms.seconds(features(run.steps[i][0])))
                waits.append(run.starts[i] - run.starts[i - 1] - run.steps[i - 1][1])
    wake = max(0.0, float(np.median(woken))) if woken else 0.0
    line = fit_wake(waits, woken)
    return ServedFit(speed, overhead, admission, tuple(float(r) for r in residuals), wake,
                     tuple(float(w) for w in woken), line, wake_spread(waits, woken, line))


WAKE_GROUPS = 6


def fit_wake(waits: list[float], woken: list[float]) -> tuple[float, float] | None:
    """(a, b) of a wake-up a + b ln(wait) through the medians of the wake-ups grouped by
    their wait (WAKE_GROUPS groups of equal count, the wait the group's median too), so the
    long tail in each group does not pull the line; None where there are too few, or the
    wake-up does not grow with the wait."""
    groups = _wait_groups(waits, woken)
    if groups is None:
        return None
    x = np.log([float(np.median(group[:, 0])) for group in groups])
    y = np.array([float(np.median(group[:, 1])) for group in groups])
    b, a = np.polyfit(x, y, 1)
    return (float(a), float(b)) if b > 0 else None


def wake_spread(waits: list[float], woken: list[float],
                line: tuple[float, float] | None) -> tuple[tuple[float, tuple[float, ...]], ...]:
    """Per group of waits (fit_wake's groups): the group's longest wait and its wake-ups
    less the line; () without a line."""
    groups = _wait_groups(waits, woken)
    if line is None or groups is None:
        return ()
    a, b = line
    return tuple((float(group[-1, 0]), tuple(float(e - (a + b * np.log(w))) for w, e in group)) for group in groups)


def _wait_groups(waits: list[float], woken: list[float]) -> list[np.ndarray] | None:
    """The (wait, wake-up) pairs sorted by wait in WAKE_GROUPS groups of equal count; None
    where there are fewer than two a group."""
    pairs = sorted((wait, excess) for wait, excess in zip(waits, woken) if wait > 0)
    return np.array_split(np.array(pairs), WAKE_GROUPS) if len(pairs) >= 2 * WAKE_GROUPS else None


def _least_squares(x: np.ndarray, y: np.ndarray, n: np.ndarray) -> tuple[float, float, float]:
    """(speed, overhead, admission) >= 0 with y ~= speed x + overhead + admission n; a
    column without spread (or with a negative coefficient) is left out."""
    if np.ptp(x) == 0:  # no spread in step sizes to separate speed from overhead: the overhead alone
        return 1.0, max(0.0, float(np.median(y - x))), 0.0
    columns = [x, np.ones_like(x)] + ([n] if np.ptp(n) > 0 else [])
    coefficients = np.linalg.lstsq(np.vstack(columns).T, y, rcond=None)[0]
    if len(coefficients) == 3 and coefficients[2] < 0:
        return _least_squares(x, y, np.zeros_like(n))
    speed, overhead = float(coefficients[0]), float(coefficients[1])
    admission = float(coefficients[2]) if len(coefficients) == 3 else 0.0
    if speed <= 0:  # too few steps to tell speed from overhead: the overhead alone
        return 1.0, max(0.0, float(np.median(y - x - admission * n))), admission
    if overhead < 0:
        rest = y - admission * n
        speed, overhead = float(np.sum(x * rest) / np.sum(x * x)), 0.0
    return speed, overhead, admission


def latency_figures(record: RunRecord, slo: SLO) -> dict[str, float | None]:
    metrics = summarize(record, slo)
    ttft, tpot = metrics["ttft_ms"], metrics["tpot_ms"]
    return {"ttft_p50": ttft["p50"], "ttft_p90": ttft["p90"], "ttft_p99": ttft["p99"],
            "tpot_p50": tpot["p50"], "tpot_p90": tpot["p90"], "tpot_p99": tpot["p99"],
            "goodput_rps": metrics["goodput_rps"]}


def scaled(terms: StepTerms, speed: float) -> StepTerms:
    return StepTerms(**{name: value * speed for name, value in attrs.asdict(terms).items()})


def check_latency(config: EngineConfig, terms: StepTerms, features: Callable[[Any], dict[str, float]],
                  cases: list[LatencyCase], threads: int, slo: SLO = SLO(),
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fit speed and per-step overhead on the FIT cases, then every HELD_OUT case
    measured and simulated (module docstring)."""
    from servelab.model_source import CheckpointSource

    vocab_size = CheckpointSource(config.engine.model).model_config.vocab_size
    served: dict[str, ServedRun] = {}
    for case in cases:
        if progress:
            progress(f"serving {case.name} for real ({threads} thread{'s' if threads > 1 else ''}, wall clock)")
        served[case.name] = serve_real(config.with_overrides(case.overrides),
                                       build_workload(case.workload, vocab_size), threads)
    fit = fit_served([served[c.name] for c in cases if c.role == FIT], terms, features)
    profile = latency_profile(terms, fit.speed, fit.step_overhead_s, threads, fit.admission_s, fit.residuals_s,
                              fit.wake_s, fit.wake_log, fit.wake_spread)
    rows = {}
    for case in cases:
        if case.role != HELD_OUT:
            continue
        measured = latency_figures(served[case.name].record, slo)
        simulated = latency_figures(serve_sim(config.with_overrides(case.overrides),
                                              build_workload(case.workload, vocab_size), profile), slo)
        rows[case.name] = {name: {"measured": measured[name], "simulated": simulated[name],
                                  "error": _error(simulated[name], measured[name])} for name in LATENCY_FIGURES}
    median_error = {}
    for name in LATENCY_FIGURES:
        errors = [row[name]["error"] for row in rows.values() if row[name]["error"] is not None]
        median_error[name] = statistics.median(errors) if errors else None
    return {"threads": threads, "speed": fit.speed, "step_overhead_s": fit.step_overhead_s,
            "admission_s": fit.admission_s, "wake_s": fit.wake_s, "wake_log": fit.wake_log,
            "wake_spread_ms": [{"longest_wait_ms": 1000 * longest, **_spread_ms(group)} for longest, group in fit.wake_spread],
            "step_noise_ms": _spread_ms(fit.residuals_s), "wake_ms": _spread_ms(fit.woken_s),
            "fit_cases": [c.name for c in cases if c.role == FIT], "slo": attrs.asdict(slo),
            "held_out": rows, "median_error": median_error}


def latency_profile(terms: StepTerms, speed: float, overhead: float, threads: int, admission_s: float = 0.0,
                    step_noise_s: tuple[float, ...] = (), wake_s: float = 0.0,
                    wake_log: tuple[float, float] | None = None,
                    wake_spread: tuple[tuple[float, tuple[float, ...]], ...] = ()) -> Accelerator:
    return Accelerator("cpu-here (fitted, served)", 1.0, 1.0, 24e9, overhead, terms=scaled(terms, speed),
                       threads=threads, admission_s=admission_s, step_noise_s=step_noise_s, wake_s=wake_s,
                       wake_log=wake_log, wake_spread=wake_spread, host_link="host-dram")


def _spread_ms(values: tuple[float, ...]) -> dict[str, float]:
    array = np.array(values) if values else np.zeros(1)
    return {"count": len(values), **{f"p{q}": float(np.percentile(array, q)) * 1e3 for q in (50, 90, 99)}}


def _spread_text(spread: dict[str, float] | None) -> str:
    if not spread:
        return "-"
    return "ms p50 {p50:.2f}, p90 {p90:.2f}, p99 {p99:.2f}".format(**spread)


def _error(simulated: float | None, measured: float | None) -> float | None:
    if simulated is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if simulated == 0 else None
    return abs(simulated - measured) / abs(measured)


def _wake_text(result: dict[str, Any]) -> str:
    spread = _spread_text(result.get("wake_ms"))
    if result.get("wake_log"):
        a, b = result["wake_log"]
        tails = ", ".join(f"{group['p90']:.2f}" for group in result.get("wake_spread_ms") or [])
        about = f", drawn about it per group of waits, p90 over the line {tails} ms" if tails else ""
        return (f"waking after a wait of w seconds {1000 * a:.2f} + {1000 * b:.2f} ln(w) ms (fitted by wait{about}; "
                f"median {1000 * result.get('wake_s', 0.0):.2f} ms, {spread})")
    return f"{1000 * result.get('wake_s', 0.0):.2f} ms waking after a wait (the median; {spread})"


def format_latency(result: dict[str, Any]) -> str:
    """The held-out table: per case and figure, measured / simulated and the error."""
    lines = [f"latency under arrivals ({result['threads']} thread(s), wall clock): fitted on "
             f"{', '.join(result['fit_cases'])}: speed x{result['speed']:.2f} of the offline terms, "
             f"{1000 * result['step_overhead_s']:.2f} ms a step between steps, "
             f"{1000 * result.get('admission_s', 0.0):.2f} ms a request admitted, "
             f"{_wake_text(result)}; step noise {_spread_text(result.get('step_noise_ms'))}",
             f"{'held-out case':<26}" + "".join(f"{name:>22}" for name in LATENCY_FIGURES)]
    for case, row in result["held_out"].items():
        cells = []
        for name in LATENCY_FIGURES:
            cell = row[name]
            if cell["measured"] is None:
                cells.append(f"{'-':>22}")
                continue
            error = "-" if cell["error"] is None else f"{100 * cell['error']:.0f}%"
            cells.append(f"{cell['measured']:>8.1f}/{cell['simulated']:<7.1f}{error:>6}")
        lines.append(f"{case:<26}" + "".join(cells))
    medians = [f"{'-' if e is None else f'{100 * e:.0f}%':>22}" for e in result["median_error"].values()]
    lines.append(f"{'median error':<26}" + "".join(medians))
    lines.append("(ms measured/simulated and error; goodput in req/s)")
    return "\n".join(lines)
