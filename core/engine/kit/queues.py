"""The kit's queue scheduler: a waiting queue and a running batch kept in rank order,
admission with prefix-cache hits, preemption by recompute, fork, abort, and the slot
accounting every scheduler reports the same way. Every built-in scheduler is one.

Seams, each a method a subclass overrides (the rest stays the kit's):

- `rank(seq)`: the order of the waiting queue and the running batch (a sort key, fixed
  when the sequence is added; lower runs first);
- `admissible(seq)`: the admission filter (False: `seq` waits this step, and the
  sequences behind it may be admitted);
- `victim(running)`: the preemption victim (by default the victim policy named by the
  `preemption` option, a policy kind of its own: `servelab.contracts.victim`);
- `schedule()`: the step itself, written from the helpers:

    builder = PlanBuilder(self.context.max_num_batched_tokens)
    ...  # _make_room / _admit / builder.add, in the policy's own order
    return self._plan(builder)

A shortest-job-first scheduler is a `rank` over `ContinuousScheduler`'s step (the
example package servelab-sjf does exactly that).

Rank: lower priority value first, then earlier arrival, then the order the scheduler
first saw the sequence. With `priority_aging_s` > 0, each priority level is worth that
many seconds of arrival time (rank by arrival + priority * priority_aging_s), which is
the same order as "effective priority improves by one level every priority_aging_s
seconds of waiting": a request that has waited long enough outranks every newer one,
whatever their priorities, so nobody starves. 0 turns aging off (strict priority).
"""

from __future__ import annotations

import warnings

import bisect
import itertools
from typing import Any, Sequence as Seq

import attrs

from servelab.errors import ConfigError
from servelab.interfaces import (
    AnticipatingPrefixCache,
    ForkingAllocator,
    PrefixCachingAllocator,
    SchedulerContext,
    SchedulerStats,
    Sequence,
    SequenceStatus,
    StepPlan,
)
from servelab.kit.blocks import blocks_for
from servelab.contracts.victim import Preemption
from servelab.kit.victims import as_preemption, resolve_victim
from servelab.options import non_negative_number, one_of


PREEMPTION_MODES = ("recompute", "swap")  # what preemption does with the victim's KV


@attrs.frozen(kw_only=True)
class QueueOptions:
    """Options every built-in scheduler takes."""

    # Seconds of waiting worth one priority level (0: strict priority, no aging).
    priority_aging_s: float = attrs.field(default=10.0, validator=non_negative_number("scheduler"))
    # Which running sequence is preempted when the KV pool runs dry: the name of a victim
    # policy (kind `victims`; the built-ins are in servelab.kit.victims), bare or qualified.
    preemption: str = attrs.field(default="newest", validator=attrs.validators.instance_of(str))
    # What happens to the victim's KV: "recompute" (freed; its tokens are computed again on
    # resumption) or "swap" (copied to the host tier, `[kv_offload]`, and back on resumption;
    # recompute when the tier cannot hold it).
    preemption_mode: str = attrs.field(default="recompute", validator=one_of("scheduler", PREEMPTION_MODES))


def option_or(options: Any, name: str, default: Any) -> Any:
    """Deprecated (kept for plugins written against earlier kits; use `kit_options`):
    `options.<name>` where the options class has that field, else `default`."""
    warnings.warn("servelab.kit.option_or is deprecated: extend the kit's options class and use kit_options",
                  DeprecationWarning, stacklevel=2)
    return attrs.asdict(options, recurse=False).get(name, default) if attrs.has(type(options)) else default


def kit_options(options: Any, options_class: type) -> Any:
    """The kit's options a scheduler runs with, composed explicitly: `options` itself where
    its class extends the kit's (`class MyOptions(ContinuousOptions)`), else the kit's
    defaults (`options_class()`: one default per option, the class's). An options class
    that repeats one of the kit's fields without extending the kit's is refused, since the
    kit would not read it."""
    if options is None:
        return options_class()
    if isinstance(options, QueueOptions):
        return options
    repeated = sorted(set(attrs.fields_dict(type(options))) & set(attrs.fields_dict(QueueOptions))
                      if attrs.has(type(options)) else ())
    if repeated:
        raise ConfigError(f"[scheduler] options class {type(options).__name__} declares {', '.join(repeated)} "
                          f"without extending servelab.kit.{options_class.__name__}, so the kit would not read "
                          f"them: declare it as `class {type(options).__name__}({options_class.__name__})`")
    return options_class()


def check_whole_prompts_fit(name: str, context: SchedulerContext) -> None:
    """Schedulers that prefill a prompt in one step need a budget of max_model_len tokens."""
    if context.max_num_batched_tokens < context.max_model_len:
        raise ConfigError(
            f"scheduler {name!r} prefills whole prompts, so [engine] max_num_batched_tokens "
            f"({context.max_num_batched_tokens}) must be >= max_model_len ({context.max_model_len}); "
            f"raise it, or choose the chunked-prefill scheduler"
        )


