"""PNG plots of a bench: latency CDFs, KV blocks in use over time, throughput vs rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.driver import RunRecord
from servelab.bench.metrics import request_latencies


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdfs(records: list[RunRecord], path: Path) -> Path:
    plt = _pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for record in records:
        latencies = request_latencies(record)
        for axis, key in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms")):
            values = sorted(latencies[key])
            if values:
                axis.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                          label=record.config_name)
    for axis, title in zip(axes, ("time to first token (ms)", "time per output token (ms)", "end to end (ms)")):
        axis.set_xlabel(title)
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def kv_blocks_over_time(records: list[RunRecord], path: Path) -> Path:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 4))
    for record in records:
        times = [t - record.start_time for t, _ in record.steps]
        used = [r.allocator_stats.num_used_blocks for _, r in record.steps]
        axis.plot(times, used, label=record.config_name)
    if records and records[0].steps:
        axis.axhline(records[0].steps[0][1].allocator_stats.num_blocks, color="grey", linestyle="--",
                     label="pool size")
    axis.set_xlabel("seconds since start")
    axis.set_ylabel("KV blocks in use")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def throughput_vs_rate(sweep: dict[str, list[tuple[float, dict[str, Any]]]], path: Path) -> Path:
    """`sweep`: config name -> [(request rate, metrics)]."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in sweep.items():
        rates = [rate for rate, _ in points]
        axes[0].plot(rates, [m["output_tokens_per_s"] for _, m in points], marker="o", label=name)
        axes[1].plot(rates, [m["ttft_ms"]["p90"] for _, m in points], marker="o", label=name)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("TTFT p90 (ms)")
    for axis in axes:
        axis.set_xlabel("request rate (req/s)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
