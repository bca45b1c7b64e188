"""When a side-by-side comparison means nothing, say so.

Three findings, each a warning in the table and an entry of the JSON's `warnings`:

- `identical`: two configs made the same decision for every request (same admission,
  first-token and finish order, preemptions, discarded tokens, prefix hits, replica and
  output tokens; in a simulation the same timings too, to the digit). Whatever the second
  config changed, it changed nothing this workload exercised.
- `same_metrics`: a config equals the reference (the config named "default", else the
  first) on every metric that does not depend on the machine's noise.
- `lopsided`: one replica of a fleet took more than `imbalance_factor` times its even
  share of the requests (a router whose tie-break sends everything to replica 0 keeps its
  hit rate and loses its goodput).

`config_changes` names what each config changed relative to the first, for the summary
line each config gets.
"""

from __future__ import annotations

from typing import Any

from servelab.bench.driver import RunRecord
from servelab.bench.metrics import SLO
from servelab.bench.miss_causes import with_miss_causes
from servelab.bench.per_request import request_records

# Metrics fixed by the decisions alone (a real run's times move with the machine's load).
DECISION_METRICS = ("output_tokens", "steps", "preemptions", "discarded_tokens", "prefix_hit_rate",
                    "slot_steps_used", "slot_steps_wasted", "draft_tokens", "accepted_tokens", "kv_utilization",
                    "kv_waste_fraction", "swap_outs", "host_hit_blocks")
# Measured with the host's clock even in a simulation.
WALL_CLOCK_METRICS = ("stage_profile", "engine_overhead_ms_at_max_batch")
DEFAULT_IMBALANCE_FACTOR = 2.0


def _dense_ranks(values: list[Any]) -> list[int | None]:
    """Each value's position among the distinct values (requests of one step share a time)."""
    order = {value: rank for rank, value in enumerate(sorted({v for v in values if v is not None}))}
    return [None if v is None else order[v] for v in values]


def decision_signature(record: RunRecord, exact_times: bool) -> tuple:
    """What a run decided for each request, in a form two runs can be compared by."""
    metrics = [o.metrics for o in record.outputs]
    columns = [_dense_ranks([m.first_scheduled_time for m in metrics]),
               _dense_ranks([m.first_token_time for m in metrics]),
               _dense_ranks([m.finish_time for m in metrics])]
    rows = []
    for index, (output, m) in enumerate(zip(record.outputs, metrics)):
        row = (columns[0][index], columns[1][index], columns[2][index], tuple(output.token_ids), m.num_preemptions,
               m.num_discarded_tokens, m.num_cached_tokens, record.replica_of[index] if record.replica_of else 0)
        if exact_times:
            row += tuple(None if t is None else t - record.start_time
                         for t in (m.first_scheduled_time, m.first_token_time, m.finish_time))
        rows.append(row)
    return tuple(rows)


def _comparable(metrics: dict[str, Any], simulated: bool) -> dict[str, Any]:
    if simulated:
        return {k: v for k, v in metrics.items() if k not in WALL_CLOCK_METRICS}
    return {k: metrics.get(k) for k in DECISION_METRICS}


def annotate(result: dict[str, Any], configs: list[tuple[str, Any]], records: list[RunRecord],
             simulated: bool, imbalance_factor: float) -> dict[str, Any]:
    """`result` with each run's per-request records (with the cause of each SLO miss:
    servelab.bench.miss_causes) and changes relative to the first config, and the
    comparison's warnings (module doc)."""
    changes = config_changes(configs)
    slo = SLO(**result["slo"])
    misses = []
    for run, record in zip(result["runs"], records):
        run["changes"] = changes[run["config"]]
        run["requests"] = request_records(record)
        misses.append(with_miss_causes(record, run["requests"], slo))
    result["warnings"] = comparison_warnings([name for name, _ in configs], records,
                                             [run["metrics"] for run in result["runs"]], simulated, imbalance_factor)
    for run, summary in zip(result["runs"], misses):
        run["metrics"]["slo_misses"] = summary
    for run in result["runs"]:
        run["flags"] = sorted({w["kind"] for w in result["warnings"] if run["config"] in w["configs"]})
    return result


