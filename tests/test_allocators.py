"""Exact bookkeeping of the naive, paged and radix allocators and the radix tree:
block ids, copies, ref counts, eviction order and stats, step by step."""

from __future__ import annotations

import pytest

from servelab.errors import ConfigError
from servelab.interfaces import (
    AllocatorContext,
    ForkingAllocator,
    KVAllocator,
    PrefixCachingAllocator,
    SchedulerContext,
)
from servelab.plugins.allocators.naive import NaiveAllocator
from servelab.kit import PagedAllocator
from servelab.plugins.allocators.hash_prefix import HashAllocator
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.plugins.allocators.radix_tree import RadixTree
from servelab.kit import ContinuousScheduler
from servelab.sampling_params import SamplingParams
from servelab.sequence import Sequence


def make(cls, num_blocks: int = 10, block_size: int = 4, max_model_len: int = 12):
    return cls(None, AllocatorContext(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len))


def seq(seq_id: str, tokens: list[int], num_computed: int = 0) -> Sequence:
    s = Sequence(seq_id, list(tokens), SamplingParams(), 0.0)
    s.num_computed_tokens = num_computed
    return s


@pytest.mark.parametrize("cls", [NaiveAllocator, PagedAllocator, RadixAllocator, HashAllocator])
def test_capabilities(cls):
    alloc = make(cls)
    assert isinstance(alloc, KVAllocator) and isinstance(alloc, ForkingAllocator)
    assert isinstance(alloc, PrefixCachingAllocator) is (cls in (RadixAllocator, HashAllocator))


# ---------------------------------------------------------------- naive


def test_naive_reserves_max_model_len_first_fit():
    alloc = make(NaiveAllocator)  # 10 blocks, reservations of 3
    for name in "abc":
        assert alloc.allocate(name, 1)
    assert [alloc.block_table(n) for n in "abc"] == [[0], [3], [6]]
    stats = alloc.stats()
    assert (stats.num_used_blocks, stats.num_free_blocks) == (9, 1)
    assert stats.num_token_slots_used == 3
    assert stats.num_token_slots_reserved_empty == 9 * 4 - 3
    # Block 9 is free, yet no request fits: 4 free slots no reservation can use.
    assert stats.num_free_slots_unusable == 4
    assert not alloc.allocate("d", 1)
    alloc.free("b")
    assert alloc.allocate("d", 5)
    assert alloc.block_table("d") == [3, 4], "first fit: the hole b left"


def test_naive_free_merges_neighbours():
    alloc = make(NaiveAllocator, num_blocks=11)
    for name in "abc":
        assert alloc.allocate(name, 12)
    assert alloc.stats().num_free_slots_unusable == 2 * 4
    alloc.free("a")
    alloc.free("c")
    assert alloc._free_runs == [[0, 3], [6, 5]]
    alloc.free("b")
    assert alloc._free_runs == [[0, 11]]
    assert alloc.stats().num_free_slots_unusable == 2 * 4  # 11 = 3 * 3 + 2


def test_naive_cannot_grow_past_its_reservation():
    alloc = make(NaiveAllocator)
    assert alloc.allocate("a", 12)
    assert not alloc.allocate("a", 13)
    assert alloc.block_table("a") == [0, 1, 2]


def test_naive_fork_copies_into_a_run_of_its_own():
    alloc = make(NaiveAllocator)
    assert alloc.allocate("a", 5)
    assert alloc.fork("a", "b")
    assert alloc.block_table("b") == [3, 4]
    assert alloc.take_block_copies() == [(0, 3), (1, 4)]
    assert alloc.take_block_copies() == []
    assert [alloc.ref_count(b) for b in range(5)] == [1, 1, 0, 1, 1]
    assert alloc.fork("a", "c")
    alloc.take_block_copies()
    before = alloc.stats()
    assert not alloc.fork("a", "d"), "only block 9 is left"
    assert alloc.stats() == before and alloc.take_block_copies() == []


def test_naive_rollback_and_zero_token_allocations():
    alloc = make(NaiveAllocator)
    assert alloc.allocate("z", 0) and alloc.block_table("z") == []
    assert alloc.stats().num_used_blocks == 0, "nothing reserved for zero tokens"
    assert alloc.allocate("a", 9)
    alloc.rollback("a", 6)
    assert alloc.block_table("a") == [0]
    assert alloc.stats().num_token_slots_used == 3


def test_naive_reservation_larger_than_the_pool_is_a_config_error():
    with pytest.raises(ConfigError, match="max_model_len=40"):
        make(NaiveAllocator, num_blocks=9, max_model_len=40)


# ---------------------------------------------------------------- paged: fork, copy-on-write, rollback


