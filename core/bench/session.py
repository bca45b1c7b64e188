"""One bench session: build an engine per config, run the workload through each
(interleaved repetitions from an empty prefix cache, warm-up excluded; see
repetitions.py), optionally a transformers baseline and a request-rate sweep, and
collect metrics, JSON and plots."""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs

from servelab.bench import plots
from servelab.bench.bench_adapters import BenchAdapters
from servelab.bench.comparison import DEFAULT_IMBALANCE_FACTOR, annotate
from servelab.bench.driver import RunRecord, StepRecorder, lora_manager_of, run_workload
from servelab.bench.metrics import SLO, summarize
from servelab.bench.repetitions import DEFAULT_REPEATS, run_repetitions, warm_up
from servelab.config import EngineConfig
from servelab.kv_sizing import DTYPE_BYTES
from servelab.errors import ConfigError
from servelab.registry import PluginRegistry
from servelab.workload import Workload, build_workload, parse_spec


@attrs.frozen
class BenchOptions:
    workload: str = "skewed"
    repeats: int = DEFAULT_REPEATS
    slo: SLO = SLO()
    baseline: str | None = None  # "hf" or "vllm"
    hf_batch_size: int | None = None
    baseline_python: str | None = None  # vLLM's interpreter, for baseline "vllm"
    plots_dir: Path | None = None
    rates: tuple[float, ...] = ()  # request rates (req/s) for a Poisson sweep
    save_workload: Path | None = None
    sim_accelerator: str | None = None  # simulate on this accelerator instead of running the model
    sim_model: str = "llama-3-8b"  # model shape to simulate
    sim_interconnect: str | None = None  # links between simulated devices (default: the accelerator's)
    warm_cache: bool = False  # keep prefix caches across the warm-up and repetitions
    replicas: int = 1  # > 1: each config is a simulated fleet of this many replicas behind its [router]
    imbalance_factor: float = DEFAULT_IMBALANCE_FACTOR  # warn when a replica takes more than this times its share


class _Engine:
    """An engine built from one config, with the recorder observing it."""

    def __init__(self, name: str, config: EngineConfig, options: "BenchOptions") -> None:
        from servelab.engine import LLMEngine

        self.name = name
        registry = PluginRegistry.from_entry_points()
        self.recorder = StepRecorder()
        registry.register(self.recorder)
        if options.sim_accelerator:
            from servelab.bench.sim.runner import VirtualClock
            from servelab.bench.sim.source import SimSource

            clock = VirtualClock()
            source = SimSource.named(options.sim_model, options.sim_accelerator, clock, options.sim_interconnect)
            config = source.fit_config(config)
            self.engine = LLMEngine(config, registry, clock=clock, source=source)
            self.dtype_bytes = source.dtype_bytes  # the simulated model's, not [engine] dtype
        else:
            self.engine = LLMEngine(config, registry)
            self.dtype_bytes = DTYPE_BYTES[config.engine.dtype]
        self.config = config
        self.recorder.clock = self.engine.clock


def run_bench(configs: list[tuple[str, EngineConfig]], options: BenchOptions) -> dict[str, Any]:
    _check_same_model(configs)
    if options.replicas != 1:
        from servelab.bench.sim.fleet import run_fleet_bench

        return run_fleet_bench(configs, options)
    engines = [_Engine(name, config, options) for name, config in configs]
    with tempfile.TemporaryDirectory(prefix="servelab-bench-adapters-") as adapter_root:
        adapters = BenchAdapters(Path(adapter_root), engines[0].engine.model_config, options.sim_accelerator is None)
        return _run_bench(configs, engines, options, adapters)


def _run_bench(configs: list[tuple[str, EngineConfig]], engines: list["_Engine"], options: BenchOptions,
               adapters: BenchAdapters) -> dict[str, Any]:
    vocab_size = min(e.engine.model_config.vocab_size for e in engines)
    workload = adapters.attach(build_workload(options.workload, vocab_size))
    if options.save_workload:
        workload.save(options.save_workload)
    _check_fits(workload, engines)
    if options.repeats < 1:
        raise ConfigError(f"repeats must be at least 1, got {options.repeats}")
    total = len(workload.requests) * (options.repeats * len(engines) + len(options.rates) * len(engines))
    with _progress(total) as bar:
        warm_up(engines, workload, options.warm_cache)  # excluded from every figure
        widest_first = tuple(sorted(workload.requests, key=lambda r: -len(r.prompt_token_ids)))
        baseline = _load_baseline(engines[0], options, widest_first)
        baseline_runs = []

        def run_baseline() -> None:
            baseline_runs.append(baseline.run(workload))

        per_config = run_repetitions(engines, workload, options.repeats, options.warm_cache, bar.update,
                                     run_baseline if baseline is not None else None)
        if baseline is not None:
            baseline.close()
        runs = []
        chosen: list[RunRecord] = []
        for e in engines:
            summaries = [summarize(r, options.slo) for r in per_config[e.name]]
            median = statistics.median_low([s["output_tokens_per_s"] for s in summaries])
            index = [s["output_tokens_per_s"] for s in summaries].index(median)
            chosen.append(per_config[e.name][index])
            runs.append({"config": e.name, "metrics": {**summaries[index], **kv_layout(e.engine, e.dtype_bytes)},
                         "repeats_output_tokens_per_s": [s["output_tokens_per_s"] for s in summaries]})
        sweep = _rate_sweep(engines, options, vocab_size, bar.update, adapters) if options.rates else {}
    result: dict[str, Any] = {
        "workload": {"spec": workload.name, "num_requests": len(workload.requests),
                     "prompt_tokens": workload.num_prompt_tokens, "output_tokens": workload.num_output_tokens},
        "slo": attrs.asdict(options.slo),
        "runs": runs,
    }
    if baseline_runs:
        median = statistics.median_low([r["output_tokens_per_s"] for r in baseline_runs])
        chosen_baseline = next(r for r in baseline_runs if r["output_tokens_per_s"] == median)
        result["baseline"] = {"config": baseline.name, "metrics": chosen_baseline,
                              "repeats_output_tokens_per_s": [r["output_tokens_per_s"] for r in baseline_runs]}
    if sweep:
        result["rate_sweep"] = {name: [{"rate": rate, "metrics": m} for rate, m in points]
                                for name, points in sweep.items()}
    if options.plots_dir:
        result["plots"] = _plots(options.plots_dir, chosen, sweep)
    return annotate(result, configs, chosen, options.sim_accelerator is not None, options.imbalance_factor)


