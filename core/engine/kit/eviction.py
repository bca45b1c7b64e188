"""Eviction in the kit's prefix cache: the default policy (least recently used first),
the orders the built-in policies sort by, and the check every choice goes through.

A policy is any object with `choose(candidates, num_blocks) -> block ids`
(`servelab.interfaces.EvictionPolicy`); most are one sort key:

    class LeastFrequentlyUsed(KeyedEviction):
        def key(self, c):
            return (c.hits, c.last_access, c.inserted)

The prefix cache checks every choice before it evicts anything: a block that is not one
of the candidates (a block some sequence holds, or one not cached) or named twice fails
the step with `PolicyViolation` naming the invariant, instead of corrupting the pool.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

from servelab.errors import PolicyViolation
from servelab.interfaces import EvictionCandidate, EvictionContext

EVICTS_ONLY_UNREFERENCED = "eviction never evicts a referenced block"
EVICTS_EACH_ONCE = "eviction names each candidate at most once"
HONOURS_CAPACITY = "eviction frees the blocks the pool needs"


class KeyedEviction:
    """A policy that evicts in ascending order of `key(candidate)` until enough blocks
    are covered. Subclasses define `key`; keys must differ between candidates (end them
    with `last_access` or `inserted`, which are unique) so the order is deterministic."""

    def __init__(self, options: Any = None, context: EvictionContext | None = None) -> None:
        self.options, self.context = options, context

    def key(self, candidate: EvictionCandidate) -> Any:
        raise NotImplementedError

    def choose(self, candidates: Seq[EvictionCandidate], num_blocks: int) -> list[int]:
        chosen: list[int] = []
        covered = 0
        for candidate in sorted(candidates, key=self.key):
            if covered >= num_blocks:
                break
            chosen.append(candidate.block)
            covered += candidate.size
        return chosen


class LeastRecentlyUsed(KeyedEviction):
    """`lru`: the entry used longest ago first (ties: the older entry)."""

    def key(self, candidate: EvictionCandidate) -> Any:
        return candidate.last_access, candidate.inserted


def checked_choice(policy: Any, candidates: Seq[EvictionCandidate], num_blocks: int) -> list[int]:
    """`policy.choose(...)`, refused with PolicyViolation unless it names only candidates,
    each once, covering `num_blocks` (or all of them)."""
    by_block = {c.block: c for c in candidates}
    chosen = list(policy.choose(candidates, num_blocks))
    name = type(policy).__name__
    for block in chosen:
        if block not in by_block:
            raise PolicyViolation(EVICTS_ONLY_UNREFERENCED,
                                  f"{name} chose block {block!r}, which is not an evictable cached block "
                                  f"(a sequence holds it, or it is not cached); candidates: {sorted(by_block)}")
    if len(set(chosen)) != len(chosen):
        raise PolicyViolation(EVICTS_EACH_ONCE, f"{name} chose {chosen}")
    covered = sum(by_block[b].size for b in chosen)
    needed = min(num_blocks, sum(c.size for c in candidates))
    if covered < needed:
        raise PolicyViolation(HONOURS_CAPACITY, f"{name} chose {covered} blocks' worth of {len(candidates)} "
                                                f"candidates; the pool needs {needed}")
    return chosen
