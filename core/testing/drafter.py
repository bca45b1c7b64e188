"""DrafterContract: what every drafter (speculative decoding proposer) must do.

    from servelab.testing import DrafterContract

    class TestMine(DrafterContract):
        factory = MyDrafter
        num_speculative_tokens = 4     # the k proposals may not exceed

A draft only costs verification time when it is wrong, so the contract does not judge
draft quality; it checks that proposals are well formed for any batch, and replays a
real greedy generation to report the acceptance rate exact-match verification would get.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import pytest

from servelab.interfaces import (AcceptingDrafter, Draft, Drafter, DrafterContext, FeatureDrafter, FinishAwareDrafter,
                                 ReleasingDrafter, Sequence, TreeDrafter)
from servelab.sampling_params import SamplingParams
from servelab.testing.contract import PolicyContract, check, exercising, since
from servelab.token_tree import max_depth, tree_error

KEYS = "proposals are keyed by the given request ids"
VOCAB = "draft tokens are in the vocabulary"
AT_MOST_K = "at most num_speculative_tokens draft tokens per sequence"
MAX_MODEL_LEN = "drafts never run past max_model_len"
IMMUTABLE = "propose never changes the sequences"
DETERMINISTIC = "a deterministic drafter proposes the same drafts for the same sequences"
PROPOSE = "propose handles any batch of decoding sequences"
RELEASE = "release forgets a sequence: a new sequence under its id gets a fresh drafter's drafts"
FINISHED = "finished accepts any finished sequence, and drafts stay well formed after it"
TREE = "token trees are well formed: one parent per token, each -1 or an earlier node"
TREE_DECLARED = "only a drafter declaring TreeDrafter.proposes_trees proposes trees"


def decoding_sequence(request_id: str, prompt: list[int], output: list[int]) -> Sequence:
    """A sequence about to decode: every token but the last one computed."""
    seq = Sequence(request_id, list(prompt), SamplingParams(), 0.0, output_token_ids=list(output))
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def _shape(draft: Any) -> tuple[list[int], list[int] | None]:
    """A proposal's tokens and, for a tree, its parents."""
    parents = draft.parents if isinstance(draft, Draft) else None
    return list(draft), list(parents) if parents is not None else None


def _accepted(tokens: list[int], parents: list[int] | None, truth: list[int]) -> int:
    """Drafts greedy verification accepts when the target's tokens are `truth`: the
    longest matching prefix of a chain, the longest matching root path of a tree."""
    if parents is None:
        return next((i for i, (d, t) in enumerate(zip(tokens, truth)) if d != t), min(len(tokens), len(truth)))
    node, depth = -1, 0
    while depth < len(truth):
        node = next((i for i, p in enumerate(parents) if p == node and tokens[i] == truth[depth]), None)
        if node is None:
            break
        depth += 1
    return depth


def _snapshot(seqs: list[Sequence]) -> list[dict[str, Any]]:
    """Every field of every sequence (lists copied)."""
    return [{name: list(value) if isinstance(value, list) else value
             for name, value in attrs.asdict(seq, recurse=False).items()} for seq in seqs]


def _changes(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    return [f"{b['request_id']}.{name}: {b[name]!r} -> {a[name]!r}"
            for b, a in zip(before, after) for name in b if a[name] != b[name]]


KNOWN_CONTINUATION = "a lookup drafter proposes the known continuation"
RESTATED = "drafts do not restate accepted tokens"
ACCEPTED = "accepted takes the accepted prefix of every verified draft, and drafts stay well formed after it"
# Contexts ending in 11 12 13, which occurred before: 5-periodic, and of period 10.
LOOKUP_CONTEXTS = ([11, 12, 13, 14, 15, 11, 12, 13], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 11, 12, 13])


def known_continuation(tokens: list[int], k: int) -> list[int]:
    """The k tokens after `tokens` if what followed the previous occurrence of its last
    three tokens follows again (past the end of `tokens`, it repeats with the same period)."""
    tail = tokens[-3:]
    start = max(i for i in range(len(tokens) - 3) if tokens[i:i + 3] == tail)
    period = len(tokens) - 3 - start
    extended = list(tokens)
    while len(extended) < len(tokens) + k:
        extended.append(extended[-period])
    return extended[len(tokens):]


