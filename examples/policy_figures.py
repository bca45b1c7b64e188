"""The policy kit's seams, each shown to matter, in one run: three tables.

    python examples/policy_figures.py                  # all three: real runs + simulated (a few minutes)
    python examples/policy_figures.py --quick          # tiny sizes, a smoke run of seconds
    python examples/policy_figures.py --only eviction --mode sim

1. Eviction policies (`[eviction] name`, radix allocator) on many system prompts in
   multi-turn conversations whose working set is about twice the KV pool, with a scan
   (one-off long prompts) in the middle: prefix hit rate, TTFT p50/p99, throughput.
2. Preemption victims (`[scheduler] preemption`, continuous) on a memory-pressured
   skewed workload: preemptions, throughput, TTFT p99 and TPOT p99.
3. SJF (servelab-sjf) against FCFS (continuous) on long-tailed outputs: TTFT p50/p99,
   e2e p50/p99, throughput.

Every table is measured with `servelab bench` twice: real runs on `builtin:tiny-random`
(this CPU) and simulated on a GPU model (`--sim h100 --sim-model llama-3-8b`, bigger
workloads). Each bench call compares the table's configs in one process, interleaved.
The SJF table needs servelab-sjf installed (`pip install -e examples/servelab-sjf`).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from servelab.workload import BenchRequest, Workload, conversations, skewed

EVICTIONS = ("lru", "lfu", "slru", "waiting-aware")
VICTIMS = ("newest", "fewest-computed-tokens", "most-kv-blocks", "lowest-priority-then-newest")
VOCAB = 8192  # builtin:tiny-random's; the simulator takes any ids
REAL = ["--model", "builtin:tiny-random"]
SIM = ["--sim", "h100", "--sim-model", "llama-3-8b"]


def eviction_workload(path: Path, *, system_prompts: int, system_len: int, conversations_n: int, scan: int,
                      scan_len: int, output_len: int, conversation_rate: float) -> str:
    """Conversations over many system prompts, plus a scan of one-off prompts arriving
    while they run; written as JSONL for `file:`."""
    rng = random.Random(0)
    requests = conversations(rng, VOCAB, num_system_prompts=system_prompts, system_len=system_len,
                             num_conversations=conversations_n, num_turns=3, user_len=32, answer_len=32,
                             output_len=output_len, conversation_rate=conversation_rate, turn_gap_s=1.0)
    middle = requests[len(requests) // 2].arrival_time
    requests += [BenchRequest([rng.randrange(VOCAB) for _ in range(scan_len)], output_len,
                              arrival_time=round(middle + 0.01 * i, 6)) for i in range(scan)]
    Workload("eviction", tuple(sorted(requests, key=lambda r: r.arrival_time))).save(path)
    return f"file:{path}"


def write_configs(folder: Path, name: str, sections: dict[str, dict[str, str]]) -> list[str]:
    """One TOML file per variant (`label -> {"section.key": value}`), named by the label."""
    paths = []
    for label, values in sections.items():
        by_section: dict[str, list[str]] = {}
        for dotted, value in values.items():
            section, key = dotted.split(".")
            by_section.setdefault(section, []).append(f"{key} = {json.dumps(value)}")
        path = folder / f"{label}.toml"
        path.write_text("\n\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in by_section.items()) + "\n")
        paths.append(str(path))
    return paths


def bench(configs: list[str], workload: str, mode: list[str], sets: list[str], out: Path) -> list[dict]:
    command = [sys.executable, "-m", "servelab.cli", "bench", *mode, "--workload", workload, "--json", str(out)]
    for config in configs:
        command += ["--config", config]
    for assignment in sets:
        command += ["--set", assignment]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode or not out.exists():
        raise SystemExit(f"bench failed ({' '.join(command)}):\n{result.stderr[-2000:]}")
    return json.loads(out.read_text())["runs"]


def table(title: str, runs: list[dict], columns: list[tuple[str, callable]]) -> str:
    lines = [f"\n{title}\n", "| config | " + " | ".join(c for c, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for run in runs:
        m = {**run["metrics"], "repeats": run.get("repeats_output_tokens_per_s") or []}
        lines.append(f"| {Path(run['config']).stem} | " + " | ".join(f(m) for _, f in columns) + " |")
    return "\n".join(lines)


def spread(m: dict) -> str:
    """The min-max of the repeats' throughputs (one run: its value)."""
    values = m["repeats"] or [m["output_tokens_per_s"]]
    return f"{min(values):.1f}-{max(values):.1f}"


def ms(metric: str, q: str):
    return lambda m: f"{m[metric][q]:.0f}"


