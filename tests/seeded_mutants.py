"""One correct policy per kind, as a researcher would write it on the kit, and plausible
bugs in each: one edit away from the correct one. tests/test_seeded_mutants.py runs the
contracts, the objective checks and the bench's warnings against every one of them."""

from __future__ import annotations

import math
from collections import Counter

import attrs

import servelab
from servelab.interfaces import Draft
from servelab.kit import ContinuousOptions, ContinuousScheduler, KeyedEviction
from servelab.plugin_types import SchedulerPlugin

# ---------------------------------------------------------------- schedulers: EDF


@attrs.frozen
class EDFOptions:
    default_slo_s: float = 10.0  # the deadline of a request that carries none (seconds after arrival)


class EDF(ContinuousScheduler):
    """Earliest deadline first: waiting requests in the order of arrival + deadline."""

    def __init__(self, options, context):
        super().__init__(options or EDFOptions(), context)

    def deadline(self, seq):
        slo = seq.params.deadline if seq.params.deadline is not None else self.options.default_slo_s
        return seq.arrival_time + slo

    def rank(self, seq):
        return (self.deadline(seq),)


class EDFIgnoringDeadlines(EDF):
    """Bug: the SLO option stands in for every request's own deadline (FCFS in disguise)."""

    def deadline(self, seq):
        return seq.arrival_time + self.options.default_slo_s


class LatestDeadlineFirst(EDF):
    """Bug: the sort key's sign flipped."""

    def rank(self, seq):
        return (-self.deadline(seq),)


# ---------------------------------------------------------------- victims


def _freed_blocks(seq, allocator) -> int:
    """Blocks only `seq` holds: what its preemption returns to the pool."""
    return sum(1 for block in allocator.block_table(seq.request_id) if allocator.ref_count(block) == 1)


def _tokens_per_freed_block(seq, allocator) -> float:
    freed = _freed_blocks(seq, allocator)
    return seq.num_computed_tokens / freed if freed else math.inf


def blocks_per_lost_token(running, allocator):
    """The victim losing the fewest computed tokens per block it frees (ties: the newest)."""
    return min(reversed(running), key=lambda seq: _tokens_per_freed_block(seq, allocator))


def most_tokens_per_block(running, allocator):
    """Bug: `max` for `min`."""
    return max(reversed(running), key=lambda seq: _tokens_per_freed_block(seq, allocator))


def inverted_ref_count(running, allocator):
    """Bug: counts the shared blocks as freed (`!= 1`): every cost is infinite, a tie,
    and the tie-break (the newest) decides alone."""
    def cost(seq):
        freed = sum(1 for b in allocator.block_table(seq.request_id) if allocator.ref_count(b) != 1)
        return seq.num_computed_tokens / freed if freed else math.inf
    return min(reversed(running), key=cost)


class StickyVictim:
    """Bug: keeps preempting its first victim, "to avoid thrashing", after that sequence
    stopped running."""

    def __init__(self):
        self.last = None

    def __call__(self, running, allocator):
        if self.last is None:
            self.last = blocks_per_lost_token(running, allocator)
        return self.last


class VictimScheduler(ContinuousScheduler):
    """The continuous scheduler preempting by `policy` (what a victim plugin amounts to)."""

    choose_victim = staticmethod(blocks_per_lost_token)

    def victim(self, running):
        return self.choose_victim(running, self.allocator)


class InvertedRefCountScheduler(VictimScheduler):
    choose_victim = staticmethod(inverted_ref_count)


# ---------------------------------------------------------------- evictors: GDSF


class GDSF(KeyedEviction):
    """GreedyDual-Size-Frequency: L when the entry was last used, plus frequency x cost
    (its depth: the prefix a miss recomputes) / size; L rises to each evicted value."""

    clock = 0.0  # L

    def value(self, c):
        return self.clock + (c.hits + 1) * c.depth / c.size

    def key(self, c):
        return self.memo_key(c, self.value), c.last_access

    def evicted(self, candidates):
        self.clock = max(self.clock, *(self.key(c)[0] for c in candidates))
        self.forget_keys(candidates)


class GDSFLiveClock(GDSF):
    """Bug: the key reads the clock as it is now, not as it was when the entry was used."""

    def key(self, c):
        return self.value(c), c.last_access


class GDSFNoTieBreak(GDSF):
    """Bug: the key lacks the unique tie-break KeyedEviction asks for."""

    def key(self, c):
        return (self.memo_key(c, self.value),)


