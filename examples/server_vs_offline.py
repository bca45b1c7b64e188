"""Server throughput against offline `LLM.generate` on the same requests, in one run.

    python examples/server_vs_offline.py --model builtin:tiny --streams 100 --max-tokens 64 --repeats 3

Starts `servelab serve --port 0` on 127.0.0.1, sends `--streams` concurrent streaming
completions (ignore_eos, greedy) `--repeats` times, and after each server run the same prompts and parameters through
`LLM.generate` in this process (interleaved, so both see the same machine load). Prints
output tokens per second of every run, the median and range of each, and the ratio of
each pair (server / offline). Both sides use the same engine settings (--set) and the
same number of torch threads (--engine-threads); `--default-threads-too` also runs
offline with torch's default thread count and reports it beside.

The load generator shares the machine with the server, so its CPU time is reported too:
client CPU seconds per wall second of a server run (1.0 = one core busy), and the
server's (its front-end process and the engine process together).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from load_test import start_server, stop_server  # noqa: E402

import torch  # noqa: E402

from servelab.server.loadgen import make_prompts, run_load  # noqa: E402
from servelab.server.serve import default_engine_threads  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine-threads", type=int, default=default_engine_threads(),
                        help="torch threads of the server's engine process and of the offline engine "
                             "(default: as `servelab serve`, every core)")
    parser.add_argument("--default-threads-too", action="store_true",
                        help="also run offline with torch's default thread count each repeat (slow where the "
                             "cores are shared: torch's threads then wait for each other)")
    args = parser.parse_args()
    args.max_waiting, args.api_key = max(256, args.streams), None

    process, url, _ = start_server(args)
    server, offline, offline_default, client_cpu, server_cpu = [], [], [], [], []
    default_threads = torch.get_num_threads()
    try:  # interleaved, so that both sides see the same machine load
        _server_run(url, args)  # warm-up
        for _ in range(args.repeats):
            client_started, server_started = time.process_time(), _tree_cpu(process.pid)
            wall_started = time.perf_counter()
            server.append(_server_run(url, args))
            wall = time.perf_counter() - wall_started
            client_cpu.append((time.process_time() - client_started) / wall)
            server_cpu.append((_tree_cpu(process.pid) - server_started) / wall)
            torch.set_num_threads(args.engine_threads)
            offline.append(_offline_run(args))  # the server is idle meanwhile
            torch.set_num_threads(default_threads)
            if args.default_threads_too:
                offline_default.append(_offline_run(args))
    finally:
        code = stop_server(process)
    ratios = [s / o for s, o in zip(server, offline)]
    print(f"{args.streams} streams x {args.max_tokens} tokens, model {args.model}, settings {args.assignments}")
    print(f"server  tok/s: {_spread(server)}  (exit code after SIGTERM: {code})")
    print(f"offline tok/s: {_spread(offline)}  ({args.engine_threads} torch threads, as the server's engine)")
    if offline_default:
        print(f"offline tok/s: {_spread(offline_default)}  ({default_threads} torch threads, torch's default)")
    print(f"CPU cores busy during the server runs: client {_spread(client_cpu, 2)}; "
          f"server {_spread(server_cpu, 2)}")
    print(f"server / offline, run by run: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
          f"max {max(ratios):.2f}; runs {', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


def _server_run(url: str, args: argparse.Namespace) -> float:
    report = asyncio.run(run_load(url, args.streams, args.streams, args.max_tokens, timeout=600))
    if report.errors:
        raise SystemExit(f"the server run had errors: {report.errors}")
    return report.output_tokens / report.seconds


_LLM = None


def _offline_run(args: argparse.Namespace) -> float:
    global _LLM
    from servelab import LLM, SamplingParams

    if _LLM is None:
        overrides = dict(a.split("=", 1) for a in args.assignments)
        _LLM = LLM(args.model, **{k: _value(v) for k, v in overrides.items()})
    prompts = make_prompts(args.streams)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    started = time.perf_counter()
    outputs = _LLM.generate(prompts, params)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def _value(text: str) -> object:
    return int(text) if text.isdigit() else text


def _spread(values: list[float], digits: int = 0) -> str:
    runs = ", ".join(f"{v:.{digits}f}" for v in values)
    return (f"median {statistics.median(values):.{digits}f} (min {min(values):.{digits}f}, "
            f"max {max(values):.{digits}f}; runs {runs})")


def _tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    total, frontier = 0.0, [pid]
    while frontier:
        current = frontier.pop()
        total += stats.get(current, (0, 0.0))[1]
        frontier.extend(child for child, (parent, _) in stats.items() if parent == current)
    return total


if __name__ == "__main__":
    sys.exit(main())
