"""The suffix drafter: its tries against a brute-force reference over the raw token
streams, its global cache of finished outputs and their eviction, its contract, and
greedy output unchanged end to end (in test_speculative_decoding.py with the others)."""

from __future__ import annotations

import collections

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from servelab import LLM, ConfigError, SamplingParams
from servelab.plugins.drafters.options import SuffixOptions
from servelab.plugins.drafters.suffix import SuffixDrafter
from servelab.plugins.drafters.suffix_trie import SuffixTrie
from servelab.interfaces import DrafterContext, FinishAwareDrafter, ReleasingDrafter
from servelab.testing import DrafterContract
from servelab.testing.drafter import decoding_sequence

# ---------------------------------------------------------------- the reference


def occurrences(streams: list[tuple[int, list[int]]], pattern: tuple[int, ...]):
    """(stamp of its last token, index of the following token or None) for every
    occurrence of `pattern` in the streams, each stream given with its first stamp."""
    m = len(pattern)
    for first, tokens in streams:
        for end in range(m - 1, len(tokens)):
            if tuple(tokens[end - m + 1: end + 1]) == pattern:
                yield first + end, (end + 1 if end + 1 < len(tokens) else None), tokens


def reference_chain(streams, history: list[int], depth: int, k: int, factor: float, offset: float,
                    min_prob: float, stamps_of=None) -> tuple[list[int], float]:
    """The suffix drafter's rule spelt out over raw streams: the longest suffix of
    `history` (at most depth - k tokens) that occurred followed by a token; then, while
    the chain's probability stays >= min_prob, the most frequent follower (ties: the one
    whose latest occurrence is latest; `stamps_of` gives latest stamps over streams since
    evicted too)."""
    stamps_of = stamps_of or streams
    for m in range(min(depth - k, len(history)), 0, -1):
        context = tuple(history[len(history) - m:])
        if not any(nxt is not None for _, nxt, _ in occurrences(streams, context)):
            continue
        length = min(k, int(factor * m + offset + 1e-9))
        draft, probs, prob = [], [], 1.0
        while len(draft) < length:
            followers = collections.Counter(tokens[nxt] for _, nxt, tokens in occurrences(streams, context)
                                            if nxt is not None)
            if not followers:
                break
            total = sum(followers.values())
            latest = {t: max(stamp for stamp, _, _ in occurrences(stamps_of, context + (t,))) for t in followers}
            token = max(followers, key=lambda t: (followers[t], latest[t]))
            prob *= followers[token] / total
            if prob < min_prob:
                break
            draft.append(token)
            probs.append(prob)
            context += (token,)
        return draft, sum(probs)
    return [], 0.0


streams_strategy = st.lists(st.integers(0, 3), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tokens=streams_strategy, depth=st.integers(3, 7), k=st.integers(1, 3),
       factor=st.sampled_from([0.5, 1.0, 2.0]), min_prob=st.sampled_from([0.0, 0.3, 0.6]))
def test_own_trie_proposals_equal_brute_force(tokens, depth, k, factor, min_prob):
    """At every prefix of a random stream (a small alphabet, so contexts repeat and
    branch), the drafter's proposal from the sequence's own trie equals the reference."""
    options = SuffixOptions(num_speculative_tokens=k, max_depth=max(depth, k + 1), max_spec_factor=factor,
                            min_token_prob=min_prob, cache_tokens=0)
    drafter = SuffixDrafter(options, DrafterContext(vocab_size=4, max_model_len=1000))
    for n in range(1, len(tokens) + 1):
        seq = decoding_sequence("s", tokens[:1], tokens[1:n])
        got = drafter.best_chain(seq)
        want, score = reference_chain([(0, tokens[:n])], tokens[:n], options.max_depth, k, factor, 0.0, min_prob)
        assert list(got.token_ids) == want, (tokens[:n], got, want)
        assert got.score == pytest.approx(score)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(outputs=st.lists(streams_strategy, min_size=1, max_size=6), history=streams_strategy,
       budget=st.integers(1, 60))
