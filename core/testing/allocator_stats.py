"""Checks of an allocator's statistics that hold after any operation, and the ledger of
prefix lookups a prefix-caching allocator must report.

AllocatorStats promises: used + free + cached == num_blocks; slots used plus reserved
empty == used blocks x block size; no count below zero; the prefix counters count one
lookup per admitted sequence (a refused admission's lookup does not count), with hit
tokens those the lookup returned.
"""

from __future__ import annotations

from typing import Any

import attrs

from servelab.testing.contract import check

STATS_BOUNDS = "allocator stats within bounds (no negatives, slots within used blocks)"
PREFIX_STATS = "prefix statistics count one lookup per admission (hits <= lookups)"
SLOT_STATS = "slot statistics add up"
BLOCKS_CONSERVED = "blocks are conserved (used + free + cached == num_blocks, each >= 0, used >= held)"

PREFIX_FIELDS = ("prefix_hit_tokens", "prefix_lookup_tokens", "num_prefix_lookups")


def check_stats_bounds(stats: Any, num_blocks: int, block_size: int) -> None:
    """Every field of AllocatorStats within what the pool allows."""
    fields = attrs.asdict(stats)
    negative = {name: value for name, value in fields.items() if value < 0}
    check(not negative, STATS_BOUNDS, lambda: f"negative fields {negative} in {stats}")
    total = stats.num_used_blocks + stats.num_free_blocks + stats.num_cached_blocks
    check(total == num_blocks == stats.num_blocks, BLOCKS_CONSERVED,
          lambda: f"used {stats.num_used_blocks} + free {stats.num_free_blocks} + cached "
                  f"{stats.num_cached_blocks} = {total}, the pool has {num_blocks}")
    capacity = stats.num_used_blocks * block_size
    check(stats.num_token_slots_used <= capacity, STATS_BOUNDS,
          lambda: f"{stats.num_token_slots_used} slots used in {stats.num_used_blocks} used blocks of {block_size}")
    check(stats.num_token_slots_used + stats.num_token_slots_reserved_empty == capacity, SLOT_STATS,
          lambda: f"slots used {stats.num_token_slots_used} + reserved empty {stats.num_token_slots_reserved_empty}"
                  f" != {stats.num_used_blocks} used blocks x {block_size}")
    free_slots = (stats.num_free_blocks + stats.num_cached_blocks) * block_size
    check(stats.num_free_slots_unusable <= free_slots, STATS_BOUNDS,
          lambda: f"{stats.num_free_slots_unusable} unusable free slots, {free_slots} slots are free")
    check(stats.prefix_hit_tokens <= stats.prefix_lookup_tokens, PREFIX_STATS,
          lambda: f"{stats.prefix_hit_tokens} hit tokens of {stats.prefix_lookup_tokens} looked up")
    check(stats.num_prefix_lookups <= stats.prefix_lookup_tokens, PREFIX_STATS,
          lambda: f"{stats.num_prefix_lookups} lookups of {stats.prefix_lookup_tokens} tokens in all")


def prefix_counts(stats: Any) -> tuple[int, int, int]:
    return tuple(getattr(stats, name) for name in PREFIX_FIELDS)


def without_prefix_counts(stats: Any) -> Any:
    return attrs.evolve(stats, **{name: 0 for name in PREFIX_FIELDS})


@attrs.define
class PrefixLedger:
    """The prefix counters an allocator must report: one lookup per admission."""

    hit_tokens: int = 0
    lookup_tokens: int = 0
    num_lookups: int = 0

    def admitted(self, hit_tokens: int, num_tokens: int) -> None:
        self.hit_tokens += hit_tokens
        self.lookup_tokens += num_tokens
        self.num_lookups += 1

    def check(self, stats: Any, when: str) -> None:
        expected = (self.hit_tokens, self.lookup_tokens, self.num_lookups)
        check(prefix_counts(stats) == expected, PREFIX_STATS, lambda: (
            f"{when}: (hit tokens, looked-up tokens, lookups) are {prefix_counts(stats)}; the admissions so far "
            f"make them {expected} (a lookup counts once its sequence is admitted, refusals not at all)"))
