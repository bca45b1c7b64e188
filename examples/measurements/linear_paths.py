"""Where the linear layers run, compared on one model: the `cpu-paged` library's matmul
(`panel_linears = true`), oneDNN (`false`) and the default (`"auto"`), per dtype, in fresh
processes alternating round by round so that every configuration sees the same machine.

    python examples/measurements/linear_paths.py --model ../peers/smollm2-hf --rounds 3

Each process generates `--num-prompts` random prompts of `--input-len` tokens, `--output-len`
tokens each, all at once (output tok/s), then one request alone three times (median
batch-1 TTFT and TPOT). Prints every round and, per configuration, the median and range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r'''
import json, random, sys, time
from servelab import LLM, SamplingParams
model, dtype, panels, num_prompts, input_len, output_len = sys.argv[1:7]
panels = {"true": True, "false": False}.get(panels, panels)
llm = LLM(model, dtype=dtype, max_num_seqs=256, **{"attention.build": "wait", "attention.panel_linears": panels})
rng = random.Random(0)
prompts = [[rng.randrange(100, 30000) for _ in range(int(input_len))] for _ in range(int(num_prompts))]
params = SamplingParams(max_tokens=int(output_len), temperature=0, ignore_eos=True)
llm.generate(prompts[:8], params)
start = time.perf_counter()
outputs = llm.generate(prompts, params)
throughput = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
alone = []
for _ in range(3):
    metrics = llm.generate(prompts[:1], params)[0].metrics
    alone.append((metrics.ttft * 1000, (metrics.e2e_latency - metrics.ttft) / (int(output_len) - 1) * 1000))
ttft, tpot = sorted(a[0] for a in alone)[1], sorted(a[1] for a in alone)[1]
print("RESULT", json.dumps({"throughput": throughput, "ttft_ms": ttft, "tpot_ms": tpot}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--configs", default="bfloat16:auto,bfloat16:true,float32:auto,float32:false",
                        help="dtype:panel_linears pairs, comma-separated")
    args = parser.parse_args()
    configs = [tuple(pair.split(":")) for pair in args.configs.split(",")]
    results: dict[tuple[str, str], list[dict]] = {config: [] for config in configs}
    for round_index in range(1, args.rounds + 1):
        for dtype, panels in configs:
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, dtype, panels, str(args.num_prompts),
                                  str(args.input_len), str(args.output_len)], capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{dtype} panel_linears={panels} failed:\n{out.stderr[-3000:]}")
            result = json.loads(line.removeprefix("RESULT "))
            results[(dtype, panels)].append(result)
            print(f"round {round_index} {dtype} panel_linears={panels}: {result['throughput']:.0f} tok/s, "
                  f"batch-1 TTFT {result['ttft_ms']:.1f} ms, TPOT {result['tpot_ms']:.2f} ms", flush=True)
    for (dtype, panels), rows in results.items():
        summary = []
        for key, unit in (("throughput", "tok/s"), ("ttft_ms", "ms TTFT"), ("tpot_ms", "ms TPOT")):
            values = [row[key] for row in rows]
            summary.append(f"{statistics.median(values):.1f} {unit} ({min(values):.1f}-{max(values):.1f})")
        print(f"{dtype} panel_linears={panels}: " + ", ".join(summary))


if __name__ == "__main__":
    main()