def test_global_cache_proposals_equal_brute_force(outputs, history, budget):
    """Finished outputs fill the global trie up to `budget` tokens, oldest evicted first;
    a sequence whose own history offers nothing proposes from the outputs still cached."""
    depth, k = 5, 2
    options = SuffixOptions(num_speculative_tokens=k, max_depth=depth, min_token_prob=0.0, cache_tokens=budget)
    drafter = SuffixDrafter(options, DrafterContext(vocab_size=10, max_model_len=1000))
    inserted = []  # (first stamp, tokens kept) of every output ever inserted
    stamp = 1
    for i, output in enumerate(outputs):
        done = decoding_sequence(f"done{i}", [9], output)
        drafter.finished(done)
        kept = output[-budget:]
        inserted.append((stamp, kept))
        stamp += len(kept)
    cached, total = [], 0
    for first, kept in reversed(inserted):  # the newest outputs that fit the budget
        if total + len(kept) > budget:
            break
        cached.insert(0, (first, kept))
        total += len(kept)
    assert drafter.cache.num_tokens == total
    # 5..8 never occur in the outputs: the sequence's own trie matches nothing they hold,
    # so its own chain is at most as good, and the global chain is the reference's.
    seq = decoding_sequence("live", [5 + t for t in history[:-1]] + [history[-1]], [])
    got = drafter.best_chain(seq)
    want, score = reference_chain(cached, [history[-1]], depth, k, 1.0, 0.0, 0.0, stamps_of=inserted)
    assert list(got.token_ids) == want
    assert got.score == pytest.approx(score)


def test_removing_every_output_empties_the_trie():
    trie = SuffixTrie(4)
    streams = [[1, 2, 1, 2, 3], [2, 2, 2], [1, 2, 3, 4, 5, 6]]
    for tokens in streams:
        trie.extend(trie.cursor(), tokens)
    assert trie.num_nodes > 1
    for tokens in streams:
        trie.remove(tokens)
    assert trie.num_nodes == 1 and not trie.root.children and trie.root.continued == 0
    with pytest.raises(ValueError, match="never inserted"):
        trie.remove([7])


def test_cost_per_step_does_not_grow_with_history():
    """Nodes touched per new token are bounded by the depth, not by the history: appending
    one token to a 2,000-token stream creates at most `depth` nodes."""
    trie = SuffixTrie(6)
    cursor = trie.cursor()
    trie.extend(cursor, list(range(2000)))
    before = trie.num_nodes
    trie.append(cursor, 5000)
    assert trie.num_nodes - before <= 6
    assert len(cursor.nodes) <= 6


def test_adaptive_length_grows_with_the_match():
    """A match of m tokens proposes at most max_spec_factor * m tokens."""
    options = SuffixOptions(num_speculative_tokens=6, max_depth=12, cache_tokens=0)
    drafter = SuffixDrafter(options, DrafterContext(vocab_size=100, max_model_len=1000))
    passage = list(range(10, 30))
    one = drafter.best_chain(decoding_sequence("one", passage + [50, 10], []))
    assert one.match_len == 1 and list(one.token_ids) == [11]
    three = drafter.best_chain(decoding_sequence("three", passage + [50, 10, 11, 12], []))
    assert three.match_len == 3 and list(three.token_ids) == [13, 14, 15]
    long = drafter.best_chain(decoding_sequence("long", passage + [50] + passage[:8], []))
    assert list(long.token_ids) == passage[8:14]


def test_finished_outputs_help_the_next_request_and_are_evicted_oldest_first():
    options = SuffixOptions(num_speculative_tokens=3, max_depth=6, cache_tokens=10)
    drafter = SuffixDrafter(options, DrafterContext(vocab_size=100, max_model_len=1000))
    assert isinstance(drafter, FinishAwareDrafter) and isinstance(drafter, ReleasingDrafter)
    seq = decoding_sequence("next", [1, 2], [])
    assert drafter.best_chain(seq).token_ids == ()
    drafter.finished(decoding_sequence("a", [0], [1, 2, 3, 4, 5, 6]))
    drafter.release("a")
    assert list(drafter.best_chain(decoding_sequence("next2", [1, 2], [])).token_ids) == [3, 4]
    drafter.finished(decoding_sequence("b", [0], [7, 8, 9, 40, 41]))  # 6 + 5 > 10: "a" is evicted
    assert drafter.cache.num_tokens == 5
    assert drafter.best_chain(decoding_sequence("next3", [1, 2], [])).token_ids == ()
    assert list(drafter.best_chain(decoding_sequence("next4", [7, 8], [])).token_ids) == [9, 40]


