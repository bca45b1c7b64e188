"""AllocatorContract: what every KV allocator must do, whatever its layout policy.

    from servelab.testing import AllocatorContract

    class TestMine(AllocatorContract):
        factory = MyAllocator          # or: plugin_name = "mine"

Capabilities are tested when present: fork, copy-on-write and rollback for a
ForkingAllocator, prefix hits, statistics and reset for a PrefixCachingAllocator.
Randomised tests are derandomized (the same examples every run) unless pytest gets
`--servelab-random`; an exception the allocator raises fails the invariant exercised.
"""

from __future__ import annotations

from typing import Any

import pytest

from servelab.interfaces import (AllocatorContext, ForkingAllocator, KVAllocator, PrefixCachingAllocator,
                                 ResettablePrefixCache)
from servelab.testing.allocator_prefix import PrefixCacheScenarios
from servelab.testing.allocator_stats import STATS_BOUNDS, check_stats_bounds
from servelab.testing.contract import PolicyContract, check, exercising
from servelab.testing.kv_store import COPY_ON_WRITE, KVStore, blocks_for, new_sequence

ALL_OR_NOTHING = "allocate and fork are all-or-nothing (a refusal changes nothing)"
PREFIX_CAPABILITY = "implements PrefixCachingAllocator (match_prefix, cache_blocks)"


