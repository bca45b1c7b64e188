"""Before and after in one run: an older commit's engine against this checkout's, on the
speed workload, alternating fresh processes so both see the same machine.

    python examples/measurements/before_after.py --before bc08919 --rounds 3
    python examples/measurements/before_after.py --before 463142b --model ../peers/smollm2-hf --dtypes bfloat16

The older commit is exported (`git archive`) into a temporary directory laid out as the
installed package (each folder where that commit's pyproject.toml maps a package: core/
or core/engine/ as servelab/, plugins/ as servelab/plugins/, ...) and put first on
PYTHONPATH for its processes; the installed entry points then load its plugins. Each
process builds its kernels if needed, warms up, generates the workload once (output
tokens/s) and one 64-token batch-1 request three times (median TPOT). Prints each round
and the ratio of the medians.

With `--model DIR` (an HF checkpoint) the workload is instead the server's at saturation
(examples/measurements/server_vs_vllm.py): the server's engine settings, 96 random
128-token prompts at once, 64 tokens each sampled as `vllm bench serve` asks (temperature
1); besides the throughput, the mean time of the prompt steps and of the decode steps, and
the decode steps' sampling time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

CHILD = r'''
import json, sys, time
from servelab import LLM, SamplingParams
from servelab.workload import build_workload
llm = LLM("builtin:tiny-random", dtype=sys.argv[1], max_model_len=512, max_num_seqs=64,
          max_num_batched_tokens=2048, **{"attention.name": "cpu-paged", "attention.build": "wait"})
requests = list(build_workload("skewed:num_requests=64", 8192).requests)
params = lambda rs: [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in rs]
warm = sorted(requests, key=lambda r: -len(r.prompt_token_ids))[:8]
llm.generate([list(r.prompt_token_ids) for r in warm], params(warm))
start = time.perf_counter()
outputs = llm.generate([list(r.prompt_token_ids) for r in requests], params(requests))
throughput = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
prompt = [(7 * i) % 8000 + 3 for i in range(128)]
tpots = []
for _ in range(3):
    out = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    tpots.append((out.metrics.e2e_latency - out.metrics.ttft) / 63 * 1000)
print("RESULT", json.dumps({"throughput": throughput, "tpot_ms": sorted(tpots)[1]}))
'''

SERVING_CHILD = r'''
import json, sys, time, torch
import servelab
from servelab import LLM, SamplingParams
from servelab.cli import serving_config_for
config = serving_config_for(sys.argv[2], ["--set", f"engine.dtype={sys.argv[1]}", "--set", "attention.build=wait"])
llm = LLM(config=config)
generator = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, llm.engine.model_config.vocab_size, (128,), generator=generator).tolist() for _ in range(96)]
llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True))
reports = []
class Steps:
    @servelab.hookimpl
    def servelab_step_finished(self, engine, report):
        reports.append(report)
llm.engine.registry.register(Steps())
start = time.perf_counter()
outputs = llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
throughput = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
step_ms = lambda steps, field: 1000 * sum(getattr(r, field) for r in steps) / max(len(steps), 1)
prompt_steps = [r for r in reports if r.num_scheduled_tokens > r.num_seqs]
decode_steps = [r for r in reports if r.num_scheduled_tokens == r.num_seqs]
total = lambda r: r.schedule_seconds + r.prepare_seconds + r.forward_seconds + r.sample_seconds + r.update_seconds
print("RESULT", json.dumps({"throughput": throughput,
                            "prompt_step_ms": 1000 * sum(map(total, prompt_steps)) / max(len(prompt_steps), 1),
                            "decode_step_ms": 1000 * sum(map(total, decode_steps)) / max(len(decode_steps), 1),
                            "decode_sample_ms": step_ms(decode_steps, "sample_seconds")}))
'''


def export_as_package(commit: str, target: Path) -> None:
    """The commit's packages laid out as the `servelab` package under target."""
    source = target / "source"
    source.mkdir()
    archive = subprocess.run(["git", "archive", commit, "core", "plugins", "pyproject.toml"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package_dir = tomllib.loads((source / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dir.items(), key=lambda item: item[0].count(".")):
        shutil.copytree(source / folder, target.joinpath(*package.split(".")), dirs_exist_ok=True)


def run(dtype: str, pythonpath: str | None, kernels: Path, model: str | None = None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # Each side keeps its kernels in a cache of its own: their sources sit at different
    # paths, so one shared cache would be rebuilt at every switch.
    env["TORCH_EXTENSIONS_DIR"] = str(kernels)
    command = [sys.executable, "-c", CHILD, dtype] if model is None else [sys.executable, "-c", SERVING_CHILD, dtype, model]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(f"the {'before' if pythonpath else 'after'} process failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the older commit (anything git archive accepts)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--model", help="an HF checkpoint: measure the server's workload on it instead (see above)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as overlay:
        export_as_package(args.before, Path(overlay))
        for dtype in args.dtypes.split(","):
            results: dict[str, list[dict]] = {"before": [], "after": []}
            for round_ in range(args.rounds):
                for name, path in (("before", overlay), ("after", None)):
                    results[name].append(run(dtype, path, Path(overlay) / f"kernels-{name}", args.model))
                    print(f"{dtype} round {round_ + 1} {name}: " + _described(results[name][-1]), flush=True)
            for field in results["before"][0]:
                values = {name: [r[field] for r in runs] for name, runs in results.items()}
                before, after = statistics.median(values["before"]), statistics.median(values["after"])
                print(f"{dtype} {field}: {before:.2f} ({min(values['before']):.2f}-{max(values['before']):.2f}) -> "
                      f"{after:.2f} ({min(values['after']):.2f}-{max(values['after']):.2f}), {after / before:.2f}x")


def _described(result: dict) -> str:
    return ", ".join(f"{field} {value:.2f}" for field, value in result.items())


if __name__ == "__main__":
    main()
