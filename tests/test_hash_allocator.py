"""The hash allocator's own behaviour (the contracts check what every allocator must
do): chained block hashes, LRU eviction tail first, collisions that miss, drafts never
cached, and reset_prefix_cache for both prefix caches."""

from __future__ import annotations

import pytest

from servelab.interfaces import AllocatorContext
from servelab.plugins.allocators import hash_prefix
from servelab.plugins.allocators.hash_prefix import HashAllocator
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.sampling_params import SamplingParams
from servelab.sequence import Sequence


def make(cls=HashAllocator, num_blocks: int = 10, block_size: int = 4, max_model_len: int = 24):
    return cls(None, AllocatorContext(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len))


def seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(), 0.0)


def compute(alloc, seq_id: str, tokens: list[int], free: bool = True) -> int:
    """Admit, compute every token, cache; returns the prefix hit."""
    s = seq(seq_id, tokens)
    s.num_computed_tokens = alloc.match_prefix(s)
    hit = s.num_computed_tokens
    assert alloc.allocate(seq_id, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    alloc.cache_blocks(s)
    if free:
        alloc.free(seq_id)
    return hit


X0, X1, Y0, Z1 = [1] * 4, [2] * 4, [3] * 4, [4] * 4


def test_a_block_is_named_by_its_whole_prefix():
    alloc = make()
    compute(alloc, "x", X0 + X1 + [9])
    compute(alloc, "y", Y0 + Z1 + [9])
    assert compute(alloc, "mixed", Y0 + X1 + [9]) == 4, "X1 after Y0 is not X1 after X0"
    assert compute(alloc, "x-again", X0 + X1 + [8]) == 8


def test_eviction_takes_the_least_recently_used_and_a_sequence_tail_first():
    alloc = make(num_blocks=6)
    compute(alloc, "a", X0 + X1)  # blocks 0, 1
    compute(alloc, "b", Y0 + Z1)  # blocks 2, 3; 4 and 5 stay free
    assert alloc.allocate("c", 12)
    assert alloc.block_table("c") == [4, 5, 1], "a is least recently used, and its tail block goes first"
    assert compute(alloc, "a-again", X0 + [7]) == 4, "a's first block is still cached"
    assert alloc.allocate("c", 20)
    assert alloc.block_table("c")[3:] == [3, 2], "then b's blocks, tail first"


def test_a_hit_refreshes_the_blocks_it_uses():
    alloc = make(num_blocks=5)
    compute(alloc, "a", X0 + [9])  # block 0 cached
    compute(alloc, "b", Y0 + [9])  # block 2 cached (block 1 was a's partial block, freed first)
    assert compute(alloc, "a2", X0 + [8]) == 4  # a's block is now the most recently used
    assert alloc.allocate("c", 16)  # 4 blocks: 3 free, then one evicted
    assert 2 in alloc.block_table("c") and 0 not in alloc.block_table("c")


def test_a_parent_block_is_never_evicted_before_its_child():
    alloc = make(num_blocks=4)
    compute(alloc, "a", X0 + X1 + [9])  # blocks 0 (X0) and 1 (X1) cached, block 2 freed
    assert alloc.allocate("c", 4) and alloc.allocate("d", 8)  # three blocks: the two free ones and one evicted
    assert 1 in alloc.block_table("d"), "X1, the tail, is evicted first"
    alloc.free("c")
    alloc.free("d")
    assert compute(alloc, "a2", X0 + [7]) == 4, "X0 is still cached and found"


def test_a_hash_collision_is_a_miss_not_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(hash_prefix, "chained_hash", lambda parent_hash, tokens: 42)  # every block collides
    alloc = make()
    compute(alloc, "x", X0 + X1 + [9])
    assert compute(alloc, "y", Y0 + X1 + [9]) == 0, "the stored tokens differ: a miss"
    assert compute(alloc, "x-again", X0 + [9]) == 4, "the block that owns the name is still found"
    assert alloc.stats().num_cached_blocks == 1, "colliding blocks are not cached"


def test_drafts_are_never_cached():
    alloc = make()
    s = seq("a", X0 + [5, 6])
    s.num_computed_tokens = alloc.match_prefix(s)
    s.draft_token_ids = [7, 8]  # tokens 6 and 7: they would fill block 1
    assert alloc.allocate("a", s.num_tokens + 2)
    s.num_computed_tokens = s.num_tokens + 2
    alloc.cache_blocks(s)
    alloc.free("a")
    assert alloc.stats().num_cached_blocks == 1, "only the block of verified tokens"
    assert compute(alloc, "b", X0 + [5, 6, 7, 8, 9]) == 4


@pytest.mark.parametrize("cls", [RadixAllocator, HashAllocator])
def test_reset_prefix_cache_drops_unheld_blocks_and_keeps_held_ones(cls):
    alloc = make(cls)
    compute(alloc, "a", X0 + X1 + [9])
    compute(alloc, "b", Y0 + Z1 + [9], free=False)
    alloc.reset_prefix_cache()
    stats = alloc.stats()
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks) == (3, 0, 7)
    assert compute(alloc, "a2", X0 + X1 + [9]) == 0, "a's prefix was dropped"
    assert compute(alloc, "b2", Y0 + Z1 + [8]) == 8, "b still holds its blocks: they stay cached"
    assert stats.num_prefix_lookups == 2, "the statistics keep counting across a reset"


def test_a_router_summary_of_the_cached_blocks_matches_the_routers_hashes_of_the_prompt():
    from servelab.interfaces import ReplicaSnapshot, RouteRequest, RouterContext, prefix_block_hashes
    from servelab.plugins.routers.prefix_affinity import PrefixAffinityOptions, PrefixAffinityRouter

    alloc = make()
    prompt = X0 + X1 + Y0 + [9]
    compute(alloc, "x", prompt)
    summary = alloc.prefix_summary()
    assert summary.block_hashes == frozenset(prefix_block_hashes(prompt, 4))
    assert summary.cached_tokens(X0 + X1 + Z1) == 8 and summary.cached_tokens(Y0 + X1) == 0

    router = PrefixAffinityRouter(PrefixAffinityOptions(), RouterContext(num_replicas=2, block_size=4))
    replicas = [ReplicaSnapshot(replica_id=0, block_size=4),
                ReplicaSnapshot(replica_id=1, block_size=4, prefix_summary=summary)]
    assert router.route(RouteRequest("r", X0 + X1 + [5]), replicas) == 1, "the replica that caches the prefix"
