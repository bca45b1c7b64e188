"""Same-run cost of logits work on one engine: structured output, logprobs, the bitmask.

    nice -n 10 python examples/measurements/logits_overhead.py --repeats 5

Workloads A (plain greedy) and B (50% of requests carry a JSON schema, or every request
asks for 5 logprobs) alternate on one warm engine, so both see the same machine load;
the report gives the median output tokens/s of each, the ratio B/A per adjacent pair
(median and min-max), and the structured processor's bitmask cost per step at batch 64
beside a batch-64 decode forward timed in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servelab import LLM, SamplingParams, StructuredOutput
from servelab.bench.driver import StepRecorder, run_workload
from servelab.interfaces import ProcessorRequest
from servelab.workload import BENCH_SCHEMA, build_workload


def throughput(engine, recorder, spec: str) -> tuple[float, float]:
    """Output tokens/s, and the sampling stage's share of the steps' time (processors,
    bitmasks and logprobs run there: a share measured within one run, less exposed to
    the machine's load than the throughput)."""
    workload = build_workload(spec, engine.model_config.vocab_size)
    record = run_workload(engine, recorder, workload, spec)
    reports = [report for _, report in record.steps]
    sample = sum(r.sample_seconds for r in reports)
    total = sum(r.schedule_seconds + r.prepare_seconds + r.forward_seconds + r.sample_seconds + r.update_seconds
                for r in reports)
    return sum(len(o.token_ids) for o in record.outputs) / (record.end_time - record.start_time), sample / total


def compare(engine, recorder, base: str, variant: str, repeats: int) -> dict:
    throughput(engine, recorder, base)  # warm-up (and the grammar compiled once)
    throughput(engine, recorder, variant)
    a, b = [], []
    for _ in range(repeats):
        a.append(throughput(engine, recorder, base))
        b.append(throughput(engine, recorder, variant))
    ratios = [y[0] / x[0] for x, y in zip(a, b)]
    return {"base_tok_s": statistics.median(x for x, _ in a), "variant_tok_s": statistics.median(y for y, _ in b),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "base_sample_share": statistics.median(s for _, s in a),
            "variant_sample_share": statistics.median(s for _, s in b)}


def bitmask_cost(llm: LLM, batch: int, repeats: int) -> dict:
    engine = llm.engine
    processor = engine.logits_pipeline.processors["structured"]
    params = SamplingParams(max_tokens=64, structured=StructuredOutput.json(BENCH_SCHEMA))
    compiled = processor.prepare(params).result()
    states = [processor.new_state(ProcessorRequest(f"r{i}", params, (1,), compiled)) for i in range(batch)]
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    for i, state in enumerate(states):  # spread the matchers over the grammar: 0..7 tokens into it
        for _ in range(i % 8):
            processor.accept(state, int(processor.apply(torch.randn(1, vocab, generator=generator), [state]).argmax()))
    logits = torch.randn(batch, vocab, generator=generator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        processor.apply(logits.clone(), states)
        times.append(time.perf_counter() - start)
    # A batch-64 decode step's forward in the same run, for scale.
    prompts = [[5 + i, 7, 9] for i in range(batch)]
    forward = []

    def on_step(report):
        if report.num_seqs == batch and report.num_scheduled_tokens == batch:
            forward.append(report.forward_seconds)

    class Observer:
        from servelab import hookimpl

        @hookimpl
        def servelab_step_finished(self, engine, report):
            on_step(report)

    engine.registry.register(Observer(), name="bitmask-observer")
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.registry.manager.unregister(name="bitmask-observer")
    return {"bitmask_ms_median": 1000 * statistics.median(times), "bitmask_ms_min": 1000 * min(times),
            "bitmask_ms_max": 1000 * max(times), "decode_forward_ms_median": 1000 * statistics.median(forward)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workload", default="fixed:num_requests=32,prompt_len=64,output_len=96")
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=512, max_num_seqs=64)
    recorder = StepRecorder()
    llm.engine.registry.register(recorder, name="recorder")
    print(f"workload {args.workload}, {args.repeats} interleaved pairs", flush=True)
    bitmask = bitmask_cost(llm, 64, 50)
    print(f"bitmask at batch 64: {bitmask['bitmask_ms_median']:.2f} ms per step (min {bitmask['bitmask_ms_min']:.2f}, "
          f"max {bitmask['bitmask_ms_max']:.2f}); batch-64 decode forward {bitmask['decode_forward_ms_median']:.2f} ms",
          flush=True)
    for name, variant in (("50% JSON schema", "structured_fraction=0.5"), ("logprobs=5", "logprobs=5")):
        result = compare(llm.engine, recorder, args.workload, f"{args.workload},{variant}", args.repeats)
        print(f"{name:>16}: {result['variant_tok_s']:.0f} vs {result['base_tok_s']:.0f} output tok/s plain; "
              f"ratio {result['ratio_median']:.3f} (min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f}); "
              f"sampling stage {100 * result['variant_sample_share']:.1f}% of step time vs "
              f"{100 * result['base_sample_share']:.1f}%", flush=True)


if __name__ == "__main__":
    main()