def test_fork_shares_every_block():
    alloc = make(PagedAllocator)
    assert alloc.allocate("p", 10)  # [0, 1, 2], block 2 half full
    assert alloc.fork("p", "c")
    assert alloc.block_table("c") == [0, 1, 2]
    assert [alloc.ref_count(b) for b in range(4)] == [2, 2, 2, 0]
    stats = alloc.stats()
    assert (stats.num_used_blocks, stats.num_token_slots_used, stats.num_token_slots_reserved_empty) == (3, 10, 2)
    assert alloc.take_block_copies() == []


def test_write_into_a_shared_partial_block_copies_it_first():
    alloc = make(PagedAllocator)
    assert alloc.allocate("p", 10)
    assert alloc.fork("p", "c")
    assert alloc.allocate("c", 11)
    assert alloc.block_table("c") == [0, 1, 3]
    assert alloc.take_block_copies() == [(2, 3)]
    assert [alloc.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    # The parent is now block 2's only holder: it writes in place.
    assert alloc.allocate("p", 12)
    assert alloc.block_table("p") == [0, 1, 2]
    assert alloc.take_block_copies() == []
    stats = alloc.stats()
    assert (stats.num_used_blocks, stats.num_token_slots_used) == (4, 8 + 4 + 3)


def test_full_shared_blocks_are_never_copied():
    alloc = make(PagedAllocator)
    assert alloc.allocate("p", 8)
    assert alloc.fork("p", "c")
    assert alloc.allocate("c", 9)
    assert alloc.block_table("c") == [0, 1, 2]
    assert alloc.take_block_copies() == []


def test_copy_needs_a_free_block_or_nothing_changes():
    alloc = make(PagedAllocator, num_blocks=3)
    assert alloc.allocate("p", 10)
    assert alloc.fork("p", "c")
    assert not alloc.allocate("c", 11)
    assert alloc.block_table("c") == [0, 1, 2] and alloc.take_block_copies() == []


def test_rollback_returns_whole_blocks_and_copies_on_the_next_shared_write():
    alloc = make(PagedAllocator)
    assert alloc.allocate("p", 8)
    assert alloc.fork("p", "c")
    assert alloc.allocate("c", 11)  # [0, 1, 2]
    alloc.rollback("c", 5)  # back to 6 tokens: block 2 returns, block 1 (shared) is partial
    assert alloc.block_table("c") == [0, 1]
    assert alloc.ref_count(2) == 0 and alloc.stats().num_free_blocks == 8
    assert alloc.allocate("c", 7)
    assert alloc.block_table("c") == [0, 2], "the parent still reads block 1: copy (into the lowest free block)"
    assert alloc.take_block_copies() == [(1, 2)]


def test_fork_into_a_sequence_that_holds_blocks_is_an_error():
    alloc = make(PagedAllocator)
    assert alloc.allocate("a", 1) and alloc.allocate("b", 1)
    with pytest.raises(ValueError, match="already holds"):
        alloc.fork("a", "b")
    assert alloc.fork("nobody", "c") and alloc.block_table("c") == []


# ---------------------------------------------------------------- radix tree


def test_radix_tree_splits_runs_where_prefixes_part_and_prints_itself():
    tree = RadixTree()
    assert tree.insert(None, (1, 2), 10) == 10
    assert tree.insert(10, (3, 4), 11) == 11  # extends the leaf's run
    assert tree.format() == "RadixTree: 2 blocks, 1 nodes\n└── [10,11] 1 2 3 4  (used 2)"
    assert tree.insert(10, (5, 6), 12) == 12  # splits [10, 11] after 10
    assert tree.insert(10, (3, 4), 99) == 11, "already cached: the cached block wins"
    assert 99 not in tree and len(tree) == 3
    assert str(tree) == "\n".join([
        "RadixTree: 3 blocks, 3 nodes",
        "└── [10] 1 2  (used 4)",
        "    ├── [11] 3 4  (used 4)",
        "    └── [12] 5 6  (used 3)",
    ])
    assert tree.match([(1, 2), (5, 6), (7, 8)]) == [10, 12]
    assert tree.match([(1, 2), (3, 4)]) == [10, 11]
    assert tree.match([(2, 1)]) == []


def test_radix_tree_evicts_lru_leaves_first_each_from_its_tail():
    tree = RadixTree()
    tree.insert(None, (1,), 0)
    tree.insert(0, (2,), 1)
    tree.insert(1, (3,), 2)  # run [0, 1, 2]
    tree.insert(0, (9,), 3)  # split: [0] -> [1, 2] and [3]
    tree.insert(None, (7,), 4)
    tree.match([(1,), (2,), (3,)])  # [0] and [1, 2] used most recently; [3] and [4] before
    held = {1}
    assert tree.evict(10, lambda b: b not in held) == [3, 4, 2]
    # Block 1 is held, so its node stays, and so does its parent.
    assert sorted(tree.match([(1,), (2,), (3,)])) == [0, 1]
    held.clear()
    assert tree.evict(10, lambda b: True) == [1, 0]
    assert len(tree) == 0 and tree.format() == "RadixTree: 0 blocks, 0 nodes"


def test_radix_tree_evicts_only_as_many_as_asked():
    tree = RadixTree()
    for block in range(4):
        tree.insert(block - 1 if block else None, (block,), block)
    assert tree.evict(2, lambda b: True) == [3, 2]
    assert tree.match([(0,), (1,), (2,)]) == [0, 1]


# ---------------------------------------------------------------- radix allocator


PREFIX_CACHES = [RadixAllocator, HashAllocator]


def admit(alloc, s: Sequence) -> int:
    """What the scheduler does: look up the prefix, allocate the rest."""
    s.num_computed_tokens = alloc.match_prefix(s)
    assert alloc.allocate(s.request_id, s.num_tokens)
    return s.num_computed_tokens


def run_to_end(alloc, s: Sequence) -> None:
    """The engine computes every token, caches the full blocks, and the sequence finishes."""
    s.num_computed_tokens = s.num_tokens
    alloc.cache_blocks(s)
    alloc.free(s.request_id)


@pytest.mark.parametrize("cls", PREFIX_CACHES)
def test_prefix_cache_reuses_full_blocks_of_a_finished_sequence(cls):
    alloc = make(cls)
    first = seq("a", list(range(10)))
    assert admit(alloc, first) == 0
    run_to_end(alloc, first)
    stats = alloc.stats()
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks) == (0, 2, 8)
    # The partial third block was never cached; the first two are found again.
    second = seq("b", list(range(10)) + [50, 51])
    assert admit(alloc, second) == 8
    assert alloc.block_table("b") == [0, 1, 3]
    stats = alloc.stats()
    assert (stats.prefix_hit_tokens, stats.prefix_lookup_tokens, stats.num_prefix_lookups) == (8, 22, 2)
    assert (stats.num_used_blocks, stats.num_cached_blocks) == (3, 0)


