"""A key-ordered eviction policy is served from an incremental queue (no sort per
eviction): the prefix caches must evict exactly what the sort of all candidates evicts,
block for block, whatever the sequence of lookups, caching, forks and frees."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from servelab import SamplingParams
from servelab.interfaces import AllocatorContext, EvictionContext
from servelab.kit import KeyedEviction, LeastRecentlyUsed
from servelab.plugins.allocators.hash_prefix import HashAllocator
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.plugins.eviction.policies import LeastFrequentlyUsed, SegmentedLRU
from servelab.sequence import Sequence

BLOCK = 2
NUM_BLOCKS = 12


class Sorted:
    """The same policy through the sort of every candidate (it overrides `choose`, so the
    cache cannot keep a queue for it)."""

    def __init__(self, policy: KeyedEviction) -> None:
        self.policy = policy

    def choose(self, candidates, num_blocks):
        return KeyedEviction.choose(self.policy, candidates, num_blocks)


def pair(allocator_class, policy_class):
    context = EvictionContext(num_blocks=NUM_BLOCKS, block_size=BLOCK)

    def make(eviction):
        return allocator_class(None, AllocatorContext(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=64,
                                                      eviction=eviction))

    queued, sorted_ = make(policy_class(None, context)), make(Sorted(policy_class(None, context)))
    assert queued._queue is not None and sorted_._queue is None
    return queued, sorted_


# A sequence: a prompt over a tiny alphabet (so prefixes are shared), then a free or not.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=9)
operations = st.lists(st.tuples(prompts, st.booleans()), min_size=1, max_size=40)


def admit(allocator, seq: Sequence, held: list[str]) -> int | None:
    """Prefix match and allocate `seq`, freeing the oldest held sequences while the pool
    is dry; its hit tokens, or None when it cannot fit at all."""
    while True:
        hit = allocator.match_prefix(seq)
        if allocator.allocate(seq.request_id, seq.num_tokens):
            return hit
        allocator.free(seq.request_id)
        if not held:
            return None
        allocator.free(held.pop(0))


def run(allocator, ops) -> list:
    """Admit each prompt and cache its full blocks; free the ones marked (the rest stay
    held until the pool needs them). Returns what is observable: each admission's hit and
    block table, and the free list's order after each operation."""
    held: list[str] = []
    observed = []
    for index, (prompt, release) in enumerate(ops):
        seq = Sequence(request_id=f"s{index}", prompt_token_ids=list(prompt), params=SamplingParams(max_tokens=1),
                       arrival_time=0.0)
        hit = admit(allocator, seq, held)
        if hit is not None:
            seq.num_computed_tokens = seq.num_tokens
            allocator.cache_blocks(seq)
            observed.append((hit, allocator.block_table(seq.request_id)))
            if release:
                allocator.free(seq.request_id)
            else:
                held.append(seq.request_id)
        observed.append(list(allocator._free_blocks))
    return observed


@settings(max_examples=80, deadline=None)
@given(ops=operations, allocator_class=st.sampled_from([RadixAllocator, HashAllocator]),
       policy_class=st.sampled_from([LeastRecentlyUsed, LeastFrequentlyUsed, SegmentedLRU]))
def test_the_queue_evicts_exactly_what_the_sort_evicts(ops, allocator_class, policy_class):
    queued, sorted_ = pair(allocator_class, policy_class)
    assert run(queued, ops) == run(sorted_, ops)


def test_the_queue_stays_bounded_by_the_cache():
    """Stale entries are compacted away: the heap stays within a multiple of the index."""
    queued, _ = pair(RadixAllocator, LeastRecentlyUsed)
    ops = [([i % 3, (i // 3) % 3, i % 2, 1], True) for i in range(3000)]
    run(queued, ops)
    assert len(queued._queue) <= 4 * len(queued.index) + 1024 + 16
