"""The scheduler contract (kind `schedulers`, `[scheduler]`): what a scheduler factory
receives (`SchedulerContext`, with the allocator it asks for room), the sequences it
queues, the plan (`StepPlan`) and stats it returns, the Protocol and its optional
capability. Changes by version: docs/contract-versions.md ("schedulers").
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Protocol, Sequence as Seq, runtime_checkable

import attrs

from servelab.contracts.allocator import KVAllocator
from servelab.sequence import Sequence, SequenceStatus

__all__ = [
    "KVAllocator",
    "Sequence",
    "SequenceStatus",
    "SchedulerContext",
    "KVMove",
    "StepPlan",
    "SchedulerStats",
    "Scheduler",
    "ForkingScheduler",
    "InFlightScheduler",
]


@attrs.frozen
class SchedulerContext:
    """What a scheduler factory receives: the allocator it must ask for room, and the
    engine limits it must never exceed."""

    allocator: KVAllocator
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    clock: Any  # callable returning seconds (time.perf_counter unless a test swaps it)
    # The KV tier below the device pool (`[kv_offload]`), or None: swap preemption
    # (`[scheduler] preemption_mode = "swap"`) moves a victim's blocks there and back.
    host_tier: Any = None
    # victims(name) -> the victim policy `name` (servelab.contracts.victim), built through the
    # engine's registry, for a scheduler whose victim is chosen by name (`[scheduler]
    # preemption`); None outside an engine.
    victims: Any = None
    # LoRA: the most distinct adapters (Sequence.lora_id > 0) one step may run, or None (no
    # cap: the engine serves no adapters). The kit's schedulers admit no sequence past it.
    max_loras_per_batch: int | None = None


@attrs.frozen
class KVMove:
    """One whole-block move the runner performs before a step, in every layer's K and V:
    `offload` device block -> host block, `load` host block -> device block, `copy` device
    block -> device block (a copy-on-write queued before a move)."""

    kind: str  # "offload" | "load" | "copy"
    source: int
    destination: int


@attrs.frozen
class StepPlan:
    """One step's work: how many new tokens each scheduled sequence processes.

    A prompt (or prompt chunk), one decode token and a recompute after preemption all
    have this same shape; there are no phases.
    """

    # Sequences to run, in batch order, with the number of their not-yet-computed
    # tokens this step processes (each >= 1; room for them is already allocated).
    scheduled: tuple[tuple[Sequence, int], ...]
    # Sequences preempted by recompute this step (their blocks were freed).
    preempted: tuple[Sequence, ...] = ()
    # Copy-on-write: KV blocks (source, destination) to copy before anything writes this
    # step. Schedulers leave it empty; the engine fills it from a ForkingAllocator.
    block_copies: tuple[tuple[int, int], ...] = ()
    # Moves between the device pool and the host tier (`KVMove`), performed in order before
    # `block_copies` (copies queued before a move are among them, as `copy` moves).
    # Schedulers leave it empty; the engine fills it from the host tier.
    kv_moves: tuple["KVMove", ...] = ()
    # Token trees of drafts (servelab.token_tree): (row of `scheduled`, parents of the draft
    # nodes scheduled with it) for each sequence whose scheduled drafts branch; the runner
    # lays their nodes out as query rows under a tree mask. Schedulers leave it empty; the
    # engine fills it from the drafter's proposals. A sequence absent here verifies a chain.
    draft_trees: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(map(itemgetter(1), self.scheduled))

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@attrs.frozen
class SchedulerStats:
    """The same numbers from every scheduler.

    A *slot* is one of the max_num_seqs places in the batch. A slot is held by a
    running sequence, and by a finished member of a static batch until its batch ends.
    Each step, a held slot is *used* when its sequence is scheduled and *idle* (wasted)
    otherwise: slot_steps_used + slot_steps_wasted counts every slot held at every step.
    """

    num_waiting: int  # queued sequences, not running: new, or preempted and waiting to resume
    num_running: int  # unfinished sequences holding a slot
    num_preemptions: int  # total since start
    # Computed tokens whose KV a recompute preemption threw away, since start: each is
    # computed again on resume unless a prefix-cache hit serves it.
    num_discarded_tokens: int = 0
    num_scheduled_seqs: int = 0  # sequences the last schedule() planned
    num_scheduled_tokens: int = 0  # tokens the last schedule() planned
    num_idle_slots: int = 0  # slots held but not scheduled in the last planned step
    slot_steps_used: int = 0  # num_scheduled_seqs summed over every step since start
    slot_steps_wasted: int = 0  # num_idle_slots summed over every step since start
    num_steps: int = 0  # non-empty plans since start


@runtime_checkable
class Scheduler(Protocol):
    """Decides every step who runs and how many tokens each processes."""

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its KV; returns it, or None."""

    def schedule(self) -> StepPlan:
        """Plan the next step; allocates KV for every scheduled token."""

    def finish(self, seqs: Seq[Sequence]) -> None:
        """Retire sequences the engine marked finished and free their KV."""

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""

    def stats(self) -> SchedulerStats:
        """Current queue lengths and counters."""


@runtime_checkable
class ForkingScheduler(Protocol):
    """Capability: parallel sampling (SamplingParams.n > 1) by forking a sequence."""

    def fork(self, parent: Sequence, children: Seq[Sequence]) -> None:
        """Run `children` alongside `parent`, whose prompt they share, from the next step.

        Called after the step that sampled every sequence's first token. Each child
        gets the parent's KV through the allocator's fork; a child that cannot (no
        memory) queues to recompute its prompt instead.
        """


@runtime_checkable
class InFlightScheduler(Protocol):
    """Capability: batches in flight (pipeline parallelism, `[engine]
    pipeline_batches_in_flight`). The engine plans the next batch while earlier ones are
    still down the pipeline, and holds their sequences meanwhile: a held sequence keeps its
    slot and KV, and is neither scheduled nor preempted until it is released (after its
    batch's tokens are appended). Without this capability the engine keeps one batch in
    flight."""

    def hold_in_flight(self, seqs: Seq[Sequence]) -> None:
        """`seqs` are in a batch still in flight: plan and preempt none of them."""

    def release_in_flight(self, seqs: Seq[Sequence]) -> None:
        """`seqs`' batch completed: they may be scheduled (and preempted) again."""
