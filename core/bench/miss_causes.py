"""Why a request missed its SLO, read from the engine's own records of the run.

A request *misses* when its TTFT or TPOT is over the bench's SLO (`--slo-ttft-ms`,
`--slo-tpot-ms`) or it finished after its deadline. The time that counts is its window:
arrival to first token for a TTFT miss, first token to finish for a TPOT miss, arrival to
finish for a deadline miss (the union where several missed). Every step of its replica
that overlaps the window (StepTrace: who ran, how many tokens, which were prefill, who
was preempted) charges the overlap to one cause:

- `preempted`: the request had been preempted (recompute) and had not yet caught up:
  waiting to resume, then recomputing what was discarded.
- `starved`: it was waiting for its first step after a request that arrived later had
  been admitted ahead of it (a priority, shortest-job or deadline order; or a later
  request that fitted where it did not).
- `behind_prefill`: another request's prefill ran while it waited, or in the step it
  was part of (a long prompt stalls the decodes batched with it); the step's time is
  shared by tokens, the prefill tokens' share charged here.
- `queued_full`: it waited while only decodes ran (no slot, KV room or token budget
  left for it): the rest of a waiting step's share.
- `slow_steps`: the steps it ran in took long (a large batch, its own long prompt): the
  rest of a step it was part of.

The first four are delays: time the request would not have lost under another decision.
When they add up to at least what the request missed by (TTFT over its bound, TPOT over
its bound times its gaps, finish after its deadline; the largest where several missed),
the cause named is the delay charged the most (ties: the order above); otherwise even
without them it would have missed, and the cause is `slow_steps`. `seconds` holds what
each cause was charged.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, defaultdict
from typing import Any

from servelab.bench.driver import RunRecord, StepTrace

CAUSES = ("preempted", "starved", "behind_prefill", "queued_full", "slow_steps")
LABELS = {"preempted": "preempted", "starved": "starved", "behind_prefill": "queued behind a prefill",
          "queued_full": "waited for room", "slow_steps": "slow steps"}


def missed_metrics(row: dict[str, Any], slo: Any) -> list[str]:
    """Which of ttft, tpot, deadline a per-request record missed."""
    missed = []
    if row["ttft_ms"] is not None and row["ttft_ms"] > slo.ttft_ms:
        missed.append("ttft")
    if row["tpot_ms"] is not None and row["tpot_ms"] > slo.tpot_ms:
        missed.append("tpot")
    if row["deadline_met"] is False:
        missed.append("deadline")
    return missed


def classify_misses(record: RunRecord, rows: list[dict[str, Any]], slo: Any) -> list[dict[str, Any] | None]:
    """Per request (in workload order), None if it met its SLO, else {"missed": [...],
    "cause": name, "seconds": {cause: seconds charged}}."""
    missed = {index: missed_metrics(row, slo) for index, row in enumerate(rows)}
    missed = {index: names for index, names in missed.items() if names}
    out: list[dict[str, Any] | None] = [None] * len(rows)
    if not missed or not record.step_traces:
        return out
    replica_of = record.replica_of or (0,) * len(rows)
    overtaken = _overtaken_at(record, replica_of)
    for replica, traces in enumerate(record.step_traces):
        mine = {index: names for index, names in missed.items() if replica_of[index] == replica}
        if not mine:
            continue
        index_of = {record.outputs[index].request_id: index for index in mine}
        totals, presence, preemptions = _scan(traces, index_of)
        starts = [trace.start for trace in traces]
        for index, names in mine.items():
            seconds = _charge(record.outputs[index].metrics, names, traces, starts, totals, presence[index],
                              preemptions[index], overtaken[index])
            out[index] = {"missed": names, "cause": _cause(seconds, _excess(rows[index], names, slo)),
                          "seconds": seconds}
    return out


def with_miss_causes(record: RunRecord, rows: list[dict[str, Any]], slo: Any) -> dict[str, Any]:
    """Adds `missed` (the metrics it missed), `miss_cause` and `miss_ms` (the milliseconds
    charged to each cause) to each per-request record; returns the run's summary."""
    classified = classify_misses(record, rows, slo)
    for row, entry in zip(rows, classified):
        row["missed"] = [] if entry is None else entry["missed"]
        row["miss_cause"] = None if entry is None else entry["cause"]
        row["miss_ms"] = None if entry is None else {c: 1000 * s for c, s in entry["seconds"].items() if s}
    return summary(classified)


def _excess(row: dict[str, Any], names: list[str], slo: Any) -> float:
    """Seconds the request missed by: the most over any bound it missed."""
    over = []
    if "ttft" in names:
        over.append(row["ttft_ms"] / 1000 - slo.ttft_ms / 1000)
    if "tpot" in names:
        over.append((row["tpot_ms"] - slo.tpot_ms) / 1000 * max(row["output_tokens"] - 1, 1))
    if "deadline" in names:
        over.append(row["e2e_ms"] / 1000 - row["deadline_s"])
    return max(over)


def _cause(seconds: dict[str, float], excess: float) -> str:
    """The delay charged the most, if the delays cover the excess; else slow_steps."""
    delays = CAUSES[:-1]
    if sum(seconds[c] for c in delays) < excess or not any(seconds[c] for c in delays):
        return "slow_steps"
    return max(delays, key=lambda c: (seconds[c], -CAUSES.index(c)))


