"""Continuous (iteration-level) batching, as in Orca and vLLM.

Every step: running sequences advance first, in admission order; then waiting ones are
admitted FCFS while a sequence slot, token budget and KV room remain. When the KV pool
runs dry, the most recently admitted sequence is preempted by recompute: its blocks
are freed and it rejoins the front of the queue with its generated tokens kept.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence as Seq

from servelab.errors import ConfigError
from servelab.interfaces import SchedulerContext, SchedulerStats, Sequence, SequenceStatus, StepPlan


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
            num_new = seq.num_uncomputed_tokens
            if num_new > budget or not self.allocator.allocate(seq.request_id, num_new):
                break  # FCFS: the head of the queue waits; nobody overtakes it
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
        return budget

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
