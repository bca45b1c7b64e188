"""Speculative decoding inside the engine's step: the configured drafter, what it can do,
and the totals. The propose stage (servelab.propose_stage) asks the drafter for drafts
before the scheduler runs; the verify stage (servelab.verify_stage) verifies them after
the target pass and, once the tokens are appended, rolls rejected slots back. Each
sequence's speculation state lives on its request (`servelab.request.Drafting`).

Drafts ride on `Sequence.draft_token_ids`, which count as uncomputed tokens: every
scheduler therefore charges them to the token budget and allocates KV slots for them
without knowing about speculation. A step may schedule fewer drafts than were proposed
(a tight budget); only the scheduled ones are verified. After the step every sequence's
drafts are cleared; the next step proposes afresh from the verified tokens.

A drafter that declares `TreeDrafter.proposes_trees` may propose token trees
(`Draft.parents`, servelab.token_tree): the nodes ride on the sequence the same way, in
their listed order, so a budget cut keeps a prefix of the list, which is a tree. The
engine puts the scheduled trees in the plan (`StepPlan.draft_trees`), the runner lays
them out under a tree mask, verification keeps one root path, and the verify stage moves
that path's K/V into the slots right after the verified tokens before it rolls the rest
back: positions, slots and rollback are the engine's, never the drafter's.

A FeatureDrafter (EAGLE-style) reads the target's intermediate features: the runner
returns them for every input row, and after the update each sequence's verified rows
(prompt chunks, its last token, its accepted drafts or tree path) go to `observe`.
"""

from __future__ import annotations

from typing import Any

import attrs

from servelab.defaults import BLOCK_SIZE
from servelab.errors import ConfigError
from servelab.interfaces import (AcceptingDrafter, FeatureDrafter, FinishAwareDrafter, ForkingAllocator,
                                 HiddenStateDrafter, ReleasingDrafter, Sequence, TreeDrafter)
from servelab.request import Drafting
from servelab.speculation_length import DynamicLength, SpeculationLengthOptions


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
        self.accepting = drafter if isinstance(drafter, AcceptingDrafter) else None
        self.finish_aware = drafter if isinstance(drafter, FinishAwareDrafter) else None
        self.feature_drafter = drafter if isinstance(drafter, FeatureDrafter) else None
        self.feature_layers: tuple[int, ...] = tuple(drafter.feature_layers) if self.feature_drafter else ()
        # None: every sequence may draft as far as the drafter proposes (and its room allows).
        self.dynamic = DynamicLength(length) if length is not None and length.dynamic_length else None
        self.drafted: list[tuple[Sequence, Drafting]] = []  # this step's drafted sequences
        self.stats = SpeculationStats(name)

    def record(self, num_drafts: int, num_accepted: int, num_verify_steps: int, num_sampling_steps: int,
               num_emitted: int) -> None:
        s = self.stats
        self.stats = attrs.evolve(
            s, num_draft_tokens=s.num_draft_tokens + num_drafts,
            num_accepted_tokens=s.num_accepted_tokens + num_accepted,
            num_verify_steps=s.num_verify_steps + num_verify_steps,
            num_sampling_steps=s.num_sampling_steps + num_sampling_steps,
            num_emitted_tokens=s.num_emitted_tokens + num_emitted)

    def end_step(self) -> None:
        """Drafts live for one step: unscheduled or unverified ones are dropped."""
        for seq, drafting in self.drafted:
            seq.draft_token_ids = []
            drafting.probs = drafting.parents = None
        self.drafted.clear()

    def release(self, seq: Sequence) -> None:
        """`seq`'s request leaves the engine (finished, aborted, failed or discarded)."""
        seq_id = seq.request_id
        if self.dynamic is not None:
            self.dynamic.forget(seq_id)
        if self.finish_aware is not None and seq.finish_reason is not None:
            self.finish_aware.finished(seq)
        if isinstance(self.drafter, ReleasingDrafter):
            self.drafter.release(seq_id)
