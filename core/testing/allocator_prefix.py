"""The allocator contract's prefix-caching scenarios (PrefixCachingAllocator only):
hits reuse computed blocks and hold the K/V of the whole matched prefix, equal block
content after a different parent never hits, the statistics count one lookup per
admission, and `reset_prefix_cache` (the optional ResettablePrefixCache) drops what no sequence holds.
"""

from __future__ import annotations

from typing import Any

import pytest

from servelab.interfaces import PrefixCachingAllocator, ResettablePrefixCache
from servelab.testing.allocator_stats import PREFIX_STATS, PrefixLedger, check_stats_bounds
from servelab.testing.contract import check, exercising
from servelab.testing.kv_store import PREFIX_HIT_TOKENS, KVStore, new_sequence

HIT_SHAPE = "a prefix-cache hit is whole blocks, below the sequence's length"
REUSED = "computed full blocks are reused"
RESET = "reset_prefix_cache drops every cached block no sequence holds"


class PrefixCacheScenarios:
    """Mixed into AllocatorContract; every test skips for an allocator without a prefix cache."""

    def caching_allocator(self, num_blocks: int = 12, block_size: int = 4) -> tuple[Any, KVStore]:
        alloc = self.make(self.context(num_blocks=num_blocks, block_size=block_size, max_model_len=24))
        if not isinstance(alloc, PrefixCachingAllocator):
            pytest.skip("not a PrefixCachingAllocator")
        return alloc, KVStore(alloc, num_blocks, block_size)

    def admit(self, alloc: Any, store: KVStore, seq_id: str, tokens: list[int]) -> int:
        """Look up, allocate and compute `tokens` as a scheduler and the engine would; the hit."""
        seq = new_sequence(seq_id, tokens)
        with exercising(PREFIX_HIT_TOKENS):
            hit = alloc.match_prefix(seq)
        store.check_prefix_hit(seq, hit)
        seq.num_computed_tokens = hit
        with exercising(REUSED):
            check(alloc.allocate(seq_id, len(tokens)), "allocate succeeds while blocks are free", seq_id)
            store.step([seq])
        return hit

    def test_prefix_hits_reuse_computed_blocks(self):
        alloc, store = self.caching_allocator()
        check(self.admit(alloc, store, "a", list(range(3, 14))) == 0, "an empty cache hits nothing")
        hit = self.admit(alloc, store, "b", list(range(3, 11)) + [50, 51])
        check(hit == 8, REUSED, f"second sequence shares 8 tokens (two blocks) with a computed one, matched {hit}")
        alloc.free("a")
        alloc.free("b")
        whole = new_sequence("c", list(range(3, 11)))  # exactly the cached blocks
        with exercising(HIT_SHAPE):
            hit = alloc.match_prefix(whole)
        check(hit == 4, HIT_SHAPE, f"an 8-token sequence fully cached must compute its last block's token: "
                                   f"matched {hit}")
        alloc.free("c")

    def test_equal_blocks_after_different_parents_never_hit(self):
        """"Y0 X1" shares block 1's tokens with "X0 X1" and block 0 with "Y0 Z1": a cache
        keyed by a block's own tokens (and index) would hand it X1's K/V, computed after X0."""
        alloc, store = self.caching_allocator(num_blocks=16)
        x0, x1, y0, z1 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
        self.admit(alloc, store, "x", x0 + x1 + [20])
        self.admit(alloc, store, "y", y0 + z1 + [21])
        hit = self.admit(alloc, store, "mixed", y0 + x1 + [22])
        check(hit == 4, REUSED, f"'Y0 X1' shares one block of prefix with 'Y0 Z1', matched {hit} tokens")
        # The same content one block later: a prefix shared from a non-zero offset.
        hit = self.admit(alloc, store, "shifted", [30, 31, 32, 33] + x0 + x1 + [23])
        check(hit == 0, PREFIX_HIT_TOKENS, f"'W X0 X1' shares no prefix with 'X0 X1', matched {hit} tokens")
        for seq_id in ("x", "y", "mixed", "shifted"):
            alloc.free(seq_id)
        hit = self.admit(alloc, store, "again", x0 + x1 + [24])
        check(hit == 8, REUSED, f"'X0 X1' was computed and freed, matched {hit} of its 8 tokens")

    def test_prefix_statistics_count_admissions(self):
        """One lookup per admitted sequence; a refused admission's lookup does not count."""
        alloc, store = self.caching_allocator(num_blocks=6)
        ledger = PrefixLedger()
        prompt = list(range(3, 14))  # 11 tokens: three blocks
        ledger.admitted(self.admit(alloc, store, "a", prompt), len(prompt))
        ledger.check(alloc.stats(), "after one admission")
        ledger.admitted(self.admit(alloc, store, "b", prompt[:8] + [60, 61]), 10)
        ledger.check(alloc.stats(), "after a second admission hitting two blocks")
        check(alloc.stats().prefix_hit_tokens == 8, PREFIX_STATS, f"8 tokens hit, stats: {alloc.stats()}")
        refused = new_sequence("c", prompt[:4] + [70] * 15)  # its first block hits, the rest does not fit
        with exercising(PREFIX_STATS):
            refused.num_computed_tokens = alloc.match_prefix(refused)
            check(not alloc.allocate("c", refused.num_tokens), "allocate refuses what does not fit",
                  f"19 tokens in a 6-block pool of 4 holding 4 blocks: {alloc.stats()}")
            alloc.free("c")
        ledger.check(alloc.stats(), "after a lookup whose admission was refused")
        check_stats_bounds(alloc.stats(), 6, 4)

    def test_reset_prefix_cache_drops_unheld_blocks(self):
        alloc, store = self.caching_allocator()
        self.require(alloc, ResettablePrefixCache)  # an optional capability (allocator contract version 2)
        self.admit(alloc, store, "a", list(range(3, 14)))
        self.admit(alloc, store, "b", [40, 41, 42, 43, 44])
        alloc.free("a")
        with exercising(RESET):
            alloc.reset_prefix_cache()
        stats = alloc.stats()
        check(stats.num_cached_blocks == 0 and stats.num_used_blocks == 2, RESET,
              f"with 'b' holding two blocks and 'a' freed, after a reset: {stats}")
        check(list(alloc.block_table("b")) and alloc.stats().num_free_blocks == 10, RESET, str(stats))
        hit = self.admit(alloc, store, "a2", list(range(3, 14)))
        check(hit == 0, RESET, f"a freed and reset prefix still hit {hit} tokens")
        check_stats_bounds(alloc.stats(), 12, 4)
