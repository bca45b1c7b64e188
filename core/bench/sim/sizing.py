"""Capacity planning on the simulator (`servelab size`): how many KV blocks and
concurrent sequences one engine holds, the request rate it sustains under a latency
SLO, the replicas a target rate needs, and when speculative decoding pays.

KV memory, not the weights, sets the ceiling: once the weights are loaded, what is left
(times the memory utilisation) divided by the bytes of one KV block is the number of
blocks, and the blocks a full-length sequence needs bound how many run at once."""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import attrs

from servelab.bench.driver import StepRecorder, run_workload
from servelab.bench.metrics import SLO, summarize
from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import GIB, Accelerator, Interconnect
from servelab.bench.sim.runner import VirtualClock
from servelab.bench.sim.source import SimSource
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.kv_sizing import blocks_for
from servelab.model.model_config import ModelConfig
from servelab.registry import PluginRegistry
from servelab.workload import GENERATORS, build_workload, parse_spec


@attrs.frozen
class MemoryPlan:
    """One device's memory, in bytes, and what the KV pool holds."""

    memory_bytes: float
    reserved_bytes: float
    weight_bytes: float  # resident weights on one device
    free_bytes: float  # what weights and runtime leave
    memory_utilization: float
    kv_pool_bytes: float  # memory_utilization * free_bytes
    kv_bytes_per_token: float  # on one device
    block_bytes: float
    num_blocks: int
    kv_tokens: int
    context_len: int
    blocks_per_sequence: int  # a sequence of context_len tokens
    max_concurrent_seqs: int  # sequences of context_len tokens the pool holds at once


