"""What long prompts cost the requests around them: decode TPOT of the short requests
and TTFT of the long prompts, per config, on a long-burst workload.

    python examples/long_prompt_tpot.py \\
        --config examples/configs/continuous.toml --config examples/configs/chunked-prefill.toml \\
        --workload long-burst:num_long=4,long_len=4000,num_short=32,arrival=poisson,rate=1 \\
        --set engine.max_model_len=4608

Each config runs the workload the way `servelab bench` does (same driver, arrival times
honoured, repeats interleaved), after a warm-up on the first requests plus the longest
one, so that no config pays for its first very long prefill's allocations. `servelab bench`
reports TPOT over every request; here requests are split by prompt length (long: at
least --long-threshold tokens), because the figure that matters is how much the short,
decoding requests slow down while a long prompt is being prefilled, and what the long
prompts pay for it in TTFT. TPOT is per request (decode time over tokens after the
first); ITL is per token (the gap before each token after the first), which shows a
single long stall that a request's mean TPOT averages away.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import attrs

from servelab.bench.driver import RunRecord, StepRecorder, run_workload
from servelab.bench.metrics import percentiles
from servelab.config import EngineConfig
from servelab.engine import LLMEngine
from servelab.registry import PluginRegistry
from servelab.workload import Workload, build_workload


class TokenTimes:
    """The engine, seen through the bench driver, with the time every token came out."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.times: dict[str, list[float]] = {}  # request id -> time of each token

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        result = self._engine.step()
        now = self._engine.clock()
        for request_id in result.events:
            self.times.setdefault(request_id, []).append(now)
        return result


def build_engine(path: str, assignments: list[str]) -> tuple[TokenTimes, StepRecorder]:
    config = EngineConfig.load(path).with_set_options(assignments)
    registry = PluginRegistry.from_entry_points()
    recorder = StepRecorder()
    registry.register(recorder)
    engine = LLMEngine(config, registry)
    recorder.clock = engine.clock
    return TokenTimes(engine), recorder


def split_metrics(record: RunRecord, workload: Workload, long_threshold: int,
                  times: dict[str, list[float]]) -> dict:
    """TPOT and ITL of short requests, TTFT of both kinds, throughput and the longest step, in ms."""
    short_tpot, short_itl, short_ttft, long_ttft = [], [], [], []
    for request, output in zip(workload.requests, record.outputs):
        metrics = output.metrics
        if len(request.prompt_token_ids) >= long_threshold:
            long_ttft.append(1000 * metrics.ttft)
            continue
        short_ttft.append(1000 * metrics.ttft)
        num_tokens = len(output.token_ids)
        if num_tokens > 1:
            short_tpot.append(1000 * (metrics.finish_time - metrics.first_token_time) / (num_tokens - 1))
        stamps = times[output.request_id]
        short_itl.extend(1000 * (b - a) for a, b in zip(stamps, stamps[1:]))
    step_ms = [1000 * (r.schedule_seconds + r.prepare_seconds + r.forward_seconds + r.sample_seconds
                       + r.update_seconds) for _, r in record.steps]
    seconds = record.end_time - record.start_time
    return {
        "output_tokens_per_s": sum(len(o.token_ids) for o in record.outputs) / seconds,
        "short_tpot_ms": percentiles(short_tpot),
        "short_itl_ms": {**percentiles(short_itl), "max": max(short_itl, default=None)},
        "short_ttft_ms": percentiles(short_ttft),
        "long_ttft_ms": {"mean": statistics.fmean(long_ttft) if long_ttft else None,
                         "max": max(long_ttft, default=None)},
        "longest_step_ms": max(step_ms, default=None),
        "steps": len(step_ms),
        "preemptions": record.preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", dest="configs", action="append", required=True)
    parser.add_argument("--workload", default="long-burst:num_long=4,long_len=4000,num_short=32,"
                                              "arrival=poisson,rate=1")
    parser.add_argument("--set", dest="assignments", action="append", default=[])
    parser.add_argument("--long-threshold", type=int, default=1024, help="prompt tokens that make a request long")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()

    engines = {Path(path).stem: build_engine(path, args.assignments) for path in args.configs}
    vocab_size = min(engine.model_config.vocab_size for engine, _ in engines.values())
    workload = build_workload(args.workload, vocab_size)
    longest = max(workload.requests, key=lambda r: len(r.prompt_token_ids))
    warm_up = Workload("warm-up", (*workload.requests[:4], attrs.evolve(longest, arrival_time=0.0)))
    for name, (engine, recorder) in engines.items():  # excluded from every figure
        run_workload(engine, recorder, warm_up, name)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, (engine, recorder) in engines.items():  # interleaved
            engine.times.clear()
            record = run_workload(engine, recorder, workload, name)
            runs[name].append(split_metrics(record, workload, args.long_threshold, engine.times))
    result = {"workload": args.workload, "set": args.assignments, "runs": {}}
    for name, summaries in runs.items():
        ordered = sorted(summaries, key=lambda s: s["short_tpot_ms"]["p99"] or 0.0)
        result["runs"][name] = ordered[(len(ordered) - 1) // 2]  # the median run by short TPOT p99
    print(format_table(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


def format_table(result: dict) -> str:
    def joined(metric: str, *keys: str):
        return lambda m: "/".join(f"{m[metric][k]:.0f}" for k in keys)

    rows = [
        ("output tokens/s", lambda m: f"{m['output_tokens_per_s']:.1f}"),
        ("short TPOT p50/p90/p99 ms", joined("short_tpot_ms", "p50", "p90", "p99")),
        ("short ITL p50/p99/max ms", joined("short_itl_ms", "p50", "p99", "max")),
        ("short TTFT p50/p99 ms", joined("short_ttft_ms", "p50", "p99")),
        ("long TTFT mean/max ms", joined("long_ttft_ms", "mean", "max")),
        ("longest step ms", lambda m: f"{m['longest_step_ms']:.0f}"),
        ("steps", lambda m: str(m["steps"])),
        ("preemptions", lambda m: str(m["preemptions"])),
    ]
    names = list(result["runs"])
    cells = [[render(result["runs"][name]) for _, render in rows] for name in names]
    width = max(len(label) for label, _ in rows)
    widths = [max(len(name), *(len(c) for c in column)) for name, column in zip(names, cells)]
    lines = [f"workload {result['workload']}",
             " " * width + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths))]
    for index, (label, _) in enumerate(rows):
        lines.append(label.ljust(width) + "  " + "  ".join(c[index].rjust(w) for c, w in zip(cells, widths)))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
