"""The propose stage: before the scheduler runs, the drafter drafts for the running
sequences that are about to decode (servelab.speculation says how drafts ride on a
sequence); after it, the scheduled token trees go into the plan."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from servelab.interfaces import Draft, Sequence, SequenceStatus, StepPlan
from servelab.logging_setup import get_logger
from servelab.request import RequestTable
from servelab.speculation import Speculator
from servelab.token_tree import first_branch, is_chain, tree_error

logger = get_logger(__name__)


class ProposeStage:
    def __init__(self, requests: RequestTable, speculator: Speculator) -> None:
        self.requests = requests
        self.speculator = speculator

    def propose(self) -> None:
        """Set the drafts of every running sequence that is about to decode. A sequence
        whose recipe follows one path (processors, logprobs) verifies a tree's first branch.

        A seeded sampled request is not drafted: how many drafts a sequence gets (and so
        how many draws its verification takes) depends on the batch (speculation length,
        budgets, a drafter's shared state), and its seed promises the same tokens whatever
        shares the batch. Its one token a step comes from the sampler and its own generator."""
        spec = self.speculator
        decoding = [seq for seq in self.requests.sequences()
                    if seq.status is SequenceStatus.RUNNING and seq.is_decoding
                    and (seq.params.seed is None or seq.params.is_greedy)]
        room = {seq.request_id: self._room(seq) for seq in decoding}
        if spec.dynamic is not None:
            room = spec.dynamic.budgets({seq_id: r for seq_id, r in room.items() if r > 0})
        seqs = [seq for seq in decoding if room.get(seq.request_id, 0) > 0]
        if not seqs:
            return
        owners = [self.requests.of(seq) for seq in seqs]
        if spec.needs_hidden_states:
            have = [(seq, r) for seq, r in zip(seqs, owners) if r.drafts[seq.completion_index].hidden is not None]
            hidden = [r.drafts[seq.completion_index].hidden for seq, r in have]
            proposals = spec.drafter.propose([seq for seq, _ in have], hidden_states=torch.stack(hidden)) \
                if have else {}
        else:
            proposals = spec.drafter.propose(seqs)
        for seq, request in zip(seqs, owners):
            draft = proposals.get(seq.request_id)
            if draft:
                self._take(seq, request, draft, room[seq.request_id])

    def _take(self, seq: Sequence, request: Any, draft: Any, room: int) -> None:
        """Check a proposal and put it on the sequence (cut to its room); a broken one is
        dropped with a warning: a faulty drafter costs its speed-up, never the request."""
        spec = self.speculator
        tokens = list(draft.token_ids if isinstance(draft, Draft) else draft)
        if spec.dynamic is not None:
            spec.dynamic.proposed(len(tokens))
        probs = draft.probs if isinstance(draft, Draft) else None
        parents = draft.parents if isinstance(draft, Draft) else None
        if not all(isinstance(t, int) and 0 <= t < spec.vocab_size for t in tokens):
            logger.warning("drafter.invalid_draft", drafter=spec.name, request_id=seq.request_id,
                           draft=tokens, vocab_size=spec.vocab_size)
            return
        if parents is not None:
            parents = list(parents)
            error = tree_error(parents, len(tokens)) if spec.proposes_trees else (
                "the drafter does not declare TreeDrafter.proposes_trees")
            if error is not None:
                logger.warning("drafter.invalid_tree", drafter=spec.name, request_id=seq.request_id, error=error)
                return
            if request.recipe.one_path and not is_chain(parents):
                keep = first_branch(parents)
                tokens = [tokens[i] for i in keep]
                probs = probs[keep] if probs is not None else None
                parents = None
        # A prefix of the nodes is a tree: cutting it to the room bounds its slots and its depth.
        tokens = tokens[:room]
        seq.draft_token_ids = tokens
        drafting = request.drafts[seq.completion_index]
        drafting.probs = probs[: len(tokens)] if probs is not None else None
        if parents is not None and not is_chain(parents[: len(tokens)]):
            drafting.parents = parents[: len(tokens)]
        spec.drafted.append((seq, drafting))

    def with_trees(self, plan: StepPlan) -> StepPlan:
        """The plan with `StepPlan.draft_trees`: the branching drafts scheduled, per plan row."""
        if not self.speculator.proposes_trees:
            return plan
        trees = []
        for row, (seq, num_new) in enumerate(plan.scheduled):
            parents = self.requests.of(seq).drafts[seq.completion_index].parents if seq.draft_token_ids else None
            if parents is None:
                continue
            num_nodes = seq.num_computed_tokens + num_new - seq.num_tokens
            if num_nodes >= 2 and num_new == num_nodes + 1 and not is_chain(parents[:num_nodes]):
                trees.append((row, tuple(parents[:num_nodes])))
        return attrs.evolve(plan, draft_trees=tuple(trees)) if trees else plan

    def _room(self, seq: Sequence) -> int:
        """Most drafts worth verifying: all accepted plus the bonus token must still fit
        max_tokens and max_model_len."""
        return (min(seq.params.max_tokens - len(seq.output_token_ids), self.speculator.max_model_len - seq.num_tokens)
                - 1)
