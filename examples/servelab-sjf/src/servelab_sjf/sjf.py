"""Shortest job first: admit the waiting request with the least expected work.

A request's expected work is its prompt plus its max_tokens. Among requests of equal
priority the waiting queue is ordered by that, so short requests overtake long ones
and the mean time to first token drops when lengths are skewed. Pure SJF starves a long
request under a steady stream of short ones; aging fixes that: each second a request
has waited is worth `aging_tokens_per_s` tokens less expected work. Because every
waiting request ages at the same rate, the order is fixed at arrival:

    rank = (priority, prompt_len + max_tokens + aging_tokens_per_s * arrival_time)

Otherwise it behaves like continuous batching: prompts are prefilled whole, running
sequences decode every step, and when the KV pool runs dry the worst-ranked running
sequence (the longest job) is preempted by recompute. Only the public servelab API
is used.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Sequence as Seq

import attrs

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


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"[scheduler] {attribute.name} must be a number >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class SJFOptions:
    """Options of the `sjf` scheduler ([scheduler] keys in a config)."""

    # Tokens of expected work one second of waiting is worth; 0 = pure SJF (long jobs may starve).
    aging_tokens_per_s: float = attrs.field(default=50.0, validator=_non_negative)


class SJFScheduler:
    """Scheduler protocol (add, abort, schedule, finish, has_unfinished, stats) plus fork."""

    def __init__(self, options: SJFOptions | None, context: SchedulerContext) -> None:
        if context.max_num_batched_tokens < context.max_model_len:
            raise ConfigError(
                f"scheduler 'sjf' prefills whole prompts, so [engine] max_num_batched_tokens "
                f"({context.max_num_batched_tokens}) must be >= max_model_len ({context.max_model_len})")
        self.options = options or SJFOptions()
        self.context = context
        self.allocator = context.allocator
        self.prefix_cache = self.allocator if isinstance(self.allocator, PrefixCachingAllocator) else None
        self.waiting: list[Sequence] = []  # in rank order: shortest (aged) job first
        self.running: list[Sequence] = []  # in rank order; the last is the preemption victim
        self._ranks: dict[str, tuple] = {}
        self._order = itertools.count()
        self._num_preemptions = 0
        self._last = SchedulerStats(num_waiting=0, num_running=0, num_preemptions=0)

    # ------------------------------------------------------------ Scheduler protocol

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._retire(seq)
                    seq.finish_reason = "abort"
                    return seq
        return None

    def schedule(self) -> StepPlan:
        budget = self.context.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        while len(self.running) > self.context.max_num_seqs:  # forks can overfill the batch
            self._preempt(self.running[-1], scheduled, preempted)
        index = 0
        while index < len(self.running):  # running sequences first, best rank first
            seq = self.running[index]
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                index += 1
                continue
            if self._make_room(seq, num_new, scheduled, preempted):
                scheduled[seq] = num_new
                budget -= num_new
                index += 1
        while not preempted and self.waiting and len(self.running) < self.context.max_num_seqs:
            num_new = self._admit(self.waiting[0], budget)
            if not num_new:
                break  # the shortest job waits for room; nobody overtakes it
            seq = self.waiting.pop(0)
            self._start(seq)
            scheduled[seq] = num_new
            budget -= num_new
        plan = StepPlan(scheduled=tuple((s, scheduled[s]) for s in self.running if s in scheduled),
                        preempted=tuple(preempted))
        self._account(plan)
        return plan

    def finish(self, seqs: Seq[Sequence]) -> None:
        done = {id(seq) for seq in seqs}
        self.running = [seq for seq in self.running if id(seq) not in done]
        for seq in seqs:
            self._retire(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return attrs.evolve(self._last, num_waiting=len(self.waiting), num_running=len(self.running),
                            num_preemptions=self._num_preemptions)

    # ------------------------------------------------------------ ForkingScheduler

    def fork(self, parent: Sequence, children: Seq[Sequence]) -> None:
        """Children share the parent's KV when the allocator forks; otherwise they recompute."""
        for child in children:
            shares = isinstance(self.allocator, ForkingAllocator) and self.allocator.fork(
                parent.request_id, child.request_id)
            if shares:
                child.num_computed_tokens = parent.num_computed_tokens
                self._ranks[child.request_id] = self._rank_of(child)
                self._start(child)
            else:
                child.num_computed_tokens = 0
                self._enqueue(child)

    # ------------------------------------------------------------ internals

    def _rank_of(self, seq: Sequence) -> tuple:
        expected = len(seq.prompt_token_ids) + seq.params.max_tokens
        return seq.priority, expected + self.options.aging_tokens_per_s * seq.arrival_time, next(self._order)

    def _enqueue(self, seq: Sequence) -> None:
        self._ranks.setdefault(seq.request_id, self._rank_of(seq))
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: self._ranks[s.request_id])

    def _start(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: self._ranks[s.request_id])

    def _retire(self, seq: Sequence) -> None:
        self.allocator.free(seq.request_id)
        self._ranks.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Allocate all of a waiting sequence's uncomputed tokens (after any prefix-cache
        hit); the count, or 0 holding nothing when they do not fit."""
        if self.prefix_cache is not None and seq.num_computed_tokens == 0:
            seq.num_computed_tokens = self.prefix_cache.match_prefix(seq)
        num_new = seq.num_uncomputed_tokens
        if num_new <= budget and self.allocator.allocate(seq.request_id, seq.num_tokens):
            return num_new
        self.allocator.free(seq.request_id)  # lets go of a matched prefix
        seq.num_computed_tokens = 0
        return 0

    def _make_room(self, seq: Sequence, num_new: int, scheduled: dict, preempted: list) -> bool:
        """Allocate for a running sequence, preempting the longest jobs while the pool is dry."""
        while not self.allocator.allocate(seq.request_id, seq.num_computed_tokens + num_new):
            victim = self.running[-1]
            self._preempt(victim, scheduled, preempted)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, scheduled: dict, preempted: list) -> None:
        """Preempt by recompute: free its KV, keep its tokens, queue it again."""
        self.running.remove(seq)
        scheduled.pop(seq, None)
        preempted.append(seq)
        self.allocator.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self._enqueue(seq)

    def _account(self, plan: StepPlan) -> None:
        num_seqs = len(plan.scheduled)
        num_idle = len(self.running) - num_seqs if num_seqs else 0
        last = self._last
        self._last = attrs.evolve(
            last, num_scheduled_seqs=num_seqs, num_scheduled_tokens=plan.num_scheduled_tokens,
            num_idle_slots=num_idle, slot_steps_used=last.slot_steps_used + num_seqs,
            slot_steps_wasted=last.slot_steps_wasted + num_idle, num_steps=last.num_steps + bool(num_seqs))