def memory_plan(cost: CostModel, block_size: int, context_len: int) -> MemoryPlan:
    hw = cost.hardware
    free = hw.memory_bytes - hw.reserved_bytes - cost.resident_weight_bytes
    num_blocks = cost.kv_blocks(block_size)  # a ConfigError naming the fix when nothing fits
    per_sequence = blocks_for(context_len, block_size)
    return MemoryPlan(
        memory_bytes=hw.memory_bytes, reserved_bytes=hw.reserved_bytes, weight_bytes=cost.resident_weight_bytes,
        free_bytes=free, memory_utilization=cost.memory_utilization, kv_pool_bytes=cost.kv_pool_bytes(),
        kv_bytes_per_token=cost.kv_bytes_per_token, block_bytes=cost.kv_bytes_per_token * block_size,
        num_blocks=num_blocks, kv_tokens=num_blocks * block_size, context_len=context_len,
        blocks_per_sequence=per_sequence, max_concurrent_seqs=num_blocks // per_sequence)


@attrs.frozen
class RatePoint:
    rate: float  # offered requests/s
    attainment: float  # share of requests meeting both SLO bounds
    ttft_p99_ms: float
    tpot_p99_ms: float | None
    output_tokens_per_s: float


class ReplicaSimulator:
    """Runs a workload spec through one fresh simulated engine per call, spread over the
    config's `[engine] tensor_parallel_size` devices joined by `link`."""

    def __init__(self, config: EngineConfig, shape: ModelConfig, hardware: Accelerator, memory_utilization: float,
                 link: Interconnect | None = None) -> None:
        self.config, self.shape, self.hardware = config, shape, hardware
        self.memory_utilization, self.link = memory_utilization, link

    def run(self, spec: str, slo: SLO) -> dict[str, Any]:
        from servelab.engine import LLMEngine

        clock = VirtualClock()
        source = SimSource(self.shape, self.hardware, clock, link=self.link, memory_utilization=self.memory_utilization)
        registry = PluginRegistry.from_entry_points()
        recorder = StepRecorder(clock)
        registry.register(recorder)
        engine = LLMEngine(source.fit_config(self.config), registry, clock=clock, source=source)
        workload = build_workload(spec, self.shape.vocab_size)
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
        if longest > engine.limits.max_model_len:
            raise ConfigError(f"the workload has a request of {longest} tokens, over the context length "
                              f"{engine.limits.max_model_len}: raise --context-len or shorten the workload")
        return summarize(run_workload(engine, recorder, workload, "size"), slo)


def _with_arrivals(spec: str, rate: float | None, duration_s: float = 0.0) -> str:
    """`spec` with Poisson arrivals at `rate` (None: all at once), and, for generators
    counted in requests, enough of them to arrive over `duration_s` seconds: a sweep
    point must run long enough for the queue to show whether the rate is sustainable."""
    name, options = parse_spec(spec)
    for key in ("arrival", "rate", "burst_size"):
        options.pop(key, None)
    if rate is not None:
        options.update(arrival="poisson", rate=f"{rate:.6g}")
        generator = GENERATORS.get(name)
        if generator is not None and "num_requests" in inspect.signature(generator).parameters:
            default = inspect.signature(generator).parameters["num_requests"].default
            options["num_requests"] = max(int(options.get("num_requests", default)), math.ceil(rate * duration_s))
    return f"{name}:" + ",".join(f"{k}={v}" for k, v in options.items())


def _point(metrics: dict[str, Any], rate: float) -> RatePoint:
    good = metrics["goodput_rps"] * metrics["seconds"]
    return RatePoint(rate, good / metrics["num_requests"], metrics["ttft_ms"]["p99"], metrics["tpot_ms"]["p99"],
                     metrics["output_tokens_per_s"])


def sustained_rate(simulate: Callable[[str, SLO], dict[str, Any]], spec: str, slo: SLO, attainment: float = 0.9,
                   iterations: int = 7, duration_s: float = 60.0) -> tuple[float, list[RatePoint], float]:
    """The highest Poisson rate at which at least `attainment` of the requests meet the
    SLO, by bisection between 0 and 1.5x the offline (all at once) request rate, each
    point arriving over at least `duration_s` seconds; returns it, every point simulated
    (by rate) and the offline rate."""
    if not 0 < attainment <= 1:
        raise ConfigError(f"SLO attainment must be in (0, 1], got {attainment}")
    offline = simulate(_with_arrivals(spec, None), slo)["requests_per_s"]
    points = {}

    def meets(rate: float) -> bool:
        if rate not in points:
            points[rate] = _point(simulate(_with_arrivals(spec, rate, duration_s), slo), rate)
        return points[rate].attainment >= attainment

    low, high = 0.0, 1.5 * offline
    if meets(high):
        return high, sorted(points.values(), key=lambda p: p.rate), offline
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low, sorted(points.values(), key=lambda p: p.rate), offline


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verification step yields with k drafts, each accepted with probability
    `acceptance` until the first rejection, plus the target's own (Leviathan et al.)."""
    if acceptance >= 1:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


@attrs.frozen
class SpeculationRow:
    k: int
    verify_cost: float  # a step verifying k drafts per sequence, over a plain decode step
    draft_cost: float  # k draft forwards, over a plain decode step
    breakeven_acceptance: float | None  # None: never pays, even accepting everything
    speedup: float  # at the given acceptance rate


def speculation(cost: CostModel, batch: int, context_len: int, acceptance: float, draft_cost: float,
                max_k: int = 8) -> list[SpeculationRow]:
    """Speedup of speculative decoding over plain decoding at one batch size and context,
    per number of drafts k: expected tokens per step over (k * draft_cost + the cost of
    verifying k + 1 tokens per sequence, relative to a plain decode step). `draft_cost`
    is one draft forward's time over one target decode step's."""
    if not 0 <= acceptance <= 1:
        raise ConfigError(f"acceptance rate must be in [0, 1], got {acceptance}")
    plain = cost.step([1] * batch, [context_len] * batch, batch).seconds
    rows = []
    for k in range(1, max_k + 1):
        verify = cost.step([k + 1] * batch, [context_len + k] * batch, batch * (k + 1)).seconds / plain
        step_cost = k * draft_cost + verify
        rows.append(SpeculationRow(k, verify, k * draft_cost, _breakeven(k, step_cost),
                                   expected_tokens(acceptance, k) / step_cost))
    return rows


def _breakeven(k: int, step_cost: float) -> float | None:
    """The acceptance rate at which expected_tokens(a, k) == step_cost (bisection)."""
    if step_cost >= k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, k) < step_cost else (low, middle)
    return high


