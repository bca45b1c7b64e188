"""`servelab bench`: a workload through servelab and, with --baseline hf, through
Hugging Face `generate` with static batches, in one process, side by side."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import structlog

from servelab.config import EngineConfig
from servelab.hookspecs import hookimpl
from servelab.registry import PluginRegistry
from servelab.sampling_params import SamplingParams
from servelab.workload import BenchRequest, SkewedWorkload

logger = structlog.get_logger(__name__)


class StepRecorder:
    """Observer plugin collecting every StepReport."""

    def __init__(self) -> None:
        self.reports: list[Any] = []

    @hookimpl
    def servelab_step_finished(self, engine, report):
        self.reports.append(report)


def run_servelab(config: EngineConfig, requests: list[BenchRequest], repeats: int) -> dict[str, Any]:
    from servelab.llm import LLM

    registry = PluginRegistry.from_entry_points()
    recorder = StepRecorder()
    registry.register(recorder)
    llm = LLM(config=config, registry=registry)
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    llm.generate(prompts[:4], params[:4])  # warm-up
    times = []
    for _ in range(repeats):
        recorder.reports.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    num_output = sum(len(o.token_ids) for o in outputs)
    full_batch = [r for r in recorder.reports if r.num_seqs >= min(len(requests), config.engine.max_num_seqs)]
    overhead = [r.overhead_seconds for r in full_batch] or [r.overhead_seconds for r in recorder.reports]
    return {
        "seconds": min(times),
        "output_tokens": num_output,
        "output_tokens_per_s": num_output / min(times),
        "steps": len(recorder.reports),
        "overhead_ms_median": 1000 * statistics.median(overhead),
        "overhead_steps": len(overhead),
        "schedule_ms_median": 1000 * statistics.median(r.schedule_seconds for r in full_batch or recorder.reports),
        "prepare_ms_median": 1000 * statistics.median(r.prepare_seconds for r in full_batch or recorder.reports),
        "update_ms_median": 1000 * statistics.median(r.update_seconds for r in full_batch or recorder.reports),
        "forward_ms_median": 1000 * statistics.median(r.forward_seconds for r in full_batch or recorder.reports),
    }


def run_hf_static(checkpoint_dir: str, dtype: str, requests: list[BenchRequest], batch_size: int,
                  repeats: int) -> dict[str, Any]:
    """HF `generate`, greedy, static batches of `batch_size` in arrival order, left padded.
    Each batch runs until its longest request is done; only requested tokens count."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=getattr(torch, dtype))
    model.eval()
    pad = 0

    def run_batch(batch: list[BenchRequest]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        longest = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad, eos_token_id=None)

    run_batch(requests[:4])  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            run_batch(requests[i : i + batch_size])
        times.append(time.perf_counter() - start)
    num_output = sum(r.max_tokens for r in requests)
    return {"seconds": min(times), "output_tokens": num_output, "output_tokens_per_s": num_output / min(times)}


def main_bench(config: EngineConfig, workload: SkewedWorkload, baseline: str | None, repeats: int,
               hf_batch_size: int | None) -> dict[str, Any]:
    from servelab.model.loader import Checkpoint

    checkpoint = Checkpoint.open(config.engine.model)
    requests = workload.requests(checkpoint.config.vocab_size)
    print(f"workload: {len(requests)} requests, prompt tokens {sum(len(r.prompt_token_ids) for r in requests)}, "
          f"output tokens {sum(r.max_tokens for r in requests)}", file=sys.stderr)
    results: dict[str, Any] = {}
    print("running servelab ...", file=sys.stderr)
    results["servelab"] = run_servelab(config, requests, repeats)
    if baseline == "hf":
        print("running hf-static ...", file=sys.stderr)
        results["hf-static"] = run_hf_static(str(checkpoint.path), config.engine.dtype, requests,
                                             hf_batch_size or config.engine.max_num_seqs, repeats)
        results["ratio"] = results["servelab"]["output_tokens_per_s"] / results["hf-static"]["output_tokens_per_s"]
    return results


def format_results(results: dict[str, Any]) -> str:
    lines = [f"{'engine':<12} {'seconds':>9} {'out tok/s':>10}"]
    for name in ("servelab", "hf-static"):
        if name in results:
            r = results[name]
            lines.append(f"{name:<12} {r['seconds']:>9.2f} {r['output_tokens_per_s']:>10.1f}")
    if "ratio" in results:
        lines.append(f"servelab / hf-static throughput: {results['ratio']:.2f}x")
    s = results["servelab"]
    lines.append(f"servelab per-step engine overhead (schedule + prepare + update), median over "
                 f"{s['overhead_steps']} steps at full batch: {s['overhead_ms_median']:.3f} ms "
                 f"(schedule {s['schedule_ms_median']:.3f}, prepare {s['prepare_ms_median']:.3f}, "
                 f"update {s['update_ms_median']:.3f}; forward {s['forward_ms_median']:.1f})")
    return "\n".join(lines)
