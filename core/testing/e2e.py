"""End-to-end runs on a tiny model: greedy tokens with the policy under test must equal
the tokens of the reference policies (paged allocator, continuous scheduler,
torch-paged attention), which servelab's own tests check against `transformers`.

Each case is one `generate` call on a fresh engine whose KV pool was first handed out
and taken back in shuffled order (so block tables are not ascending runs), run twice
(the second run meets a warm prefix cache); references are computed once per process
and case. The prompts share prefixes from position 0, reach the same block content
after different parents, and repeat a prefix's content shifted by a block. Any
exception raised during a run fails "tokens identical to the reference policies" with
the policy's traceback.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import attrs

from servelab.plugin_types import KINDS
from servelab.testing.contract import check, exercising
from servelab.testing.tiny_model import tiny_checkpoint

NEEDS_TRANSFORMERS = ("the end-to-end cases build a tiny model with transformers (servelab's `test` extra); "
                      "the `contracts` extra leaves it out")

REFERENCE = {"allocator": "paged", "scheduler": "continuous", "attention": "torch-paged"}
VOCAB_SIZE = 211  # the tiny "llama" checkpoint's
BLOCK_SIZE = 8
SAME_TOKENS = "tokens identical to the reference policies"


@attrs.frozen
class Case:
    """One generate call: engine overrides, and whether it forks (n > 1)."""

    name: str
    overrides: tuple[tuple[str, Any], ...]
    n: int = 1
    # Overrides the reference policies cannot take (a token budget below max_model_len):
    # tokens do not depend on them, so the reference runs without.
    policy_only: tuple[tuple[str, Any], ...] = ()
    # Sampled (temperature 1, a seed per prompt) rather than greedy: parallel samples then
    # write different tokens after the fork, so a skipped copy-on-write shows.
    seeded: bool = False


CASES = {
    "roomy": Case("roomy", (("max_model_len", 128), ("block_size", BLOCK_SIZE))),
    # 14 blocks of 8 slots: a few sequences at a time, so schedulers preempt and caches evict.
    "tight": Case("tight", (("max_model_len", 112), ("num_kv_blocks", 14), ("block_size", BLOCK_SIZE))),
    # Prompt chunks of 12 tokens end inside blocks and inside cached prefixes.
    "chunked": Case("chunked", (("max_model_len", 128), ("block_size", BLOCK_SIZE)),
                    policy_only=(("max_num_batched_tokens", 12),)),
    # Parallel sampling: three seeded samples per prompt, diverging after the fork.
    "parallel": Case("parallel", (("max_model_len", 128), ("block_size", BLOCK_SIZE)), n=3, seeded=True),
}


def prompts() -> list[list[int]]:
    """Eight prompts sharing a six-block prefix in different ways (prefix caches hit), and
    reusing its blocks' content where it must not hit."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(48)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    other = tail(11)
    return [prefix + tail(5), prefix + tail(16), prefix, prefix[:20] + tail(9), other, prefix + tail(1),
            other[:BLOCK_SIZE] + prefix[BLOCK_SIZE:] + tail(3),  # the prefix's blocks 1-5 after another block 0
            prefix[BLOCK_SIZE:] + tail(4)]  # the same content one block earlier


MAX_TOKENS = [10, 6, 12, 8, 9, 7, 6, 5]


def sampling_params(case: Case, n: int) -> list[Any]:
    from servelab import SamplingParams

    if case.seeded:
        return [SamplingParams(max_tokens=m, temperature=1.0, seed=100 + i, ignore_eos=True, n=n)
                for i, m in enumerate(MAX_TOKENS)]
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, n=n) for m in MAX_TOKENS]


def shuffle_free_blocks(allocator: Any, block_size: int, seed: int = 11) -> None:
    """Take every block the allocator hands out one block at a time, then give them back
    in shuffled order: later block tables are not ascending runs of a fresh pool."""
    held = []
    while len(held) < allocator.stats().num_blocks and allocator.allocate(f"shuffle-{len(held)}", block_size):
        held.append(f"shuffle-{len(held)}")
    random.Random(seed).shuffle(held)
    for seq_id in held:
        allocator.free(seq_id)


