"""Eviction policies beyond the kit's least recently used: each a sort key over what the
prefix cache knows of an evictable entry (`servelab.interfaces.EvictionCandidate`).

- `lfu`: fewest hits first (a block reused by many lookups stays), then least recently
  used. A scan (blocks read once) goes before a popular system prompt.
- `slru`: segmented LRU: entries never hit since they were cached (probation) go before
  entries hit at least once (protected), least recently used first within each. One
  reuse is enough to protect, so a one-off scan cannot flush the reused prefixes.
- `waiting-aware`: least recently used, but entries that requests in the waiting queue
  will hit (their `demand`, counted by the cache over the head of the queue) go last,
  fewest waiting requests first.
"""

from __future__ import annotations

from typing import Any

from servelab.interfaces import EvictionCandidate
from servelab.kit import KeyedEviction


class LeastFrequentlyUsed(KeyedEviction):
    def key(self, c: EvictionCandidate) -> Any:
        return c.hits, c.last_access, c.inserted


class SegmentedLRU(KeyedEviction):
    def key(self, c: EvictionCandidate) -> Any:
        return c.hits > 0, c.last_access, c.inserted


class WaitingAware(KeyedEviction):
    uses_demand = True  # servelab.interfaces.DemandAwareEviction: the cache counts demand

    def key(self, c: EvictionCandidate) -> Any:
        return c.demand, c.last_access, c.inserted