class GDSFMostValuableFirst(GDSF):
    """Bug: the value's sign flipped, so the most valuable entry goes first."""

    def key(self, c):
        return -self.memo_key(c, self.value), c.last_access


class GDSFWithItsParent(GDSF):
    """Bug: evicts "the block before" too, by id arithmetic, to free whole prefixes."""

    def choose(self, candidates, num_blocks):
        chosen = super().choose(candidates, num_blocks)
        return chosen + [block - 1 for block in chosen if block - 1 not in chosen]


# ---------------------------------------------------------------- drafters: a bigram token tree


@attrs.frozen
class TreeOptions:
    num_speculative_tokens: int = 3  # the tree's depth
    width: int = 2  # children per node


class BigramTree:
    """Proposes, breadth first, the `width` most frequent successors of each node's token
    in the sequence so far, `num_speculative_tokens` deep, never past max_model_len."""

    proposes_trees = True

    def __init__(self, options, context):
        self.options = options or TreeOptions()
        self.max_model_len = context.max_model_len

    def room(self, seq, num_nodes):
        return num_nodes < self.max_model_len - seq.num_tokens

    def parent_index(self, parent):
        return parent

    def propose(self, seqs):
        proposals = {}
        for seq in seqs:
            tokens = seq.prompt_token_ids + seq.output_token_ids
            follows: dict[int, Counter] = {}
            for token, successor in zip(tokens, tokens[1:]):
                follows.setdefault(token, Counter())[successor] += 1
            nodes, parents, frontier = [], [], [(-1, tokens[-1])]
            for _ in range(min(self.options.num_speculative_tokens, self.max_model_len - seq.num_tokens)):
                later = []
                for parent, token in frontier:
                    for successor, _ in follows.get(token, Counter()).most_common(self.options.width):
                        if not self.room(seq, len(nodes)):
                            break
                        parents.append(self.parent_index(parent))
                        nodes.append(successor)
                        later.append((len(nodes) - 1, successor))
                frontier = later
            if nodes:
                proposals[seq.request_id] = Draft(nodes, parents=parents)
        return proposals


class BigramTreePastMaxModelLen(BigramTree):
    """Bug: bounds the tree's depth by the room left, not its nodes."""

    def room(self, seq, num_nodes):
        return True


class BigramTreeOffByOne(BigramTree):
    """Bug: parents counted from 1 (the sequence's last token as node 0)."""

    def parent_index(self, parent):
        return parent + 1


# ---------------------------------------------------------------- routers: longest cached prefix


class LongestCachedPrefix:
    """The replica holding the longest prefix of the prompt; then the least loaded."""

    def __init__(self, options=None, context=None):
        self.home: dict[tuple, int] = {}

    def cached(self, request, replica):
        summary = replica.prefix_summary
        return summary.cached_tokens(request.prompt_token_ids) if summary is not None else 0

    def score(self, request, replica):
        return -self.cached(request, replica), replica.load_tokens, replica.replica_id

    def route(self, request, replicas):
        return min(replicas, key=lambda r: self.score(request, r)).replica_id


class LongestCachedPrefixAllOnZero(LongestCachedPrefix):
    """Bug: the tie-break forgets the load, so every tie (no cache anywhere, or the same
    cache everywhere) goes to the lowest id."""

    def score(self, request, replica):
        return -self.cached(request, replica), replica.replica_id


class LongestCachedPrefixByPosition(LongestCachedPrefix):
    """Bug: returns the chosen snapshot's position in the list."""

    def route(self, request, replicas):
        best = min(replicas, key=lambda r: self.score(request, r))
        return replicas.index(best)


class LongestCachedPrefixStickyHome(LongestCachedPrefix):
    """Bug: remembers each prompt head's replica and sends it there even after that
    replica left the fleet."""

    def route(self, request, replicas):
        head = tuple(request.prompt_token_ids[:8])
        if head not in self.home:
            self.home[head] = super().route(request, replicas)
        return self.home[head]


# ---------------------------------------------------------------- registering the schedulers


class SchedulersUnderTest:
    """A plugin registering the schedulers above by name, for engines built in the tests."""

    @servelab.hookimpl
    def servelab_register_schedulers(self):
        return [SchedulerPlugin(name=name, factory=factory, options=options, description=name)
                for name, factory, options in (
                    ("edf", EDF, EDFOptions), ("edf-ignoring-deadlines", EDFIgnoringDeadlines, EDFOptions),
                    ("victim-blocks-per-token", VictimScheduler, ContinuousOptions),
                    ("victim-inverted-ref-count", InvertedRefCountScheduler, ContinuousOptions))]
