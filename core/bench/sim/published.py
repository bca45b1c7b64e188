"""The simulator against published latency under load: the SGLang repository's
`benchmark/benchmark_vllm_060/README.md` (Llama-3.1-8B-Instruct on one A100-80G and
Llama-3.1-70B-Instruct on 4 x H100 at TP 4; ShareGPT prompts through
`sglang.bench_serving`; vLLM 0.6.0 with `--num-scheduler-steps 10 --max-model-len 4096`,
SGLang 0.3.0 with `--enable-torch-compile --disable-radix-cache`).

Every row runs the engine that published it (servelab.bench.sim.engine_models) on the
GPU profile, through a ShareGPT-like workload (ShareGPT itself is not downloaded: lengths
are drawn to match its published statistics, `sharegpt_like`), and its figures are
computed as `bench_serving` computes them: per request, TTFT to the first streamed chunk,
E2E to the last, TPOT = (E2E - TTFT) / (output tokens - 1), and ITL every gap between
two chunks (one chunk a run of steps where the engine streams per run), all medians;
offline, output tokens over the run's duration.

`servelab sim-check published` prints every figure, simulated against published, with
the ratio and the error."""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from typing import Any, Callable

import attrs

import servelab.bench.sim.prefill_alone as prefill_alone
from servelab.bench.driver import RunRecord, StepRecorder, run_workload
from servelab.bench.sim.engine_models import ENGINE_MODELS, ServingEngineModel
from servelab.bench.sim.fidelity import TRTLLM_LIKE_CONFIG
from servelab.bench.sim.hardware import accelerator
from servelab.bench.sim.runner import VirtualClock
from servelab.bench.sim.shapes import model_shape
from servelab.bench.sim.source import SimSource
from servelab.config import EngineConfig
from servelab.registry import PluginRegistry
from servelab.workload import BenchRequest, Workload, _tokens, lognormal_length, with_arrivals

# ShareGPT through bench_serving's filter (prompts of 4-1,024 tokens, prompt + output at
# most 2,048, output at least 4) with the Llama-3 tokenizer: 215 prompt and 198 output
# tokens a request on average (1,000 prompts: 215,196 and 198,343 tokens). The shape is
# ours: log-normal, sigma 1 on both (ShareGPT's lengths are heavy-tailed, most requests
# short, medians 149 and 125); the location parameters below give those means after the filter.
SHAREGPT_MEAN_PROMPT, SHAREGPT_MEAN_OUTPUT = 215, 198
_PROMPT_LOCATION, _OUTPUT_LOCATION, _SIGMA = 258.4, 208.3, 1.0
MAX_PROMPT, MAX_TOTAL, MIN_LEN = 1024, 2048, 4
MAX_MODEL_LEN = 4096


def sharegpt_like(num_requests: int, vocab_size: int, rate: float | None = None, seed: int = 0) -> Workload:
    """`num_requests` ShareGPT-like requests, Poisson at `rate` req/s (None: all at once)."""
    rng = random.Random(seed)
    requests = []
    while len(requests) < num_requests:
        prompt = lognormal_length(rng, _PROMPT_LOCATION, _SIGMA, 1, 1 << 20)
        output = lognormal_length(rng, _OUTPUT_LOCATION, _SIGMA, 1, 1 << 20)
        if prompt < MIN_LEN or output < MIN_LEN or prompt > MAX_PROMPT or prompt + output > MAX_TOTAL:
            continue  # bench_serving drops these
        requests.append(BenchRequest(_tokens(rng, vocab_size, prompt), output))
    name = f"sharegpt-like:num_requests={num_requests}" + (f",rate={rate}" if rate else "")
    if rate:
        requests = with_arrivals(requests, rng, "poisson", rate)
    return Workload(name, tuple(requests))


@attrs.frozen
class Setup:
    label: str
    sim_model: str
    accelerator: str
    tensor_parallel: int


SETUPS = {
    "8b-a100": Setup("Llama-3.1-8B, 1 x A100-80G", "llama-3-8b", "a100", 1),
    "70b-h100x4": Setup("Llama-3.1-70B, 4 x H100, TP 4", "llama-3-70b", "h100", 4),
}
E2E, TTFT, TPOT, ITL, OUTPUT_TPS = "median E2E ms", "median TTFT ms", "median TPOT ms", "median ITL ms", \
    "output tokens/s"


@attrs.frozen
class PublishedRun:
    setup: str  # SETUPS key
    engine: str  # ENGINE_MODELS key
    rate: float | None  # req/s; None: offline, every prompt at once
    num_prompts: int
    published: dict[str, float]

    @property
    def label(self) -> str:
        return f"{'offline' if self.rate is None else f'{self.rate:g} req/s'}, {self.num_prompts:,} prompts"


