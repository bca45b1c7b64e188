"""Speculative decoding inside the engine's step: ask the drafter for drafts before the
scheduler runs, verify them after the target pass, roll rejected slots back.

Drafts ride on `Sequence.draft_token_ids`, which count as uncomputed tokens: every
scheduler therefore charges them to the token budget and allocates KV slots for them
without knowing about speculation. A step may schedule fewer drafts than were proposed
(a tight budget); only the scheduled ones are verified. After the step every sequence's
drafts are cleared; the next step proposes afresh from the verified tokens.

A drafter that declares `TreeDrafter.proposes_trees` may propose token trees
(`Draft.parents`, servelab.token_tree): the nodes ride on the sequence the same way, in
their listed order, so a budget cut keeps a prefix of the list, which is a tree. The
engine puts the scheduled trees in the plan (`StepPlan.draft_trees`), the runner lays
them out under a tree mask, verification keeps one root path, and `settle` moves that
path's K/V into the slots right after the verified tokens before it rolls the rest back:
positions, slots and rollback are the engine's, never the drafter's.

A FeatureDrafter (EAGLE-style) reads the target's intermediate features: the runner
returns them for every input row, and after the update each sequence's verified rows
(prompt chunks, its last token, its accepted drafts or tree path) go to `observe`.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

import attrs
import torch

from servelab.defaults import BLOCK_SIZE
from servelab.errors import ConfigError
from servelab.interfaces import (AcceptingDrafter, Draft, FeatureDrafter, FinishAwareDrafter, ForkingAllocator,
                                 HiddenStateDrafter, ReleasingDrafter, Sequence, StepPlan, TreeDrafter)
from servelab.logging_setup import get_logger
from servelab.speculation_length import DynamicLength, SpeculationLengthOptions
from servelab.token_tree import first_branch, is_chain, tree_error
from servelab.verification import Verified, verify

logger = get_logger(__name__)


@attrs.frozen
class SpeculationStats:
    """Totals since the engine started, for one drafter."""

    drafter: str
    num_draft_tokens: int = 0  # drafts verified by the target
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0  # (sequence, step) pairs that verified at least one draft
    num_sampling_steps: int = 0  # (sequence, step) pairs that produced tokens, with or without drafts
    num_emitted_tokens: int = 0  # tokens those produced

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_tokens_per_step(self) -> float | None:
        """Tokens per target step per sequence (1.0 without speculation)."""
        return self.num_emitted_tokens / self.num_sampling_steps if self.num_sampling_steps else None


class Speculator:
    """The engine's half of speculative decoding, around one drafter."""

    def __init__(self, name: str, drafter: Any, allocator: Any, max_model_len: int, vocab_size: int,
                 length: SpeculationLengthOptions | None = None, slot_mover: Any = None,
                 block_size: int = BLOCK_SIZE) -> None:
        if not isinstance(allocator, ForkingAllocator):
            raise ConfigError(
                f"drafter {name!r} needs an allocator that can roll back rejected draft slots "
                f"(ForkingAllocator.rollback); {type(allocator).__name__} cannot: choose naive, paged, radix or hash")
        self.name = name
        self.drafter = drafter
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.needs_hidden_states = isinstance(drafter, HiddenStateDrafter) and bool(drafter.needs_hidden_states)
        # Token trees: the drafter declares them; the runner's move_slots puts an accepted path in place.
        self.proposes_trees = isinstance(drafter, TreeDrafter) and bool(drafter.proposes_trees)
        self.slot_mover = slot_mover
        self.block_size = block_size
        self._parents: dict[str, list[int]] = {}  # seq id -> parents of its drafts, when they branch
        self._accepting = drafter if isinstance(drafter, AcceptingDrafter) else None
        self._finish_aware = drafter if isinstance(drafter, FinishAwareDrafter) else None
        self._feature_drafter = drafter if isinstance(drafter, FeatureDrafter) else None
        self.feature_layers: tuple[int, ...] = tuple(drafter.feature_layers) if self._feature_drafter else ()
        # This step's features [T, F] and, per scheduled sequence, (seq, first position, first row).
        self._features: torch.Tensor | None = None
        self._feature_rows: list[tuple[Sequence, int, int]] = []
        self._paths: dict[str, list[int]] = {}  # seq id -> the accepted tree path settled this step
        # None: every sequence may draft as far as the drafter proposes (and its room allows).
        self.dynamic = DynamicLength(length) if length is not None and length.dynamic_length else None
        self._probs: dict[str, torch.Tensor | None] = {}
        self._hidden: dict[str, torch.Tensor] = {}  # seq id -> target hidden state behind its last token
        self._drafted: list[Sequence] = []
        self.stats = SpeculationStats(name)

    # ------------------------------------------------------------ before the step

    def propose(self, candidates: Seq[Sequence], chain_only: Any = frozenset()) -> None:
        """Set the drafts of every running sequence that is about to decode. Sequences whose
        ids are in `chain_only` (their requests have logits processors or logprobs, which
        follow one path) verify a tree's first branch."""
        # A seeded sampled request is not drafted: how many drafts a sequence gets (and so
        # how many draws its verification takes) depends on the batch (speculation length,
        # budgets, a drafter's shared state), and its seed promises the same tokens whatever
        # shares the batch. Its one token a step comes from the sampler and its own generator.
        room = {seq.request_id: self._room(seq) for seq in candidates
                if seq.is_decoding and (seq.params.seed is None or seq.params.is_greedy)}
        if self.dynamic is not None:
            room = self.dynamic.budgets({seq_id: r for seq_id, r in room.items() if r > 0})
        seqs = [seq for seq in candidates if room.get(seq.request_id, 0) > 0]
        if not seqs:
            return
        if self.needs_hidden_states:
            have = [seq for seq in seqs if seq.request_id in self._hidden]
            proposals = self.drafter.propose(have, hidden_states=torch.stack(
                [self._hidden[seq.request_id] for seq in have])) if have else {}
        else:
            proposals = self.drafter.propose(seqs)
        for seq in seqs:
            draft = proposals.get(seq.request_id)
            if not draft:
                continue
            tokens = list(draft.token_ids if isinstance(draft, Draft) else draft)
            if self.dynamic is not None:
                self.dynamic.proposed(len(tokens))
            probs = draft.probs if isinstance(draft, Draft) else None
            parents = draft.parents if isinstance(draft, Draft) else None
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in tokens):
                # A broken drafter costs its speed-up, never the request: the draft is dropped.
                logger.warning("drafter.invalid_draft", drafter=self.name, request_id=seq.request_id,
                               draft=tokens, vocab_size=self.vocab_size)
                continue
            if parents is not None:
                parents = list(parents)
                error = tree_error(parents, len(tokens)) if self.proposes_trees else (
                    "the drafter does not declare TreeDrafter.proposes_trees")
                if error is not None:
                    logger.warning("drafter.invalid_tree", drafter=self.name, request_id=seq.request_id,
                                   error=error)
                    continue
                if seq.request_id in chain_only and not is_chain(parents):
                    keep = first_branch(parents)
                    tokens = [tokens[i] for i in keep]
                    probs = probs[keep] if probs is not None else None
                    parents = None
            # A prefix of the nodes is a tree: cutting it to the room bounds its slots and its depth.
            tokens = tokens[: room[seq.request_id]]
            seq.draft_token_ids = tokens
            self._probs[seq.request_id] = probs[: len(tokens)] if probs is not None else None
            if parents is not None and not is_chain(parents[: len(tokens)]):
                self._parents[seq.request_id] = parents[: len(tokens)]
            self._drafted.append(seq)

    def draft_trees(self, plan: StepPlan) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """`StepPlan.draft_trees` of a plan: the branching drafts scheduled, per plan row."""
        if not self._parents:
            return ()
        trees = []
        for row, (seq, num_new) in enumerate(plan.scheduled):
            parents = self._parents.get(seq.request_id)
            if parents is None:
                continue
            num_nodes = seq.num_computed_tokens + num_new - seq.num_tokens
            if num_nodes >= 2 and num_new == num_nodes + 1 and not is_chain(parents[:num_nodes]):
                trees.append((row, tuple(parents[:num_nodes])))
        return tuple(trees)

    def _room(self, seq: Sequence) -> int:
        """Most drafts worth verifying: all accepted plus the bonus token must still fit
        max_tokens and max_model_len."""
        return min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1

    # ------------------------------------------------------------ after the target pass

    def verify(self, seqs: Seq[Sequence], logits: torch.Tensor, first_rows: Seq[int], num_rows: Seq[int],
               generators: Seq[torch.Generator | None], default_generator: torch.Generator) -> list[Verified]:
        """Verify each sequence's first num_rows - 1 drafts against its logits rows
        first_rows[i] .. first_rows[i] + num_rows[i] - 1."""
        rows = torch.tensor([r for first, n in zip(first_rows, num_rows) for r in range(first, first + n)],
                            dtype=torch.int64, device=logits.device)
        drafts = [seq.draft_token_ids[: n - 1] for seq, n in zip(seqs, num_rows)]
        probs, parents = [], []
        for seq, draft in zip(seqs, drafts):
            q = self._probs.get(seq.request_id)
            probs.append(q[: len(draft)] if q is not None else None)
            tree = self._parents.get(seq.request_id)
            parents.append(tree[: len(draft)] if tree is not None and not is_chain(tree[: len(draft)]) else None)
        return verify(logits[rows], drafts, probs, [seq.params for seq in seqs], generators, default_generator,
                      parents if any(tree is not None for tree in parents) else None)

    def settle(self, seq: Sequence, num_verified_drafts: int, num_accepted: int, num_tokens_before: int,
               path: Seq[int] | None = None) -> None:
        """After the accepted tokens were appended: keep the K/V of verified tokens only and
        give the rejected drafts' slots back. `path`: a token tree's accepted nodes, whose
        K/V moves first from node i's slot to the slot of the token it became."""
        if self._accepting is not None and num_verified_drafts:
            accepted = [seq.draft_token_ids[i] for i in path] if path is not None else seq.draft_token_ids[:num_accepted]
            self._accepting.accepted(seq.request_id, list(accepted))
        computed = seq.num_computed_tokens
        keep = min(num_tokens_before + num_accepted, seq.num_tokens)
        if path is not None:
            self._move_path(seq, path[: keep - num_tokens_before], num_tokens_before)
            if self._feature_drafter is not None:
                self._paths[seq.request_id] = list(path)
        if computed > keep:
            self.allocator.rollback(seq.request_id, computed - keep)
            seq.num_computed_tokens = keep
        seq.num_draft_tokens += num_verified_drafts
        seq.num_accepted_tokens += num_accepted
        if self.dynamic is not None:
            self.dynamic.observe(seq.request_id, num_verified_drafts, num_accepted)

    def _move_path(self, seq: Sequence, path: Seq[int], first: int) -> None:
        """Accepted node path[j] was computed at logical position first + path[j]; its token
        is now the sequence's token first + j. Sources never precede destinations (nodes
        are listed parents first), and every source is read before any write."""
        moves = [(first + node, first + j) for j, node in enumerate(path) if node != j]
        if not moves:
            return
        table = self.allocator.block_table(seq.request_id)
        size = self.block_size

        def slot(position: int) -> int:
            return table[position // size] * size + position % size

        self.slot_mover([(slot(source), slot(destination)) for source, destination in moves])

    def record(self, num_drafts: int, num_accepted: int, num_verify_steps: int, num_sampling_steps: int,
               num_emitted: int) -> None:
        s = self.stats
        self.stats = attrs.evolve(
            s, num_draft_tokens=s.num_draft_tokens + num_drafts,
            num_accepted_tokens=s.num_accepted_tokens + num_accepted,
            num_verify_steps=s.num_verify_steps + num_verify_steps,
            num_sampling_steps=s.num_sampling_steps + num_sampling_steps,
            num_emitted_tokens=s.num_emitted_tokens + num_emitted)

    def remember_hidden(self, sampled: Seq[Sequence], first_rows: Seq[int], num_accepted: dict[str, int],
                        hidden: torch.Tensor, forks: Seq[tuple[Sequence, Seq[Sequence]]],
                        paths: dict[str, Seq[int]] | None = None) -> None:
        """Keep, per sequence, the hidden state of the row that produced its last token:
        the row after its accepted drafts, a tree's last accepted node's (forked children
        share their parent's)."""
        for seq, first in zip(sampled, first_rows):
            path = paths.get(seq.request_id) if paths else None
            offset = (path[-1] + 1 if path else 0) if path is not None else num_accepted.get(seq.request_id, 0)
            self._hidden[seq.request_id] = hidden[first + offset]
        for parent, children in forks:
            for child in children:
                self._hidden[child.request_id] = self._hidden[parent.request_id]

    def keep_features(self, plan: StepPlan, features: torch.Tensor) -> None:
        """The runner's features of this step's rows (before the update moves positions)."""
        self._features = features
        rows, row = [], 0
        for seq, num_new in plan.scheduled:
            rows.append((seq, seq.num_computed_tokens, row))
            row += num_new
        self._feature_rows = rows

    def observe_features(self) -> None:
        """After the update: each sequence's verified rows go to the FeatureDrafter."""
        features, self._features = self._features, None
        paths, self._paths = self._paths, {}
        if features is None:
            return
        for seq, start, first in self._feature_rows:
            count = seq.num_computed_tokens - start  # positions now verified (rejected drafts rolled back)
            if count <= 0 or seq.finish_reason is not None:
                continue
            path = paths.get(seq.request_id)
            if path is None:
                rows = features[first: first + count]
            else:  # a tree: the last token's row, then the accepted nodes' (node i is row 1 + i)
                rows = features[torch.tensor([first] + [first + 1 + node for node in path[: count - 1]])]
            prompt, lo, hi = seq.prompt_token_ids, start + 1, start + 1 + count
            tokens = prompt[lo:hi] + seq.output_token_ids[max(0, lo - len(prompt)): max(0, hi - len(prompt))]
            self._feature_drafter.observe(seq.request_id, start, rows, tokens)
        self._feature_rows = []

    def end_step(self) -> None:
        """Drafts live for one step: unscheduled or unverified ones are dropped."""
        for seq in self._drafted:
            seq.draft_token_ids = []
            self._probs.pop(seq.request_id, None)
        self._drafted.clear()
        self._parents.clear()

    def release(self, seq: Sequence) -> None:
        """`seq`'s request leaves the engine (finished, aborted, failed or discarded)."""
        seq_id = seq.request_id
        self._hidden.pop(seq_id, None)
        if self.dynamic is not None:
            self.dynamic.forget(seq_id)
        if self._finish_aware is not None and seq.finish_reason is not None:
            self._finish_aware.finished(seq)
        if isinstance(self.drafter, ReleasingDrafter):
            self.drafter.release(seq_id)
