"""Time one attention layer (one backend.forward, cache write included) for a decode batch,
torch-paged against sdpa-contiguous on the same K/V.

Every backend gets the same K/V values, written through its own `forward` into its own
cache: sdpa-contiguous reads contiguous block tables (as the naive allocator gives them),
torch-paged shuffled ones (as a paged allocator gives them after some churn). Each timed
call is one decode step: every sequence writes its last token and attends over its whole
context. Backends run round-robin and each figure is the median over the rounds;
`prepare` (once per step, shared by every layer) is timed apart. The outputs of every
backend are checked against each other first.

    OMP_NUM_THREADS=1 python examples/attention_figures.py                      # tiny-random geometry
    OMP_NUM_THREADS=1 python examples/attention_figures.py --dtype float32,bfloat16 \\
        --before-module /tmp/torch_paged_before.py --json figures.json

--before-module times another torch-paged implementation (a file defining
TorchPagedAttention, e.g. `git show <commit>:plugins/kernels/torch_paged.py`) with the same
harness, tables and data, under the label "before".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
import types
from typing import Any, Callable

import torch

from servelab.interfaces import AttentionContext, AttentionMetadata
from servelab.plugins.kernels.options import TorchPagedOptions
from servelab.plugins.kernels.sdpa_contiguous import SdpaContiguousAttention
from servelab.plugins.kernels.torch_paged import TorchPagedAttention

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def metadata(tables: list[list[int]], query_lens: list[int], context_lens: list[int],
             block_size: int) -> AttentionMetadata:
    """A step's metadata laid out as the runner lays it out."""
    slots, starts = [], [0]
    for table, query_len, context_len in zip(tables, query_lens, context_lens):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context_len - query_len, context_len)]
        starts.append(starts[-1] + query_len)
    width = max(len(t) for t in tables)

    def tensor(values):
        return torch.tensor(values, dtype=torch.int64)

    return AttentionMetadata(
        query_start_loc=tensor(starts), query_lens=tensor(query_lens), context_lens=tensor(context_lens),
        block_tables=tensor([t + [0] * (width - len(t)) for t in tables]), slot_mapping=tensor(slots),
        max_query_len=max(query_lens), max_context_len=max(context_lens),
        query_lens_list=tuple(query_lens), context_lens_list=tuple(context_lens))


