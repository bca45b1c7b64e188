"""The simulator against published GPU measurements: TensorRT-LLM's performance
overview for Llama-3.1-8B on one GPU (offline throughput from v0.15's `trtllm-bench`,
FP16, fixed lengths, every request at once; online serving from v0.14, BF16, 500
requests of 467 prompt and 256 output tokens, Poisson arrivals). Each row runs through
the engine `servelab bench --sim` builds, with a TensorRT-LLM-like config, and is compared."""

from __future__ import annotations

from typing import Any, Iterator

import attrs

from servelab.bench.driver import StepRecorder, run_workload
from servelab.bench.metrics import SLO, summarize
from servelab.bench.sim.hardware import accelerator
from servelab.bench.sim.runner import VirtualClock
from servelab.bench.sim.shapes import model_shape
from servelab.bench.sim.source import SimSource
from servelab.config import EngineConfig
from servelab.registry import PluginRegistry
from servelab.workload import build_workload


@attrs.frozen
class Reference:
    """One published measurement: a workload on an accelerator and the figures reported."""

    accelerator: str
    workload: str  # a `servelab bench --workload` spec
    published: dict[str, float]  # metric key -> published value
    label: str


# TensorRT-LLM's defaults of those releases: in-flight batching with up to 2048 sequences
# and 8192 tokens a step, running generation before new contexts, 64-token KV blocks.
TRTLLM_LIKE_CONFIG = {
    "engine.max_num_seqs": 2048, "engine.max_num_batched_tokens": 8192, "engine.max_model_len": 8192,
    "engine.block_size": 64, "scheduler.name": "continuous", "scheduler.policy": "decode-first",
}
OUTPUT_TPS, TTFT, ITL = "output tokens/s", "mean TTFT ms", "mean ITL ms"

# Offline: (prompt, output) -> output tokens/s on (H100, A100); requests simulated per row,
# enough for several turnovers of the batch the KV pool holds.
OFFLINE = {
    (128, 128): (16117, 6553, 4000), (128, 2048): (9894, 5220, 600), (2048, 128): (1972, 790, 1000),
    (2048, 2048): (4371, 2367, 400), (1000, 1000): (7721, 3753, 1000), (5000, 500): (1802, 816, 400),
}
ONLINE_REQUESTS, ONLINE_PROMPT, ONLINE_OUTPUT = 500, 467, 256
# (accelerator, requests/s or None for all at once) -> (mean TTFT ms, mean ITL ms, output tokens/s)
ONLINE = {
    ("h100", 2): (23, 8, 504), ("h100", 16): (30, 11, 3765), ("h100", 32): (50, 19, 6774),
    ("h100", None): (3335, 39, 9420), ("h200", 2): (21, 6, 504), ("h200", None): (3237, 36, 10121),
}


def references() -> Iterator[Reference]:
    """Every published row: the offline table on H100 and A100, then the online one."""
    for (prompt, output), (h100, a100, num_requests) in OFFLINE.items():
        spec = f"fixed:num_requests={num_requests},prompt_len={prompt},output_len={output}"
        for accelerator, value in (("h100", h100), ("a100", a100)):
            yield Reference(accelerator, spec, {OUTPUT_TPS: value}, f"offline {prompt}/{output}")
    for (accelerator, rate), (ttft, itl, tps) in ONLINE.items():
        spec = f"fixed:num_requests={ONLINE_REQUESTS},prompt_len={ONLINE_PROMPT},output_len={ONLINE_OUTPUT}"
        if rate is not None:
            spec += f",arrival=poisson,rate={rate}"
        yield Reference(accelerator, spec, {TTFT: ttft, ITL: itl, OUTPUT_TPS: tps},
                        f"online {'inf' if rate is None else rate} req/s")


def simulate(reference: Reference, sim_model: str = "llama-3-8b") -> dict[str, float]:
    """The reference's figures as the simulator produces them: one run of its workload,
    as `servelab bench --sim` times it (a simulated clock needs no warm-up or repeats)."""
    from servelab.engine import LLMEngine

    clock = VirtualClock()
    source = SimSource(model_shape(sim_model), accelerator(reference.accelerator), clock)
    config = source.fit_config(EngineConfig().with_overrides(TRTLLM_LIKE_CONFIG))
    registry = PluginRegistry.from_entry_points()
    recorder = StepRecorder(clock)
    registry.register(recorder)
    engine = LLMEngine(config, registry, clock=clock, source=source)
    workload = build_workload(reference.workload, source.model_config.vocab_size)
    metrics = summarize(run_workload(engine, recorder, workload, reference.label), SLO())
    simulated = {OUTPUT_TPS: metrics["output_tokens_per_s"], TTFT: metrics["ttft_ms"]["mean"],
                 ITL: metrics["itl_ms"]["mean"]}
    return {key: simulated[key] for key in reference.published}


def compare(selected: list[Reference] | None = None) -> list[dict[str, Any]]:
    """One row per (reference, figure): simulated, published and their ratio."""
    rows = []
    for reference in selected if selected is not None else list(references()):
        simulated = simulate(reference)
        for key, published in reference.published.items():
            rows.append({"accelerator": reference.accelerator, "label": reference.label, "metric": key,
                         "simulated": simulated[key], "published": published,
                         "ratio": simulated[key] / published})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the rows."""
    lines = ["| GPU | workload | figure | sim | published | sim / published |", "|---|---|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['accelerator'].upper()} | {row['label']} | {row['metric']} | "
                     f"{row['simulated']:,.0f} | {row['published']:,.0f} | {row['ratio']:.2f} |")
    return "\n".join(lines)