def format_size(result: dict[str, Any]) -> str:
    m, devices = result["memory"], result["tensor_parallel"]
    joined = f" over {result['interconnect']}" if devices > 1 else ""
    lines = [
        f"{result['model']} on {devices} x {result['accelerator']} (tensor parallelism {devices}{joined}), "
        f"context {m['context_len']} tokens, blocks of {result['block_size']} tokens",
        f"  per device: {m['memory_bytes'] / GIB:.1f} GiB = weights {m['weight_bytes'] / GIB:.1f} GiB "
        f"+ runtime {m['reserved_bytes'] / GIB:.1f} GiB + free {m['free_bytes'] / GIB:.1f} GiB",
        f"  KV pool: {m['memory_utilization']:.2f} x {m['free_bytes'] / GIB:.1f} GiB = "
        f"{m['kv_pool_bytes'] / GIB:.1f} GiB / {m['block_bytes'] / 2**20:.2f} MiB a block "
        f"({m['kv_bytes_per_token'] / 1024:.0f} KiB a token, KV {result.get('kv_cache_dtype', 'auto')}) = "
        f"{m['num_blocks']:,} blocks = {m['kv_tokens']:,} tokens",
        f"  concurrent sequences of {m['context_len']} tokens: {m['max_concurrent_seqs']:,} "
        f"({m['blocks_per_sequence']} blocks each)",
    ]
    if "rate" in result:
        rate = result["rate"]
        lines.append(f"rate sweep, workload {rate['workload']}, SLO TTFT <= {result['slo']['ttft_ms']:g} ms and "
                     f"TPOT <= {result['slo']['tpot_ms']:g} ms for {100 * rate['attainment']:.0f}% of requests:")
        lines.append(f"  {'req/s':>8} {'in SLO':>7} {'TTFT p99 ms':>12} {'TPOT p99 ms':>12} {'out tok/s':>10}")
        for p in rate["points"]:
            tpot = "-" if p["tpot_p99_ms"] is None else f"{p['tpot_p99_ms']:.0f}"
            lines.append(f"  {p['rate']:>8.2f} {100 * p['attainment']:>6.1f}% {p['ttft_p99_ms']:>12.0f} "
                         f"{tpot:>12} {p['output_tokens_per_s']:>10.0f}")
        lines.append(f"  one replica sustains {rate['sustained_rps']:.2f} req/s "
                     f"(offline, all at once: {rate['offline_rps']:.2f} req/s)")
        if rate.get("target_rps"):
            lines.append(f"  {rate['target_rps']:g} req/s needs {rate['replicas_needed']} replicas "
                         f"({rate['replicas_needed'] * devices} devices)")
    if "speculation" in result:
        spec = result["speculation"]
        lines.append(f"speculative decoding at batch {spec['batch']}, context {spec['context_len']}, draft cost "
                     f"{spec['draft_cost']:.3f} of a target decode step ({spec['draft_cost_source']}), "
                     f"acceptance {spec['acceptance']:.2f}:")
        lines.append(f"  {'k':>3} {'verify cost':>12} {'draft cost':>11} {'breakeven acceptance':>21} {'speedup':>8}")
        for row in spec["rows"]:
            breakeven = "never" if row["breakeven_acceptance"] is None else f"{row['breakeven_acceptance']:.3f}"
            lines.append(f"  {row['k']:>3} {row['verify_cost']:>11.2f}x {row['draft_cost']:>10.2f}x "
                         f"{breakeven:>21} {row['speedup']:>7.2f}x")
    return "\n".join(lines)


def replicas_needed(target_rps: float, sustained_rps: float) -> int | None:
    if sustained_rps <= 0:
        return None
    return max(1, math.ceil(target_rps / sustained_rps - 1e-9))
