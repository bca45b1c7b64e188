"""Every built-in allocator against one hypothesis state machine.

Random sequences of allocate (with a prefix-cache lookup where the allocator has one),
append, fork, write, rollback and free run against a simulated KV cache: `write`
performs the block copies the allocator queued, then stores each sequence's new tokens
in the slots its block table names, the way the runner does. After every rule: each
block's ref count equals the number of tables holding it, no block is lost or counted
twice, and the slot statistics add up; after every write, every sequence still reads
exactly its own tokens through its block table (copy-on-write kept writers apart, and
prefix-cache hits hold the right tokens); at the end, with everything freed, the whole
pool is allocatable again.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from servelab.interfaces import AllocatorContext, ForkingAllocator, KVAllocator, PrefixCachingAllocator
from servelab.plugins.allocators.naive import NaiveAllocator
from servelab.plugins.allocators.paged import PagedAllocator, blocks_for
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.sampling_params import SamplingParams
from servelab.sequence import Sequence

# Two token values only, so that prompts share prefixes and the prefix cache hits.
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=24)


class AllocatorMachine(RuleBasedStateMachine):
    """Subclasses set `factory`."""

    factory = None
    seqs = Bundle("seqs")

    @initialize(block_size=st.sampled_from([1, 2, 4]), max_blocks_per_seq=st.integers(1, 6), extra=st.integers(0, 10))
    def setup(self, block_size: int, max_blocks_per_seq: int, extra: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_blocks_per_seq * block_size
        self.num_blocks = max_blocks_per_seq + extra
        self.alloc = type(self).factory(None, AllocatorContext(num_blocks=self.num_blocks, block_size=block_size,
                                                                max_model_len=self.max_model_len))
        assert isinstance(self.alloc, KVAllocator) and isinstance(self.alloc, ForkingAllocator)
        self.caching = isinstance(self.alloc, PrefixCachingAllocator)
        self.store = [[None] * block_size for _ in range(self.num_blocks)]  # the simulated KV cache
        self.live: dict[str, Sequence] = {}  # tokens in prompt_token_ids; num_computed_tokens = written
        self.counter = 0

    # ------------------------------------------------------------ rules

    @rule(target=seqs, tokens=TOKENS)
    def allocate(self, tokens: list[int]) -> str:
        tokens = tokens[: self.max_model_len]
        seq_id = self._new_id()
        seq = Sequence(seq_id, list(tokens), SamplingParams(), 0.0)
        before = self.alloc.stats()
        if self.caching:
            hit = self.alloc.match_prefix(seq)
            assert hit % self.block_size == 0 and 0 <= hit < len(tokens)
            assert len(self.alloc.block_table(seq_id)) == hit // self.block_size
            seq.num_computed_tokens = hit
        if self.alloc.allocate(seq_id, len(tokens)):
            self.live[seq_id] = seq
        else:
            self.alloc.free(seq_id)  # what the scheduler does when admission fails
            assert self._counts(self.alloc.stats()) == self._counts(before)
            assert list(self.alloc.block_table(seq_id)) == []
        return seq_id

    @rule(seq_id=seqs, tokens=TOKENS)
    def append(self, seq_id: str, tokens: list[int]) -> None:
        seq = self.live.get(seq_id)
        if seq is None or not self._written(seq):
            return
        tokens = tokens[: self.max_model_len - seq.num_tokens]
        before = (self.alloc.stats(), list(self.alloc.block_table(seq_id)))
        if self.alloc.allocate(seq_id, seq.num_tokens + len(tokens)):
            seq.prompt_token_ids.extend(tokens)
        else:
            assert (self.alloc.stats(), list(self.alloc.block_table(seq_id))) == before

    @rule()
    def write(self) -> None:
        """One engine step: block copies first, then every pending token into its slot."""
        for source, destination in self.alloc.take_block_copies():
            self.store[destination] = list(self.store[source])
        for seq in self.live.values():
            table = self.alloc.block_table(seq.request_id)
            for position in range(seq.num_computed_tokens, seq.num_tokens):
                block, offset = divmod(position, self.block_size)
                self.store[table[block]][offset] = seq.prompt_token_ids[position]
            seq.num_computed_tokens = seq.num_tokens
            if self.caching:
                self.alloc.cache_blocks(seq)
        for seq in self.live.values():
            assert self._visible(seq) == seq.prompt_token_ids, f"{seq.request_id} reads another sequence's tokens"

    @rule(target=seqs, parent_id=seqs)
    def fork(self, parent_id: str) -> str:
        child_id = self._new_id()
        parent = self.live.get(parent_id)
        if parent is None or not self._written(parent):
            return child_id
        before = self.alloc.stats()
        if self.alloc.fork(parent_id, child_id):
            child = Sequence(child_id, list(parent.prompt_token_ids), SamplingParams(), 0.0)
            child.num_computed_tokens = child.num_tokens
            self.live[child_id] = child
            assert list(self.alloc.block_table(child_id)) == list(self.alloc.block_table(parent_id)) or (
                not self._shares_blocks())
        else:
            assert self._counts(self.alloc.stats()) == self._counts(before)
        return child_id

    @rule(seq_id=seqs, num_slots=st.integers(1, 8))
    def rollback(self, seq_id: str, num_slots: int) -> None:
        seq = self.live.get(seq_id)
        if seq is None or not self._written(seq):
            return
        num_slots = min(num_slots, seq.num_tokens)
        self.alloc.rollback(seq_id, num_slots)
        del seq.prompt_token_ids[seq.num_tokens - num_slots:]
        seq.num_computed_tokens = seq.num_tokens

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id: str) -> None:
        self.alloc.free(seq_id)
        self.live.pop(seq_id, None)
        assert list(self.alloc.block_table(seq_id)) == []

    @precondition(lambda self: self.live)
    @rule()
    def free_unknown_is_a_no_op(self) -> None:
        before = self.alloc.stats()
        self.alloc.free("never-allocated")
        assert self.alloc.stats() == before

    # ------------------------------------------------------------ invariants

    @invariant()
    def tables_fit_their_tokens(self) -> None:
        for seq_id, seq in self.live.items():
            table = list(self.alloc.block_table(seq_id))
            assert len(table) == blocks_for(seq.num_tokens, self.block_size)
            assert len(set(table)) == len(table), "a block twice in one table"
            assert all(0 <= b < self.num_blocks for b in table)

    @invariant()
    def ref_counts_equal_holders(self) -> None:
        holders = [0] * self.num_blocks
        for seq_id in self.live:
            for block in self.alloc.block_table(seq_id):
                holders[block] += 1
        assert [self.alloc.ref_count(b) for b in range(self.num_blocks)] == holders

    @invariant()
    def no_block_lost_or_double_counted(self) -> None:
        stats = self.alloc.stats()
        held = {b for seq_id in self.live for b in self.alloc.block_table(seq_id)}
        assert stats.num_used_blocks + stats.num_free_blocks + stats.num_cached_blocks == self.num_blocks
        assert min(stats.num_used_blocks, stats.num_free_blocks, stats.num_cached_blocks) >= 0
        assert stats.num_used_blocks >= len(held)
        if self._shares_blocks():
            assert stats.num_used_blocks == len(held)

    @invariant()
    def slot_stats_add_up(self) -> None:
        stats = self.alloc.stats()
        assert stats.num_token_slots_used + stats.num_token_slots_reserved_empty == \
            stats.num_used_blocks * self.block_size
        # A shared block holds as many tokens as its fullest holder has in it.
        fullest: dict[int, int] = {}
        for seq_id, seq in self.live.items():
            for index, block in enumerate(self.alloc.block_table(seq_id)):
                count = min(self.block_size, seq.num_tokens - index * self.block_size)
                fullest[block] = max(fullest.get(block, 0), count)
        assert sum(fullest.values()) <= stats.num_token_slots_used
        if not self._shares_blocks():
            assert stats.num_token_slots_used == sum(s.num_tokens for s in self.live.values())

    # ------------------------------------------------------------ the end

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for seq_id in list(self.live):
            self.alloc.free(seq_id)
        stats = self.alloc.stats()
        assert stats.num_used_blocks == 0 and stats.num_token_slots_used == 0
        assert stats.num_free_blocks + stats.num_cached_blocks == self.num_blocks
        self.check_pool_is_whole()

    def check_pool_is_whole(self) -> None:
        """Every block can be handed out again, each exactly once."""
        assert self.alloc.allocate("everything", self.num_blocks * self.block_size)
        assert sorted(self.alloc.block_table("everything")) == list(range(self.num_blocks))

    # ------------------------------------------------------------ helpers

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    def _written(self, seq: Sequence) -> bool:
        return seq.num_computed_tokens == seq.num_tokens

    def _visible(self, seq: Sequence) -> list[int]:
        table = self.alloc.block_table(seq.request_id)
        return [self.store[table[i // self.block_size]][i % self.block_size] for i in range(seq.num_tokens)]

    def _shares_blocks(self) -> bool:
        return not isinstance(self.alloc, NaiveAllocator)

    @staticmethod
    def _counts(stats):
        return (stats.num_used_blocks, stats.num_free_blocks, stats.num_cached_blocks, stats.num_token_slots_used)


class PagedMachine(AllocatorMachine):
    factory = PagedAllocator


class RadixMachine(AllocatorMachine):
    factory = RadixAllocator

    @invariant()
    def cached_blocks_are_the_unheld_tree_blocks(self) -> None:
        unheld = [b for b in range(self.num_blocks) if b in self.alloc.tree and self.alloc.ref_count(b) == 0]
        assert self.alloc.stats().num_cached_blocks == len(unheld)


class NaiveMachine(AllocatorMachine):
    factory = NaiveAllocator

    @invariant()
    def tables_are_disjoint_contiguous_runs(self) -> None:
        seen: set[int] = set()
        for seq_id in self.live:
            table = list(self.alloc.block_table(seq_id))
            assert table == list(range(table[0], table[0] + len(table))) if table else True
            assert seen.isdisjoint(table)
            seen.update(table)

    def check_pool_is_whole(self) -> None:
        """Free runs merged back into one: as many reservations fit as the pool holds."""
        reservation = self.alloc.reservation
        stats = self.alloc.stats()
        assert stats.num_free_slots_unusable == (self.num_blocks % reservation) * self.block_size
        count = self.num_blocks // reservation
        assert all(self.alloc.allocate(f"r{i}", 1) for i in range(count))
        assert not self.alloc.allocate("one-more", 1)
        starts = sorted(self.alloc.block_table(f"r{i}")[0] for i in range(count))
        assert starts == [i * reservation for i in range(count)], "first fit packs from block 0"


MACHINE_SETTINGS = settings(max_examples=120, stateful_step_count=30, deadline=None)
PagedMachine.TestCase.settings = RadixMachine.TestCase.settings = NaiveMachine.TestCase.settings = MACHINE_SETTINGS
TestPagedContract = PagedMachine.TestCase
TestRadixContract = RadixMachine.TestCase
TestNaiveContract = NaiveMachine.TestCase
