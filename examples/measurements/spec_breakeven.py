"""The drafters' measured acceptance, priced on a large model and GPU by servelab's cost model.

    python examples/speculation_figures.py ... --json spec.json
    python examples/measurements/spec_breakeven.py spec.json --sim h100 --sim-model llama-3-8b

A CPU run measures what each drafter gets accepted (tokens per target step, drafts
verified per step); its wall-clock speedup there says little about a GPU, where a target
step costs far more than a draft. This prices the same acceptance profile on the
simulator's cost model (servelab.bench.sim): per step, the drafter's passes plus one
target step verifying (1 + drafts) tokens per sequence, against a plain decode step, at
the batch it was measured at, with a context of `--context-len` tokens:

    speedup = tokens per target step x plain step / (draft passes + verification step)

and the acceptance it would need to break even: the tokens per step at which the
speedup is 1. Draft passes run inside the engine's step: they pay their kernels and
launches, not the engine's per-step overhead. Draft costs, per step:

* ngram, suffix (chain or tree): none (host-side lookups, overlapped with the GPU);
* draft-model: k steps of a Llama-3.2-1B-shaped model (hidden 2048, 16 layers);
* medusa: one pass of a 1-layer model of the target's width and vocabulary (an upper
  bound: Medusa's heads are one H x H matmul each, plus the LM head for each head's row);
* eagle: per draft depth one pass of a 1-layer model of the target's width with a 32k
  draft vocabulary (EAGLE-3's), over one row per sequence (chain) or `tree_top_k` rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import accelerator
from servelab.bench.sim.shapes import _shape, model_shape

DRAFT_MODEL = dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256)


def draft_seconds(name: str, target_shape, hardware, batch: int, context: int, k: int, tree_top_k: int) -> float:
    """One step's drafting time for `batch` sequences. A draft pass runs inside the engine's
    step, so it pays its kernels (and launches) but not the engine's per-step overhead."""
    base = name.split("+")[0]
    t = target_shape

    def passes(model: CostModel, count: int, rows: int) -> float:
        one = model.step([rows] * batch, [context + rows] * batch, batch * rows).seconds - hardware.step_overhead_s
        return count * one

    if base in ("none", "ngram", "suffix", "suffix-tree"):
        return 0.0
    if base == "draft-model":
        d = DRAFT_MODEL
        return passes(CostModel(_shape(d["hidden"], d["layers"], d["heads"], d["kv_heads"], d["intermediate"],
                                       d["vocab"], t.max_position_embeddings), hardware), k, 1)
    one_layer = _shape(t.hidden_size, 1, t.num_heads, t.num_kv_heads, t.intermediate_size,
                       32000 if base.startswith("eagle") else t.vocab_size, t.max_position_embeddings)
    model = CostModel(one_layer, hardware)
    if base.startswith("medusa"):
        return passes(model, 1, 1)
    return passes(model, k, tree_top_k if base == "eagle-tree" else 1)


def price(rows: list[dict], sim: str, sim_model: str, context: int, k: int, tree_top_k: int) -> list[dict]:
    hardware, shape = accelerator(sim), model_shape(sim_model)
    target = CostModel(shape, hardware)
    out = []
    for row in rows:
        if row["drafter"] == "none" or row["tokens_per_target_step"] is None:
            continue
        batch = row["batch"]
        drafted = row.get("drafted_per_target_step") or 0.0
        plain = target.step([1] * batch, [context] * batch, batch).seconds
        rows_per_seq = 1 + round(drafted)
        verify = target.step([rows_per_seq] * batch, [context + rows_per_seq] * batch, batch * rows_per_seq).seconds
        draft = draft_seconds(row["drafter"], shape, hardware, batch, context, k, tree_top_k)
        step = draft + verify
        out.append({**{key: row[key] for key in ("model", "workload", "batch", "drafter") if key in row},
                    "tokens_per_target_step": row["tokens_per_target_step"], "drafted_per_step": drafted,
                    "cpu_speedup": row.get("speedup"), "sim_speedup": row["tokens_per_target_step"] * plain / step,
                    "breakeven_tokens_per_step": step / plain})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="speculation_figures.py --json outputs")
    parser.add_argument("--sim", default="h100")
    parser.add_argument("--sim-model", default="llama-3-8b")
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--k", type=int, default=4, help="draft depth of the measured drafters")
    parser.add_argument("--tree-top-k", type=int, default=4)
    args = parser.parse_args()
    rows = []
    for path in args.json:
        rows.extend(json.loads(Path(path).read_text()))
    priced = price(rows, args.sim, args.sim_model, args.context_len, args.k, args.tree_top_k)
    print(f"\n{args.sim_model} on {args.sim}, context {args.context_len}\n")
    print("| measured on | workload | batch | drafter | tokens / target step | CPU speedup | "
          f"{args.sim_model} / {args.sim} speedup | break-even tokens / step |\n|---|---|---|---|---|---|---|---|")
    for r in priced:
        cpu = f"{r['cpu_speedup']:.2f}x" if r["cpu_speedup"] is not None else "-"
        print(f"| {r.get('model', '-')} | {r['workload']} | {r['batch']} | `{r['drafter']}` | "
              f"{r['tokens_per_target_step']:.2f} | {cpu} | {r['sim_speedup']:.2f}x | "
              f"{r['breakeven_tokens_per_step']:.2f} |")


if __name__ == "__main__":
    main()