@pytest.mark.parametrize("cls", PREFIX_CACHES)
def test_prefix_cache_always_leaves_one_token_to_compute(cls):
    alloc = make(cls)
    first = seq("a", list(range(8)))
    admit(alloc, first)
    run_to_end(alloc, first)
    again = seq("b", list(range(8)))
    assert admit(alloc, again) == 4, "8 cached tokens, but the last block is recomputed for logits"


@pytest.mark.parametrize("cls", PREFIX_CACHES)
def test_prefix_cache_failed_admission_is_not_counted_and_unpins(cls):
    alloc = make(cls, num_blocks=4, max_model_len=16)
    first = seq("a", list(range(8)))
    admit(alloc, first)
    run_to_end(alloc, first)
    assert alloc.allocate("big", 8)  # holds 2 of the 2 free blocks
    second = seq("b", list(range(8)) + [1, 2, 3, 4, 5])
    assert alloc.match_prefix(second) == 8
    assert not alloc.allocate("b", second.num_tokens)  # needs 2 more blocks, none left
    alloc.free("b")
    stats = alloc.stats()
    assert (stats.num_prefix_lookups, stats.prefix_hit_tokens) == (1, 0)
    assert (stats.num_used_blocks, stats.num_cached_blocks) == (2, 2)


@pytest.mark.parametrize("cls", PREFIX_CACHES)
def test_prefix_cache_evicts_only_when_the_free_list_is_dry_lru_first(cls):
    alloc = make(cls, num_blocks=6, max_model_len=24)
    for name, tokens in (("a", [1] * 8), ("b", [2] * 8)):
        s = seq(name, tokens)
        admit(alloc, s)
        run_to_end(alloc, s)
    # a's blocks [0, 1] and b's [2, 3] are cached; blocks 4 and 5 are free.
    assert alloc.allocate("c", 8)
    assert alloc.block_table("c") == [4, 5]
    assert alloc.stats().num_cached_blocks == 4, "nothing evicted while the free list had blocks"
    assert alloc.allocate("c", 16)
    assert alloc.block_table("c") == [4, 5, 1, 0], "a is least recently used: its leaf block first"
    assert alloc.stats().num_cached_blocks == 2
    alloc.free("c")
    assert admit(alloc, seq("d", [2] * 9)) == 8, "b's prefix survived"


def test_radix_never_shares_a_partial_block_and_copies_a_cached_one_before_writing():
    alloc = make(RadixAllocator)
    s = seq("a", [7] * 8)
    admit(alloc, s)
    s.num_computed_tokens = 8
    alloc.cache_blocks(s)
    assert alloc.block_table("a") == [0, 1] and 1 in alloc.tree
    alloc.rollback("a", 2)  # block 1, cached, is now a's partial last block
    assert alloc.allocate("a", 7)
    assert alloc.block_table("a") == [0, 2]
    assert alloc.take_block_copies() == [(1, 2)]
    assert alloc.ref_count(1) == 0 and alloc.stats().num_cached_blocks == 1


