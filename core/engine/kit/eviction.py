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

A policy that is only a key (a `KeyedEviction` that keeps the inherited `choose` and
reads no `demand`) over an index that reports its changes (`IncrementalPrefixIndex`)
is served from an `EvictionQueue` instead: the same order, kept as entries change, so
an eviction costs O(log n) in the n evictable entries rather than a sort of them all.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Sequence as Seq

from servelab.errors import PolicyViolation
from servelab.interfaces import EvictionCandidate, EvictionContext

EVICTS_ONLY_UNREFERENCED = "eviction never evicts a referenced block"
EVICTS_EACH_ONCE = "eviction names each candidate at most once"
HONOURS_CAPACITY = "eviction frees the blocks the pool needs"
PURE_KEYS = "eviction keys are pure functions of the candidate"


class KeyedEviction:
    """A policy that evicts in ascending order of `key(candidate)` until enough blocks
    are covered. Subclasses define `key`, with two rules the eviction contract checks:

    - keys differ between candidates (end them with `last_access` or `inserted`, which
      are unique), so the order never depends on the order candidates come in;
    - a key is a pure function of its candidate: the same candidate gives the same key
      every time it is asked (the queue recomputes keys to tell current entries from
      stale ones). A policy with state (an aging clock) updates it in `evicted(...)`
      (`servelab.interfaces.EvictionObserver`, called on the queue path too) and lets it
      into a key only as it stood when that candidate was first keyed (`memo_key`)."""

    def __init__(self, options: Any = None, context: EvictionContext | None = None) -> None:
        self.options, self.context = options, context
        self._memo_keys: dict[int, tuple[int, Any]] = {}  # block -> (last_access, key), for memo_key

    def key(self, candidate: EvictionCandidate) -> Any:
        raise NotImplementedError

    def memo_key(self, candidate: EvictionCandidate, compute: Callable[[EvictionCandidate], Any]) -> Any:
        """`compute(candidate)` the first time this candidate (its block, at its
        `last_access`) is keyed, the same value ever after: how a key reading state stays
        pure. Forget evicted blocks with `forget_keys` (O(1) a block)."""
        memo = self._memo_keys
        entry = memo.get(candidate.block)
        if entry is None or entry[0] != candidate.last_access:
            entry = memo[candidate.block] = (candidate.last_access, compute(candidate))
        return entry[1]

    def forget_keys(self, candidates: Seq[EvictionCandidate]) -> None:
        """Drop the memoized keys of `candidates`' blocks (call it from `evicted`)."""
        for candidate in candidates:
            self._memo_keys.pop(candidate.block, None)

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


def orders_by_key(policy: Any) -> bool:
    """True when `policy` evicts in ascending `key` order and nothing else (the inherited
    `KeyedEviction.choose`), so an `EvictionQueue` can keep its order."""
    return isinstance(policy, KeyedEviction) and type(policy).choose is KeyedEviction.choose


class EvictionQueue:
    """The evictable entries of a prefix cache in ascending `key` order, kept as they
    change: a heap with lazy deletion.

    The index calls `changed(block)` whenever the entry named `block` appears or may
    have changed; `candidate_of(block)` says what it is now (None: not evictable). Each
    change pushes the entry's current key, so the heap always holds every live entry's
    current key, beside stale ones that `pop` skips (an entry is current when its key
    now equals the key it was pushed with). Keys are unique (`KeyedEviction`), so `pop`
    returns entries in exactly the order a sort of all candidates gives.
    """

    def __init__(self, key: Callable[[EvictionCandidate], Any],
                 candidate_of: Callable[[int], EvictionCandidate | None],
                 all_candidates: Callable[[], list[EvictionCandidate]], policy_name: str = "the policy") -> None:
        self._key, self._candidate_of, self._all = key, candidate_of, all_candidates
        self._policy_name = policy_name
        self._heap: list[tuple[Any, int, int]] = []
        self._order = itertools.count()  # never compare blocks: equal keys pop in push order
        self._latest: dict[int, int] = {}  # block -> the push order of its latest entry

    def __len__(self) -> int:
        """Heap entries, stale ones included."""
        return len(self._heap)

    def changed(self, block: int) -> None:
        candidate = self._candidate_of(block)
        if candidate is not None:
            order = next(self._order)
            heapq.heappush(self._heap, (self._key(candidate), order, block))
            self._latest[block] = order

    def pop(self) -> EvictionCandidate | None:
        """The current entry with the smallest key, taken off the queue (it comes back with
        its next change); None when nothing is evictable. An entry whose candidate did not
        change since it was pushed (it is the block's latest) but whose key did is refused
        with PolicyViolation: the key read state that moved, and the entry would be lost."""
        heap = self._heap
        while heap:
            key, order, block = heapq.heappop(heap)
            candidate = self._candidate_of(block)
            if candidate is None:
                continue
            now = self._key(candidate)
            if now == key:
                return candidate
            if self._latest.get(block) == order:
                raise PolicyViolation(PURE_KEYS, f"{self._policy_name} keyed block {block} {key!r} when it was "
                                                 f"queued and {now!r} now, the candidate unchanged: a key must give "
                                                 f"the same value for the same candidate (KeyedEviction.memo_key), "
                                                 f"or the queue loses the entry")
        return None

    def compact(self, live: int) -> None:
        """Rebuild from the index's candidates once stale entries outnumber `live` ones
        (the index's size) by far, so the heap stays O(live)."""
        if len(self._heap) > 4 * live + 1024:
            self._heap = [(self._key(c), next(self._order), c.block) for c in self._all()]
            self._latest = {block: order for _, order, block in self._heap}
            heapq.heapify(self._heap)


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
