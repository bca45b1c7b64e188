"""The kit prefix cache's seams for eviction policies with state: `evicted(candidates)`
after every eviction on both paths (the O(log n) queue kept), keys refused when they move,
and the `hash` cache taking a block's orphaned descendants with it."""

from __future__ import annotations

import pytest

from servelab.errors import PolicyViolation
from servelab.interfaces import AllocatorContext, EvictionContext, EvictionObserver
from servelab.kit import KeyedEviction
from servelab.kit.eviction import PURE_KEYS
from servelab.plugins.allocators.hash_prefix import HashAllocator
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.sampling_params import SamplingParams
from servelab.sequence import Sequence

from seeded_mutants import GDSF, GDSFLiveClock

CACHES = {"radix": RadixAllocator, "hash": HashAllocator}


def _cache(name: str, policy, num_blocks: int = 12):
    return CACHES[name](None, AllocatorContext(num_blocks=num_blocks, block_size=4, max_model_len=32,
                                               eviction=policy))


def _serve(cache, request_id: str, prompt: list[int]) -> None:
    seq = Sequence(request_id, prompt, SamplingParams(max_tokens=1), 0.0)
    seq.num_computed_tokens = cache.match_prefix(seq)
    assert cache.allocate(request_id, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    cache.cache_blocks(seq)
    cache.free(request_id)


class _Recording(KeyedEviction):
    """LRU that records what it is told was evicted."""

    def __init__(self, options=None, context=None):
        super().__init__(options, context)
        self.told = []

    def key(self, c):
        return c.last_access, c.inserted

    def evicted(self, candidates):
        self.told.append([c.block for c in candidates])


class _RecordingChooser(_Recording):
    """The same order through its own `choose` (the path without the queue)."""

    def choose(self, candidates, num_blocks):
        return KeyedEviction.choose(self, candidates, num_blocks)


@pytest.mark.parametrize("cache_name", ["radix", "hash"])
@pytest.mark.parametrize("policy_class", [_Recording, _RecordingChooser])
def test_an_observing_policy_is_told_every_eviction_on_both_paths(cache_name, policy_class):
    policy = policy_class()
    assert isinstance(policy, EvictionObserver)
    cache = _cache(cache_name, policy)
    assert (cache._queue is not None) == (policy_class is _Recording)  # observing keeps the queue
    cached_before = set()
    for index in range(8):
        _serve(cache, f"s{index}", [10 + index] * 8 + [1])
        cached_before |= {b for b in range(12) if b in cache.index}
    told = [block for call in policy.told for block in call]
    assert policy.told and all(call for call in policy.told)
    # everything it was told of had been cached, and is cached no more unless reused since
    assert set(told) <= cached_before
    assert cache.stats().num_used_blocks == 0


@pytest.mark.parametrize("cache_name", ["radix", "hash"])
def test_gdsf_keeps_its_queue_and_its_clock_rises(cache_name):
    policy = GDSF(None, EvictionContext(12, 4))
    cache = _cache(cache_name, policy)
    assert cache._queue is not None
    for index in range(10):
        _serve(cache, f"s{index}", [10 + index] * 8 + [1])
    assert policy.clock > 0


@pytest.mark.parametrize("cache_name", ["radix", "hash"])
def test_keys_that_move_are_refused_naming_the_rule(cache_name):
    cache = _cache(cache_name, GDSFLiveClock(None, EvictionContext(12, 4)))
    with pytest.raises(PolicyViolation, match=f"invariant violated: {PURE_KEYS}"):
        for index in range(10):
            _serve(cache, f"s{index}", [10 + index] * 8 + [1])


class _ShallowestFirst(KeyedEviction):
    """Evicts the first block of a prompt before the blocks after it."""

    def key(self, c):
        return c.depth, c.inserted


def test_hash_evicts_a_block_with_its_orphaned_descendants():
    cache = _cache("hash", _ShallowestFirst(), num_blocks=8)
    _serve(cache, "a", [10] * 12 + [1])  # three cached blocks in a chain
    assert len(cache.index) == 3
    _serve(cache, "b", [20] * 24 + [1])  # needs 7 blocks: the chain's first block goes first
    index = cache.index
    for block, entry in index.cached.items():
        assert entry.depth == 1 or entry.parent_hash in index.block_of, f"block {block} is orphaned"
    assert not any(entry.tokens == (10,) * 4 for entry in index.cached.values())  # the whole chain went
    assert cache.stats().num_used_blocks == 0