class DrafterContract(PolicyContract):
    """Invariants (each failure message starts "invariant violated: <name>"):

    - implements Drafter; an empty batch gets no proposals
    - proposals are keyed by the given request ids
    - draft tokens are in the vocabulary: ints in [0, vocab_size)
    - at most num_speculative_tokens draft tokens per sequence (for a token tree: at most
      that many deep)
    - token trees (`Draft.parents`) come only from a drafter declaring
      `TreeDrafter.proposes_trees`, and are well formed: one parent per token, each -1 or
      an earlier node's index
    - drafts never run past max_model_len (a tree's nodes count, near-full histories
      that branch included)
    - propose never changes the sequences (any field of them)
    - a deterministic drafter proposes the same drafts for the same sequences
    - release forgets a sequence: a new sequence under its id gets a fresh drafter's
      drafts (release, where defined, is called as the engine calls it)
    - finished (a FinishAwareDrafter's) accepts any finished sequence, proposed for or
      not, with or without output, and the drafts after it stay well formed
    - well formed on every decode step of a real greedy generation (replayed)
    - a FeatureDrafter is first shown seeded random features of every computed position
      (`observe`, as the engine calls it after a step), so that it has something to draft
      from; set `feature_size` (len(feature_layers) x the target's hidden size)
    - accepted (an AcceptingDrafter's, version 2) takes the accepted prefix of every
      verified draft, and the drafts after it stay well formed
    - a lookup drafter (`lookup_drafter = True`) proposes the known continuation of a
      repeated n-gram, and its drafts do not restate accepted tokens (where the
      continuation itself equals the last tokens, as in a periodic context, proposing it
      is right)

    k is the contract class's `num_speculative_tokens`, else the options'; a contract
    that can find neither fails (the at-most-k check never silently skips).
    """

    kind = "drafters"
    num_speculative_tokens: int | None = None  # k; default: the options' num_speculative_tokens, if any
    deterministic = True
    lookup_drafter = False  # proposes what followed an earlier occurrence (prompt lookup, n-gram)
    vocab_size = 211
    max_model_len = 128
    feature_size: int | None = None  # a FeatureDrafter's features per position

    def drafter(self) -> Any:
        return self.make(DrafterContext(vocab_size=self.vocab_size, max_model_len=self.max_model_len))

    def max_drafts(self) -> int:
        declared = attrs.asdict(self._options) if attrs.has(type(self._options)) else {}
        k = self.num_speculative_tokens or declared.get("num_speculative_tokens")
        check(k, AT_MOST_K, "the contract cannot tell k: set `num_speculative_tokens = k` on the contract class "
                            "(the drafter's options declare no positive num_speculative_tokens)")
        return k

    def check_proposals(self, drafter: Any, seqs: list[Sequence]) -> Mapping[str, Any]:
        """Propose for `seqs` and check every invariant; returns the proposals."""
        if isinstance(drafter, FeatureDrafter):
            self.observe_features(drafter, seqs)
        before = _snapshot(seqs)
        with exercising(PROPOSE):
            proposals = drafter.propose(seqs)
        after = _snapshot(seqs)
        check(after == before, IMMUTABLE, lambda: "; ".join(_changes(before, after)))
        ids = {s.request_id for s in seqs}
        check(set(proposals) <= ids, KEYS, lambda: f"unknown ids {sorted(set(proposals) - ids)}")
        k = self.max_drafts()
        by_id = {s.request_id: s for s in seqs}
        for request_id, proposal in proposals.items():
            draft = list(proposal)
            bad = [t for t in draft if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            check(not bad, VOCAB, lambda: f"{request_id}: {bad} outside [0, {self.vocab_size}) in draft {draft}")
            parents = proposal.parents if isinstance(proposal, Draft) else None
            if parents is not None:
                check(isinstance(drafter, TreeDrafter) and drafter.proposes_trees, TREE_DECLARED,
                      f"{request_id}: a draft with parents from {type(drafter).__name__}")
                error = tree_error(list(parents), len(draft))
                check(error is None, TREE, lambda: f"{request_id}: {error} (parents {list(parents)})")
            # A tree's k bounds its depth (the drafts one step can accept); its nodes take slots.
            depth = max_depth(parents, len(draft))
            check(depth <= k, AT_MOST_K, lambda: f"{request_id}: {depth} drafts deep, k = {k}")
            room = self.max_model_len - by_id[request_id].num_tokens
            check(len(draft) <= max(room, 0), MAX_MODEL_LEN,
                  lambda: f"{request_id} holds {by_id[request_id].num_tokens} tokens, {len(draft)} drafts, "
                          f"max_model_len {self.max_model_len}")
        if self.deterministic:
            with exercising(DETERMINISTIC):
                again = drafter.propose(seqs)
            same = ({r: _shape(d) for r, d in again.items()} == {r: _shape(d) for r, d in proposals.items()})
            check(same, DETERMINISTIC, "two calls on the same sequences disagree")
        return proposals

    def observe_features(self, drafter: Any, seqs: list[Sequence]) -> None:
        """What the engine gives a FeatureDrafter after the step that computed `seqs`' tokens:
        features (seeded random) of positions 0 .. num_computed_tokens - 1."""
        import torch

        check(self.feature_size, "the contract knows the feature size",
              "set `feature_size` on the contract class (len(feature_layers) x the target's hidden size)")
        generator = torch.Generator().manual_seed(7)
        for seq in seqs:
            computed = seq.num_computed_tokens
            if computed == 0:
                continue
            tokens = seq.prompt_token_ids + seq.output_token_ids
            drafter.observe(seq.request_id, 0, torch.randn(computed, self.feature_size, generator=generator),
                            tokens[1: computed + 1])

    # ------------------------------------------------------------ scenarios

    def test_lookup_proposes_the_known_continuation(self):
        """11 12 13 occurred before, followed by 14 15 ...: in a 5-periodic context, where
        the continuation of 5 tokens equals the last 5 accepted ones (so proposing them is
        right), and in one whose period (10) exceeds any k, where a draft equal to the
        last accepted tokens is always a restatement."""
        if not self.lookup_drafter:
            pytest.skip("not a lookup drafter (set lookup_drafter = True)")
        for tokens in LOOKUP_CONTEXTS:
            continuation = known_continuation(tokens, self.max_drafts())
            for prompt, output in ((tokens, []), (tokens[:5], tokens[5:])):
                seq = decoding_sequence("lookup", prompt, output)
                draft = list(self.check_proposals(self.drafter(), [seq]).get("lookup", []))
                restated = bool(draft) and draft == tokens[-len(draft):] and draft != continuation[: len(draft)]
                check(not restated, RESTATED, lambda: f"draft {draft} repeats the last accepted tokens "
                                                      f"instead of what followed them ({continuation})")
                check(draft and draft == continuation[: len(draft)], KNOWN_CONTINUATION,
                      f"draft {draft} after {tokens}; the known continuation is {continuation}")

    def test_empty_batch_gets_no_proposals(self):
        drafter = self.drafter()
        check(isinstance(drafter, Drafter), "implements Drafter", type(drafter).__name__)
        check(dict(drafter.propose([])) == {}, "an empty batch gets no proposals")

    def test_repetitive_sequences(self):
        """Text that repeats itself is where lookup drafters propose the most."""
        pattern = [11, 12, 13, 14, 15]
        seqs = [
            decoding_sequence("loop", pattern * 4, pattern[:2]),
            decoding_sequence("prompt-only", pattern * 3, []),
            decoding_sequence("one-token", [7], []),
            decoding_sequence("edge", [self.vocab_size - 1] * 6, [0, self.vocab_size - 1]),
            decoding_sequence("nearly-full", (pattern * 40)[: self.max_model_len - 1], []),
            decoding_sequence("full", (pattern * 40)[: self.max_model_len], []),
        ]
        self.check_proposals(self.drafter(), seqs)
        for seq in seqs:  # one at a time, too: a batch must not change anyone's drafts
            self.check_proposals(self.drafter(), [seq])

    def test_nearly_full_sequences_that_branch(self):
        """Histories where one token was followed by several others (11 then 12, 13, 14 or
        15), one to three positions short of max_model_len: a tree drafter sees branches
        there, and its nodes, not only its depth, must fit the positions left."""
        branching = [11, 12, 11, 13, 11, 14, 11, 15, 16]
        seqs = []
        for room in (1, 2, 3):
            length = self.max_model_len - room
            tokens = (branching * (length // len(branching) + 1))[: length - 1] + [11]
            seqs.append(decoding_sequence(f"branching-{room}", tokens[: length // 2], tokens[length // 2:]))
        self.check_proposals(self.drafter(), seqs)
        for seq in seqs:
            self.check_proposals(self.drafter(), [seq])

    def release(self, drafter: Any, request_id: str) -> None:
        """What the engine does when a sequence finishes or is preempted."""
        if isinstance(drafter, ReleasingDrafter):
            with exercising(RELEASE):
                drafter.release(request_id)

    def test_release_forgets_a_sequence(self):
        """Sequences finish (or are preempted) and new ones reuse their ids, as a preempted
        sequence does when it resumes with other tokens computed."""
        pattern = [21, 22, 23, 24]
        first = [decoding_sequence("a", pattern * 5, pattern[:3]), decoding_sequence("b", [9, 8, 9, 8, 9], [8])]
        second = [decoding_sequence("a", [30, 31, 30, 31], [30]), decoding_sequence("b", pattern * 2, [21])]
        drafter = self.drafter()
        self.check_proposals(drafter, first)
        for seq in first:
            self.release(drafter, seq.request_id)
        self.release(drafter, "never-proposed")  # a sequence preempted before its first decode
        reused = self.check_proposals(drafter, second)
        if self.deterministic:
            fresh = self.check_proposals(self.drafter(), second)
            got = {r: list(d) for r, d in reused.items()}
            want = {r: list(d) for r, d in fresh.items()}
            check(got == want, RELEASE, f"after release, drafts {got}; a fresh drafter proposes {want}")

    @since(2)
    def test_accepted_drafts_feed_the_drafter(self):
        """What the engine does after verification (drafter contract version 2): `accepted`
        with the accepted prefix of each draft (empty when the first was rejected)."""
        drafter = self.drafter()
        self.require(drafter, AcceptingDrafter)
        pattern = [41, 42, 43, 44, 45]
        seqs = [decoding_sequence("a", pattern * 3, pattern[:2]), decoding_sequence("b", [5, 6, 5, 6, 5], [6]),
                decoding_sequence("c", [9], [])]
        for step in range(3):
            proposals = self.check_proposals(drafter, seqs)
            for seq in seqs:
                draft = list(proposals.get(seq.request_id, []))
                if not draft:
                    continue
                kept = draft[: (step + len(seq.request_id)) % (len(draft) + 1)]  # all, some or none accepted
                with exercising(ACCEPTED):
                    drafter.accepted(seq.request_id, kept)
                seq.output_token_ids.extend(kept + [pattern[step]])
                seq.num_computed_tokens = seq.num_tokens - 1
        with exercising(ACCEPTED):
            self.check_proposals(drafter, seqs)

    def test_finished_sequences_feed_the_drafter(self):
        """What the engine does when sequences finish: `finished`, then `release`."""
        drafter = self.drafter()
        if not isinstance(drafter, FinishAwareDrafter):
            pytest.skip("not a FinishAwareDrafter")
        pattern = [31, 32, 33, 34, 35]
        done = [decoding_sequence("a", [7, 8], pattern * 3), decoding_sequence("b", pattern, []),
                decoding_sequence("c", [self.vocab_size - 1], [0, self.vocab_size - 1] * 3)]
        self.check_proposals(drafter, done[:1])
        for seq in done:
            before = _snapshot([seq])
            with exercising(FINISHED):
                drafter.finished(seq)
            check(_snapshot([seq]) == before, IMMUTABLE, "finished changed the sequence")
            self.release(drafter, seq.request_id)
        later = [decoding_sequence("d", [1, 2], pattern[:2]), decoding_sequence("e", [0], [self.vocab_size - 1]),
                 decoding_sequence("f", (pattern * 40)[: self.max_model_len - 1], [])]
        with exercising(FINISHED):
            self.check_proposals(drafter, later)

    def test_random_batches(self):
        import hypothesis.strategies as st
        from hypothesis import given

        tokens = st.lists(st.integers(0, self.vocab_size - 1) | st.sampled_from([3, 4, 5]), min_size=1,
                          max_size=self.max_model_len)
        batch = st.lists(st.tuples(tokens, st.integers(0, 16)), max_size=6)

        @self.hypothesis_settings()
        @given(batch=batch)
        def run(batch):
            seqs = [decoding_sequence(f"s{i}", t[: max(1, len(t) - cut)], t[max(1, len(t) - cut):])
                    for i, (t, cut) in enumerate(batch)]
            self.check_proposals(self.drafter(), seqs)

        run()

    # ------------------------------------------------------------ end to end

    def test_replays_a_greedy_generation(self):
        """At every decode step of the reference greedy run on a tiny model, drafts are well
        formed; exact-match verification accepts the longest matching prefix, so the tokens
        are the reference tokens by construction and only the acceptance rate is reported."""
        from servelab.testing.e2e import MAX_TOKENS, VOCAB_SIZE, prompts, reference_tokens

        if self.vocab_size != VOCAB_SIZE:
            pytest.skip(f"the tiny model's vocabulary is {VOCAB_SIZE}")
        outputs = reference_tokens("roomy")
        drafter = self.drafter()
        proposed = accepted = 0
        for step in range(max(MAX_TOKENS)):
            seqs = [decoding_sequence(f"r{i}", p, list(o[: step + 1]))
                    for i, (p, o) in enumerate(zip(prompts(), outputs)) if step + 1 < len(o)]
            for i, output in enumerate(outputs):
                if step + 1 == len(output):  # finished: the engine releases it
                    self.release(drafter, f"r{i}")
            for seq_id, draft in self.check_proposals(drafter, seqs).items():
                truth = outputs[int(seq_id[1:])][step + 1:]
                tokens, parents = _shape(draft)
                proposed += len(tokens)
                accepted += _accepted(tokens, parents, truth)
        print(f"drafter replay: {accepted} of {proposed} draft tokens accepted")


__all__ = ["DrafterContract", "decoding_sequence"]
