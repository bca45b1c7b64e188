"""Turning a run's records into the numbers people compare."""

from __future__ import annotations

from typing import Any

import attrs

from servelab.bench.driver import RunRecord
from servelab.bench.per_request import attainment, by_class, is_good, request_records
from servelab.bench.stage_profile import stage_profile
from servelab.expert_load import load_histograms


@attrs.frozen
class SLO:
    """A request counts towards goodput when it meets both bounds (and its own deadline,
    where the workload gives it one)."""

    ttft_ms: float = 1000.0
    tpot_ms: float = 200.0


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        # linear interpolation between closest ranks
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 (published serving tables report means)."""
    return {"mean": sum(values) / len(values) if values else None, **percentiles(values)}


def mean_itl_ms(record: RunRecord) -> float | None:
    """Mean inter-token latency over every gap between consecutive tokens of a request:
    the gaps of a request sum to its finish minus its first token, so this is the
    token-weighted mean of TPOT."""
    gaps = seconds = 0.0
    for output in record.outputs:
        num_tokens = len(output.token_ids)
        if num_tokens > 1:
            gaps += num_tokens - 1
            seconds += output.metrics.finish_time - output.metrics.first_token_time
    return 1000 * seconds / gaps if gaps else None


def request_latencies(record: RunRecord) -> dict[str, list[float]]:
    """TTFT, TPOT and end-to-end latency per request, in milliseconds."""
    ttft, tpot, e2e = [], [], []
    for output in record.outputs:
        metrics = output.metrics
        ttft.append(1000 * metrics.ttft)
        e2e.append(1000 * metrics.e2e_latency)
        num_tokens = len(output.token_ids)
        if num_tokens > 1:
            tpot.append(1000 * (metrics.finish_time - metrics.first_token_time) / (num_tokens - 1))
    return {"ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": e2e}


def summarize(record: RunRecord, slo: SLO) -> dict[str, Any]:
    """The bench's metrics for one run (the JSON `metrics` object)."""
    seconds = record.end_time - record.start_time
    latencies = request_latencies(record)
    num_output = sum(len(o.token_ids) for o in record.outputs)
    rows = request_records(record)
    good = sum(is_good(row, slo) for row in rows)
    reports = [report for _, report in record.steps]
    slot_steps_used = sum(r.num_seqs for r in reports)
    slot_steps_wasted = sum(r.scheduler_stats.num_idle_slots for r in reports)
    before, after = record.allocator_stats_before, record.allocator_stats_after
    lookups = after.prefix_lookup_tokens - before.prefix_lookup_tokens
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    return {
        "seconds": seconds,
        "num_requests": len(record.outputs),
        "output_tokens": num_output,
        "output_tokens_per_s": num_output / seconds,
        "requests_per_s": len(record.outputs) / seconds,
        **{name: distribution(values) for name, values in latencies.items()},
        "itl_ms": {"mean": mean_itl_ms(record)},
        "goodput_rps": good / seconds,
        "deadline_attainment": attainment(rows),  # None: no request had a deadline
        "by_class": by_class(rows, slo, seconds),
        "kv_utilization": _mean(_kv_used_fraction(r) for r in reports),
        "kv_waste_fraction": _mean(_kv_waste_fraction(r, record.block_size) for r in reports),
        "prefix_hit_rate": hits / lookups if lookups else None,
        **_speculation(reports, record.outputs),
        "slot_steps_used": slot_steps_used,
        "slot_steps_wasted": slot_steps_wasted,
        "preemptions": record.preemptions,
        "discarded_tokens": record.discarded_tokens,
        **_tiers(reports),
        "steps": len(reports),
        "engine_overhead_ms_at_max_batch": _overhead_at_max_batch(reports),
        "stage_profile": stage_profile(reports),
        **_expert_load(record),
        **_pipeline(record),
        **record.adapters,
    }


def _pipeline(record: RunRecord) -> dict[str, Any]:
    """Under pipeline parallelism, stage 0's compute and bubble over the run; empty otherwise."""
    if not record.pipeline_after:
        return {}
    after, before = record.pipeline_after["pipeline"], record.pipeline_before.get("pipeline", {})
    run = {key: after[key] - before.get(key, 0) for key in ("steps", "micro_batches", "stage0_compute_s",
                                                          "stage0_bubble_s")}
    busy = run["stage0_compute_s"] + run["stage0_bubble_s"]
    stages = {}
    if after.get("stage_compute_s"):  # every stage's times (not under torchrun)
        count = len(after["stage_compute_s"])
        compute = [after["stage_compute_s"][i] - (before.get("stage_compute_s") or [0.0] * count)[i]
                   for i in range(count)]
        bubble = [after["stage_bubble_s"][i] - (before.get("stage_bubble_s") or [0.0] * count)[i]
                  for i in range(count)]
        stages = {"stage_compute_s": compute, "stage_bubble_s": bubble,
                  "stage_bubble_fractions": [b / (c + b) if c + b else None for c, b in zip(compute, bubble)]}
    return {"pipeline": {**run, "stage0_bubble_fraction": run["stage0_bubble_s"] / busy if busy else None,
                         "batches_in_flight": after.get("batches_in_flight", 1),
                         "overlapped_batches": after.get("overlapped_batches", 0)
                         - before.get("overlapped_batches", 0), **stages}}


def _expert_load(record: RunRecord) -> dict[str, Any]:
    """A mixture-of-experts model's per-layer expert-load histogram over the run; empty for a dense one."""
    if not record.expert_load_after:
        return {}
    return {"expert_load": load_histograms(record.expert_load_before, record.expert_load_after)}


def _tiers(reports) -> dict[str, Any]:
    """The host KV tier's traffic over the run ([kv_offload]); empty without one."""
    tiers = [r.tier_stats for r in reports if r.tier_stats is not None]
    if not tiers:
        return {}
    first, last = tiers[0], tiers[-1]
    moves = [t.moves_last_step for t in tiers]
    return {
        "host_blocks_used_peak": max(t.num_host_used for t in tiers),
        "kv_moves_per_step": sum(moves) / len(moves),
        "kv_bytes_moved": sum(t.bytes_last_step for t in tiers),
        "host_hit_blocks": last.host_hit_blocks - first.host_hit_blocks,
        "swap_outs": last.num_swap_outs - first.num_swap_outs,
    }


def _speculation(reports, outputs) -> dict[str, Any]:
    """Drafts verified and accepted over the run; tokens per target step per sequence."""
    drafted = sum(r.num_draft_tokens for r in reports)
    accepted = sum(r.num_accepted_tokens for r in reports)
    steps = sum(o.metrics.num_sampling_steps for o in outputs)
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,  # None: no drafter, or nothing drafted
        "tokens_per_target_step": tokens / steps if steps else None,
    }


def _overhead_at_max_batch(reports) -> float | None:
    """Median scheduler + allocator + input-preparation + update time of the fullest steps."""
    if not reports:
        return None
    fullest = max(r.num_seqs for r in reports)
    values = sorted(1000 * r.overhead_seconds for r in reports if r.num_seqs == fullest)
    return values[len(values) // 2]


def _kv_used_fraction(report) -> float:
    stats = report.allocator_stats
    return stats.num_used_blocks / stats.num_blocks if stats.num_blocks else 0.0


def _kv_waste_fraction(report, block_size: int) -> float:
    """Slots reserved but empty, plus free slots unusable for the next request, over the pool."""
    stats = report.allocator_stats
    total_slots = stats.num_blocks * block_size
    return stats.num_wasted_slots / total_slots if total_slots else 0.0


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None