def summary(classified: list[dict[str, Any] | None]) -> dict[str, Any]:
    """{"num_missed": n, "causes": {cause: count}} over a run's requests."""
    counts = Counter(entry["cause"] for entry in classified if entry is not None)
    return {"num_missed": sum(counts.values()), "causes": {c: counts[c] for c in CAUSES if counts[c]}}


def summary_line(config: str, causes: dict[str, Any]) -> str | None:
    """"default: 12 missed their SLO: 7 queued behind a prefill, 3 preempted, 2 starved"."""
    if not causes or not causes["num_missed"]:
        return None
    parts = ", ".join(f"{n} {LABELS[c]}" for c, n in sorted(causes["causes"].items(), key=lambda kv: -kv[1]))
    return f"{config}: {causes['num_missed']} missed their SLO: {parts}"


def _request_id(sequence_id: str) -> str:
    return sequence_id.partition("#")[0]  # completion i > 0 of a request is "{request_id}#{i}"


def _scan(traces: tuple[StepTrace, ...], index_of: dict[str, int]):
    """One pass over the steps: each step's (tokens, prefill tokens); for each request of
    `index_of`, its {step: its prefill tokens there} and the steps that preempted it."""
    totals = []
    presence: dict[int, dict[int, int]] = defaultdict(dict)
    preemptions: dict[int, list[int]] = defaultdict(list)
    for number, trace in enumerate(traces):
        prefill = 0
        for sequence_id, num_new in trace.prefilling:
            prefill += num_new
            index = index_of.get(_request_id(sequence_id))
            if index is not None:
                presence[index][number] = presence[index].get(number, 0) + num_new
        for sequence_id in trace.decoding:
            index = index_of.get(_request_id(sequence_id))
            if index is not None:
                presence[index].setdefault(number, 0)
        for sequence_id in trace.preempted:
            index = index_of.get(_request_id(sequence_id))
            if index is not None:
                preemptions[index].append(number)
        totals.append((trace.num_scheduled_tokens, prefill))
    return totals, presence, preemptions


def _window(metrics: Any, names: list[str]) -> tuple[float, float]:
    first_token = metrics.first_token_time if metrics.first_token_time is not None else metrics.finish_time
    start = metrics.arrival_time if ("ttft" in names or "deadline" in names) else first_token
    end = first_token if names == ["ttft"] else metrics.finish_time
    return start, end


def _charge(metrics: Any, names: list[str], traces, starts: list[float], totals, presence: dict[int, int],
            preempted_at: list[int], overtaken_at: float | None) -> dict[str, float]:
    """Seconds of the request's window charged to each cause (module doc)."""
    seconds = dict.fromkeys(CAUSES, 0.0)
    start, end = _window(metrics, names)
    if start is None or end is None or end <= start:
        return seconds
    preempted_steps = set(preempted_at)
    catching_up = False
    # From its first preemption if that came before the window: it may still be catching up.
    first = min([max(bisect.bisect_right(starts, start) - 1, 0), *preempted_at])
    first_scheduled = metrics.first_scheduled_time
    for number in range(first, bisect.bisect_left(starts, end)):
        trace = traces[number]
        mine = presence.get(number)
        if number in preempted_steps:
            catching_up = True
        elif catching_up and mine == 0:
            catching_up = False  # decoding again: what was discarded is recomputed
        overlap = min(trace.end, end) - max(trace.start, start)
        if overlap <= 0:
            continue
        tokens, prefill = totals[number]
        if catching_up:
            seconds["preempted"] += overlap
        elif mine is None:
            waiting_first = first_scheduled is None or trace.start < first_scheduled
            if waiting_first and overtaken_at is not None and overtaken_at <= trace.end:
                seconds["starved"] += overlap
            else:
                share = prefill / tokens if tokens else 0.0
                seconds["behind_prefill"] += overlap * share
                seconds["queued_full"] += overlap * (1 - share)
        else:
            others_prefill = prefill - mine
            share = others_prefill / tokens if tokens else 0.0
            seconds["behind_prefill"] += overlap * share
            seconds["slow_steps"] += overlap * (1 - share)
    return seconds


def _overtaken_at(record: RunRecord, replica_of) -> list[float | None]:
    """Per request: the earliest time a request that arrived strictly later, on the same
    replica, was first scheduled before it; None if none was."""
    out: list[float | None] = [None] * len(record.outputs)
    groups: dict[int, list[int]] = defaultdict(list)
    for index, replica in enumerate(replica_of):
        groups[replica].append(index)
    for members in groups.values():
        metrics = {index: record.outputs[index].metrics for index in members}
        order = sorted(members, key=lambda index: metrics[index].arrival_time, reverse=True)
        earliest_later = None  # min first-scheduled time over the arrivals strictly after
        for _, group in itertools.groupby(order, key=lambda index: metrics[index].arrival_time):
            same = list(group)
            for index in same:
                scheduled = metrics[index].first_scheduled_time
                if earliest_later is not None and (scheduled is None or earliest_later < scheduled):
                    out[index] = earliest_later
            times = [metrics[index].first_scheduled_time for index in same]
            earliest_later = min((t for t in (*times, earliest_later) if t is not None), default=None)
    return out
