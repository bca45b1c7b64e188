"""Speculative decoding, measured: acceptance rate, tokens per target step and wall-clock
speedup over plain decoding, for each drafter, at batch 1 and batch 16, on two workloads.

    python examples/speculation_figures.py --threads 1 --json spec.json --plot spec.png

(a) repetitive: each prompt holds a passage of Python's own documentation or source,
    then asks for it again and starts it ("rewrite this passage"): the continuation
    copies the input, the case prompt lookup is made for.
(b) open-ended: short prompts (a keyword, a docstring opening) the model continues freely.
(c) code-editing and (d) summarisation, for an instruction-tuned model (`--model
    smollm2-135m --workloads code-editing summarisation`): a chat request, rendered with
    the model's own template, to edit a function (rename a name, add type hints) or to
    summarise a passage; an edit copies most of its input, a summary some phrases.

Greedy decoding, so every drafter produces exactly the plain run's tokens (checked here:
a figure from a run that changed the output would mean nothing). Batch 1 runs the
requests one at a time; batch 16 submits all 16 at once. Drafters run interleaved in
each repeat, each on its own engine, after a warm-up, and the median repeat is kept
(with the min-max of the repeats' speedups). Each drafter also runs with dynamic
speculation length (`+dyn`: `[drafter] dynamic_length = true`). The suffix drafter's
cache of previous outputs is emptied before every timed run, so a run gains only from
the outputs of its own earlier requests, never from a previous repeat of the same prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from servelab import LLM, SamplingParams
from servelab.logging_setup import configure_logging

WORKLOADS = ("repetitive", "open-ended", "code-editing", "summarisation")
EDITS = ("Rename the parameter `text` to `source` in this function and return the whole function.",
         "Add type hints to this function and return the whole function.")


def passages(count: int, chars: int = 400) -> list[str]:
    """Deterministic passages from pydoc_data topics and a few standard-library sources."""
    import inspect
    import json as json_module
    import textwrap

    from pydoc_data.topics import topics

    texts = [topics[key] for key in sorted(topics) if len(topics[key]) > 2 * chars]
    sources = [inspect.getsource(obj) for obj in (textwrap.dedent, textwrap.TextWrapper.wrap, json_module.dumps,
                                                  json_module.loads, textwrap.indent, textwrap.shorten)]
    picked = []
    for i in range(count):
        text = sources[i // 2 % len(sources)] if i % 2 else texts[(i * 7) % len(texts)]
        picked.append(text[:chars].rsplit(" ", 1)[0])
    return picked


def sources(count: int) -> list[str]:
    """Whole functions of the standard library, for the code-editing requests."""
    import inspect
    import json as json_module
    import shlex
    import textwrap

    functions = (textwrap.dedent, textwrap.indent, textwrap.shorten, json_module.dumps, shlex.quote, shlex.join)
    return [inspect.getsource(functions[i % len(functions)]) for i in range(count)]


def chat_prompts(llm: LLM, requests: list[str]) -> list[str]:
    """Each request as the model's chat template renders a one-message conversation."""
    from servelab.server.chat import ChatTemplate

    template = ChatTemplate.from_tokenizer(llm.tokenizer)
    return [template.render([{"role": "user", "content": request}]).text for request in requests]


def prompts(workload: str, count: int, llm: LLM) -> list[str]:
    if workload == "code-editing":
        return chat_prompts(llm, [f"{EDITS[i % len(EDITS)]}\n\n```python\n{source}```"
                                  for i, source in enumerate(sources(count))])
    if workload == "summarisation":
        return chat_prompts(llm, [f"Summarise this passage in two sentences.\n\n{p}" for p in passages(count, 800)])
    if workload == "repetitive":
        # The passage, a blank line, and its first words again (cut at a space, so the
        # restart tokenises as the passage did).
        return [f"{p}\n\n{p[:40].rsplit(' ', 1)[0]}" for p in passages(count)]
    openings = ["def ", "class ", "The ", "import ", "    def __init__(self", "# ", "Return the ", "If the ",
                "for ", "This module ", "with open(", "A ", "raise ", "The following ", "try:\n    ", "@"]
    return [openings[i % len(openings)] for i in range(count)]


def drafter_configs(draft_model: str, eagle_heads: str = "") -> dict[str, dict | None]:
    eagle = {"name": "eagle", **({"heads": eagle_heads} if eagle_heads else {})}
    static = {
        "ngram": {"name": "ngram", "num_speculative_tokens": 4, "max_ngram": 3},
        "suffix": {"name": "suffix", "num_speculative_tokens": 4},
        "suffix-tree": {"name": "suffix", "num_speculative_tokens": 4, "tree_nodes": 8},
        "draft-model": {"name": "draft-model", "model": draft_model, "num_speculative_tokens": 4},
        "medusa": {"name": "medusa"},
        "medusa-tree": {"name": "medusa", "tree_nodes": 16},
        "eagle": eagle,
        "eagle-tree": {**eagle, "tree_nodes": 16},
    }
    configs: dict[str, dict | None] = {"none": None}
    for name, config in static.items():
        configs[name] = config
        configs[f"{name}+dyn"] = {**config, "dynamic_length": True}
    return configs


