"""End-to-end runs on a tiny model: greedy tokens with the policy under test must equal
the tokens of the reference policies (paged allocator, continuous scheduler,
torch-paged attention), which servelab's own tests check against `transformers`.

Each case is one `generate` call on a fresh engine; references are computed once per
process and case.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import attrs

from servelab.testing.contract import check
from servelab.testing.tiny_model import tiny_checkpoint

REFERENCE = {"allocator": "paged", "scheduler": "continuous", "attention": "torch-paged"}
SECTION_OF_KIND = {"allocators": "allocator", "schedulers": "scheduler", "attention": "attention"}
VOCAB_SIZE = 211  # the tiny "llama" checkpoint's
BLOCK_SIZE = 8


@attrs.frozen
class Case:
    """One generate call: engine overrides, and whether it forks (n > 1)."""

    name: str
    overrides: tuple[tuple[str, Any], ...]
    n: int = 1
    # Overrides the reference policies cannot take (a token budget below max_model_len):
    # tokens do not depend on them, so the reference runs without.
    policy_only: tuple[tuple[str, Any], ...] = ()


CASES = {
    "roomy": Case("roomy", (("max_model_len", 128), ("block_size", BLOCK_SIZE))),
    # 14 blocks of 8 slots: a few sequences at a time, so schedulers preempt and caches evict.
    "tight": Case("tight", (("max_model_len", 112), ("num_kv_blocks", 14), ("block_size", BLOCK_SIZE))),
    # Prompt chunks of 12 tokens end inside blocks and inside cached prefixes.
    "chunked": Case("chunked", (("max_model_len", 128), ("block_size", BLOCK_SIZE)),
                    policy_only=(("max_num_batched_tokens", 12),)),
    # Parallel sampling: three greedy completions, each equal to the single one.
    "parallel": Case("parallel", (("max_model_len", 128), ("block_size", BLOCK_SIZE)), n=3),
}


def prompts() -> list[list[int]]:
    """Six prompts sharing a six-block prefix in different ways (prefix caches hit)."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(48)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    return [prefix + tail(5), prefix + tail(16), prefix, prefix[:20] + tail(9), tail(11), prefix + tail(1)]


MAX_TOKENS = [10, 6, 12, 8, 9, 7]


def _generate(policies: dict[str, str], overrides: dict[str, Any], registry: Any, n: int) -> list[list[list[int]]]:
    from servelab import LLM, SamplingParams

    settings = dict(overrides)
    settings.update({f"{section}.name": name for section, name in policies.items()})
    engine = LLM(tiny_checkpoint(), registry=registry, **settings).engine
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, n=n) for m in MAX_TOKENS]
    # Twice: the second run meets whatever the first left behind (a warm prefix cache).
    first = _run_to_completion(engine, params)
    second = _run_to_completion(engine, params)
    check(first == second, "tokens identical to the reference policies",
          "a second run on the same engine changed the greedy tokens")
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
def reference_tokens(case_name: str) -> tuple[tuple[int, ...], ...]:
    """The reference policies' greedy tokens for CASES[case_name] (n = 1)."""
    from servelab.registry import PluginRegistry

    case = CASES[case_name]
    outputs = _generate(REFERENCE, dict(case.overrides), PluginRegistry.from_entry_points(), 1)
    return tuple(tuple(o[0]) for o in outputs)


def check_against_reference(kind: str, name: str, registry: Any, case_name: str,
                            partners: dict[str, str] | None = None, **engine: Any) -> None:
    """Greedy tokens with policy `name` of `kind` in place of the reference one must equal
    the reference tokens for CASES[case_name]. `partners` swaps other reference policies
    too, by section ({"allocator": "naive"} for a backend that needs contiguous tables)."""
    case = CASES[case_name]
    policies = dict(REFERENCE, **(partners or {}), **{SECTION_OF_KIND[kind]: name})
    overrides = dict(case.overrides + case.policy_only, **engine)
    got = _generate(policies, overrides, registry, case.n)
    expected = reference_tokens(case_name)
    for index, (completions, want) in enumerate(zip(got, expected)):
        for completion in completions:
            check(tuple(completion) == want, "tokens identical to the reference policies",
                  f"case {case_name!r}, prompt {index}: got {list(completion)}, the reference policies "
                  f"({', '.join(REFERENCE.values())}) give {list(want)}")