def comparison_warnings(names: list[str], records: list[RunRecord], metrics: list[dict[str, Any]],
                        simulated: bool, imbalance_factor: float = DEFAULT_IMBALANCE_FACTOR) -> list[dict[str, Any]]:
    """The findings (module doc) over the configs `names`, their chosen runs and metrics."""
    warnings: list[dict[str, Any]] = []
    signatures = [decision_signature(r, simulated) for r in records]
    identical: set[tuple[str, str]] = set()
    for later in range(1, len(names)):
        for earlier in range(later):
            if signatures[earlier] == signatures[later]:
                identical.add((names[earlier], names[later]))
                warnings.append(_identical(names[earlier], names[later], simulated))
                break
    reference = names.index("default") if "default" in names else 0
    for index, name in enumerate(names):
        pair = tuple(sorted((names[reference], name), key=names.index))
        if index == reference or pair in identical:
            continue
        if _comparable(metrics[index], simulated) == _comparable(metrics[reference], simulated):
            warnings.append({"kind": "same_metrics", "configs": [names[reference], name],
                             "message": f"config {name!r} equals {names[reference]!r} on every metric"
                             + (": whatever it changed made no measurable difference on this workload" if simulated
                                else " its decisions fix (steps, preemptions, discarded tokens, prefix hits, "
                                     "slot-steps, KV use): whatever it changed did not change what the engine "
                                     "did, only its speed could differ")})
    for name, m in zip(names, metrics):
        if "fleet" in m:
            warnings.extend(_lopsided(name, m["fleet"]["requests_per_replica"], imbalance_factor))
    return warnings


def _identical(first: str, second: str, simulated: bool) -> dict[str, Any]:
    if simulated:
        detail, verdict = "every request's timings, to the digit", "had no effect on this workload"
    else:
        detail = "the same admission, first-token and finish order"
        verdict = ("changed nothing the engine decided on this workload: the two columns differ in speed at "
                   "most (a kernel or dtype change), never in scheduling, preemption or caching")
    return {"kind": "identical", "configs": [first, second],
            "message": f"configs {first!r} and {second!r} produced identical per-request results ({detail}; "
                       f"same preemptions, discarded tokens, prefix hits and outputs): what {second!r} changes "
                       + verdict}


def _lopsided(name: str, counts: list[int], factor: float) -> list[dict[str, Any]]:
    total = sum(counts)
    if not total or len(counts) < 2:
        return []
    share = total / len(counts)
    busiest = max(range(len(counts)), key=counts.__getitem__)
    if counts[busiest] <= factor * share:
        return []
    return [{"kind": "lopsided", "configs": [name], "replica": busiest,
             "message": f"config {name!r}: replica {busiest} took {counts[busiest]} of {total} requests, "
                        f"{counts[busiest] / share:.1f}x its even share (over {factor:g}x): the fleet's figures "
                        "measure one replica, whatever the hit rate says"}]


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(configs: list[tuple[str, Any]]) -> dict[str, list[str]]:
    """Per config, the settings it changed relative to the first config ("section.key=value
    (first: value)"); empty for the first, and for a config that changes nothing."""
    first = _flatten(configs[0][1].to_dict())
    out = {}
    for name, config in configs:
        flat = _flatten(config.to_dict())
        changes = []
        for key in sorted(set(first) | set(flat)):
            if first.get(key, _UNSET) != flat.get(key, _UNSET):
                now = "unset" if key not in flat else repr(flat[key])
                was = "unset" if key not in first else repr(first[key])
                changes.append(f"{key}={now} ({configs[0][0]}: {was})")
        out[name] = changes
    return out


_UNSET = object()
