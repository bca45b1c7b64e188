"""The paged allocator's exact bookkeeping.

PagedAllocator hands out physical block ids from a FIFO free list: a sequence holding
N tokens owns exactly ceil(N / block_size) blocks, allocation is all-or-nothing, and a
freed sequence's blocks go to the back of the free list in table order. These tests
pin the exact ids, not just counts, and a hypothesis state machine replays random
allocate / grow / free sequences against a plain-Python model of the free list.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from servelab.interfaces import AllocatorContext, KVAllocator
from servelab.kit import PagedAllocator, blocks_for

BLOCK_SIZE = 4


def make(num_blocks: int = 8, block_size: int = BLOCK_SIZE, max_model_len: int = 64) -> PagedAllocator:
    return PagedAllocator(None, AllocatorContext(num_blocks=num_blocks, block_size=block_size,
                                                 max_model_len=max_model_len))


def test_satisfies_the_protocol():
    assert isinstance(make(), KVAllocator)


def test_fresh_pool_is_all_free():
    stats = make(num_blocks=5).stats()
    assert (stats.num_blocks, stats.num_used_blocks, stats.num_free_blocks) == (5, 0, 5)
    assert stats.num_token_slots_used == 0
    assert stats.num_token_slots_reserved_empty == 0


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in range(0, 10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert blocks_for(7, 1) == 7


def test_block_ids_come_in_free_list_order():
    alloc = make(num_blocks=8)
    assert alloc.allocate("a", 5)  # 2 blocks
    assert alloc.allocate("b", 4)  # 1 block
    assert alloc.allocate("c", 12)  # 3 blocks
    assert alloc.block_table("a") == [0, 1]
    assert alloc.block_table("b") == [2]
    assert alloc.block_table("c") == [3, 4, 5]


def test_block_boundary_off_by_one():
    alloc = make(num_blocks=8)
    assert alloc.allocate("s", 8)
    assert alloc.block_table("s") == [0, 1], "8 tokens at block size 4 fill exactly 2 blocks"
    assert alloc.allocate("s", 8)
    assert alloc.block_table("s") == [0, 1], "growing 8 -> 8 must take no block"
    assert alloc.stats().num_free_blocks == 6
    assert alloc.allocate("s", 9)
    assert alloc.block_table("s") == [0, 1, 2], "the 9th token needs a third block"
    for n in (10, 11, 12):
        assert alloc.allocate("s", n)
        assert alloc.block_table("s") == [0, 1, 2]
    assert alloc.allocate("s", 13)
    assert alloc.block_table("s") == [0, 1, 2, 3]


def test_growth_appends_to_the_existing_table():
    alloc = make(num_blocks=8)
    assert alloc.allocate("a", 1)
    assert alloc.allocate("b", 1)
    assert alloc.allocate("a", 5)  # a's second block comes after b's
    assert alloc.block_table("a") == [0, 2]
    assert alloc.block_table("b") == [1]


def test_smaller_request_keeps_what_is_held():
    alloc = make(num_blocks=8)
    assert alloc.allocate("s", 9)
    assert alloc.allocate("s", 2)
    assert alloc.block_table("s") == [0, 1, 2]
    assert alloc.stats().num_token_slots_used == 9


def test_allocate_is_all_or_nothing():
    alloc = make(num_blocks=4)
    assert alloc.allocate("a", 10)  # 3 blocks, 1 left
    before = (alloc.stats(), list(alloc.block_table("a")))

    assert alloc.allocate("b", 5) is False  # needs 2
    assert alloc.block_table("b") == []
    assert alloc.allocate("a", 17) is False  # needs 2 more
    assert (alloc.stats(), list(alloc.block_table("a"))) == before

    # The one free block is still the one the next allocation gets.
    assert alloc.allocate("b", 4)
    assert alloc.block_table("b") == [3]
    assert alloc.stats().num_free_blocks == 0


def test_exactly_filling_the_pool_succeeds():
    alloc = make(num_blocks=3)
    assert alloc.allocate("a", 12)
    assert alloc.stats().num_free_blocks == 0
    assert alloc.allocate("a", 12)  # no growth needed
    assert alloc.allocate("b", 0)  # zero tokens need zero blocks
    assert alloc.block_table("b") == []
    assert alloc.allocate("c", 1) is False


def test_the_lowest_free_block_goes_first():
    alloc = make(num_blocks=6)
    assert alloc.allocate("a", 8)  # [0, 1]
    assert alloc.allocate("b", 8)  # [2, 3]
    alloc.free("a")
    assert alloc.block_table("a") == []
    # Free: 0, 1, 4, 5. a's freed blocks come before the never-used ones.
    assert alloc.allocate("c", 16)
    assert alloc.block_table("c") == [0, 1, 4, 5]
    alloc.free("c")
    assert alloc.allocate("d", 4)
    assert alloc.block_table("d") == [0]
    alloc.free("b")
    assert alloc.allocate("e", 20)
    assert alloc.block_table("e") == [1, 2, 3, 4, 5]


def test_free_of_unknown_or_twice_is_a_no_op():
    alloc = make(num_blocks=4)
    assert alloc.allocate("a", 6)
    before = alloc.stats()
    alloc.free("nobody")
    assert alloc.stats() == before
    alloc.free("a")
    alloc.free("a")
    stats = alloc.stats()
    assert (stats.num_used_blocks, stats.num_free_blocks) == (0, 4)
    # A second free must not have put a's blocks on the free list twice.
    assert alloc.allocate("b", 16)
    assert sorted(alloc.block_table("b")) == [0, 1, 2, 3]
    assert alloc.allocate("c", 1) is False


def test_freed_id_can_be_reused_from_scratch():
    alloc = make(num_blocks=4)
    assert alloc.allocate("a", 9)
    alloc.free("a")
    assert alloc.allocate("a", 1)
    assert alloc.block_table("a") == [0]
    assert alloc.stats().num_token_slots_used == 1


def test_stats_count_slots():
    alloc = make(num_blocks=10)
    assert alloc.allocate("a", 5)  # 2 blocks, 3 empty slots
    assert alloc.allocate("b", 8)  # 2 blocks, 0 empty
    assert alloc.allocate("c", 1)  # 1 block, 3 empty
    stats = alloc.stats()
    assert stats.num_blocks == 10
    assert stats.num_used_blocks == 5
    assert stats.num_free_blocks == 5
    assert stats.num_token_slots_used == 14
    assert stats.num_token_slots_reserved_empty == 5 * BLOCK_SIZE - 14 == 6
    alloc.free("b")
    stats = alloc.stats()
    assert (stats.num_used_blocks, stats.num_free_blocks) == (3, 7)
    assert stats.num_token_slots_used == 6
    assert stats.num_token_slots_reserved_empty == 6


# ---------------------------------------------------------------- random sequences


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / grow / free, checked against a model of the free list (a set whose
    lowest ids go first)."""

    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4, 16]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.alloc = make(num_blocks=num_blocks, block_size=block_size, max_model_len=num_blocks * block_size)
        self.free_model: set[int] = set(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, int] = {}
        self.counter = 0

    def _expect_allocate(self, seq_id: str, num_tokens: int) -> None:
        table = self.tables.get(seq_id, [])
        need = blocks_for(num_tokens, self.block_size) - len(table)
        fits = need <= len(self.free_model)
        before = self.alloc.stats()
        assert self.alloc.allocate(seq_id, num_tokens) is fits
        if not fits:
            assert self.alloc.stats() == before
            return
        taken = sorted(self.free_model)[:max(need, 0)]
        self.free_model -= set(taken)
        self.tables[seq_id] = table + taken
        self.tokens[seq_id] = max(num_tokens, self.tokens.get(seq_id, 0))

    @rule(target=seqs, num_tokens=st.integers(0, 40))
    def allocate_new(self, num_tokens: int) -> str:
        seq_id = f"s{self.counter}"
        self.counter += 1
        self._expect_allocate(seq_id, num_tokens)
        return seq_id

    @rule(seq_id=seqs, delta=st.integers(0, 12))
    def grow(self, seq_id: str, delta: int) -> None:
        self._expect_allocate(seq_id, self.tokens.get(seq_id, 0) + delta)

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id: str) -> None:
        self.alloc.free(seq_id)
        self.free_model |= set(self.tables.pop(seq_id, []))
        self.tokens.pop(seq_id, None)

    @rule()
    def free_unknown(self) -> None:
        before = self.alloc.stats()
        self.alloc.free("never-allocated")
        assert self.alloc.stats() == before

    @invariant()
    def tables_match_the_model(self) -> None:
        for seq_id, table in self.tables.items():
            assert list(self.alloc.block_table(seq_id)) == table

    @invariant()
    def every_table_has_exactly_the_blocks_its_tokens_need(self) -> None:
        for seq_id, num_tokens in self.tokens.items():
            assert len(self.alloc.block_table(seq_id)) == blocks_for(num_tokens, self.block_size)

    @invariant()
    def ids_partition_the_pool(self) -> None:
        held = [b for seq_id in self.tables for b in self.alloc.block_table(seq_id)]
        assert len(held) == len(set(held)), "a block id sits in two tables"
        stats = self.alloc.stats()
        assert stats.num_used_blocks + stats.num_free_blocks == stats.num_blocks == self.num_blocks
        assert stats.num_used_blocks == len(held)
        assert sorted(held + list(self.free_model)) == list(range(self.num_blocks))

    @invariant()
    def slot_stats_add_up(self) -> None:
        stats = self.alloc.stats()
        used_tokens = sum(self.tokens.values())
        assert stats.num_token_slots_used == used_tokens
        assert stats.num_token_slots_reserved_empty == stats.num_used_blocks * self.block_size - used_tokens
        assert 0 <= stats.num_token_slots_reserved_empty


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
