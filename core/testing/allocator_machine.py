"""The allocator contract's hypothesis state machine.

Random sequences of allocate (after a prefix-cache lookup where the allocator has
one), append, fork, write, rollback, free and prefix-cache reset (the last and the
prefix-aimed prompts in `allocator_prefix_rules`) run against a
simulated KV cache (`KVStore`) whose values depend on the whole prefix. Prompts built
from a few block-sized chunks reach the same block content through different parents.
After every rule each invariant below is checked; every failure (an exception the
allocator raises included) names the invariant it broke.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from servelab.interfaces import (AllocatorContext, ForkingAllocator, KVAllocator, PrefixCachingAllocator,
                                 ResettablePrefixCache)
from servelab.testing.allocator_prefix_rules import PrefixRules
from servelab.testing.allocator_stats import (
    BLOCKS_CONSERVED,
    STATS_BOUNDS,
    PREFIX_STATS,
    SLOT_STATS,
    PrefixLedger,
    check_stats_bounds,
    prefix_counts,
    without_prefix_counts,
)
from servelab.testing.contract import check, exercising
from servelab.testing.kv_store import COPY_ON_WRITE, TABLE_COVERS_TOKENS, KVStore, blocks_for, new_sequence

ALL_OR_NOTHING = "allocate and fork are all-or-nothing (a refusal changes nothing)"
DISTINCT_IN_TABLE = "a block appears at most once in a table"
LEAK_ON_FREE = "block leaked on free"
REF_COUNTS = "ref counts equal the number of tables holding a block"
FREE_UNKNOWN = "free of an unknown sequence is a no-op"
PREFIX_HIT_SHAPE = "a prefix-cache hit is whole blocks, below the sequence's length"
ROLLBACK = "rollback returns the slots past the kept tokens"
POOL_WHOLE = "the whole pool is allocatable again once everything is freed"

# Two token values only, so that prompts share prefixes and prefix caches hit.
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=24)


class AllocatorMachine(PrefixRules, RuleBasedStateMachine):
    """`contract` (an AllocatorContract instance) is set on a subclass per run."""

    contract: Any = None
    seqs = Bundle("seqs")

    @initialize(data=st.data(), max_blocks_per_seq=st.integers(1, 6), extra=st.integers(0, 10))
    def setup(self, data, max_blocks_per_seq: int, extra: int) -> None:
        self.block_size = data.draw(st.sampled_from(self.contract.block_sizes), label="block_size")
        self.max_model_len = max_blocks_per_seq * self.block_size
        self.num_blocks = max_blocks_per_seq + extra
        self.alloc = self.contract.make(AllocatorContext(num_blocks=self.num_blocks, block_size=self.block_size,
                                                         max_model_len=self.max_model_len))
        check(isinstance(self.alloc, KVAllocator), "implements KVAllocator", type(self.alloc).__name__)
        self.forking = isinstance(self.alloc, ForkingAllocator)
        self.caching = isinstance(self.alloc, PrefixCachingAllocator)
        self.resettable = self.caching and isinstance(self.alloc, ResettablePrefixCache)  # optional since version 2
        self.store = KVStore(self.alloc, self.num_blocks, self.block_size)
        self.ledger = PrefixLedger()
        self.live: dict[str, Any] = {}  # seq id -> Sequence; tokens in prompt_token_ids, computed = written
        self.counter = 0

    # ------------------------------------------------------------ rules

    @rule(target=seqs, tokens=TOKENS)
    def allocate(self, tokens: list[int]) -> str:
        return self._admit(tokens)

    def _admit(self, tokens: list[int]) -> str:
        """What a scheduler does to admit a sequence: look up its prefix, allocate, and
        free it again if the allocation is refused."""
        tokens = tokens[: self.max_model_len]
        seq = new_sequence(self._new_id(), tokens)
        before_lookup = self.alloc.stats()
        hit = 0
        if self.caching:
            with exercising(PREFIX_HIT_SHAPE):
                hit = self.alloc.match_prefix(seq)
            check(hit % self.block_size == 0 and 0 <= hit < len(tokens), PREFIX_HIT_SHAPE,
                  f"{hit} tokens matched of {len(tokens)}, block size {self.block_size}")
            check(len(self.alloc.block_table(seq.request_id)) == hit // self.block_size, PREFIX_HIT_SHAPE,
                  f"{hit} tokens matched but the table has {len(self.alloc.block_table(seq.request_id))} blocks")
            self.store.check_prefix_hit(seq, hit)
            seq.num_computed_tokens = hit
        before = (self.alloc.stats(), list(self.alloc.block_table(seq.request_id)))
        with exercising(ALL_OR_NOTHING):
            admitted = self.alloc.allocate(seq.request_id, len(tokens))
        if admitted:
            self.live[seq.request_id] = seq
            if self.caching:
                self.ledger.admitted(hit, len(tokens))
            self.ledger.check(self.alloc.stats(), f"after admitting {seq.request_id} with {hit} tokens hit")
            return seq.request_id
        after = (self.alloc.stats(), list(self.alloc.block_table(seq.request_id)))
        check(after == before, ALL_OR_NOTHING, lambda: f"a refused allocate changed {before} into {after}")
        with exercising(LEAK_ON_FREE if self.caching else FREE_UNKNOWN):  # unknown unless a lookup held blocks
            self.alloc.free(seq.request_id)
        freed = self.alloc.stats()
        check(without_prefix_counts(freed) == without_prefix_counts(before_lookup), ALL_OR_NOTHING,
              lambda: f"a lookup, a refused allocate and a free moved the stats from {before_lookup} to {freed}")
        check(prefix_counts(freed) == prefix_counts(before_lookup), PREFIX_STATS,
              lambda: f"a refused admission changed the prefix counters from {prefix_counts(before_lookup)} "
                      f"to {prefix_counts(freed)}")
        check(list(self.alloc.block_table(seq.request_id)) == [], ALL_OR_NOTHING,
              "a refused allocate left a block table behind")
        return seq.request_id

    @rule(seq_id=seqs, tokens=TOKENS)
    def append(self, seq_id: str, tokens: list[int]) -> None:
        seq = self.live.get(seq_id)
        if seq is None or not self._written(seq):
            return
        tokens = tokens[: self.max_model_len - seq.num_tokens]
        before = (self.alloc.stats(), list(self.alloc.block_table(seq_id)))
        with exercising(ALL_OR_NOTHING):
            grown = self.alloc.allocate(seq_id, seq.num_tokens + len(tokens))
        if grown:
            seq.prompt_token_ids.extend(tokens)
        else:
            after = (self.alloc.stats(), list(self.alloc.block_table(seq_id)))
            check(after == before, ALL_OR_NOTHING, f"a refused allocate changed {before} into {after}")

    @rule()
    def write(self) -> None:
        """One engine step: block copies first, then every pending token into its slot."""
        with exercising(COPY_ON_WRITE):
            self.store.step(list(self.live.values()))

    @precondition(lambda self: self.forking)
    @rule(target=seqs, parent_id=seqs)
    def fork(self, parent_id: str) -> str:
        child_id = self._new_id()
        parent = self.live.get(parent_id)
        if parent is None or not self._written(parent):
            return child_id
        before = self.alloc.stats()
        with exercising(ALL_OR_NOTHING):
            forked = self.alloc.fork(parent_id, child_id)
        if forked:
            child = new_sequence(child_id, parent.prompt_token_ids, num_computed=parent.num_tokens)
            self.live[child_id] = child
        else:
            check(self.alloc.stats() == before, ALL_OR_NOTHING, "a refused fork changed the stats")
        return child_id

    @precondition(lambda self: self.forking)
    @rule(target=seqs, parent_id=seqs)
    def fork_then_diverge(self, parent_id: str) -> str:
        """Parallel sampling: fork, then parent and child each write a token of their own."""
        self.write()  # the engine forks after the step that computed the parent's prompt
        child_id = self.fork(parent_id)
        pair = [self.live.get(parent_id), self.live.get(child_id)]
        if None in pair:
            return child_id
        for seq in pair:
            if seq.num_tokens >= self.max_model_len:
                continue
            with exercising(ALL_OR_NOTHING):
                grown = self.alloc.allocate(seq.request_id, seq.num_tokens + 1)
            if grown:
                self.counter += 1
                seq.prompt_token_ids.append(100 + self.counter)  # a token no other sequence writes
        self.write()
        return child_id

    @precondition(lambda self: self.forking)
    @rule(seq_id=seqs, num_slots=st.integers(1, 8))
    def rollback(self, seq_id: str, num_slots: int) -> None:
        seq = self.live.get(seq_id)
        if seq is None or not self._written(seq):
            return
        num_slots = min(num_slots, seq.num_tokens)
        with exercising(ROLLBACK):
            self.alloc.rollback(seq_id, num_slots)
        del seq.prompt_token_ids[seq.num_tokens - num_slots:]
        seq.num_computed_tokens = seq.num_tokens
        table = self.alloc.block_table(seq_id)
        check(len(table) == blocks_for(seq.num_tokens, self.block_size), ROLLBACK,
              f"{seq_id} kept {seq.num_tokens} tokens but holds {len(table)} blocks of {self.block_size}")

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id: str) -> None:
        seq = self.live.pop(seq_id, None)
        before = self.alloc.stats().num_used_blocks
        mine = set(self.alloc.block_table(seq_id))
        others = {b for other in self.live for b in self.alloc.block_table(other)}
        with exercising(LEAK_ON_FREE):
            self.alloc.free(seq_id)
        after = self.alloc.stats().num_used_blocks
        check(list(self.alloc.block_table(seq_id)) == [], LEAK_ON_FREE, f"{seq_id} still has a block table")
        if seq is not None:
            check(before - after >= len(mine - others), LEAK_ON_FREE, (
                f"freeing {seq_id} released {before - after} blocks, but it was the only holder of "
                f"{len(mine - others)} ({sorted(mine - others)})"))

    @precondition(lambda self: self.live)
    @rule()
    def free_unknown(self) -> None:
        before = self.alloc.stats()
        with exercising(FREE_UNKNOWN):
            self.alloc.free("never-allocated")
        check(self.alloc.stats() == before, FREE_UNKNOWN, "stats changed")

    # ------------------------------------------------------------ invariants

    @invariant()
    def tables_fit_their_tokens(self) -> None:
        for seq_id, seq in self.live.items():
            table = list(self.alloc.block_table(seq_id))
            check(len(table) == blocks_for(seq.num_tokens, self.block_size), TABLE_COVERS_TOKENS,
                  lambda: f"{seq_id} holds {seq.num_tokens} tokens in {len(table)} blocks of {self.block_size}")
            check(len(set(table)) == len(table), DISTINCT_IN_TABLE, lambda: f"{seq_id}: {table}")
            check(all(0 <= b < self.num_blocks for b in table), "block ids are valid", lambda: f"{seq_id}: {table}")

    @invariant()
    def ref_counts_equal_holders(self) -> None:
        if not self.forking:
            return
        holders = [0] * self.num_blocks
        for seq_id in self.live:
            for block in self.alloc.block_table(seq_id):
                holders[block] += 1
        found = [self.alloc.ref_count(b) for b in range(self.num_blocks)]
        check(found == holders, REF_COUNTS, lambda: f"ref counts {found}, tables hold {holders}")

    @invariant()
    def stats_within_bounds(self) -> None:
        with exercising(STATS_BOUNDS):
            stats = self.alloc.stats()
        check_stats_bounds(stats, self.num_blocks, self.block_size)
        held = {b for seq_id in self.live for b in self.alloc.block_table(seq_id)}
        check(stats.num_used_blocks >= len(held), BLOCKS_CONSERVED,
              lambda: f"{stats.num_used_blocks} used blocks, but tables hold {len(held)}")
        self.ledger.check(stats, "after the last operation")

    @invariant()
    def slot_stats_cover_the_tables(self) -> None:
        stats = self.alloc.stats()
        # A shared block holds as many tokens as its fullest holder has in it.
        fullest: dict[int, int] = {}
        for seq_id, seq in self.live.items():
            for index, block in enumerate(self.alloc.block_table(seq_id)):
                count = min(self.block_size, seq.num_tokens - index * self.block_size)
                fullest[block] = max(fullest.get(block, 0), count)
        check(sum(fullest.values()) <= stats.num_token_slots_used, SLOT_STATS,
              lambda: f"tables hold {sum(fullest.values())} tokens, stats count "
                      f"{stats.num_token_slots_used} slots used")

    @invariant()
    def policy_specific_state(self) -> None:
        if hasattr(self, "alloc"):
            with exercising("the policy's own invariants"):
                self.contract.check_allocator_state(self.alloc, {s: list(self.alloc.block_table(s)) for s in self.live})

    # ------------------------------------------------------------ the end

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for seq_id in list(self.live):
            self.free(seq_id)
        stats = self.alloc.stats()
        check(stats.num_used_blocks == 0 and stats.num_token_slots_used == 0, LEAK_ON_FREE,
              f"with every sequence freed, {stats.num_used_blocks} blocks and {stats.num_token_slots_used} "
              f"slots are still in use")
        with exercising(POOL_WHOLE):
            check_pool_is_whole(self.alloc, self.num_blocks, self.block_size, self.max_model_len)

    # ------------------------------------------------------------ helpers

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    @staticmethod
    def _written(seq: Any) -> bool:
        return seq.num_computed_tokens == seq.num_tokens


def check_pool_is_whole(alloc: Any, num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Fill an empty pool with max_model_len sequences, then 1-token ones: every block must
    be handed out once, but for fewer than one max_model_len sequence's worth (an
    allocator reserving whole runs cannot use a shorter remainder)."""
    tables = []
    for size in (max_model_len, 1):
        while len(tables) <= num_blocks and alloc.allocate(f"fill-{len(tables)}", size):
            tables.append(list(alloc.block_table(f"fill-{len(tables)}")))
    held = [b for table in tables for b in table]
    check(len(held) == len(set(held)), POOL_WHOLE, f"a block handed out twice: {sorted(held)}")
    used = alloc.stats().num_used_blocks
    check(used > num_blocks - blocks_for(max_model_len, block_size), POOL_WHOLE, (
        f"only {used} of {num_blocks} blocks could be allocated after freeing everything "
        f"(max_model_len {max_model_len}, block size {block_size}): blocks were lost"))
    for index in range(len(tables)):
        alloc.free(f"fill-{index}")
