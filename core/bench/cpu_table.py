"""The CPU table: servelab's weight formats and llama.cpp on the same GGUF file and requests.

    servelab bench --model smollm2-135m --baseline llama.cpp [--llama-cpp-bin DIR] [--repeats 5]

Rows: batch-1 TPOT and TTFT (`prompt` tokens in, `output` out), then output tokens/s with 8
and 32 sequences of the same shape decoding at once. Columns: servelab with the file's
weights as int4 and int8 blocks (int8 activations, servelab.model.quantized_linear) and
dequantized to fp32 and bf16, then llama.cpp (llama_cpp_baseline.py; skipped with its reason
when absent). Repetitions alternate the engines (a drifting machine slows every column
alike); each cell is the median and the min-max over them. The header names the CPU, its
vector unit and the threads. Timings mean something only on a quiet machine.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from servelab.bench.llama_cpp_baseline import LlamaCppBaseline, LlamaCppFailed, LlamaCppMissing, Shape

VARIANTS = {"int4": ("int4", "float32"), "int8": ("int8", "float32"), "fp32": ("dequantize", "float32"),
            "bf16": ("dequantize", "bfloat16")}  # column -> ([engine] weights, [engine] dtype)
METRICS = ("tpot_ms", "ttft_ms")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def gguf_file(model: str) -> Path | None:
    """The GGUF file `model` names (a file, a folder holding one, or a named model), or None."""
    from servelab.model.gguf_checkpoint import find_gguf, is_gguf
    from servelab.model.loader import resolve_model

    path = resolve_model(model)
    path = find_gguf(path) or path if path.is_dir() else path
    return path if path.is_file() and is_gguf(path) else None


def measure_servelab(llm: Any, shape: Shape, vocab_size: int) -> dict[str, Any]:
    """The table's figures for one loaded engine, greedy, every request running to its length."""
    from servelab import SamplingParams

    params = SamplingParams(max_tokens=shape.output, temperature=0, ignore_eos=True)
    prompts = [[1 + (i * 7919 + s * 104729) % (vocab_size - 2) for i in range(shape.prompt)]
               for s in range(max(shape.batches, default=1))]
    single = llm.generate(prompts[:1], params)[0]
    rates = {}
    for n in shape.batches:
        start = time.perf_counter()
        outputs = llm.generate(prompts[:n], params)
        rates[n] = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
    return {"tpot_ms": single.tpot * 1000, "ttft_ms": single.metrics.ttft * 1000, "output_tokens_per_s": rates}


def run_cpu_table(model: str, repeats: int = 3, shape: Shape = Shape(), variants: tuple[str, ...] = tuple(VARIANTS),
                  llama_cpp_bin: str | None = None, engine_options: dict[str, Any] | None = None,
                  progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Every column's figures over `repeats` alternating repetitions (after one warm-up each)."""
    from servelab import LLM

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown servelab columns {unknown}; the table has {', '.join(VARIANTS)}")
    threads = torch.get_num_threads()
    options = {"max_model_len": shape.prompt + shape.output, "max_num_seqs": max(shape.batches, default=1),
               "max_num_batched_tokens": max(2048, shape.prompt), "attention.name": "cpu-paged",
               "attention.build": "wait", **(engine_options or {})}
    columns: dict[str, Callable[[], dict[str, Any]]] = {}
    for name in variants:
        weights, dtype = VARIANTS[name]
        llm = LLM(model, weights=weights, dtype=dtype, **options)
        vocab = llm.engine.model_config.vocab_size
        columns[name] = lambda llm=llm, vocab=vocab: measure_servelab(llm, shape, vocab)
    skipped = {}
    path = gguf_file(model)
    try:
        if path is None:
            raise LlamaCppMissing(f"llama.cpp reads GGUF files; {model!r} is not one")
        baseline = LlamaCppBaseline(str(path), threads, shape, llama_cpp_bin)
        columns[baseline.name] = baseline.measure
    except LlamaCppMissing as exc:
        skipped["llama.cpp"] = str(exc)
    for name, measure in columns.items():  # warm-up: kernels handed out, oneDNN's kernels generated
        if name in VARIANTS:
            measure()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in columns}
    for repeat in range(repeats):
        for name, measure in columns.items():
            try:
                runs[name].append(measure())
            except LlamaCppFailed as exc:
                skipped[name] = str(exc)
        for name in skipped:
            runs.pop(name, None)
            columns.pop(name, None)
        progress(f"repetition {repeat + 1}/{repeats} done")
    return {"cpu": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(), "threads": threads,
            "model": model, "gguf": str(path) if path else None,
            "shape": {"prompt": shape.prompt, "output": shape.output, "batches": list(shape.batches)},
            "repeats": repeats, "columns": runs, "skipped": skipped}


def _cell(values: list[float | None], digits: int) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def format_cpu_table(result: dict[str, Any]) -> str:
    shape = result["shape"]
    names = list(result["columns"])
    lines = [f"{result['cpu']} ({result['capability']}), {result['threads']} threads; {result['model']}; "
             f"{shape['prompt']} tokens in, {shape['output']} out; median (min-max) of {result['repeats']} "
             f"alternating repetitions"]
    rows = [("batch-1 TPOT ms", lambda run: run["tpot_ms"], 2),
            (f"TTFT ms ({shape['prompt']}-token prompt)", lambda run: run["ttft_ms"], 1)]
    rows += [(f"{n} sequences, output tok/s", lambda run, n=n: run["output_tokens_per_s"].get(n), 0)
             for n in shape["batches"]]
    cells = [[label] + [_cell([pick(run) for run in result["columns"][name]], digits) for name in names]
             for label, pick, digits in rows]
    header = [""] + [f"servelab {name}" if name in VARIANTS else name for name in names]
    widths = [max(len(row[i]) for row in [header] + cells) for i in range(len(header))]
    for row in [header] + cells:
        lines.append("  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)))
    for name, reason in result["skipped"].items():
        lines.append(f"{name}: skipped: {reason}")
    return "\n".join(lines)
