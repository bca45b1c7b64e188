"""The kit's continuous (iteration-level) batching, as in Orca and vLLM: the `continuous`
scheduler, and the step a scheduler that only reorders (`rank`) inherits.

Every step, running sequences decode and waiting ones are admitted, in rank order
(priority, then arrival; see `queues`), while a sequence slot, token budget and KV room
remain. Prompts are prefilled whole, in one step.

Policy (`policy` option):

- "prefill-first" (default, vLLM V0): waiting prompts are admitted first and the running
  sequences' decode tokens fill what is left of the token budget. KV for those decode
  tokens is claimed before admission, so admitting never preempts a running sequence.
- "decode-first": running sequences decode first; admissions take the budget left.

The two differ only when the token budget is tight: prefill-first gives new requests
their first token sooner, decode-first keeps running requests' tokens flowing.

When the KV pool runs dry, the victim (`preemption` option; by default the lowest-ranked
running sequence, for equal priorities the newest) is preempted by recompute: its blocks are freed and it waits, with its generated
tokens kept, to recompute prompt and output in one go. Nobody is admitted in a step that
preempted. With a prefix-caching allocator an admitted sequence starts from its longest
cached prefix. Forked sequences (parallel sampling) join the running batch; past
max_num_seqs, the lowest-ranked are preempted at the next step.
"""

from __future__ import annotations

from typing import Any

import attrs

from servelab.interfaces import SchedulerContext, Sequence, SequenceStatus, StepPlan
from servelab.options import one_of
from servelab.kit.queues import PlanBuilder, QueueOptions, QueueScheduler, check_whole_prompts_fit

POLICIES = ("prefill-first", "decode-first")


@attrs.frozen(kw_only=True)
class ContinuousOptions(QueueOptions):
    # Who gets the token budget first: new prompts or running decodes.
    policy: str = attrs.field(default="prefill-first", validator=one_of("scheduler", POLICIES))


class ContinuousScheduler(QueueScheduler):
    name = "continuous"

    options_class = ContinuousOptions

    def __init__(self, options: Any, context: SchedulerContext) -> None:
        check_whole_prompts_fit(self.name, context)
        super().__init__(options, context)
        kit = self.queue_options  # a plain QueueOptions: the policy's one default, ContinuousOptions'
        self.policy = kit.policy if isinstance(kit, ContinuousOptions) else ContinuousOptions().policy

    def schedule(self) -> StepPlan:
        builder = PlanBuilder(self.context.max_num_batched_tokens)
        self._shed_overflow(builder)
        ready = self._claim_running(builder)
        policy = self.policy
        if policy == "decode-first":
            builder.add_each_that_fits(ready)
        if not builder.preempted:
            self._admit_waiting(builder, whole=True)
        if policy == "prefill-first":
            builder.add_each_that_fits(ready)
        return self._plan(builder)

    def _claim_running(self, builder: PlanBuilder) -> list[tuple[Sequence, int]]:
        """KV for running sequences' next tokens, best rank first, while their tokens fit
        the budget; preempts from the back when the pool is dry."""
        ready: list[tuple[Sequence, int]] = []
        demand = 0
        allocate = self.allocator.allocate
        for seq in list(self.running):  # a copy: victims leave `running`
            if not self._schedulable(seq):
                continue  # preempted earlier in this loop, or in a batch still in flight
            num_new = seq.num_uncomputed_tokens
            if demand + num_new > builder.budget:
                break
            # _make_room, spelled out for the common case: the first allocation succeeds.
            if (allocate(seq.request_id, seq.num_computed_tokens + num_new)
                    or self._preempt_until_room(seq, num_new, builder)):
                ready.append((seq, num_new))
                demand += num_new
        if builder.preempted:  # a victim may have been claimed already (not with `newest`)
            ready = [(seq, n) for seq, n in ready if seq.status is SequenceStatus.RUNNING]
        return ready