def _generate(policies: dict[str, str], overrides: dict[str, Any], registry: Any, case: Case,
              n: int) -> list[list[list[int]]]:
    from servelab import LLM

    settings = dict(overrides)
    settings.update({f"{section}.name": name for section, name in policies.items()})
    with exercising(SAME_TOKENS):
        engine = LLM(tiny_checkpoint(), registry=registry, **settings).engine
        shuffle_free_blocks(engine.allocator, settings.get("block_size", BLOCK_SIZE))
        params = sampling_params(case, n)
        # Twice: the second run meets whatever the first left behind (a warm prefix cache).
        first = _run_to_completion(engine, params)
        second = _run_to_completion(engine, params)
    check(first == second, SAME_TOKENS, lambda: "a second run on the same engine (a warm prefix cache) changed "
          f"the tokens of prompts {[i for i, (a, b) in enumerate(zip(first, second)) if a != b]}")
    used = engine.allocator.stats().num_used_blocks
    check(used == 0, "block leaked on free", f"{used} KV blocks still in use after every request finished")
    return first


def _run_to_completion(engine: Any, params: list[Any]) -> list[list[list[int]]]:
    """LLM.generate's loop, bounded: a policy that loses a request fails instead of hanging."""
    request_ids = [engine.add_request(prompt, sp) for prompt, sp in zip(prompts(), params)]
    bound = 4 * sum((len(p) + sp.max_tokens) * sp.n for p, sp in zip(prompts(), params))
    finished: dict[str, Any] = {}
    for _ in range(bound):
        if len(finished) == len(request_ids):
            break
        missing = [r for r in request_ids if r not in finished]
        check(engine.has_unfinished(), "request dropped",
              lambda: f"the scheduler has nothing unfinished, yet {', '.join(missing)} never finished")
        finished.update((o.request_id, o) for o in engine.step().finished)
    check(len(finished) == len(request_ids), "no progress: an empty plan while requests are unfinished",
          lambda: f"{len(request_ids) - len(finished)} requests unfinished after {bound} steps, with "
                  f"{engine.scheduler.stats().num_running} running and {engine.allocator.stats().num_used_blocks} "
                  f"of {engine.allocator.stats().num_blocks} KV blocks in use")
    return [[c.token_ids for c in finished[r].outputs] for r in request_ids]


@functools.lru_cache(maxsize=None)
def reference_completions(case_name: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The reference policies' completions of each prompt for CASES[case_name]."""
    from servelab.registry import PluginRegistry

    case = CASES[case_name]
    # Greedy completions are all alike: the reference computes one (n = 1).
    n = case.n if case.seeded else 1
    outputs = _generate(REFERENCE, dict(case.overrides), PluginRegistry.from_entry_points(), case, n)
    return tuple(tuple(tuple(c) for c in o) for o in outputs)


def reference_tokens(case_name: str) -> tuple[tuple[int, ...], ...]:
    """The reference policies' first completion of each prompt for CASES[case_name]."""
    return tuple(o[0] for o in reference_completions(case_name))


def check_against_reference(kind: str, name: str, registry: Any, case_name: str,
                            partners: dict[str, str] | None = None, **engine: Any) -> None:
    """Greedy tokens with policy `name` of `kind` in place of the reference one must equal
    the reference tokens for CASES[case_name]. `partners` swaps other reference policies
    too, by section ({"allocator": "naive"} for a backend that needs contiguous tables)."""
    import pytest

    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    case = CASES[case_name]
    policies = dict(REFERENCE, **(partners or {}), **{KINDS[kind].section: name})
    overrides = dict(case.overrides + case.policy_only, **engine)
    got = _generate(policies, overrides, registry, case, case.n)
    expected = reference_completions(case_name)
    for index, (completions, wanted) in enumerate(zip(got, expected)):
        for number, completion in enumerate(completions):
            want = wanted[number] if case.seeded else wanted[0]
            check(tuple(completion) == want, SAME_TOKENS,
                  f"case {case_name!r}, prompt {index}, completion {number}: got {list(completion)}, the "
                  f"reference policies ({', '.join(REFERENCE.values())}) give {list(want)}")