def kv_layout(engine: Any, dtype_bytes: int) -> dict[str, Any]:
    """How the engine's KV pool stores a token: `[engine] kv_cache_dtype`, the bytes of K and
    V of every layer for one token (the whole model's, its elements `dtype_bytes` each under
    "auto"), and the blocks the pool holds."""
    section = engine.config.engine
    return {"kv_cache_dtype": section.kv_cache_dtype,
            "kv_bytes_per_token": engine.model_config.kv_bytes_per_token(dtype_bytes, section.kv_cache_dtype),
            "kv_blocks": engine.limits.num_kv_blocks}


def _load_baseline(first: _Engine, options: BenchOptions, warm_up: tuple) -> Any:
    """The baseline engine, loaded and warmed up, with `name`, `run(workload)` and `close()`."""
    if options.baseline is None:
        return None
    if options.sim_accelerator:
        raise ConfigError(f"--baseline {options.baseline} runs a real model; it cannot be combined with --sim")
    if any(r.adapter is not None for r in warm_up):
        raise ConfigError(f"--baseline {options.baseline} runs the base model alone; the workload's requests name "
                          f"LoRA adapters")
    engine = first.config.engine
    if options.baseline == "vllm":
        from servelab.bench.vllm_baseline import VllmBaseline

        limits = first.engine.limits
        vllm = VllmBaseline(options.baseline_python, str(first.engine.source.path), engine.dtype,
                            limits.max_model_len, engine.max_num_seqs, limits.max_num_batched_tokens)
        vllm.run(Workload("warm-up", warm_up[: engine.max_num_seqs]))
        return vllm
    from servelab.bench.hf_baseline import HfStaticBaseline

    batch_size = options.hf_batch_size or engine.max_num_seqs
    return HfStaticBaseline(str(first.engine.source.path), engine.dtype, batch_size, list(warm_up[:batch_size]))


def _rate_sweep(engines: list[_Engine], options: BenchOptions, vocab_size: int, update,
                adapters: BenchAdapters) -> dict[str, list]:
    name, spec_options = parse_spec(options.workload)
    if name in ("file", "mooncake", "azure"):
        raise ConfigError(f"--rates re-draws a generator's arrivals; a {name}: workload has its own "
                          "(a trace takes speedup=F instead)")
    sweep: dict[str, list] = {e.name: [] for e in engines}
    for rate in options.rates:
        spec_options.update(arrival="poisson", rate=rate)
        spec = f"{name}:" + ",".join(f"{k}={v}" for k, v in spec_options.items())
        workload = adapters.attach(build_workload(spec, vocab_size))
        for e in engines:
            record = run_workload(e.engine, e.recorder, workload, e.name, update)
            sweep[e.name].append((rate, summarize(record, options.slo)))
    return sweep


def _plots(directory: Path, records: list[RunRecord], sweep: dict[str, list]) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [plots.latency_cdfs(records, directory / "latency_cdf.png"),
             plots.kv_blocks_over_time(records, directory / "kv_blocks.png")]
    if sweep:
        paths.append(plots.throughput_vs_rate(sweep, directory / "throughput_vs_rate.png"))
    return [str(p) for p in paths]


def _check_same_model(configs: list[tuple[str, EngineConfig]]) -> None:
    models = {name: config.engine.model for name, config in configs}
    if len(set(models.values())) > 1:
        named = ", ".join(f"{name}: {model}" for name, model in models.items())
        raise ConfigError(f"the configs name different models ({named}); a side-by-side bench compares "
                          "policies on one model: pass --model to run every config on the same one")


def _check_fits(workload: Workload, engines: list[_Engine]) -> None:
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
    for e in engines:
        if longest > e.engine.limits.max_model_len:
            raise ConfigError(f"workload has a request of {longest} tokens, over config {e.name!r}'s "
                              f"max_model_len={e.engine.limits.max_model_len}; raise [engine] max_model_len")
        lora_manager_of(e.engine, workload)  # adapters named, and served


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, disable=None)
