"""Chunked prefill (Sarathi-Serve, vLLM V1): long prompts are split across steps so
running decodes keep flowing.

Every step, in this order, while the token budget (max_num_batched_tokens) lasts:

1. one decode token (and its drafts, as far as the budget goes) for every running
   sequence that has caught up, best rank first;
2. the next chunk of every running sequence still prefilling (or recomputing after a
   preemption), best rank first;
3. the first chunk of waiting sequences, admitted in rank order while a slot is free.

A chunk is whatever the budget has left, up to the rest of the prompt, so a
4,000-token prompt under a 512-token budget spans eight or more steps and never holds
the running decodes back for more than one budget's worth of work. With a
prefix-caching allocator, an admitted sequence starts from its longest cached prefix
and only the uncached tail is prefilled. The budget may be smaller than max_model_len.

Preemption by recompute takes the victim (`preemption` option; by default the
lowest-ranked running sequence, for equal priorities the newest), even one already
planned this step, which is then unplanned;
nobody is admitted in a step that preempted.

The `chunked-prefill` scheduler is this class; like `ContinuousScheduler`, a policy
overrides a seam of `QueueScheduler` on it (`rank`, `admissible`, `victim`) and keeps
the chunked step.
"""

from __future__ import annotations

from typing import Any

from servelab.interfaces import SchedulerContext, StepPlan
from servelab.kit.queues import PlanBuilder, QueueOptions, QueueScheduler


class ChunkedPrefillScheduler(QueueScheduler):
    name = "chunked-prefill"

    def __init__(self, options: Any, context: SchedulerContext) -> None:
        super().__init__(options if options is not None else QueueOptions(), context)

    def schedule(self) -> StepPlan:
        builder = PlanBuilder(self.context.max_num_batched_tokens)
        self._shed_overflow(builder)
        self._run(builder, decodes=True)
        self._run(builder, decodes=False)
        if not builder.preempted:
            self._admit_waiting(builder, whole=False)
        return self._plan(builder)

    def _run(self, builder: PlanBuilder, *, decodes: bool) -> None:
        """Running sequences in rank order: those decoding (one uncomputed token, plus any
        drafts, which a short budget cuts), or those prefilling (the next chunk)."""
        for seq in list(self.running):  # a copy: victims leave `running`
            if builder.budget <= 0:
                break
            if not self._schedulable(seq) or seq.is_decoding != decodes:
                continue
            num_new = min(seq.num_uncomputed_tokens, builder.budget)
            if self._make_room(seq, num_new, builder):
                builder.add(seq, num_new)
