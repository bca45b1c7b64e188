"""Where a step's time goes: milliseconds per step in each stage of the engine's step
(schedule, prepare, forward, sample, update), binned by how many sequences the step ran.

"engine" is everything but the model forward, the engine's own work per step; its p50 and
p90 over the bin's steps show the spread. The stage times are wall-clock seconds from
StepReport, also under the simulator, where only the forward is simulated.
"""

from __future__ import annotations

from typing import Any, Iterable

from servelab.outputs import StepReport

STAGES = ("schedule", "prepare", "forward", "sample", "update")
# (lowest, highest) sequences per step; None: no upper bound.
BINS: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 8), (9, 32), (33, 64), (65, 256), (257, None))


def bin_label(low: int, high: int | None) -> str:
    """'1', '2-8', '257+'."""
    if high is None:
        return f"{low}+"
    return str(low) if low == high else f"{low}-{high}"


def _bin_of(num_seqs: int) -> int:
    for index, (low, high) in enumerate(BINS):
        if num_seqs >= low and (high is None or num_seqs <= high):
            return index
    raise ValueError(f"a step ran {num_seqs} sequences")


def _stage_seconds(report: StepReport) -> tuple[float, ...]:
    return (report.schedule_seconds, report.prepare_seconds, report.forward_seconds,
            report.sample_seconds, report.update_seconds)


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def stage_profile(reports: Iterable[StepReport]) -> list[dict[str, Any]]:
    """One row per bin that saw steps, smallest first:

        {"seqs": "33-64", "min_seqs": 33, "max_seqs": 64, "steps": 120,
         "ms_per_step": {"schedule": ..., "prepare": ..., "forward": ..., "sample": ...,
                         "update": ..., "engine": ...},
         "engine_ms_p50": ..., "engine_ms_p90": ...}

    `ms_per_step` holds means; `engine` is the sum of every stage but the forward.
    `max_seqs` is None for the open-ended last bin.
    """
    per_bin: dict[int, list[tuple[float, ...]]] = {}
    for report in reports:
        if report.num_seqs > 0:
            per_bin.setdefault(_bin_of(report.num_seqs), []).append(_stage_seconds(report))
    rows = []
    for index in sorted(per_bin):
        steps = per_bin[index]
        low, high = BINS[index]
        means = {stage: 1000 * sum(s[i] for s in steps) / len(steps) for i, stage in enumerate(STAGES)}
        engine = sorted(1000 * (sum(s) - s[STAGES.index("forward")]) for s in steps)
        means["engine"] = sum(engine) / len(engine)
        rows.append({"seqs": bin_label(low, high), "min_seqs": low, "max_seqs": high, "steps": len(steps),
                     "ms_per_step": means, "engine_ms_p50": _quantile(engine, 0.5),
                     "engine_ms_p90": _quantile(engine, 0.9)})
    return rows


def format_stage_profile(name: str, rows: list[dict[str, Any]]) -> list[str]:
    """The profile of one config as table lines (none when it has no steps)."""
    if not rows:
        return []
    columns = (*STAGES, "engine")
    lines = [f"per-stage ms per step, {name} (engine = all but forward):",
             f"  {'seqs':>7} {'steps':>7} " + " ".join(f"{c:>9}" for c in columns) + f" {'engine p50/p90':>15}"]
    for row in rows:
        ms = row["ms_per_step"]
        spread = f"{row['engine_ms_p50']:.3f}/{row['engine_ms_p90']:.3f}"
        lines.append(f"  {row['seqs']:>7} {row['steps']:>7} " + " ".join(f"{ms[c]:>9.3f}" for c in columns)
                     + f" {spread:>15}")
    return lines
