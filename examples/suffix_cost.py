"""The suffix drafter's cost per step on the step loop, against the history's length:
microseconds per sequence per step (append one accepted token, propose), for `suffix`
and for `ngram` (prompt lookup, which scans the history with numpy), no model.

    python examples/suffix_cost.py --lengths 256 1024 4096 16384 --steps 300 --repeats 3

Each history is a token stream cut from the tokenized standard-library docs (so contexts
repeat as in real text); every step appends the stream's next token, as an accepted
token would be, and asks the drafter for one sequence. The first proposal (which
inserts the whole history into the sequence's trie) is timed separately.
"""

from __future__ import annotations

import argparse
import statistics
import time

from servelab.interfaces import DrafterContext
from servelab.plugins.drafters.ngram import NgramDrafter
from servelab.plugins.drafters.options import NgramOptions, SuffixOptions
from servelab.plugins.drafters.suffix import SuffixDrafter
from servelab.testing.drafter import decoding_sequence


def corpus(num_tokens: int) -> list[int]:
    from pydoc_data.topics import topics

    from servelab import LLM

    tokenizer = LLM("builtin:tiny").engine.tokenizer
    text = "\n\n".join(topics[key] for key in sorted(topics))
    tokens = tokenizer.encode(text)
    while len(tokens) < num_tokens:
        tokens = tokens + tokens
    return tokens[:num_tokens]


def time_drafter(make, tokens: list[int], length: int, steps: int) -> tuple[float, float]:
    """(seconds of the first proposal, median seconds per later step)."""
    drafter = make()
    seq = decoding_sequence("s", tokens[:length], [])
    start = time.perf_counter()
    drafter.propose([seq])
    first = time.perf_counter() - start
    per_step = []
    for i in range(steps):
        seq.output_token_ids.append(tokens[length + i])
        seq.num_computed_tokens = seq.num_tokens - 1
        start = time.perf_counter()
        drafter.propose([seq])
        per_step.append(time.perf_counter() - start)
    return first, statistics.median(per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokens = corpus(max(args.lengths) + args.steps)
    context = DrafterContext(vocab_size=4096, max_model_len=max(args.lengths) + args.steps + 8)
    makers = {"suffix": lambda: SuffixDrafter(SuffixOptions(), context),
              "ngram": lambda: NgramDrafter(NgramOptions(max_ngram=3), context)}
    print("| history tokens | drafter | first proposal ms | per step us (min-max of repeats) |\n|---|---|---|---|")
    for length in args.lengths:
        for name, make in makers.items():
            runs = [time_drafter(make, tokens, length, args.steps) for _ in range(args.repeats)]
            firsts = sorted(r[0] * 1e3 for r in runs)
            steps = sorted(r[1] * 1e6 for r in runs)
            print(f"| {length} | `{name}` | {statistics.median(firsts):.1f} | "
                  f"{statistics.median(steps):.1f} ({steps[0]:.1f}-{steps[-1]:.1f}) |", flush=True)


if __name__ == "__main__":
    main()
