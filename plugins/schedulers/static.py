"""Static batching, as serving worked before Orca: form a batch, run it to completion,
and only then admit anyone else.

A batch is formed from the head of the queue (rank order, see `queues`): as many
requests as fit max_num_seqs slots (a request sampling n completions takes n) and
whose prompts fit the KV pool. Prompts are computed whole; when they exceed the token
budget together, the rest wait for the next steps. A member that finishes keeps its
slot, idle, until the last member finishes: the slot-steps wasted that continuous
batching recovers (head-of-line blocking).

When decoding members outgrow the KV pool, the lowest-ranked is preempted by
recompute, as in `continuous`; it stays a member of its batch and resumes as soon as
room frees, before any new request is admitted. An aborted member frees its KV at once;
its slot, like a finished member's, idles until the batch ends.
"""

from __future__ import annotations

import bisect
from typing import Any

from servelab.interfaces import SchedulerContext, Sequence, StepPlan
from servelab.kit import PlanBuilder, QueueOptions, QueueScheduler, check_whole_prompts_fit


class StaticScheduler(QueueScheduler):
    name = "static"

    def __init__(self, options: Any, context: SchedulerContext) -> None:
        check_whole_prompts_fit(self.name, context)
        super().__init__(options if options is not None else QueueOptions(), context)
        self.pending: list[Sequence] = []  # preempted members waiting to resume, in rank order
        self.num_batch_slots = 0  # slots the current batch holds, its finished members' included

    def schedule(self) -> StepPlan:
        builder = PlanBuilder(self.context.max_num_batched_tokens)
        if not self.running and not self.pending:
            self._form_batch()
        self._shed_overflow(builder)
        self._run_members(builder)
        if not builder.preempted:
            self._resume_pending(builder)
        return self._plan(builder)

    def _form_batch(self) -> None:
        """The previous batch is done: the next one, with KV for every member's prompt."""
        self.num_batch_slots = 0
        while self.waiting:
            seq = self.waiting[0]
            slots = seq.params.n  # its other completions are forked from it after its first step
            if self.num_batch_slots and self.num_batch_slots + slots > self.context.max_num_seqs:
                break
            if not self._adapter_fits(seq):
                break  # a LoRA adapter past max_loras_per_batch opens the next batch
            if not self._admit(seq, seq.num_uncomputed_tokens, whole=True):
                break  # the pool is full; the head of the queue opens the next batch
            self.waiting.pop(0)
            self._start(seq)
            self.num_batch_slots += slots

    def _run_members(self, builder: PlanBuilder) -> None:
        """Each running member's uncomputed tokens (a whole prompt, or one decode token),
        best rank first, while the budget lasts."""
        for seq in list(self.running):  # a copy: victims leave `running`
            if not self._schedulable(seq):
                continue
            num_new = seq.num_uncomputed_tokens
            if num_new <= builder.budget and self._make_room(seq, num_new, builder):
                builder.add(seq, num_new)  # a prompt that does not fit this step waits for the next one

    def _resume_pending(self, builder: PlanBuilder) -> None:
        while self.pending and len(self.running) < self.context.max_num_seqs:
            seq = self.pending[0]
            num_new = self._admit(seq, builder.budget, whole=True)
            if not num_new:
                break
            self.pending.pop(0)
            self._start(seq)
            builder.add(seq, num_new)

    # ------------------------------------------------------------ queue hooks

    def _queues(self) -> tuple[list[Sequence], ...]:
        return self.waiting, self.running, self.pending

    def _requeue(self, seq: Sequence) -> None:
        bisect.insort(self.pending, seq, key=self._rank)

    def _num_held_slots(self) -> int:
        return self.num_batch_slots
