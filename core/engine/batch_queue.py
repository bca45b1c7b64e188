"""Batches in flight (pipeline parallelism): the engine plans and submits the next batch
while earlier ones are still down the pipeline, as vLLM's batch queue does.

With S stages, one batch at a time leaves every stage but one idle while the batch passes
through; with up to `[engine] pipeline_batches_in_flight` batches (default: S) submitted
before the oldest is completed, rank 0 computes its stage of batch j + 1 while the later
stages compute batch j. A sequence is in at most one batch in flight: the scheduler holds
it (`InFlightScheduler`) from its batch's submission until its tokens are appended.

A step then does one of two things: it submits a plan and returns with no tokens while
fewer than the depth are in flight, or it completes the oldest batch (sampling, update,
retirement, as a synchronous step) when the queue is full or nothing else can be planned.
Batches complete in submission order, so every stage sees them in the same order and a
batch reads only KV that earlier ones wrote before it.
"""

from __future__ import annotations

import collections
from typing import Any

import attrs

from servelab.errors import ConfigError
from servelab.interfaces import BatchQueueRunner, InFlightScheduler, StepPlan
from servelab.logging_setup import get_logger

logger = get_logger(__name__)


@attrs.frozen
class InFlightBatch:
    plan: StepPlan
    inputs: Any
    ticket: Any  # the runner's, for `complete`


@attrs.define
class BatchQueueStats:
    depth: int  # batches allowed in flight at once
    overlapped: int = 0  # batches submitted while another was still in flight


class BatchQueue:
    """The batches submitted and not yet completed, oldest first."""

    def __init__(self, depth: int, scheduler: InFlightScheduler) -> None:
        self.depth = depth
        self.scheduler = scheduler
        self._batches: collections.deque[InFlightBatch] = collections.deque()
        self._held: set[int] = set()  # id() of every sequence in a batch in flight
        self.stats = BatchQueueStats(depth)

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def is_full(self) -> bool:
        return len(self._batches) >= self.depth

    def holds(self, seq: Any) -> bool:
        return id(seq) in self._held

    def held_ids(self) -> set[int]:
        return self._held

    def submitted(self, plan: StepPlan, inputs: Any, ticket: Any) -> None:
        seqs = [seq for seq, _ in plan.scheduled]
        self.scheduler.hold_in_flight(seqs)
        self._held.update(map(id, seqs))
        self.stats.overlapped += bool(self._batches)
        self._batches.append(InFlightBatch(plan, inputs, ticket))

    def oldest(self) -> InFlightBatch:
        """The oldest batch, out of the queue; its sequences released to the scheduler."""
        batch = self._batches.popleft()
        seqs = [seq for seq, _ in batch.plan.scheduled]
        self._held.difference_update(map(id, seqs))
        self.scheduler.release_in_flight(seqs)
        return batch


def build_batch_queue(config: Any, runner: Any, scheduler: Any, speculator: Any,
                      host_tier: Any) -> BatchQueue | None:
    """The engine's batch queue where the runner keeps several batches in flight and
    everything else allows it; None for one batch at a time. `[engine]
    pipeline_batches_in_flight` > 1 that cannot be honoured is a ConfigError naming why;
    the default (0) falls back to one batch, logged."""
    requested = config.engine.pipeline_batches_in_flight
    if not isinstance(runner, BatchQueueRunner) or runner.max_batches_in_flight <= 1:
        if requested > 1 and config.engine.pipeline_parallel_size > 1:
            raise ConfigError(f"[engine] pipeline_batches_in_flight={requested}: this runner keeps one batch "
                              f"in flight")
        return None
    reasons = []
    if not isinstance(scheduler, InFlightScheduler):
        reasons.append(f"scheduler {config.scheduler.name!r} cannot hold sequences in flight "
                       f"(servelab.contracts.scheduler.InFlightScheduler)")
    if speculator is not None:
        reasons.append("speculative decoding drafts from every sequence's latest token")
    if host_tier is not None:
        reasons.append("the host KV tier moves blocks between steps")
    if reasons:
        if requested > 1:
            raise ConfigError(f"[engine] pipeline_batches_in_flight={requested} cannot be honoured: "
                              f"{'; '.join(reasons)}; set it to 1")
        logger.info("pipeline.one_batch_in_flight", reasons=reasons)
        return None
    return BatchQueue(runner.max_batches_in_flight, scheduler)
