"""The side-by-side table `servelab bench` prints."""

from __future__ import annotations

from typing import Any

from servelab.bench.miss_causes import summary_line
from servelab.bench.stage_profile import format_stage_profile


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


ROWS = [
    ("output tokens/s", lambda m: _fmt(m.get("output_tokens_per_s"))),
    ("requests/s", lambda m: _fmt(m.get("requests_per_s"), 2)),
    ("TTFT p50/p90/p99 ms", lambda m: _trio(m.get("ttft_ms"))),
    ("TPOT p50/p90/p99 ms", lambda m: _trio(m.get("tpot_ms"))),
    ("e2e p50/p90/p99 ms", lambda m: _trio(m.get("e2e_ms"))),
    ("TTFT / TPOT / ITL mean ms", lambda m: "/".join(_ms((m.get(k) or {}).get("mean"))
                                                     for k in ("ttft_ms", "tpot_ms", "itl_ms"))),
    ("goodput req/s", lambda m: _fmt(m.get("goodput_rps"), 2)),
    ("deadlines met", lambda m: _pct(m.get("deadline_attainment"))),
    ("KV dtype / bytes a token", lambda m: "-" if "kv_cache_dtype" not in m
     else f"{m['kv_cache_dtype']} / {m['kv_bytes_per_token']:,}"),
    ("KV blocks", lambda m: _fmt(m.get("kv_blocks"))),
    ("KV utilisation", lambda m: _pct(m.get("kv_utilization"))),
    ("KV waste", lambda m: _pct(m.get("kv_waste_fraction"))),
    ("prefix hit rate", lambda m: _pct(m.get("prefix_hit_rate"))),
    ("acceptance rate", lambda m: _pct(m.get("acceptance_rate"))),
    ("tokens / target step", lambda m: _fmt(m.get("tokens_per_target_step"), 2)),
    ("slot-steps used", lambda m: _fmt(m.get("slot_steps_used"))),
    ("slot-steps wasted", lambda m: _fmt(m.get("slot_steps_wasted"))),
    ("preemptions", lambda m: _fmt(m.get("preemptions"))),
    ("tokens discarded by preemption", lambda m: _fmt(m.get("discarded_tokens"))),
    ("host KV blocks used, peak", lambda m: _fmt(m.get("host_blocks_used_peak"))),
    ("KV moves / step", lambda m: _fmt(m.get("kv_moves_per_step"), 2)),
    ("KV MB moved", lambda m: _fmt(None if m.get("kv_bytes_moved") is None else m["kv_bytes_moved"] / 1e6, 1)),
    ("LoRA pool loads / step", lambda m: _fmt(m.get("adapter_loads_per_step"), 3)),
    ("LoRA disk reads", lambda m: _fmt(m.get("adapter_disk_reads"))),
]


def _ms(value: float | None) -> str:
    """Milliseconds with the digits that matter: whole above 100, tenths above 10,
    hundredths below (a tiny model's TPOT is a fraction of a millisecond)."""
    if value is None:
        return "-"
    return _fmt(float(value), 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2)


def _trio(values: dict | None) -> str:
    if not values:
        return "-"
    return "/".join(_ms(values[k]) for k in ("p50", "p90", "p99"))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _spread(values: list[float] | None) -> str:
    """min-max of the repetitions' output tokens/s: how far apart the timed runs landed."""
    if not values:
        return "-"
    return f"{min(values):.1f}-{max(values):.1f}"


def format_table(result: dict[str, Any]) -> str:
    runs = [*result["runs"], *([result["baseline"]] if "baseline" in result else [])]
    columns = [(run["config"], run["metrics"]) for run in runs]
    repeats = max(len(run.get("repeats_output_tokens_per_s", ())) for run in runs)
    rows = [ROWS[0], (f"  min-max of {repeats} runs", None), *ROWS[1:]]
    label_width = max(len(label) for label, _ in rows)
    cells = [[_spread(run.get("repeats_output_tokens_per_s")) if render is None else render(run["metrics"])
              for _, render in rows] for run in runs]
    widths = [max(len(name), *(len(c) for c in column)) for (name, _), column in zip(columns, cells)]
    workload = result["workload"]
    lines = [f"workload {workload['spec']}: {workload['num_requests']} requests, "
             f"{workload['prompt_tokens']} prompt tokens, {workload['output_tokens']} output tokens",
             " " * label_width + "  " + "  ".join(n.rjust(w) for (n, _), w in zip(columns, widths))]
    for row, (label, _) in enumerate(rows):
        lines.append(label.ljust(label_width) + "  " + "  ".join(c[row].rjust(w) for c, w in zip(cells, widths)))
    if "baseline" in result:
        base = result["baseline"]["metrics"]["output_tokens_per_s"]
        for name, metrics in columns[:-1]:
            lines.append(f"{name} / {result['baseline']['config']} output tokens/s: {metrics['output_tokens_per_s'] / base:.2f}x")
    for name, metrics in columns:
        if "fleet" in metrics:
            fleet = metrics["fleet"]
            counts = fleet["requests_per_replica"]
            lines.append(f"{name}: router {fleet['router']} over {fleet['replicas']} replicas, "
                         f"requests per replica {min(counts)}-{max(counts)}, prefix hit rate per replica "
                         + " ".join(_pct(rate) for rate in fleet["prefix_hit_rate_per_replica"]))
    lines.extend(_class_lines(result["runs"]))
    lines.extend(filter(None, (summary_line(run["config"], run["metrics"].get("slo_misses")) for run in result["runs"])))
    for name, metrics in columns:
        lines.extend(format_stage_profile(name, metrics.get("stage_profile", [])))
    for name, points in result.get("rate_sweep", {}).items():
        lines.append(f"rate sweep, {name}:")
        lines.append(f"  {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'goodput':>8}")
        for point in points:
            m = point["metrics"]
            lines.append(f"  {point['rate']:>7g} {m['output_tokens_per_s']:>10.1f} "
                         f"{_ms(m['ttft_ms']['p50']) + '/' + _ms(m['ttft_ms']['p99']):>16} "
                         f"{_ms(m['tpot_ms']['p50']) + '/' + _ms(m['tpot_ms']['p99']):>16} "
                         f"{m['goodput_rps']:>8.2f}")
    for path in result.get("plots", []):
        lines.append(f"plot: {path}")
    lines.extend(_change_lines(result["runs"]))
    lines.extend(f"warning: {w['message']}" for w in result.get("warnings", []))
    return "\n".join(lines)


def _class_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Deadline attainment and goodput per request class, where the workload has classes."""
    lines = []
    for run in runs:
        classes = run["metrics"].get("by_class") or {}
        if len(classes) < 2 and all(c["deadline_attainment"] is None for c in classes.values()):
            continue
        lines.append(f"{run['config']} by request class: " + "; ".join(
            f"{name} {c['num_requests']} requests, deadlines met {_pct(c['deadline_attainment'])}, "
            f"goodput {c['goodput_rps']:.2f} req/s" for name, c in classes.items()))
    return lines


def _change_lines(runs: list[dict[str, Any]]) -> list[str]:
    """One line per config after the first: what it changed relative to the first."""
    lines = []
    for run in runs[1:]:
        if "changes" in run:
            changed = ", ".join(run["changes"]) or "nothing (the same settings as the first config)"
            lines.append(f"{run['config']} changes relative to {runs[0]['config']}: {changed}")
    return lines
