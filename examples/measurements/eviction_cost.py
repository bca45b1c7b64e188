"""What a prefix cache's eviction costs per allocation, as the cache grows.

    python examples/measurements/eviction_cost.py                  # radix and hash, every eviction policy
    python examples/measurements/eviction_cost.py --sizes 1000 30000
    python examples/measurements/eviction_cost.py --policies lru gdsf   # a stateful policy (EvictionObserver)

A pool of N blocks is filled with N cached, unheld one-block prefixes (each from a
finished sequence), then sequences that each need one new block arrive one at a time:
every allocation evicts one cached block, chosen by the policy from all N candidates.
The baseline, in the same run, is the same allocation from a free list (no eviction).
Reported: microseconds per allocation (median and min-max of 5 rounds) and the ratio
to the baseline, for each policy kept in order by the cache's queue (the built-in
policies) and through a sort of every candidate per eviction (a policy with its own
`choose`, a demand-aware one, and every policy before the queue): the sort grows as
N log N per eviction, and on a GPU-sized pool (tens of thousands of blocks) it is a
large part of a step. `gdsf` is GreedyDual-Size-Frequency as docs/writing-a-policy.md
writes it: a key plus `evicted(...)` (an aging clock), served from the queue like the
built-ins; through the sort it is what overriding `choose` to learn of evictions cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

from servelab import SamplingParams
from servelab.interfaces import AllocatorContext, EvictionContext
from servelab.kit import KeyedEviction
from servelab.sequence import Sequence
from servelab.testing import make_allocator
from servelab.testing.contract import installed_factory

BLOCK = 16
ROUNDS = 5


def sequence(index: int, length: int) -> Sequence:
    tokens = [(index * 7919 + i) % 50000 for i in range(length)]
    return Sequence(request_id=f"s{index}", prompt_token_ids=tokens, params=SamplingParams(max_tokens=1),
                    arrival_time=0.0)


class Sorted:
    """A policy through the sort of every candidate: what a policy with its own `choose`
    costs, and what every policy cost before the queue."""

    def __init__(self, policy: KeyedEviction) -> None:
        self.policy = policy

    def choose(self, candidates, num_blocks):
        return KeyedEviction.choose(self.policy, candidates, num_blocks)


class SortedObserver(Sorted):
    """`Sorted` for a policy that is told of evictions."""

    def evicted(self, candidates):
        self.policy.evicted(candidates)


class GDSF(KeyedEviction):
    """GreedyDual-Size-Frequency (docs/writing-a-policy.md): L + frequency x depth / size."""

    clock = 0.0

    def value(self, c):
        return self.clock + (c.hits + 1) * c.depth / c.size

    def key(self, c):
        return self.memo_key(c, self.value), c.last_access

    def evicted(self, candidates):
        self.clock = max(self.clock, *(self.key(c)[0] for c in candidates))
        self.forget_keys(candidates)


def filled(allocator_name: str, eviction: str, num_blocks: int, *, sort: bool):
    """A prefix cache of `num_blocks` blocks, every one cached and unheld."""
    context = EvictionContext(num_blocks=num_blocks, block_size=BLOCK)
    if eviction == "gdsf":
        policy = GDSF(None, context)
    else:
        policy_factory, policy_options = installed_factory("evictors", eviction)
        policy = policy_factory(policy_options(), context)
    if sort:
        policy = SortedObserver(policy) if eviction == "gdsf" else Sorted(policy)
    factory, options = installed_factory("allocators", allocator_name)
    allocator = factory(options(), AllocatorContext(num_blocks=num_blocks, block_size=BLOCK,
                                                    max_model_len=64 * BLOCK, eviction=policy))
    for index in range(num_blocks):
        seq = sequence(index, BLOCK + 1)
        assert allocator.allocate(seq.request_id, BLOCK)
        seq.num_computed_tokens = BLOCK
        allocator.cache_blocks(seq)
        allocator.free(seq.request_id)
    return allocator


def per_allocation_us(allocator, first: int, count: int) -> float:
    """Allocate one block for each of `count` new sequences, which keep it: each
    allocation takes a block the pool has to find (on a full prefix cache, by eviction)."""
    start = time.perf_counter()
    for index in range(first, first + count):
        assert allocator.allocate(f"n{index}", 1)
    return (time.perf_counter() - start) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 30000])
    parser.add_argument("--allocations", type=int, default=50)
    parser.add_argument("--policies", nargs="+", default=["lru", "lfu", "slru"])
    args = parser.parse_args()
    print("| allocator | eviction | order kept by | cached blocks | µs per allocation (min-max) | x free-list baseline |")
    print("|---|---|---|---:|---:|---:|")
    for size in args.sizes:
        baseline_rounds = []
        for _ in range(ROUNDS):
            allocator = make_allocator("paged", size, BLOCK, 64 * BLOCK)
            baseline_rounds.append(per_allocation_us(allocator, 0, args.allocations))
        baseline = statistics.median(baseline_rounds)
        print(f"| paged | (none) | free list | {size} | {baseline:.1f} ({min(baseline_rounds):.1f}-"
              f"{max(baseline_rounds):.1f}) | 1.00 |")
        for allocator_name in ("hash", "radix"):
            for eviction in args.policies:
                for sort in (False, True):
                    rounds = [per_allocation_us(filled(allocator_name, eviction, size, sort=sort), 0,
                                                args.allocations) for _ in range(ROUNDS)]
                    median = statistics.median(rounds)
                    print(f"| {allocator_name} | {eviction} | {'sort per eviction' if sort else 'queue'} | {size} | "
                          f"{median:.1f} ({min(rounds):.1f}-{max(rounds):.1f}) | {median / baseline:.1f} |",
                          flush=True)


if __name__ == "__main__":
    main()