THROUGHPUT = ("output tok/s", lambda m: f"{m['output_tokens_per_s']:.1f}")
SPREAD = ("tok/s min-max", lambda m: spread(m))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--only", choices=("eviction", "victims", "sjf"), action="append")
    parser.add_argument("--mode", choices=("real", "sim"), action="append")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of the real runs, configs interleaved (the simulator is deterministic: 1)")
    args = parser.parse_args()
    figures = args.only or ["eviction", "victims", "sjf"]
    modes = args.mode or ["real", "sim"]
    q = args.quick
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for mode_name in modes:
            real = mode_name == "real"
            mode = [*REAL, "--repeats", str(args.repeats)] if real else [*SIM, "--repeats", "1"]
            where = "builtin:tiny-random, this CPU" if real else "simulated H100, llama-3-8b"
            if "eviction" in figures:
                # Pool: num_kv_blocks x 16 tokens; system prompts alone are about twice that.
                blocks, system_len = ((24, 64) if q else (128, 256)) if real else ((40, 128) if q else (2048, 2048))
                system_prompts = 2 * blocks * 16 // system_len
                # Conversations arrive near capacity: far below it no policy changes TTFT, far
                # above it queueing alone sets TTFT (the simulated H100 saturates past ~12/s).
                workload = eviction_workload(
                    folder / f"eviction-{mode_name}.jsonl", system_prompts=system_prompts, system_len=system_len,
                    conversations_n=(6 if q else 48) if real else (12 if q else 600), scan=4 if q else 16,
                    scan_len=system_len, output_len=(4 if q else 16) if real else (8 if q else 64),
                    conversation_rate=12.0 if real else 10.0)
                configs = write_configs(folder, "eviction", {
                    f"eviction-{name}": {"allocator.name": "radix", "eviction.name": name} for name in EVICTIONS})
                runs = bench(configs, workload, mode, [f"engine.num_kv_blocks={blocks}", "engine.block_size=16",
                                                       f"engine.max_model_len={4 * system_len}"],
                             folder / "eviction.json")
                print(table(f"Eviction policies, radix, {blocks} KV blocks ({where})", runs, [
                    ("prefix hit rate", lambda m: f"{100 * m['prefix_hit_rate']:.1f}%"),
                    ("TTFT p50 ms", ms("ttft_ms", "p50")), ("TTFT p99 ms", ms("ttft_ms", "p99")), THROUGHPUT,
                    SPREAD]))
            if "victims" in figures:
                n, blocks = ((12, 20) if q else (64, 48)) if real else ((24, 300) if q else (1000, 1500))
                configs = write_configs(folder, "victims", {
                    f"victim-{name}": {"scheduler.name": "continuous", "scheduler.preemption": name}
                    for name in VICTIMS})
                workload = f"skewed:num_requests={n},mean_prompt_len=64,mean_output_len={32 if real else 256}," \
                           f"max_len={256 if real else 4096}"
                runs = bench(configs, workload, mode, [f"engine.num_kv_blocks={blocks}", "engine.block_size=16",
                                                       f"engine.max_model_len={256 if real else 4096}"],
                             folder / "victims.json")
                print(table(f"Preemption victims, continuous, {blocks} KV blocks ({where})", runs, [
                    ("preemptions", lambda m: str(m["preemptions"])),
                    ("tokens discarded", lambda m: str(m["discarded_tokens"])), THROUGHPUT, SPREAD,
                    ("TTFT p99 ms", ms("ttft_ms", "p99")), ("TPOT p99 ms", ms("tpot_ms", "p99"))]))
            if "sjf" in figures:
                n = (8 if q else 32) if real else (100 if q else 2000)
                configs = write_configs(folder, "sjf", {"fcfs-continuous": {"scheduler.name": "continuous"},
                                                        "sjf": {"scheduler.name": "sjf"}})
                # At 40 requests/s the simulated H100 runs at about 90% of capacity: a queue forms
                # for SJF to reorder (at 34/s it rarely does; at 48/s FCFS TTFT is all queueing).
                workload = (f"skewed:num_requests={n},mean_prompt_len=64,mean_output_len=64,sigma=1.2,max_len=512"
                            if real else f"skewed:num_requests={n},sigma=1.2,arrival=poisson,rate=40")
                runs = bench(configs, workload, mode, ["allocator.name=paged",
                                                       f"engine.max_num_seqs={4 if real else 32}"],
                             folder / "sjf.json")
                print(table(f"SJF vs FCFS, long-tailed outputs ({where})", runs, [
                    ("TTFT p50 ms", ms("ttft_ms", "p50")), ("TTFT p99 ms", ms("ttft_ms", "p99")),
                    ("e2e mean ms", ms("e2e_ms", "mean")), ("e2e p50 ms", ms("e2e_ms", "p50")),
                    ("e2e p99 ms", ms("e2e_ms", "p99")), THROUGHPUT, SPREAD]))


if __name__ == "__main__":
    main()