def forget_previous_outputs(llm: LLM) -> None:
    from servelab.plugins.drafters.suffix import SuffixDrafter

    drafter = llm.engine.speculator.drafter if llm.engine.speculator is not None else None
    if isinstance(drafter, SuffixDrafter):
        drafter.clear_cache()


def run_once(llm: LLM, texts: list[str], batch: int, params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    if batch == 1:
        outputs = [llm.generate(text, params)[0] for text in texts]
    else:
        outputs = llm.generate(texts, params)
    return time.perf_counter() - start, [o.token_ids for o in outputs]


def measure(args: argparse.Namespace) -> list[dict]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    extra = {}
    for item in args.extra_drafter:  # NAME=JSON: one more configuration, beside the built-in list
        name, _, config = item.partition("=")
        extra[name] = json.loads(config)
    configs = {name: cfg for name, cfg in drafter_configs(args.draft_model, args.eagle_heads).items()
               if name in args.drafters}
    configs.update(extra)
    engines = {name: LLM(args.model, config={"drafter": cfg} if cfg else {}, max_num_seqs=16, seed=0)
               for name, cfg in configs.items()}
    rows = []
    for workload in args.workloads:
        texts = prompts(workload, args.num_requests, next(iter(engines.values())))
        for batch in args.batches:
            seconds: dict[str, list[float]] = {name: [] for name in engines}
            stats_delta: dict[str, tuple[int, int, int, int]] = {}
            reference = None
            for name, llm in engines.items():  # warm-up, and the tokens every drafter must reproduce
                llm.generate(texts[:2], SamplingParams(max_tokens=8, temperature=0))
                forget_previous_outputs(llm)
                _, tokens = run_once(llm, texts[:batch], batch, params)
                reference = reference or tokens
                if tokens != reference:
                    raise SystemExit(f"{name} changed the greedy output on {workload}: verification is broken")
            for repeat in range(args.repeats):
                for name, llm in engines.items():
                    forget_previous_outputs(llm)
                    before = llm.engine.speculation_stats()
                    elapsed, _ = run_once(llm, texts, batch, params)
                    seconds[name].append(elapsed)
                    after = llm.engine.speculation_stats()
                    if after is not None:
                        stats_delta[name] = tuple(getattr(after, f) - getattr(before, f) for f in (
                            "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "num_sampling_steps"))
                    print(f"{workload:>10} batch {batch:>2} {name:>16} repeat {repeat + 1}: {elapsed:6.2f} s",
                          flush=True)
            base = statistics.median(seconds["none"]) if "none" in seconds else None
            num_tokens = len(texts) * args.max_tokens
            for name in engines:
                wall = statistics.median(seconds[name])
                drafted, accepted, emitted, steps = stats_delta.get(name, (0, 0, num_tokens, num_tokens))
                # Spread: each repeat's time against the same repeat's plain run.
                ratios = [b / w for b, w in zip(seconds["none"], seconds[name])] if base else []
                rows.append({
                    "workload": workload, "batch": batch, "drafter": name, "seconds": wall,
                    "output_tokens_per_s": num_tokens / wall,
                    "speedup": base / wall if base else None,
                    "speedup_min": min(ratios) if ratios else None, "speedup_max": max(ratios) if ratios else None,
                    "accepted_per_target_step": accepted / steps if steps else None,
                    "acceptance_rate": accepted / drafted if drafted else None,
                    "tokens_per_target_step": emitted / steps if steps else None,
                    "drafted_per_target_step": drafted / steps if steps else None, "model": args.model,
                    "draft_tokens": drafted, "accepted_tokens": accepted,
                })
    return rows


def print_table(rows: list[dict]) -> None:
    print("\n| workload | batch | drafter | output tok/s | speedup (min-max) | acceptance | accepted / target step "
          "| tokens / target step |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        accept = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "-"
        speedup = (f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
                   if r["speedup"] is not None else "-")
        accepted = f"{r['accepted_per_target_step']:.2f}" if r["accepted_per_target_step"] is not None else "-"
        per_step = f"{r['tokens_per_target_step']:.2f}" if r["tokens_per_target_step"] is not None else "-"
        name = f"`{r['drafter']}`" if r["drafter"] != "none" else "none"
        print(f"| {r['workload']} | {r['batch']} | {name} | {r['output_tokens_per_s']:.1f} | {speedup} | {accept} "
              f"| {accepted} | {per_step} |")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["workload"], r["batch"]) for r in rows}, key=lambda g: (WORKLOADS.index(g[0]), g[1]))
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(drafters)
    for i, name in enumerate(drafters):
        values = [next((r["speedup"] or 0 for r in rows if (r["workload"], r["batch"]) == g and r["drafter"] == name), 0)
                  for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(drafters) - 1) / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"{w}\nbatch {b}" for w, b in groups])
    ax.set_ylabel("wall-clock speedup vs no speculation")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--draft-model", default="builtin:tiny-draft")
    parser.add_argument("--eagle-heads", default="", help="directory of the EAGLE head (default: the model's)")
    parser.add_argument("--drafters", nargs="+", default=list(drafter_configs("")))
    parser.add_argument("--extra-drafter", action="append", default=[], metavar="NAME=JSON",
                        help='one more drafter configuration, e.g. suffix-d8=\'{"name": "suffix", "max_depth": 8}\'')
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS[:2]))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    configure_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