def test_radix_merges_blocks_two_sequences_computed_in_one_step():
    alloc = make(RadixAllocator)
    a, b = seq("a", [3] * 8 + [4]), seq("b", [3] * 8 + [5] * 4)
    admit(alloc, a)
    admit(alloc, b)  # both computed the same first 8 tokens in one step: no hit for b
    assert alloc.block_table("a") == [0, 1, 2] and alloc.block_table("b") == [3, 4, 5]
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        alloc.cache_blocks(s)
    assert alloc.block_table("b") == [0, 1, 5], "b switched to a's cached blocks and freed its own"
    assert [alloc.ref_count(block) for block in range(6)] == [2, 2, 1, 0, 0, 1]
    assert len(alloc.tree) == 3 and 5 in alloc.tree, "b's own last block is cached after a's prefix"
    assert alloc.stats().num_free_blocks == 6
    alloc.free("a")
    alloc.free("b")
    assert alloc.stats().num_cached_blocks == 3


@pytest.mark.parametrize("cls", PREFIX_CACHES)
def test_prefix_cache_cached_blocks_of_a_fork_are_shared_by_both(cls):
    alloc = make(cls)
    parent = seq("p", list(range(10)))
    admit(alloc, parent)
    parent.num_computed_tokens = 10
    alloc.cache_blocks(parent)
    assert alloc.fork("p", "c")
    assert alloc.allocate("c", 11)
    assert alloc.block_table("c") == [0, 1, 3] and alloc.take_block_copies() == [(2, 3)]
    alloc.free("p")
    alloc.free("c")
    stats = alloc.stats()
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks) == (0, 2, 8)


# ---------------------------------------------------------------- the scheduler with these capabilities


def scheduler_over(alloc, max_num_seqs: int = 4) -> ContinuousScheduler:
    return ContinuousScheduler(None, SchedulerContext(allocator=alloc, max_num_seqs=max_num_seqs,
                                                      max_num_batched_tokens=64, max_model_len=12,
                                                      clock=lambda: 0.0))


def test_scheduler_computes_only_the_uncached_tail():
    alloc = make(RadixAllocator, max_model_len=32)
    sched = ContinuousScheduler(None, SchedulerContext(allocator=alloc, max_num_seqs=4, max_num_batched_tokens=32,
                                                       max_model_len=32, clock=lambda: 0.0))
    first = seq("a", list(range(10)))
    sched.add(first)
    assert [(s.request_id, n) for s, n in sched.schedule().scheduled] == [("a", 10)]
    first.num_computed_tokens = 10
    first.output_token_ids.append(99)
    alloc.cache_blocks(first)
    second = seq("b", list(range(9)))
    sched.add(second)
    plan = sched.schedule()
    assert sorted((s.request_id, n) for s, n in plan.scheduled) == [("a", 1), ("b", 1)]
    assert second.num_computed_tokens == 8
    assert alloc.block_table("b")[:2] == alloc.block_table("a")[:2] == [0, 1]


def test_scheduler_fork_runs_children_and_trims_the_batch_to_max_num_seqs():
    alloc = make(PagedAllocator)
    sched = scheduler_over(alloc, max_num_seqs=2)
    parent = seq("p", [1, 2, 3])
    sched.add(parent)
    sched.schedule()
    parent.num_computed_tokens = 3
    parent.output_token_ids.append(9)
    children = [seq(f"p#{i}", [1, 2, 3]) for i in (1, 2)]
    for child in children:
        child.output_token_ids.append(9)
    sched.fork(parent, children)
    assert all(c.num_computed_tokens == 3 for c in children)
    assert alloc.block_table("p#1") == alloc.block_table("p") == [0]
    plan = sched.schedule()
    assert plan.preempted == (children[1],), "three running, two allowed: the newest waits"
    assert children[1].num_computed_tokens == 0 and alloc.block_table("p#2") == []
    assert sorted((s.request_id, n) for s, n in plan.scheduled) == [("p", 1), ("p#1", 1)]
    assert alloc.take_block_copies() == [(0, 1)], "p wrote first into the shared block: p copies"


def test_scheduler_fork_without_memory_queues_the_child_to_recompute():
    alloc = make(NaiveAllocator, num_blocks=5)  # room for one reservation of 3 blocks
    sched = scheduler_over(alloc)
    parent = seq("p", [1, 2, 3])
    sched.add(parent)
    sched.schedule()
    parent.num_computed_tokens = 3
    child = seq("p#1", [1, 2, 3])
    sched.fork(parent, [child])
    assert list(sched.waiting) == [child] and child.num_computed_tokens == 0