class Bench:
    """One backend, its cache filled with the shared K/V, ready to time decode steps."""

    def __init__(self, label: str, backend: Any, tables: list[list[int]], keys: torch.Tensor, values: torch.Tensor,
                 block_size: int) -> None:
        self.label, self.backend, self.tables = label, backend, tables
        batch, context = keys.shape[0], keys.shape[1]
        shape = backend.kv_cache_shape()
        self.key_cache = torch.zeros(shape, dtype=keys.dtype)
        self.value_cache = torch.zeros(shape, dtype=keys.dtype)
        self._fill(keys, values, block_size)
        self.metadata = metadata(tables, [1] * batch, [context] * batch, block_size)
        self.key, self.value = keys[:, -1].contiguous(), values[:, -1].contiguous()

    def _fill(self, keys: torch.Tensor, values: torch.Tensor, block_size: int) -> None:
        """Positions 0 .. context - 2 of every sequence, written through forward: each block
        is a one-block "sequence" of its own, so the fill costs little attention."""
        batch, context, num_kv_heads, head_dim = keys.shape
        num_heads = self.backend.context.num_heads
        pieces = [(seq, start, min(start + block_size, context - 1))
                  for seq in range(batch) for start in range(0, context - 1, block_size)]
        for chunk in range(0, len(pieces), 512):
            part = pieces[chunk:chunk + 512]
            lens = [end - start for _, start, end in part]
            tables = [[self.tables[seq][start // block_size]] for seq, start, _ in part]
            k = torch.cat([keys[seq, start:end] for seq, start, end in part])
            v = torch.cat([values[seq, start:end] for seq, start, end in part])
            q = torch.zeros(k.shape[0], num_heads, head_dim, dtype=k.dtype)
            self.backend.forward(q, k, v, self.key_cache, self.value_cache,
                                 self.backend.prepare(metadata(tables, lens, lens, block_size)), 1.0)

    def prepare(self) -> Any:
        return self.backend.prepare(self.metadata)

    def forward(self, query: torch.Tensor, prepared: Any, scale: float) -> torch.Tensor:
        return self.backend.forward(query, self.key, self.value, self.key_cache, self.value_cache, prepared, scale)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def timed(function: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def load_before(path: str) -> type:
    spec = importlib.util.spec_from_file_location("torch_paged_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TorchPagedAttention


def run(args: argparse.Namespace, dtype: torch.dtype) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(args.seed)
    batch, context, block_size = args.batch, args.context, args.block_size
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq + 8
    attention_context = AttentionContext(
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=block_size,
        num_blocks=num_blocks, dtype=dtype, device=torch.device("cpu"))
    contiguous = [list(range(8 + s * blocks_per_seq, 8 + (s + 1) * blocks_per_seq)) for s in range(batch)]
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    shuffled = [[physical.pop() for _ in range(blocks_per_seq)] for _ in range(batch)]
    shape = (batch, context, args.kv_heads, args.head_dim)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    query = torch.randn(batch, args.heads, args.head_dim, generator=generator).to(dtype)
    scale = args.head_dim ** -0.5

    paged_options = TorchPagedOptions(**dict(_parse(o) for o in args.paged_option))
    benches = []
    if args.before_module:
        before = load_before(args.before_module)
        # The defaults of the torch-paged the file came from (its options class had these two).
        options = types.SimpleNamespace(decode_group_size=16, prefill_group_size=4)
        benches.append(Bench("before", before(options, attention_context), shuffled, keys, values, block_size))
    benches.append(Bench("torch-paged", TorchPagedAttention(paged_options, attention_context), shuffled, keys,
                         values, block_size))
    benches.append(Bench("sdpa-contiguous", SdpaContiguousAttention(None, attention_context), contiguous, keys,
                         values, block_size))
    del keys, values

    reference = benches[-1].forward(query, benches[-1].prepare(), scale).float()
    for bench in benches[:-1]:
        error = (bench.forward(query, bench.prepare(), scale).float() - reference).abs().max().item()
        if error > TOLERANCE[dtype]:
            sys.exit(f"{bench.label} differs from sdpa-contiguous by {error:.3g} (> {TOLERANCE[dtype]:g})")

    prepare_s: dict[str, list[float]] = {b.label: [] for b in benches}
    forward_s: dict[str, list[float]] = {b.label: [] for b in benches}
    for _ in range(args.repeats):
        for bench in benches:  # round-robin, so load drifts hit every backend alike
            seconds, prepared = timed(bench.prepare)
            prepare_s[bench.label].append(seconds)
            seconds, _ = timed(lambda: bench.forward(query, prepared, scale))
            forward_s[bench.label].append(seconds)
    contiguous_ms = median_ms(forward_s["sdpa-contiguous"])
    return [dict(dtype=str(dtype).replace("torch.", ""), backend=b.label, batch=batch, context=context,
                 heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=block_size,
                 forward_ms=round(median_ms(forward_s[b.label]), 3), prepare_ms=round(median_ms(prepare_s[b.label]), 3),
                 vs_contiguous=round(median_ms(forward_s[b.label]) / contiguous_ms, 3))
            for b in benches]


def _parse(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    return key, float(value) if "." in value else int(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="decoding sequences (default 64)")
    parser.add_argument("--context", type=int, default=1024, help="context length of each (default 1024)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (builtin:tiny-random: 8)")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads (builtin:tiny-random: 4)")
    parser.add_argument("--head-dim", type=int, default=64, help="head size (builtin:tiny-random: 64)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--before-module", help="a torch_paged.py to time as 'before' (same harness and data)")
    parser.add_argument("--paged-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a TorchPagedOptions field for torch-paged (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': stdout)")
    args = parser.parse_args(argv)

    rows = []
    for name in args.dtype.split(","):
        rows += run(args, getattr(torch, name.strip()))
    print(f"attention per layer, decode batch {args.batch} x context {args.context}, {args.heads} heads / "
          f"{args.kv_heads} KV heads, head_dim {args.head_dim}, block {args.block_size}; median of {args.repeats}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'dtype':9} {'backend':16} {'forward ms':>10} {'prepare ms':>10} {'vs contiguous':>13}")
    for row in rows:
        print(f"{row['dtype']:9} {row['backend']:16} {row['forward_ms']:10.2f} {row['prepare_ms']:10.2f} "
              f"{row['vs_contiguous']:12.2f}x")
    if args.json:
        text = json.dumps(rows, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as handle:
                handle.write(text + "\n")


if __name__ == "__main__":
    main()
