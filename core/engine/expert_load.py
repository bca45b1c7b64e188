"""Per-layer expert-load histograms: how many (token, expert) assignments each expert of
each sparse layer took. The engine's runner reports the totals (`expert_load_of`); the
bench reports a run's share of them and their imbalance (`load_histograms`), the server
exports them on /metrics, and placement policies place by them. Likewise a pipeline's
stage times (`pipeline_stats_of`: rank 0's compute, wait and bubble)."""

from __future__ import annotations

from typing import Any

from servelab.contracts.moe import ExpertLoadSource
from servelab.contracts.pipeline import PipelineStatsSource


def expert_load_of(source: Any) -> dict[int, list[int]]:
    """A runner's or an engine's totals per sparse layer; empty for a dense model (or
    one that does not report them)."""
    return source.expert_load() if isinstance(source, ExpertLoadSource) else {}


def imbalance(counts: list[int]) -> float | None:
    """The busiest expert's load over the mean expert's (1.0: even); None before any."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else None


def load_histograms(before: dict[int, list[int]], after: dict[int, list[int]]) -> dict[str, Any]:
    """What a run added, per layer: {"counts": per expert, "imbalance": max over mean}."""
    out = {}
    for layer, totals in sorted(after.items()):
        start = before.get(layer, [0] * len(totals))
        counts = [a - b for a, b in zip(totals, start)]
        out[str(layer)] = {"counts": counts, "imbalance": imbalance(counts)}
    return out


def pipeline_stats_of(source: Any) -> Any:
    """A pipeline-parallel runner's (or engine's) stage statistics; None otherwise."""
    return source.pipeline_stats() if isinstance(source, PipelineStatsSource) else None


def pipeline_summary(stats: Any) -> dict[str, Any]:
    """Rank 0's stage times as the bench JSON reports them; empty without a pipeline."""
    if stats is None:
        return {}
    return {"pipeline": {"steps": stats.steps, "micro_batches": stats.micro_batches,
                         "stage0_compute_s": stats.compute_s, "stage0_bubble_s": stats.wait_s,
                         "stage0_bubble_fraction": stats.bubble_fraction,
                         "batches_in_flight": stats.batches_in_flight,
                         "overlapped_batches": stats.overlapped_batches,
                         "stage_compute_s": [c for c, _ in stats.stage_times],
                         "stage_bubble_s": [w for _, w in stats.stage_times]}}