def _online(setup: str, engine: str, rate: float, e2e: float, ttft: float, tpot: float, itl: float) -> PublishedRun:
    return PublishedRun(setup, engine, rate, 300 * int(rate), {E2E: e2e, TTFT: ttft, TPOT: tpot, ITL: itl})


# Copied from the README (medians in ms; 1,200 prompts at 4 req/s, 2,400 at 8).
PUBLISHED = (
    _online("8b-a100", "vllm-0.6.0", 4, 1691.97, 100.48, 14.14, 129.32),
    _online("8b-a100", "vllm-0.6.0", 8, 2137.16, 120.39, 17.09, 158.63),
    _online("8b-a100", "sglang-0.3.0", 4, 1564.17, 31.98, 13.17, 11.93),
    _online("8b-a100", "sglang-0.3.0", 8, 2175.02, 35.68, 17.85, 14.41),
    _online("70b-h100x4", "vllm-0.6.0", 4, 2915.60, 179.15, 23.58, 231.23),
    _online("70b-h100x4", "vllm-0.6.0", 8, 3752.38, 207.12, 29.15, 275.32),
    PublishedRun("8b-a100", "vllm-0.6.0", None, 5000, {OUTPUT_TPS: 4132}),
    PublishedRun("8b-a100", "sglang-0.3.0", None, 5000, {OUTPUT_TPS: 4282}),
    PublishedRun("70b-h100x4", "vllm-0.6.0", None, 5000, {OUTPUT_TPS: 3700.64}),
)
TARGET = (0.8, 1.25)  # the ratio band a figure should fall in


@attrs.frozen
class SimRun:
    record: RunRecord
    runs: list[int]  # per step, its run (prefill_alone.PrefillAloneScheduler.runs)


def simulate(run: PublishedRun, scale: float = 1.0, model: ServingEngineModel | None = None,
             config: dict[str, Any] | None = None) -> dict[str, float]:
    """The run's figures as the simulator produces them, with `scale` times its prompts
    (at least 50). `model` replaces the engine's model; `config` (a TensorRT-LLM-like
    config, say) runs the profile's own engine instead of any engine model."""
    setup = SETUPS[run.setup]
    model = model or ENGINE_MODELS[run.engine]
    sim = _run(setup, model if config is None else None, config, max(50, round(scale * run.num_prompts)), run.rate)
    if config is not None:
        return figures(sim, per_run=False)
    return figures(sim, model.delivers_per_run, model.frontend_s)


def _run(setup: Setup, model: ServingEngineModel | None, config: dict[str, Any] | None, num_prompts: int,
         rate: float | None) -> SimRun:
    from servelab.bench.sim.engine_models import EngineSimSource
    from servelab.engine import LLMEngine

    clock = VirtualClock()
    shape, hardware = model_shape(setup.sim_model), accelerator(setup.accelerator)
    if model is not None:
        source = EngineSimSource(shape, hardware, clock, model=model)
        overrides = model.engine_config(MAX_MODEL_LEN)
    else:
        source = SimSource(shape, hardware, clock)
        overrides = {**(config or {}), "engine.max_model_len": MAX_MODEL_LEN}
    overrides["engine.tensor_parallel_size"] = setup.tensor_parallel
    engine_config = source.fit_config(EngineConfig().with_overrides(overrides))
    registry = PluginRegistry.from_entry_points()
    registry.register(prefill_alone)
    recorder = StepRecorder(clock)
    registry.register(recorder)
    engine = LLMEngine(engine_config, registry, clock=clock, source=source)
    workload = sharegpt_like(num_prompts, shape.vocab_size, rate)
    record = run_workload(engine, recorder, workload, f"{setup.label}")
    steps = len(record.step_traces[0])
    scheduler = engine.scheduler
    runs = list(range(steps))
    if steps and isinstance(scheduler, prefill_alone.PrefillAloneScheduler):
        runs = scheduler.runs[-steps:]  # the warm-up-free run: its steps are the last planned
    return SimRun(record, runs)


def delivery_times(sim: SimRun, per_run: bool) -> dict[str, list[float]]:
    """Per request id, when each of its tokens reached the client: at the end of its
    step, or of its step's run where the engine streams a run's tokens at once."""
    traces = sim.record.step_traces[0]
    if len(sim.runs) != len(traces):
        raise RuntimeError(f"{len(traces)} steps ran but the scheduler planned {len(sim.runs)}")
    ends = [trace.end for trace in traces]
    if per_run:
        run_end: dict[int, float] = {}
        for run, end in zip(sim.runs, ends):
            run_end[run] = end
        ends = [run_end[run] for run in sim.runs]
    times: dict[str, list[float]] = defaultdict(list)
    for trace, end in zip(traces, ends):
        for request_id in trace.decoding:
            times[request_id].append(end)
        for request_id, _ in trace.prefilling:
            times[request_id].append(end)
    return times


