"""Suffix decoding: propose the most frequent continuation of the sequence's longest
matching suffix, looked up in a suffix trie over the sequence's own prompt and output
(one per sequence) and in one over the outputs the engine finished before (global).

    sequence  ... 5 8 2 9 ... 5 8 2 7 ... 5 8 2 9 ... 5 8 |      suffix (5, 8) seen 3 times
    trie      5 8 -> 2 (3) -> 9 (2) -> ...  / 7 (1)               draft: 2 9 ... (2 with p 1, 9 with p 2/3)

Per step and sequence the cost is bounded by the trie's depth and the draft, never by
the history: the new tokens (the accepted ones) are appended to the sequence's trie in
O(depth) each, its cursor (the nodes of its last depth - 1 tokens) is kept, the match is
read off the cursor, and the walk is one step per draft token. The global cursor of a
sequence is recomputed from its last depth - 1 tokens only when the global cache
changed (an output was added or evicted).

Adaptive length, as the paper's: a match of m tokens proposes at most
max_spec_factor * m + max_spec_offset tokens (and k), so a long match drafts far and a
one-token match drafts little; the chain stops where its probability falls below
min_token_prob. Of the two tries' chains the one with the higher score (the sum of its
prefixes' probabilities, the expected number of tokens accepted) wins, the sequence's
own on a tie. Unlike Arctic Inference, which scores every match length, only the
longest match of at most max_depth - k tokens is walked (the most specific context, and
the one the adaptive length lets draft furthest): one walk per trie per step.

The global cache holds the outputs of finished sequences (not prompts, as in the
paper), up to cache_tokens tokens; when a new output would pass that, the oldest
outputs are evicted first (FIFO) and their counts taken back.

With `tree_nodes = N` the drafter proposes a token tree from the same match: the N most
probable continuations below the matched node, best first by the product of count
ratios along each path (at most the adaptive length deep, none below min_token_prob),
as Arctic Inference's suffix decoding speculates a tree.
"""

from __future__ import annotations

import collections
from typing import Mapping, Sequence as Seq

from servelab.interfaces import Draft, DrafterContext, Sequence
from servelab.plugins.drafters.options import SuffixOptions
from servelab.plugins.drafters.suffix_trie import Chain, Cursor, Node, SuffixTrie


class _SequenceState:
    """One sequence's own trie, and where it stands in the global one."""

    __slots__ = ("trie", "cursor", "num_tokens", "global_cursor", "global_version")

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.cursor = self.trie.cursor()
        self.num_tokens = 0  # tokens of the sequence appended to its trie
        self.global_cursor: Cursor | None = None
        self.global_version = -1


class GlobalCache:
    """The outputs of finished sequences in one trie, bounded to `max_tokens` tokens."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        self.trie = SuffixTrie(depth)
        self.max_tokens = max_tokens
        self.outputs: collections.deque[tuple[int, ...]] = collections.deque()
        self.num_tokens = 0
        self.version = 0  # changes whenever the trie does: cursors into it are then stale

    def add(self, tokens: Seq[int]) -> None:
        tokens = tuple(tokens[-self.max_tokens:]) if self.max_tokens else ()
        if not tokens:
            return
        while self.outputs and self.num_tokens + len(tokens) > self.max_tokens:
            oldest = self.outputs.popleft()
            self.trie.remove(oldest)
            self.num_tokens -= len(oldest)
        self.trie.extend(self.trie.cursor(), tokens)
        self.outputs.append(tokens)
        self.num_tokens += len(tokens)
        self.version += 1

    def clear(self) -> None:
        self.__init__(self.trie.depth, self.max_tokens)


class SuffixDrafter:
    def __init__(self, options: SuffixOptions | None, context: DrafterContext) -> None:
        self.options = options or SuffixOptions()
        self.max_model_len = context.max_model_len
        self.depth = self.options.max_depth
        self.max_match = self.depth - self.options.num_speculative_tokens
        self.cache = GlobalCache(self.depth, self.options.cache_tokens)
        self._states: dict[str, _SequenceState] = {}

    @property
    def proposes_trees(self) -> bool:
        return self.options.tree_nodes > 0

    def propose(self, seqs: Seq[Sequence]) -> Mapping[str, list[int] | Draft]:
        proposals: dict[str, list[int] | Draft] = {}
        for seq in seqs:
            chain, trie, node, length = self._best(seq)
            if not chain.token_ids:
                continue
            if self.proposes_trees:
                room = self.max_model_len - seq.num_tokens
                tokens, parents = trie.tree(node, length, min(self.options.tree_nodes, room),
                                            self.options.min_token_prob)
                if tokens:
                    proposals[seq.request_id] = Draft(tokens, parents=parents)
            else:
                proposals[seq.request_id] = list(chain.token_ids)
        return proposals

    def best_chain(self, seq: Sequence) -> Chain:
        """The proposal for `seq`: its own trie's chain or the global one's, the higher score."""
        return self._best(seq)[0]

    def _best(self, seq: Sequence) -> tuple[Chain, SuffixTrie | None, Node | None, int]:
        """The better of the two tries' chains, with its trie, matched node and length cap
        (a tree grows from the same match)."""
        k = min(self.options.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        state = self._caught_up(seq)
        if k <= 0:
            return Chain(), None, None, 0
        best = self._chain(state.trie, state.cursor, k)
        if self.cache.num_tokens:
            other = self._chain(self.cache.trie, self._global_cursor(seq, state), k)
            if other[0].score > best[0].score:
                best = other
        return best

    def _chain(self, trie: SuffixTrie, cursor: Cursor, k: int) -> tuple[Chain, SuffixTrie, Node | None, int]:
        node = trie.match(cursor, self.max_match)
        if node is None:
            return Chain(), trie, None, 0
        o = self.options
        length = min(k, int(o.max_spec_factor * node.depth + o.max_spec_offset + 1e-9))
        chain = trie.walk(node, length, o.min_token_prob)
        return Chain(chain.token_ids, chain.probs, node.depth), trie, node, length

    def _caught_up(self, seq: Sequence) -> _SequenceState:
        state = self._states.get(seq.request_id)
        if state is None or state.num_tokens > seq.num_tokens:
            state = self._states[seq.request_id] = _SequenceState(self.depth)
        if state.num_tokens < seq.num_tokens:
            new = seq.token_slice(state.num_tokens, seq.num_tokens)
            state.trie.extend(state.cursor, new)
            if state.global_cursor is not None and state.global_version == self.cache.version:
                self.cache.trie.follow(state.global_cursor, new)
            state.num_tokens = seq.num_tokens
        return state

    def _global_cursor(self, seq: Sequence, state: _SequenceState) -> Cursor:
        if state.global_cursor is None or state.global_version != self.cache.version:
            state.global_cursor = self.cache.trie.cursor()
            start = max(0, seq.num_tokens - (self.depth - 1))
            self.cache.trie.follow(state.global_cursor, seq.token_slice(start, seq.num_tokens))
            state.global_version = self.cache.version
        return state.global_cursor

    # ------------------------------------------------------------ lifecycle

    def finished(self, seq: Sequence) -> None:
        """A sequence finished: its output joins the global cache."""
        if self.options.cache_tokens and seq.output_token_ids:
            self.cache.add(seq.output_token_ids)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def clear_cache(self) -> None:
        """Forget every previous output (the global cache), keeping running sequences' tries."""
        self.cache.clear()