class PlanBuilder:
    """One step's plan under construction: who runs with how many tokens, the token
    budget left, and who was preempted."""

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens still free this step
        self.scheduled: dict[Sequence, int] = {}  # sequence -> new tokens (Sequence hashes by identity)
        self.preempted: list[Sequence] = []

    def add(self, seq: Sequence, num_new: int) -> None:
        self.scheduled[seq] = num_new
        self.budget -= num_new

    def add_each_that_fits(self, pairs: Seq[tuple[Sequence, int]]) -> None:
        """`add` every (sequence, new tokens) pair, in order, whose tokens fit the budget left."""
        scheduled, budget = self.scheduled, self.budget
        for seq, num_new in pairs:
            if num_new <= budget:
                scheduled[seq] = num_new
                budget -= num_new
        self.budget = budget

    def drop(self, seq: Sequence) -> None:
        """Unschedule `seq` (it was preempted after all), returning its tokens to the budget."""
        self.budget += self.scheduled.pop(seq, 0)


class QueueScheduler:
    """Queues, admission, preemption and accounting; subclasses write `schedule()`.

    `waiting` and `running` are kept in rank order (`rank`). The preemption victim is
    `victim(running)`: by default the last of `running` (lowest rank: lowest priority,
    then newest), so the best-ranked running sequence is never preempted while others
    could be, and always progresses.
    """

    name = "queue"
    options_class: type = QueueOptions  # the kit's options this scheduler reads (`kit_options`)

    def __init__(self, options: Any, context: SchedulerContext) -> None:
        self.queue_options = kit_options(options, self.options_class)
        self.options = options if options is not None else self.queue_options
        self.context = context
        self.allocator = context.allocator
        self.prefix_cache = context.allocator if isinstance(context.allocator, PrefixCachingAllocator) else None
        self._anticipating = context.allocator if isinstance(context.allocator, AnticipatingPrefixCache) else None
        self._victim_policy = resolve_victim(self.queue_options.preemption, context)
        self.swap = self.queue_options.preemption_mode == "swap"
        self.host_tier = context.host_tier
        if self.swap and self.host_tier is None:
            raise ConfigError('[scheduler] preemption_mode = "swap" swaps KV to the host tier, which is off: '
                              'set [kv_offload] host_blocks (or host_memory), or preemption_mode = "recompute"')
        self.num_swap_outs = 0
        self.waiting: list[Sequence] = []  # holding no KV, in rank order
        self.running: list[Sequence] = []  # holding a slot (and KV for their computed tokens), in rank order
        self._ranks: dict[str, tuple] = {}  # sequence id -> rank
        self._held: set[Sequence] = set()  # in a batch still in flight: neither planned nor preempted
        self._order = itertools.count()
        self.num_preemptions = 0
        self.num_discarded_tokens = 0
        self._last = SchedulerStats(num_waiting=0, num_running=0, num_preemptions=0)

    # ------------------------------------------------------------ Scheduler protocol

    def add(self, seq: Sequence) -> None:
        self._ranks[seq.request_id] = self._new_rank(seq)
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in self._queues():
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.allocator.free(request_id)
                    if self.host_tier is not None:
                        self.host_tier.discard(request_id)
                    self._ranks.pop(request_id, None)
                    self._held.discard(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    return seq
        return None

    def finish(self, seqs: Seq[Sequence]) -> None:
        if not seqs:
            return
        done = set(seqs)  # a Sequence hashes by identity
        self.running = list(itertools.filterfalse(done.__contains__, self.running))
        for seq in seqs:
            self.allocator.free(seq.request_id)
            if self.host_tier is not None:
                self.host_tier.discard(seq.request_id)
            self._ranks.pop(seq.request_id, None)
            self._held.discard(seq)
            seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return any(self._queues())

    def stats(self) -> SchedulerStats:
        return attrs.evolve(self._last, num_waiting=sum(map(len, self._queues())) - len(self.running),
                            num_running=len(self.running), num_preemptions=self.num_preemptions,
                            num_discarded_tokens=self.num_discarded_tokens)

    def fork(self, parent: Sequence, children: Seq[Sequence]) -> None:
        """Children share the parent's KV and run from the next step; one that cannot
        (no memory) queues to recompute its prompt, like a preempted sequence."""
        allocator: ForkingAllocator = self.allocator  # the engine admits n > 1 only if it forks
        for child in children:
            self._ranks[child.request_id] = self._new_rank(child)
            if allocator.fork(parent.request_id, child.request_id):
                child.num_computed_tokens = parent.num_computed_tokens
                self._start(child)
            else:
                child.num_computed_tokens = 0
                child.status = SequenceStatus.WAITING
                self._requeue(child)

    def hold_in_flight(self, seqs: Seq[Sequence]) -> None:
        """InFlightScheduler: `seqs` are in a batch still in flight (pipeline parallelism)."""
        self._held.update(seqs)

    def release_in_flight(self, seqs: Seq[Sequence]) -> None:
        self._held.difference_update(seqs)

    def _schedulable(self, seq: Sequence) -> bool:
        """Whether running `seq` may be planned this step: still RUNNING (not preempted
        earlier in this step) and in no batch still in flight. `_plan` leaves held sequences
        out whatever a subclass's own `schedule()` added; checking this first keeps the
        budget for the others."""
        return seq.status is SequenceStatus.RUNNING and seq not in self._held

    def _preemptible(self) -> list[Sequence]:
        """The running sequences a victim may be chosen from: those in no batch in flight."""
        held = self._held
        return [seq for seq in self.running if seq not in held] if held else self.running

    # ------------------------------------------------------------ queues

    def _queues(self) -> tuple[list[Sequence], ...]:
        """Every list a sequence this scheduler owns can be in (subclasses add theirs)."""
        return self.waiting, self.running

    # ------------------------------------------------------------ seams

    def rank(self, seq: Sequence) -> tuple:
        """The sort key of `seq` in both queues, computed once when it is added (lower
        first). Default: priority then arrival, with `priority_aging_s` aging (module doc)."""
        aging = self.queue_options.priority_aging_s
        if aging > 0:
            return (seq.arrival_time + seq.priority * aging,)
        return seq.priority, seq.arrival_time

    def admissible(self, seq: Sequence) -> bool:
        """May waiting `seq` be admitted now? False leaves it waiting this step."""
        return True

    def victim(self, running: Seq[Sequence]) -> Sequence | Preemption:
        """The running sequence to preempt (`running` is never empty), or a Preemption of it
        that also decides swap or recompute. Default: the `preemption` option's policy."""
        return self._victim_policy.choose(running, self.allocator)

    # ------------------------------------------------------------ ranks

    def _new_rank(self, seq: Sequence) -> tuple:
        return (*self.rank(seq), next(self._order))

    def _rank(self, seq: Sequence) -> tuple:
        return self._ranks[seq.request_id]

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self._rank)

    def _requeue(self, seq: Sequence) -> None:
        """Where a preempted sequence waits to resume (subclasses may keep their own list)."""
        self._enqueue(seq)

    def _start(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=self._rank)

    # ------------------------------------------------------------ KV

    def _admit(self, seq: Sequence, budget: int, *, whole: bool) -> int:
        """Allocate a waiting sequence's next tokens, after any prefix-cache hit: all its
        uncomputed tokens (`whole`), or as many as `budget` allows. Returns how many it
        computes this step, or 0, holding nothing, when they do not fit. Does not move
        `seq` between queues."""
        if self.host_tier is not None and self.host_tier.is_swapped(seq.request_id):
            return self._swap_in(seq, budget, whole=whole)
        # A request scoring its prompt (prompt_logprobs) computes every position: no prefix reuse.
        if self.prefix_cache is not None and seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None:
            seq.num_computed_tokens = self.prefix_cache.match_prefix(seq)
        num_new = min(seq.num_uncomputed_tokens, budget)
        fits = num_new == seq.num_uncomputed_tokens if whole else num_new > 0
        if fits and self.allocator.allocate(seq.request_id, seq.num_computed_tokens + num_new):
            return num_new
        self.allocator.free(seq.request_id)  # lets go of the matched prefix
        seq.num_computed_tokens = 0
        return 0

    def _swap_in(self, seq: Sequence, budget: int, *, whole: bool) -> int:
        """`_admit` for a sequence swapped out: fresh blocks for its computed tokens (their
        K/V comes back from the host tier before the step) and its next tokens."""
        num_new = min(seq.num_uncomputed_tokens, budget)
        fits = num_new == seq.num_uncomputed_tokens if whole else num_new > 0
        if fits and self.allocator.allocate(seq.request_id, seq.num_computed_tokens + num_new):
            table = self.allocator.block_table(seq.request_id)
            self.host_tier.swap_in(seq.request_id, list(table[:self.host_tier.num_swapped_blocks(seq.request_id)]))
            return num_new
        self.allocator.free(seq.request_id)
        return 0

    def _admit_waiting(self, builder: PlanBuilder, *, whole: bool) -> None:
        """Admit from the head of `waiting` while a slot is free: whole prompts (`whole`),
        or first chunks while the budget lasts. The head that does not fit waits, and
        nobody overtakes it."""
        index = 0
        while index < len(self.waiting) and len(self.running) < self.context.max_num_seqs and (
                whole or builder.budget > 0):
            seq = self.waiting[index]
            if not (self.admissible(seq) and self._adapter_fits(seq)):
                index += 1
                continue
            num_new = self._admit(seq, builder.budget, whole=whole)
            if not num_new:
                break
            self.waiting.pop(index)
            self._start(seq)
            builder.add(seq, num_new)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether running `seq` keeps the batch within `max_loras_per_batch` LoRA adapters;
        one that would not waits (others, of adapters already running, go ahead of it)."""
        cap = self.context.max_loras_per_batch
        if cap is None or not seq.lora_id:
            return True
        running = {other.lora_id for other in self.running if other.lora_id}
        return seq.lora_id in running or len(running) < cap

    def _make_room(self, seq: Sequence, num_new: int, builder: PlanBuilder) -> bool:
        """Allocate `num_new` more tokens for running `seq`, preempting victims while the
        pool is dry; False if `seq` itself had to go. A victim planned earlier this step
        is unplanned (and leaves `running`: loop over a copy)."""
        return (self.allocator.allocate(seq.request_id, seq.num_computed_tokens + num_new)
                or self._preempt_until_room(seq, num_new, builder))

    def _preempt_until_room(self, seq: Sequence, num_new: int, builder: PlanBuilder) -> bool:
        """`_make_room` once the first allocation failed: preempt victims and retry; False
        if `seq` itself had to go."""
        while True:
            preemption = self._victim()
            self._preempt(preemption.victim, builder, preemption.swap)
            if preemption.victim is seq:
                return False
            if self.allocator.allocate(seq.request_id, seq.num_computed_tokens + num_new):
                return True

    def _preempt(self, seq: Sequence, builder: PlanBuilder, swap: bool | None = None) -> None:
        """Preempt: free its KV (swapped to the host tier first where `swap`, or the mode
        when None, asks and the tier can hold it), keep its tokens, queue it to resume."""
        self.running.remove(seq)
        builder.drop(seq)
        builder.preempted.append(seq)
        if not self._swap_out(seq, self.swap if swap is None else swap):
            self.num_discarded_tokens += seq.num_computed_tokens
            seq.num_discarded_tokens += seq.num_computed_tokens
            seq.num_computed_tokens = 0
        self.allocator.free(seq.request_id)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self._requeue(seq)

    def _swap_out(self, seq: Sequence, swap: bool) -> bool:
        """Swap preemption: copy the blocks of `seq`'s computed tokens to the host tier
        (it keeps `num_computed_tokens`). False where recompute was chosen, there is no
        tier, nothing to keep, or the tier cannot hold it."""
        if not swap or self.host_tier is None or seq.num_computed_tokens == 0:
            return False
        blocks = blocks_for(seq.num_computed_tokens, self.host_tier.block_size)
        table = self.allocator.block_table(seq.request_id)
        if not self.host_tier.swap_out(seq.request_id, list(table[:blocks])):
            return False
        self.num_swap_outs += 1
        return True

    def _shed_overflow(self, builder: PlanBuilder) -> None:
        """The start of a step: forks can overfill the batch, so preempt victims past
        max_num_seqs; a prefix cache that anticipates is told who waits."""
        while len(self.running) > self.context.max_num_seqs and self._preemptible():
            preemption = self._victim()
            self._preempt(preemption.victim, builder, preemption.swap)
        if self._anticipating is not None:
            self._anticipating.anticipate(self.waiting)

    def _victim(self) -> Preemption:
        candidates = self._preemptible()
        return as_preemption(self.victim(candidates), candidates, f"{type(self).__name__}.victim")

    # ------------------------------------------------------------ accounting

    def _num_held_slots(self) -> int:
        """Slots held this step (static batches also count their finished members)."""
        return len(self.running)

    def _plan(self, builder: PlanBuilder) -> StepPlan:
        """The plan in rank order, with this step's accounting recorded."""
        tokens_of, held = builder.scheduled.get, self._held
        # a sequence held in flight never goes out, whatever a subclass's own loop added
        scheduled = tuple([(seq, num_new) for seq in self.running
                           if (num_new := tokens_of(seq)) is not None and seq not in held])
        plan = StepPlan(scheduled=scheduled, preempted=tuple(builder.preempted))
        num_seqs, num_tokens = len(scheduled), plan.num_scheduled_tokens
        num_idle = self._num_held_slots() - num_seqs if scheduled else 0
        last = self._last
        self._last = attrs.evolve(
            last, num_scheduled_seqs=num_seqs, num_scheduled_tokens=num_tokens, num_idle_slots=num_idle,
            slot_steps_used=last.slot_steps_used + num_seqs, slot_steps_wasted=last.slot_steps_wasted + num_idle,
            num_steps=last.num_steps + bool(scheduled))
        return plan
