"""A scheduler driven step by step without a model, over a real allocator.

`SchedulerHarness` stands in for the engine around a scheduler: every scheduled
sequence advances its computed tokens, one that caught up gets a dummy output token
(1000, 1001, ... so a lost or duplicated token shows), a prefix-caching allocator
caches the computed blocks, a request with n > 1 forks its children after its prompt
(as the engine does), and a sequence holding max_tokens outputs is retired through
`finish`. The clock (`now`, what the scheduler's `context.clock` returns and new requests
arrive at) moves only as told: by `seconds_per_step` after each step (0 by default), or
by setting `now`. Every plan is checked against the
scheduler invariants before the harness touches a sequence; `check_all_done` checks
that every request was served exactly once. An exception the scheduler raises fails the
invariant its call exercises, with the scheduler's traceback.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from servelab.interfaces import (
    ForkingScheduler,
    PrefixCachingAllocator,
    SchedulerContext,
    Sequence,
    SequenceStatus,
    StepPlan,
)
from servelab.sampling_params import SamplingParams
from servelab.sequence import sequence_id
from servelab.testing.contract import check, exercising

OUTPUT_TOKEN_BASE = 1000

BUDGET = "token budget exceeded"
MAX_NUM_SEQS = "max_num_seqs exceeded"
SCHEDULED_TWICE = "a sequence is scheduled at most once per step"
TOKEN_COUNT = "each scheduled sequence processes between 1 and its uncomputed tokens"
KNOWN = "only queued, unfinished sequences are scheduled"
RUNNING = "scheduled sequences are RUNNING"
ROOM = "KV is allocated for every scheduled token"
PREEMPTED = "a preempted sequence is WAITING with no KV and no computed tokens"
STATS = "scheduler stats agree with the plan"
TOKENS_KEPT = "the scheduler never changes a sequence's tokens"
FINISHED_FREED = "a finished or aborted request holds no KV"
DROPPED = "request dropped"
DUPLICATED = "request finished twice"
PROGRESS = "no progress: an empty plan while requests are unfinished"
ABORT = "abort removes the request wherever it is"
HAS_UNFINISHED = "has_unfinished is True exactly while requests are unfinished"
PLAN = "schedule() plans a step within every limit"
FORK = "parallel sampling: forked children run alongside their parent"


def output_tokens(max_tokens: int) -> list[int]:
    return [OUTPUT_TOKEN_BASE + i for i in range(max_tokens)]


class SchedulerHarness:
    """`make_scheduler(context)` builds the scheduler over `allocator`; `observer`, if
    given, has before_step(harness) / after_step(harness, plan) called around steps."""

    def __init__(self, make_scheduler: Callable[[SchedulerContext], Any], allocator: Any, *, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 observer: Any = None, max_idle_steps: int = 0, seconds_per_step: float = 0.0,
                 start_time: float = 0.0) -> None:
        self.now = start_time
        self.seconds_per_step = seconds_per_step
        self.allocator = allocator
        self.context = SchedulerContext(allocator=allocator, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens,
                                        max_model_len=max_model_len, clock=lambda: self.now)
        self.scheduler = make_scheduler(self.context)
        self.prefix_cache = allocator if isinstance(allocator, PrefixCachingAllocator) else None
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.observer = observer
        self.max_idle_steps = max_idle_steps
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its sequences (completion 0 first)
        self.unforked: set[str] = set()  # n > 1 requests whose prompt is not computed yet
        self.aborted: set[str] = set()
        self.finished: list[Sequence] = []
        self.first_scheduled: list[str] = []  # sequence ids, in the order they first ran
        self.plans: list[StepPlan] = []
        self.add_order: dict[str, int] = {}
        self.num_partial_chunks = 0  # scheduled counts short of a sequence's uncomputed tokens
        self.idle_steps = 0
        self._ids = itertools.count()

    # ------------------------------------------------------------ requests

    def add(self, prompt: int | list[int], max_tokens: int | None = None, request_id: str | None = None,
            priority: int = 0, n: int | None = None, *, params: SamplingParams | None = None,
            arrival_time: float | None = None) -> Sequence:
        """Queue a request (`prompt` is a token list, or a length: tokens 1..prompt) with
        `params` (any SamplingParams: max_tokens, n, deadline, ...), or with the shorthand
        `max_tokens` and `n`; it arrives at `arrival_time` (default: `now`)."""
        if params is None:
            if max_tokens is None:
                raise TypeError("SchedulerHarness.add needs max_tokens or params")
            params = SamplingParams(max_tokens=max_tokens, n=n or 1)
        elif (max_tokens is not None and max_tokens != params.max_tokens) or (n is not None and n != params.n):
            raise TypeError(f"SchedulerHarness.add: max_tokens={max_tokens}, n={n} contradict {params!r}")
        n = params.n
        prompt_ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
        request_id = request_id or f"r{next(self._ids)}"
        arrival = self.now if arrival_time is None else arrival_time
        group = [Sequence(sequence_id(request_id, i), list(prompt_ids), params, arrival,
                          priority=priority, completion_index=i) for i in range(n)]
        self.requests[request_id] = group
        self.add_order[request_id] = len(self.add_order)
        if n > 1:
            self.unforked.add(request_id)
        with exercising(DROPPED):
            self.scheduler.add(group[0])
        return group[0]

    def abort(self, request_id: str) -> None:
        """Abort every unfinished sequence of a request, as the engine does."""
        for seq in self.requests[request_id]:
            if seq.is_finished or seq.finish_reason is not None:
                continue
            held = len(self.allocator.block_table(seq.request_id))
            with exercising(ABORT):
                returned = self.scheduler.abort(seq.request_id)
            forked = not (request_id in self.unforked and seq.completion_index > 0)
            check(returned is seq or (returned is None and not forked), ABORT,
                  f"abort({seq.request_id!r}) returned {returned!r}")
            check(list(self.allocator.block_table(seq.request_id)) == [], FINISHED_FREED,
                  f"aborted {seq.request_id} still holds {held} blocks")
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        self.unforked.discard(request_id)
        self.aborted.add(request_id)

    # ------------------------------------------------------------ the step

    def step(self) -> StepPlan:
        if self.observer is not None:
            self.observer.before_step(self)
        tokens_before = {s.request_id: (list(s.prompt_token_ids), list(s.output_token_ids)) for s in self._all()}
        unfinished = self._unfinished()
        self.check_has_unfinished(unfinished)
        with exercising(PLAN):
            plan = self.scheduler.schedule()
        self.check_plan(plan)
        for seq in self._all():
            check((seq.prompt_token_ids, seq.output_token_ids) == tokens_before[seq.request_id], TOKENS_KEPT,
                  lambda: f"{seq.request_id}'s tokens changed during schedule()")
        self.idle_steps = self.idle_steps + 1 if unfinished and plan.is_empty else 0
        check(self.idle_steps <= self.max_idle_steps, PROGRESS,
              f"{len(unfinished)} unfinished, {self.idle_steps} empty plans in a row")
        self._update(plan)
        self.plans.append(plan)
        if self.observer is not None:
            self.observer.after_step(self, plan)
        self.now += self.seconds_per_step
        return plan

    def _update(self, plan: StepPlan) -> None:
        """The engine's bookkeeping after the forward pass."""
        done: list[Sequence] = []
        forks = []
        for seq, num_new in plan.scheduled:
            if seq.request_id not in self.first_scheduled:
                self.first_scheduled.append(seq.request_id)
            seq.num_computed_tokens += num_new
            if self.prefix_cache is not None:
                with exercising(ROOM):
                    self.prefix_cache.cache_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            sampled = [seq]
            if seq.request_id in self.unforked:  # parallel sampling: children sample from this row too
                self.unforked.discard(seq.request_id)
                children = self.requests[seq.request_id][1:]
                sampled += children
                forks.append((seq, children))
            for target in sampled:
                target.output_token_ids.append(OUTPUT_TOKEN_BASE + len(target.output_token_ids))
                if len(target.output_token_ids) >= target.params.max_tokens:
                    target.finish_reason = "length"
                    done.append(target)
        for parent, children in forks:
            with exercising(FORK):
                self.scheduler.fork(parent, [c for c in children if c.finish_reason is None])
        with exercising(FINISHED_FREED):
            self.scheduler.finish(done)
        for seq in done:
            check(seq.status is SequenceStatus.FINISHED, "finish marks sequences FINISHED", seq.request_id)
            check(list(self.allocator.block_table(seq.request_id)) == [], FINISHED_FREED,
                  f"finished {seq.request_id} holds {list(self.allocator.block_table(seq.request_id))}")
        self.finished.extend(done)

    def check_plan(self, plan: StepPlan) -> None:
        """What must hold for every plan, before the engine touches the sequences."""
        check(plan.num_scheduled_tokens <= self.max_num_batched_tokens, BUDGET,
              lambda: f"{plan.num_scheduled_tokens} tokens scheduled, max_num_batched_tokens is "
                      f"{self.max_num_batched_tokens}: {[(s.request_id, n) for s, n in plan.scheduled]}")
        with exercising(STATS):
            stats = self.scheduler.stats()
        check(len(plan.scheduled) <= self.max_num_seqs and stats.num_running <= self.max_num_seqs, MAX_NUM_SEQS,
              lambda: f"{len(plan.scheduled)} scheduled, {stats.num_running} running, max_num_seqs "
                      f"{self.max_num_seqs}")
        check(stats.num_scheduled_seqs == len(plan.scheduled) and
              stats.num_scheduled_tokens == plan.num_scheduled_tokens, STATS,
              lambda: f"stats say {stats.num_scheduled_seqs} seqs / {stats.num_scheduled_tokens} tokens, "
                      f"the plan has {len(plan.scheduled)} / {plan.num_scheduled_tokens}")
        seqs = [seq for seq, _ in plan.scheduled]
        check(len({id(s) for s in seqs}) == len(seqs), SCHEDULED_TWICE, lambda: str([s.request_id for s in seqs]))
        known = {id(s) for s in self._all() if s.finish_reason is None}
        for seq, num_new in plan.scheduled:
            check(id(seq) in known, KNOWN, lambda: f"{seq.request_id} ({seq.finish_reason or 'never queued'})")
            check(1 <= num_new <= seq.num_uncomputed_tokens, TOKEN_COUNT,
                  lambda: f"{seq.request_id}: {num_new} of {seq.num_uncomputed_tokens} uncomputed tokens")
            self.num_partial_chunks += num_new < seq.num_uncomputed_tokens
            check(seq.status is SequenceStatus.RUNNING, RUNNING, lambda: f"{seq.request_id} is {seq.status}")
            needed = -(-(seq.num_computed_tokens + num_new) // self.block_size)
            held = len(self.allocator.block_table(seq.request_id))
            check(held >= needed, ROOM, lambda: f"{seq.request_id} needs {needed} blocks, holds {held}")
        for seq in plan.preempted:
            check(seq not in seqs and seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0 and
                  list(self.allocator.block_table(seq.request_id)) == [], PREEMPTED,
                  lambda: f"{seq.request_id}: status {seq.status}, {seq.num_computed_tokens} computed, "
                          f"table {list(self.allocator.block_table(seq.request_id))}")

    def check_has_unfinished(self, unfinished: list[Sequence]) -> None:
        with exercising(HAS_UNFINISHED):
            says = self.scheduler.has_unfinished()
        check(says or not unfinished, DROPPED, lambda: (
            f"has_unfinished() is False while {', '.join(s.request_id for s in unfinished)} "
            f"{'is' if len(unfinished) == 1 else 'are'} unfinished"))
        check(not says or unfinished, HAS_UNFINISHED, "True with every request finished")

    def run(self, max_steps: int = 1000) -> list[StepPlan]:
        """Step until nothing is unfinished; returns the plans."""
        start = len(self.plans)
        while self._unfinished():
            check(len(self.plans) - start < max_steps, PROGRESS, f"not done after {max_steps} steps")
            self.step()
        return self.plans[start:]

    # ------------------------------------------------------------ the end

    def check_all_done(self) -> None:
        """Every request finished exactly once with all its tokens, or was aborted; no KV held."""
        finished_ids = [s.request_id for s in self.finished]
        duplicates = {i for i in finished_ids if finished_ids.count(i) > 1}
        check(not duplicates, DUPLICATED, f"{sorted(duplicates)}")
        for request_id, group in self.requests.items():
            for seq in group:
                if request_id in self.aborted and seq.finish_reason == "abort":
                    continue
                check(seq.request_id in finished_ids and seq.output_token_ids == output_tokens(seq.params.max_tokens),
                      DROPPED, lambda: f"{seq.request_id} ({seq.status.value}, {len(seq.output_token_ids)} of "
                                       f"{seq.params.max_tokens} tokens) was never finished")
                check(list(self.allocator.block_table(seq.request_id)) == [], FINISHED_FREED, seq.request_id)
        self.check_has_unfinished(self._unfinished())
        used = self.allocator.stats().num_used_blocks
        check(used == 0, FINISHED_FREED, f"{used} KV blocks still in use after every request finished")
        stats = self.scheduler.stats()
        check(stats.num_waiting == stats.num_running == 0, STATS,
              f"{stats.num_waiting} waiting, {stats.num_running} running after every request finished")

    # ------------------------------------------------------------ helpers

    def _all(self) -> list[Sequence]:
        return [seq for group in self.requests.values() for seq in group]

    def _unfinished(self) -> list[Sequence]:
        return [seq for seq in self._all() if seq.finish_reason is None]

    @staticmethod
    def supports_fork(scheduler: Any, allocator: Any) -> bool:
        from servelab.interfaces import ForkingAllocator

        return isinstance(scheduler, ForkingScheduler) and isinstance(allocator, ForkingAllocator)
