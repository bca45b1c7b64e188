"""EvictionContract: what every prefix-cache eviction policy must do.

    from servelab.testing import EvictionContract

    class TestMine(EvictionContract):
        plugin_name = "mine"           # or: factory = MyEviction

Checked on crafted candidate sets and inside both kit prefix caches (`radix`, `hash`)
under memory pressure, with sequences holding cached blocks while others are evicted.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from servelab.interfaces import AllocatorContext, EvictionCandidate, EvictionContext, EvictionObserver, EvictionPolicy
from servelab.kit.eviction import (EVICTS_EACH_ONCE, EVICTS_ONLY_UNREFERENCED, HONOURS_CAPACITY, PURE_KEYS,
                                   KeyedEviction)
from servelab.testing.contract import PolicyContract, check, exercising
from servelab.testing.objectives import ObjectiveChecks
from servelab.testing.drafter import decoding_sequence

DETERMINISTIC = "eviction is deterministic: the same candidates give the same choice"
HELD_KEPT = "a block a sequence holds keeps its K/V through eviction"
ORDER_FREE = "the choice does not depend on the order candidates come in"
UNIQUE_KEYS = "eviction keys differ between candidates (the tie-break KeyedEviction asks for)"
OBSERVED = "evicted(candidates) accepts what the cache evicted"


def candidate_sets(seed: int = 0, count: int = 30) -> list[tuple[list[EvictionCandidate], int]]:
    """Candidate lists with every field varied, and how many blocks each eviction needs."""
    rng = random.Random(seed)
    sets = []
    for index in range(count):
        blocks = rng.sample(range(64), rng.randint(1, 12))
        ticks = rng.sample(range(1, 1000), 2 * len(blocks))
        candidates = [EvictionCandidate(block=b, last_access=max(ticks[2 * i], ticks[2 * i + 1]),
                                        inserted=min(ticks[2 * i], ticks[2 * i + 1]), hits=rng.randint(0, 5),
                                        depth=rng.randint(1, 8), size=rng.choice((1, 1, 2, 3)),
                                        demand=rng.choice((0, 0, 1, 2)))
                      for i, b in enumerate(blocks)]
        sets.append((candidates, rng.randint(1, sum(c.size for c in candidates) + 2)))
    return sets


class EvictionContract(PolicyContract, ObjectiveChecks):
    """Invariants (each failure message starts "invariant violated: <name>"):

    - implements EvictionPolicy
    - eviction never evicts a referenced block: it names only the candidates it was given
      (blocks no sequence holds), in the caches too (a held block keeps its K/V)
    - eviction names each candidate at most once
    - eviction frees the blocks the pool needs (honours capacity)
    - eviction is deterministic, and the choice does not depend on the order candidates
      come in (the same candidates as a set give the same blocks)
    - a `KeyedEviction`'s keys differ between candidates (ties broken by `last_access` or
      `inserted`), and are pure functions of the candidate: the same before and after
      evictions (the O(log n) queue recomputes keys to tell current entries from stale)
    - an `EvictionObserver` accepts `evicted(candidates)` after every eviction
    """

    kind = "evictors"

    def context(self) -> EvictionContext:
        return EvictionContext(num_blocks=64, block_size=4)

    def test_implements_eviction_policy(self):
        policy = self.make(self.context())
        check(isinstance(policy, EvictionPolicy), "implements EvictionPolicy", type(policy).__name__)

    def test_choices_name_candidates_once_and_cover_the_need(self):
        policy = self.make(self.context())
        for candidates, needed in candidate_sets():
            with exercising(EVICTS_ONLY_UNREFERENCED):
                chosen = list(policy.choose(list(candidates), needed))
            offered = {c.block: c for c in candidates}
            stray = [b for b in chosen if b not in offered]
            check(not stray, EVICTS_ONLY_UNREFERENCED,
                  f"chose {stray}, not among the evictable candidates {sorted(offered)}")
            check(len(set(chosen)) == len(chosen), EVICTS_EACH_ONCE, f"chose {chosen}")
            covered = sum(offered[b].size for b in chosen)
            check(covered >= min(needed, sum(c.size for c in candidates)), HONOURS_CAPACITY,
                  f"chose {covered} blocks' worth, {needed} needed, of {len(candidates)} candidates")

    def test_choices_are_deterministic(self):
        for candidates, needed in candidate_sets(seed=1):
            first = list(self.make(self.context()).choose(list(candidates), needed))
            again = list(self.make(self.context()).choose(list(candidates), needed))
            check(first == again, DETERMINISTIC, f"{first} then {again}")

    def test_choices_do_not_depend_on_candidate_order(self):
        for index, (candidates, needed) in enumerate(candidate_sets(seed=2)):
            shuffled = list(candidates)
            random.Random(index).shuffle(shuffled)
            first = sorted(self.make(self.context()).choose(list(candidates), needed))
            again = sorted(self.make(self.context()).choose(shuffled, needed))
            check(first == again, ORDER_FREE, f"{first} from {[c.block for c in candidates]}, {again} from "
                                              f"{[c.block for c in shuffled]} (the same candidates, reordered)")

    def test_keys_are_unique_and_pure(self):
        """Keys over every candidate set: pairwise different, and unchanged by evictions
        the policy is told of."""
        policy = self.make(self.context())
        if not isinstance(policy, KeyedEviction):
            pytest.skip("not a KeyedEviction (no key to check)")
        for candidates, needed in candidate_sets(seed=3):
            keys = [policy.key(c) for c in candidates]
            for i, left in enumerate(keys):
                twins = [candidates[j].block for j in range(i + 1, len(keys)) if keys[j] == left]
                check(not twins, UNIQUE_KEYS, lambda: f"blocks {candidates[i].block} and {twins} share the key "
                      f"{left!r}: which goes first depends on the order the index lists them; end the key with "
                      "last_access or inserted")
            chosen = set(policy.choose(list(candidates), needed))
            if isinstance(policy, EvictionObserver):
                with exercising(OBSERVED):
                    policy.evicted(tuple(c for c in candidates if c.block in chosen))
            survivors = [c for c in candidates if c.block not in chosen]
            after = {c.block: policy.key(c) for c in survivors}
            moved = [(c.block, k, after[c.block]) for c, k in zip(candidates, keys)
                     if c.block in after and after[c.block] != k]
            check(not moved, PURE_KEYS, lambda: f"after an eviction, block {moved[0][0]}'s key went from "
                  f"{moved[0][1]!r} to {moved[0][2]!r}: the eviction queue would lose it; keep state in "
                  "evicted(...) and let it into a key only as it stood when the candidate was first keyed "
                  "(KeyedEviction.memo_key)")

    def test_caches_keep_held_blocks(self):
        """Both kit prefix caches, a pool too small for every prefix: sequences hold their
        cached prefixes while new ones force evictions."""
        from servelab.testing.contract import installed_factory

        for name in ("radix", "hash"):
            factory, options_class = installed_factory("allocators", name)
            alloc = factory(options_class(), AllocatorContext(num_blocks=12, block_size=4, max_model_len=32,
                                                              eviction=self.make(self.context())))
            held: dict[str, list[int]] = {}
            for index in range(8):
                prompt = [100 + index % 3] * 4 + [index] * 8  # three shared first blocks, then their own
                seq = decoding_sequence(f"s{index}", prompt, [])
                seq.num_computed_tokens = alloc.match_prefix(seq)
                with exercising(EVICTS_ONLY_UNREFERENCED):
                    admitted = alloc.allocate(seq.request_id, seq.num_tokens)
                if not admitted:
                    alloc.free(seq.request_id)
                    continue
                seq.num_computed_tokens = seq.num_tokens
                alloc.cache_blocks(seq)
                if index % 2:
                    held[seq.request_id] = list(alloc.block_table(seq.request_id))
                else:
                    alloc.free(seq.request_id)
                for seq_id, table in held.items():
                    check(list(alloc.block_table(seq_id)) == table and all(alloc.ref_count(b) for b in table),
                          HELD_KEPT, f"{name}: {seq_id} held {table}, now {list(alloc.block_table(seq_id))}")


__all__ = ["EvictionContract"]
