"""Continuous (iteration-level) batching, as in Orca and vLLM.

Every step: running sequences advance first, in admission order; then waiting ones are
admitted FCFS while a sequence slot, token budget and KV room remain. When the KV pool
runs dry, the most recently admitted sequence is preempted by recompute: its blocks
are freed and it rejoins the front of the queue with its generated tokens kept.

With a prefix-caching allocator, an admitted sequence starts from its longest cached
prefix and only the rest of its prompt is computed. Forked sequences (parallel
sampling) join the running batch behind everyone else; past max_num_seqs, the newest
are preempted at the next step.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence as Seq

from servelab.errors import ConfigError
from servelab.interfaces import (
    ForkingAllocator,
    PrefixCachingAllocator,
    SchedulerContext,
    SchedulerStats,
    Sequence,
    SequenceStatus,
    StepPlan,
)


class ContinuousScheduler:
    def __init__(self, options: Any, context: SchedulerContext) -> None:
        if context.max_num_batched_tokens < context.max_model_len:
            raise ConfigError(
                f"scheduler 'continuous' prefills whole prompts, so [engine] max_num_batched_tokens "
                f"({context.max_num_batched_tokens}) must be >= max_model_len ({context.max_model_len}); "
                f"raise it, or choose a chunked-prefill scheduler"
            )
        self.context = context
        self.allocator = context.allocator
        self.prefix_cache = context.allocator if isinstance(context.allocator, PrefixCachingAllocator) else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.allocator.free(request_id)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    return seq
        return None

    def schedule(self) -> StepPlan:
        budget = self.context.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        while len(self.running) > self.context.max_num_seqs:  # forks overfilled the batch
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self._make_room(seq, num_new, preempted):
                scheduled.append((seq, num_new))
                budget -= num_new
                index += 1
        if not preempted:
            budget = self._admit(budget, scheduled)
        return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted))

    def _make_room(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
        """Allocate for `seq`, preempting from the back of `running`; False if `seq` itself went."""
        while not self.allocator.allocate(seq.request_id, seq.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit(self, budget: int, scheduled: list[tuple[Sequence, int]]) -> int:
        while self.waiting and len(self.running) < self.context.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._try_allocate(seq, budget)
            if not num_new:
                break  # FCFS: the head of the queue waits; nobody overtakes it
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _try_allocate(self, seq: Sequence, budget: int) -> int:
        """Allocate a waiting sequence's uncomputed tokens (after any prefix-cache hit);
        how many it computes this step, or 0, holding nothing, if they do not fit."""
        if self.prefix_cache is not None and seq.num_computed_tokens == 0:
            seq.num_computed_tokens = self.prefix_cache.match_prefix(seq)
        num_new = seq.num_uncomputed_tokens
        if num_new <= budget and self.allocator.allocate(seq.request_id, seq.num_tokens):
            return num_new
        self.allocator.free(seq.request_id)  # lets go of the matched prefix
        seq.num_computed_tokens = 0
        return 0

    def fork(self, parent: Sequence, children: Seq[Sequence]) -> None:
        allocator: ForkingAllocator = self.allocator  # the engine admits n > 1 only if it forks
        requeue = []
        for child in children:
            if allocator.fork(parent.request_id, child.request_id):
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            else:  # no memory for a copy: recompute the prompt later, like a preempted sequence
                child.num_computed_tokens = 0
                child.status = SequenceStatus.WAITING
                requeue.append(child)
        self.waiting.extendleft(reversed(requeue))

    def finish(self, seqs: Seq[Sequence]) -> None:
        done = {id(seq) for seq in seqs}
        self.running = [seq for seq in self.running if id(seq) not in done]
        for seq in seqs:
            self.allocator.free(seq.request_id)
            seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self.waiting), num_running=len(self.running), num_preemptions=self.num_preemptions
        )
