"""AllocatorContract: what every KV allocator must do, whatever its layout policy.

    from servelab.testing import AllocatorContract

    class TestMine(AllocatorContract):
        factory = MyAllocator          # or: plugin_name = "mine"

Capabilities are tested when present: fork, copy-on-write and rollback for a
ForkingAllocator, prefix hits for a PrefixCachingAllocator.
"""

from __future__ import annotations

from typing import Any

import pytest

from servelab.interfaces import AllocatorContext, ForkingAllocator, KVAllocator, PrefixCachingAllocator
from servelab.testing.contract import PolicyContract, check
from servelab.testing.kv_store import KVStore, blocks_for, new_sequence


class AllocatorContract(PolicyContract):
    """Invariants (each failure message starts "invariant violated: <name>"):

    - implements KVAllocator; fresh pool: every block free, nothing used
    - allocate and fork are all-or-nothing (a refusal changes nothing)
    - the block table covers exactly the allocated tokens; block ids are valid; a block
      appears at most once in a table
    - blocks are conserved (used + free + cached == num_blocks); slot statistics add up
    - block leaked on free: freeing returns every block no other sequence holds
    - free of an unknown sequence is a no-op
    - ref counts equal the number of tables holding a block (ForkingAllocator)
    - copy-on-write: every sequence reads back exactly its own tokens (ForkingAllocator)
    - rollback returns the slots past the kept tokens (ForkingAllocator)
    - a prefix-cache hit is whole blocks below the sequence's length and holds the
      matched tokens (PrefixCachingAllocator)
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

    def test_allocate_is_all_or_nothing(self):
        alloc = self.make(self.context(num_blocks=6, block_size=4, max_model_len=12))
        check(alloc.allocate("a", 12) and alloc.allocate("b", 9), "allocate succeeds while blocks are free")
        before = (alloc.stats(), list(alloc.block_table("a")), list(alloc.block_table("c")))
        check(not alloc.allocate("c", 12), "allocate and fork are all-or-nothing (a refusal changes nothing)",
              "12 more tokens fit in a full pool")
        alloc.free("c")
        after = (alloc.stats(), list(alloc.block_table("a")), list(alloc.block_table("c")))
        check(after == before, "allocate and fork are all-or-nothing (a refusal changes nothing)",
              f"{before} became {after}")

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

    def test_writes_after_a_fork_stay_private(self):
        """Parent and child share a partly filled block, then both write into it."""
        alloc = self.make(self.context())
        if not isinstance(alloc, ForkingAllocator):
            pytest.skip("not a ForkingAllocator")
        store = KVStore(alloc, 10, 4)
        parent = new_sequence("p", [5, 6, 7, 8, 9, 10])
        check(alloc.allocate("p", 6), "allocate succeeds while blocks are free")
        store.step([parent])
        check(alloc.fork("p", "c"), "fork succeeds while blocks are free")
        child = new_sequence("c", parent.prompt_token_ids, num_computed=6)
        store.step([child])  # the child reads the parent's tokens
        for seq, token in ((child, 100), (parent, 200), (child, 101)):
            seq.prompt_token_ids.append(token)
            check(alloc.allocate(seq.request_id, seq.num_tokens), "allocate succeeds while blocks are free")
            store.step([parent, child])
        ref_counts = [alloc.ref_count(b) for b in range(10)]
        holders = [sum(b in alloc.block_table(s) for s in "pc") for b in range(10)]
        check(ref_counts == holders, "ref counts equal the number of tables holding a block",
              f"ref counts {ref_counts}, tables hold {holders}")

    def test_rollback_returns_slots(self):
        alloc = self.make(self.context())
        if not isinstance(alloc, ForkingAllocator):
            pytest.skip("not a ForkingAllocator")
        check(alloc.allocate("a", 9), "allocate succeeds while blocks are free")
        alloc.rollback("a", 6)
        check(len(alloc.block_table("a")) == 1, "rollback returns the slots past the kept tokens",
              f"3 tokens kept in {len(alloc.block_table('a'))} blocks of 4")
        check(alloc.stats().num_token_slots_used >= 3, "slot statistics add up")
        alloc.free("a")
        check(alloc.stats().num_used_blocks == 0, "block leaked on free", "after a rollback and a free")

    def test_prefix_hits_reuse_computed_blocks(self):
        alloc = self.make(self.context(num_blocks=12))
        if not isinstance(alloc, PrefixCachingAllocator):
            pytest.skip("not a PrefixCachingAllocator")
        store = KVStore(alloc, 12, 4)
        first = new_sequence("a", list(range(3, 14)))  # two full blocks and a partial one
        check(alloc.match_prefix(first) == 0, "an empty cache hits nothing")
        check(alloc.allocate("a", first.num_tokens), "allocate succeeds while blocks are free")
        store.step([first])
        second = new_sequence("b", list(range(3, 11)) + [50, 51])
        hit = alloc.match_prefix(second)
        check(hit == 8, "computed full blocks are reused",
              f"second sequence shares 8 tokens (two blocks) with a computed one, matched {hit}")
        store.check_prefix_hit(second, hit)
        alloc.free("a")
        alloc.free("b")
        whole = new_sequence("c", list(range(3, 11)))  # exactly the cached blocks
        hit = alloc.match_prefix(whole)
        check(hit == 4, "a prefix-cache hit is whole blocks, below the sequence's length",
              f"an 8-token sequence fully cached must compute its last block's token: matched {hit}")
        alloc.free("c")

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