def figures(sim: SimRun, per_run: bool, frontend_s: float = 0.0) -> dict[str, float]:
    """bench_serving's medians (and output throughput) of one simulated run; the
    client sees every token `frontend_s` after the engine's clock reaches it."""
    record = sim.record
    times = delivery_times(sim, per_run)
    e2e, ttft, tpot, itl = [], [], [], []
    for output in record.outputs:
        arrival = output.metrics.arrival_time - frontend_s
        delivered = sorted(times[output.request_id])[:len(output.token_ids)]
        ttft.append(1000 * (delivered[0] - arrival))
        e2e.append(1000 * (delivered[-1] - arrival))
        if len(output.token_ids) > 1:
            tpot.append((e2e[-1] - ttft[-1]) / (len(output.token_ids) - 1))
        chunks = sorted(set(delivered))
        itl.extend(1000 * (b - a) for a, b in zip(chunks, chunks[1:]))
    seconds = record.end_time - record.start_time
    return {E2E: statistics.median(e2e), TTFT: statistics.median(ttft), TPOT: statistics.median(tpot),
            ITL: statistics.median(itl) if itl else 0.0,
            OUTPUT_TPS: sum(len(o.token_ids) for o in record.outputs) / seconds}


def compare(selected: tuple[PublishedRun, ...] = PUBLISHED, scale: float = 1.0,
            progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per published figure: simulated, published, ratio and error."""
    rows = []
    for run in selected:
        if progress:
            progress(f"{SETUPS[run.setup].label}, {run.engine}, {run.label}")
        simulated = simulate(run, scale)
        for metric, published in run.published.items():
            ratio = simulated[metric] / published
            rows.append({"setup": SETUPS[run.setup].label, "engine": run.engine, "run": run.label,
                         "metric": metric, "simulated": simulated[metric], "published": published,
                         "ratio": ratio, "error": abs(ratio - 1), "in_band": TARGET[0] <= ratio <= TARGET[1]})
    return rows


def ablation(scale: float = 1.0, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Why a TensorRT-LLM-like model reads these engines' TPOT low: each online 8B row's
    median TPOT and TTFT under (1) the profile's own engine (decode-first, prefills mixed
    into decode steps, 1.5 ms of host a step), (2) the engine's scheduler with that fixed
    host time, (3) the full engine model (its host work too)."""
    rows = []
    for run in PUBLISHED:
        if run.rate is None or run.setup != "8b-a100":
            continue
        model = ENGINE_MODELS[run.engine]
        hardware = accelerator(SETUPS[run.setup].accelerator)
        from servelab.bench.sim.engine_models import HostWork

        fixed_host = attrs.evolve(model, host=HostWork(step_s=hardware.step_overhead_s))
        variants = {"profile's engine (TensorRT-LLM-like)": (None, TRTLLM_LIKE_CONFIG),
                    "engine's scheduler and front end, fixed host": (fixed_host, None),
                    "engine model (scheduler + host work)": (model, None)}
        for variant, (variant_model, config) in variants.items():
            if progress:
                progress(f"{run.engine}, {run.label}: {variant}")
            simulated = simulate(run, scale, variant_model, config)
            rows.append({"engine": run.engine, "run": run.label, "variant": variant,
                         **{metric: {"simulated": simulated[metric], "ratio": simulated[metric] / run.published[metric]}
                            for metric in (TPOT, TTFT)}})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = ["| setup | engine | run | figure | sim | published | sim / published | error |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        flag = "" if row["in_band"] else " *"
        lines.append(f"| {row['setup']} | {row['engine']} | {row['run']} | {row['metric']} | "
                     f"{row['simulated']:,.2f} | {row['published']:,.2f} | {row['ratio']:.2f}{flag} | "
                     f"{100 * row['error']:.0f}% |")
    inside = sum(row["in_band"] for row in rows)
    lines.append(f"\n{inside} of {len(rows)} figures within [{TARGET[0]}, {TARGET[1]}] (* outside); "
                 f"median error {100 * statistics.median(row['error'] for row in rows):.0f}%")
    return "\n".join(lines)


def format_ablation(rows: list[dict[str, Any]]) -> str:
    lines = ["| engine | run | model | median TPOT ms (ratio) | median TTFT ms (ratio) |", "|---|---|---|---:|---:|"]
    for row in rows:
        tpot, ttft = row[TPOT], row[TTFT]
        lines.append(f"| {row['engine']} | {row['run']} | {row['variant']} | {tpot['simulated']:.2f} "
                     f"({tpot['ratio']:.2f}) | {ttft['simulated']:.1f} ({ttft['ratio']:.2f}) |")
    return "\n".join(lines)