def test_options_are_checked():
    with pytest.raises(ConfigError, match="max_depth .4. must exceed num_speculative_tokens .4."):
        SuffixOptions(num_speculative_tokens=4, max_depth=4)
    with pytest.raises(ConfigError, match="min_token_prob must be a probability"):
        SuffixOptions(min_token_prob=1.5)
    with pytest.raises(ConfigError, match="unknown option \\[drafter\\] 'depth' for drafter 'suffix'"):
        LLM("builtin:tiny", config={"drafter": {"name": "suffix", "depth": 3}})


def reference_tree_paths(tokens: list[int], depth: int, k: int, min_prob: float) -> dict[tuple[int, ...], float]:
    """Every continuation (up to k tokens) of the longest matched context of `tokens`, with
    its probability: the product of follower counts over the context's continued count."""
    for m in range(min(depth - k, len(tokens)), 0, -1):
        context = tuple(tokens[len(tokens) - m:])
        if not any(nxt is not None for _, nxt, _ in occurrences([(0, tokens)], context)):
            continue
        paths: dict[tuple[int, ...], float] = {}
        frontier = [((), 1.0)]
        while frontier:
            path, prob = frontier.pop()
            if len(path) == min(k, m):  # the adaptive length at factor 1
                continue
            followers = collections.Counter(t[nxt] for _, nxt, t in occurrences([(0, tokens)], context + path)
                                            if nxt is not None)
            total = sum(followers.values())
            for token, count in followers.items():
                child = (path + (token,), prob * count / total)
                if child[1] >= min_prob:
                    paths[child[0]] = child[1]
                    frontier.append(child)
        return paths
    return {}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=40), nodes=st.integers(1, 8),
       min_prob=st.sampled_from([0.0, 0.2]))
def test_tree_mode_proposes_the_most_probable_continuations(tokens, nodes, min_prob):
    """Tree mode's nodes are the `nodes` most probable continuations of the match (by the
    trie's count ratios), as a well-formed tree listing parents first."""
    from servelab.token_tree import tree_error

    options = SuffixOptions(num_speculative_tokens=3, max_depth=6, min_token_prob=min_prob, cache_tokens=0,
                            tree_nodes=nodes)
    drafter = SuffixDrafter(options, DrafterContext(vocab_size=4, max_model_len=1000))
    draft = drafter.propose([decoding_sequence("s", tokens[:1], tokens[1:])]).get("s")
    reference = reference_tree_paths(tokens, options.max_depth, 3, min_prob)
    if draft is None:
        assert not reference
        return
    parents = list(draft.parents)
    assert tree_error(parents, len(draft.token_ids)) is None
    paths = []
    for i, token in enumerate(draft.token_ids):
        paths.append((paths[parents[i]] if parents[i] >= 0 else ()) + (token,))
    assert len(set(paths)) == len(paths) == min(nodes, len(reference))
    got = sorted((reference[path] for path in paths), reverse=True)  # KeyError: not a continuation
    assert got == pytest.approx(sorted(reference.values(), reverse=True)[: len(paths)])


class TestSuffix(DrafterContract):
    lookup_drafter = True
    plugin_name = "suffix"


class TestSuffixTree(DrafterContract):
    plugin_name = "suffix"
    options = SuffixOptions(tree_nodes=6)


def test_engine_feeds_finished_outputs_to_the_cache():
    """The same prompt twice, one after the other: the second request drafts from the
    first one's output and has most of its drafts accepted; the greedy tokens are equal."""
    llm = LLM("builtin:tiny", config={"drafter": {"name": "suffix"}}, max_model_len=256)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    first = llm.generate("The with statement", params)[0]
    drafter = llm.engine.speculator.drafter
    assert drafter.cache.num_tokens == 32 and not drafter._states
    second = llm.generate("The with statement", params)[0]
    assert second.token_ids == first.token_ids
    assert second.metrics.num_accepted_tokens >= 20 > first.metrics.num_accepted_tokens