class AllocatorContract(PrefixCacheScenarios, PolicyContract):
    """Invariants (each failure message starts "invariant violated: <name>"):

    - implements KVAllocator; fresh pool: every block free, nothing used
    - allocate and fork are all-or-nothing (a refusal changes nothing: stats and tables
      right after it equal those before it)
    - the block table covers exactly the allocated tokens; block ids are valid; a block
      appears at most once in a table
    - blocks are conserved (used + free + cached == num_blocks); slot statistics add up
    - allocator stats within bounds (no negatives, slots within used blocks), after
      fork, copy-on-write and rollback too
    - block leaked on free: freeing returns every block no other sequence holds
    - free of an unknown sequence is a no-op
    - ref counts equal the number of tables holding a block (ForkingAllocator)
    - copy-on-write: every sequence reads back exactly its own tokens (ForkingAllocator)
    - rollback returns the slots past the kept tokens (ForkingAllocator)
    - a prefix-cache hit is whole blocks below the sequence's length and holds the K/V
      of the whole matched prefix: equal blocks after different parents never hit
      (PrefixCachingAllocator)
    - prefix statistics count one lookup per admission (hits <= lookups)
    - reset_prefix_cache drops every cached block no sequence holds (ResettablePrefixCache, an
      optional capability since version 2)
    - the whole pool is allocatable again once everything is freed
    - tokens identical to the reference policies, end to end on a tiny model
    """

    kind = "allocators"
    block_sizes = (1, 2, 4)  # block sizes the state machine draws from
    stateful_step_count = 30

    def check_allocator_state(self, allocator: Any, tables: dict[str, list[int]]) -> None:
        """Hook for a subclass's own invariants, run after every state-machine step."""

    def context(self, num_blocks: int = 10, block_size: int = 4, max_model_len: int = 12) -> AllocatorContext:
        return AllocatorContext(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)

    # ------------------------------------------------------------ scenarios

    def test_fresh_pool_is_all_free(self):
        alloc = self.make(self.context())
        check(isinstance(alloc, KVAllocator), "implements KVAllocator", type(alloc).__name__)
        stats = alloc.stats()
        check((stats.num_blocks, stats.num_used_blocks, stats.num_token_slots_used) == (10, 0, 0),
              "a fresh pool is all free", str(stats))
        check(stats.num_free_blocks + stats.num_cached_blocks == 10, "a fresh pool is all free", str(stats))
        check(list(alloc.block_table("unknown")) == [], "an unknown sequence has an empty table")
        partial = [name for name in ("match_prefix", "cache_blocks") if hasattr(alloc, name)]
        check(len(partial) != 1 and (partial or not isinstance(alloc, ResettablePrefixCache)), PREFIX_CAPABILITY,
              f"it has only {partial or ['reset_prefix_cache']}: the engine and schedulers treat it as having no "
              f"prefix cache")

    def test_allocate_is_all_or_nothing(self):
        """A refusal, of a new sequence or of growing one, changes nothing, before any free()."""
        alloc = self.make(self.context(num_blocks=7, block_size=4, max_model_len=12))
        with exercising(ALL_OR_NOTHING):
            check(alloc.allocate("a", 12) and alloc.allocate("b", 9), "allocate succeeds while blocks are free")
            for seq_id, num_tokens in (("c", 12), ("b", 20)):  # one block is free; each needs more
                before = (alloc.stats(), [list(alloc.block_table(s)) for s in "abc"])
                refused = not alloc.allocate(seq_id, num_tokens)
                after = (alloc.stats(), [list(alloc.block_table(s)) for s in "abc"])
                check(refused, "allocate refuses what does not fit", f"{seq_id}: {num_tokens} tokens, {before}")
                check(after == before, ALL_OR_NOTHING, f"refusing {seq_id} {num_tokens} tokens changed {before} "
                                                       f"into {after}")

    def test_free_returns_every_block(self):
        alloc = self.make(self.context(num_blocks=12, block_size=4, max_model_len=12))
        for index, num_tokens in enumerate((5, 12, 1, 8)):
            if not alloc.allocate(f"s{index}", num_tokens):
                break
        for index in range(4):
            before = alloc.stats().num_used_blocks
            held = len(alloc.block_table(f"s{index}"))
            alloc.free(f"s{index}")
            released = before - alloc.stats().num_used_blocks
            check(released >= held, "block leaked on free",
                  f"freeing s{index} released {released} of the {held} blocks it held alone")
        stats = alloc.stats()
        check(stats.num_used_blocks == 0 and stats.num_free_blocks + stats.num_cached_blocks == 12,
              "block leaked on free", f"after freeing everything: {stats}")
        with exercising("free of an unknown sequence is a no-op"):
            alloc.free("never-allocated")
        check(alloc.stats() == stats, "free of an unknown sequence is a no-op", f"{stats} became {alloc.stats()}")

    def test_writes_after_a_fork_stay_private(self):
        """Parent and child share a partly filled block, then both write into it."""
        alloc = self.make(self.context())
        if not isinstance(alloc, ForkingAllocator):
            pytest.skip("not a ForkingAllocator")
        store = KVStore(alloc, 10, 4)
        parent = new_sequence("p", [5, 6, 7, 8, 9, 10])
        with exercising(COPY_ON_WRITE):
            check(alloc.allocate("p", 6), "allocate succeeds while blocks are free")
            store.step([parent])
            check(alloc.fork("p", "c"), "fork succeeds while blocks are free")
            child = new_sequence("c", parent.prompt_token_ids, num_computed=6)
            store.step([child])  # the child reads the parent's tokens
            check_stats_bounds(alloc.stats(), 10, 4)
            for seq, token in ((child, 100), (parent, 200), (child, 101)):
                seq.prompt_token_ids.append(token)
                check(alloc.allocate(seq.request_id, seq.num_tokens), "allocate succeeds while blocks are free")
                store.step([parent, child])
                check_stats_bounds(alloc.stats(), 10, 4)
        ref_counts = [alloc.ref_count(b) for b in range(10)]
        holders = [sum(b in alloc.block_table(s) for s in "pc") for b in range(10)]
        check(ref_counts == holders, "ref counts equal the number of tables holding a block",
              f"ref counts {ref_counts}, tables hold {holders}")

    def test_rollback_returns_slots(self):
        alloc = self.make(self.context())
        if not isinstance(alloc, ForkingAllocator):
            pytest.skip("not a ForkingAllocator")
        with exercising("rollback returns the slots past the kept tokens"):
            check(alloc.allocate("a", 9), "allocate succeeds while blocks are free")
            alloc.rollback("a", 6)
        check(len(alloc.block_table("a")) == 1, "rollback returns the slots past the kept tokens",
              f"3 tokens kept in {len(alloc.block_table('a'))} blocks of 4")
        check(alloc.stats().num_token_slots_used >= 3, "slot statistics add up")
        check_stats_bounds(alloc.stats(), 10, 4)
        alloc.free("a")
        check(alloc.stats().num_used_blocks == 0, "block leaked on free", "after a rollback and a free")

    def test_stats_stay_in_bounds_through_fork_cow_and_rollback(self):
        """Until a rollback, the slots used are exactly those holding a token: a block
        two sequences hold counts its slots once."""
        alloc = self.make(self.context())
        if not isinstance(alloc, ForkingAllocator):
            pytest.skip("not a ForkingAllocator")
        lengths: dict[str, int] = {}
        steps = (("a 10-token sequence", lambda: alloc.allocate("p", 10), {"p": 10}),
                 ("a fork of it", lambda: alloc.fork("p", "c"), {"c": 10}),
                 ("the child's copy-on-write append", lambda: alloc.allocate("c", 11), {"c": 11}),
                 ("a rollback of the child's last 3 tokens", lambda: alloc.rollback("c", 3), {"c": 8}))
        for what, operation, grown in steps:
            with exercising(STATS_BOUNDS):
                check(operation() is not False, "allocate and fork succeed while blocks are free", what)
                stats = alloc.stats()
            lengths.update(grown)
            check_stats_bounds(stats, 10, 4)
            fullest: dict[int, int] = {}
            for seq_id, length in lengths.items():
                for index, block in enumerate(alloc.block_table(seq_id)):
                    fullest[block] = max(fullest.get(block, 0), min(4, length - 4 * index))
            holding = sum(fullest.values())
            exact = "rollback" not in what  # a rollback may leave a shared block's high-water mark
            check(stats.num_token_slots_used == holding if exact else stats.num_token_slots_used >= holding,
                  STATS_BOUNDS, f"after {what}: {stats.num_token_slots_used} slots used, the tables hold "
                                f"{holding} tokens in {len(fullest)} distinct blocks")
        alloc.free("p")
        alloc.free("c")
        check(alloc.stats().num_used_blocks == 0, "block leaked on free", str(alloc.stats()))

    # ------------------------------------------------------------ random operation sequences

    def test_random_operation_sequences(self):
        from hypothesis.stateful import run_state_machine_as_test

        from servelab.testing.allocator_machine import AllocatorMachine

        machine = type("AllocatorMachine", (AllocatorMachine,), {"contract": self})
        run_state_machine_as_test(machine, settings=self.hypothesis_settings(
            stateful_step_count=self.stateful_step_count))

    # ------------------------------------------------------------ end to end

    @pytest.mark.parametrize("case", ["roomy", "tight", "parallel"])
    def test_greedy_tokens_match_the_reference_policies(self, case):
        from servelab.testing.e2e import check_against_reference

        probe = self.make(self.context(num_blocks=16, block_size=8, max_model_len=128))
        if case == "parallel" and not isinstance(probe, ForkingAllocator):
            pytest.skip("parallel sampling needs a ForkingAllocator")
        name, registry = self.policy_section()
        check_against_reference(self.kind, name, registry, case)


__all__ = ["AllocatorContract", "blocks_for"]
