"""One record per request of a run (the `requests` list of `servelab bench --json`), and
what the records add up to per request class: deadline attainment and goodput."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from servelab.bench.driver import RunRecord

UNCLASSIFIED = "all"  # the class of requests whose workload gave them none


def request_records(record: RunRecord) -> list[dict[str, Any]]:
    """Per request, in workload order: when it arrived (seconds after the run started),
    its lengths, latencies (ms), preemptions and the computed tokens they discarded, the
    replica that served it, the prompt tokens the prefix cache held when it was first
    scheduled, and its deadline and whether it finished within it."""
    out = []
    for index, output in enumerate(record.outputs):
        request = record.requests[index] if record.requests else None
        metrics, deadline = output.metrics, None if request is None else request.deadline
        e2e, ttft, tpot = metrics.e2e_latency, metrics.ttft, output.tpot
        out.append({
            "index": index,
            "request_id": output.request_id,
            "request_class": None if request is None else request.request_class,
            "arrival_s": metrics.arrival_time - record.start_time,
            "prompt_tokens": len(output.prompt_token_ids),
            "output_tokens": len(output.token_ids),
            "ttft_ms": None if ttft is None else 1000 * ttft,
            "tpot_ms": None if tpot is None else 1000 * tpot,
            "e2e_ms": None if e2e is None else 1000 * e2e,
            "preemptions": metrics.num_preemptions,
            "discarded_tokens": metrics.num_discarded_tokens,
            "replica": record.replica_of[index] if record.replica_of else 0,
            "prefix_hit_tokens": metrics.num_cached_tokens,
            "deadline_s": deadline,
            "deadline_met": None if deadline is None else e2e is not None and e2e <= deadline,
        })
    return out


def is_good(row: dict[str, Any], slo: Any) -> bool:
    """Goodput's test: within the TTFT and TPOT bounds, and within its deadline if it has one."""
    return ((row["ttft_ms"] or 0.0) <= slo.ttft_ms and (row["tpot_ms"] or 0.0) <= slo.tpot_ms
            and row["deadline_met"] is not False)


def attainment(rows: list[dict[str, Any]]) -> float | None:
    """The share of the requests with a deadline that met it (None: none had one)."""
    judged = [row["deadline_met"] for row in rows if row["deadline_met"] is not None]
    return sum(judged) / len(judged) if judged else None


def by_class(rows: list[dict[str, Any]], slo: Any, seconds: float) -> dict[str, dict[str, Any]]:
    """Per request class: requests, deadline attainment, goodput (req/s over the whole run)."""
    classes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        classes[row["request_class"] or UNCLASSIFIED].append(row)
    return {name: {"num_requests": len(members), "deadline_attainment": attainment(members),
                   "goodput_rps": sum(is_good(row, slo) for row in members) / seconds if seconds else 0.0}
            for name, members in sorted(classes.items())}
