"""The `prefill-alone` scheduler: the step structure of vLLM's V0 engine without chunked
prefill and of SGLang up to 0.3, which the simulator's published-engine models run
(servelab.bench.sim.engine_models).

At every scheduler call, waiting prompts are admitted first (whole, in rank order,
while a slot, the token budget and KV room remain); a step that admits any runs those
prompts alone, and every running decode waits for it. Only a call that admits nobody
decodes the running batch, and then it keeps decoding that batch for
`num_scheduler_steps` steps (vLLM's multi-step scheduling) before the queue is looked at
again: an arrival waits for the run to end. Sequences that finish during a run leave it;
nobody joins it. Preemption by recompute as in `continuous`.

`runs` records, for each step planned, the run it belongs to (a prefill step is a run
of its own), which is when an engine that streams a run's tokens at its end hands
them out."""

from __future__ import annotations

from typing import Any

import attrs

import servelab
from servelab.interfaces import SchedulerContext, StepPlan
from servelab.kit import ContinuousOptions, ContinuousScheduler
from servelab.kit.queues import PlanBuilder
from servelab.plugin_types import SchedulerPlugin


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    from servelab.errors import ConfigError

    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"[scheduler] {attribute.name} must be an integer >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class PrefillAloneOptions(ContinuousOptions):
    # Decode steps run between two scheduler calls (vLLM's --num-scheduler-steps).
    num_scheduler_steps: int = attrs.field(default=1, validator=_positive)


class PrefillAloneScheduler(ContinuousScheduler):
    name = "prefill-alone"
    options_class = PrefillAloneOptions

    def __init__(self, options: Any, context: SchedulerContext) -> None:
        super().__init__(options, context)
        self.num_scheduler_steps = self.queue_options.num_scheduler_steps
        self._steps_left = 0  # decode steps still to run in the current run
        self._run = -1
        self.runs: list[int] = []  # per planned step with work: its run's index

    def schedule(self) -> StepPlan:
        builder = PlanBuilder(self.context.max_num_batched_tokens)
        self._shed_overflow(builder)
        in_run = self._steps_left > 0
        if in_run:  # the run's batch decodes on; if nobody in it is left, the queue is looked at
            builder.add_each_that_fits(self._claim_running(builder))
            if builder.scheduled or builder.preempted:
                self._steps_left = self._steps_left - 1 if builder.scheduled else 0
                return self._record(builder, new_run=False)
        self._steps_left = 0
        if not builder.preempted:
            self._admit_waiting(builder, whole=True)
        if builder.scheduled:  # prompts run alone
            return self._record(builder, new_run=True)
        builder.add_each_that_fits(self._claim_running(builder))
        if builder.scheduled:
            self._steps_left = self.num_scheduler_steps - 1
        return self._record(builder, new_run=True)

    def _record(self, builder: PlanBuilder, *, new_run: bool) -> StepPlan:
        plan = self._plan(builder)
        if plan.scheduled:
            if new_run or self._run < 0:
                self._run += 1
            self.runs.append(self._run)
        return plan


@servelab.hookimpl
def servelab_register_schedulers():
    return [SchedulerPlugin(
        name="prefill-alone", factory=PrefillAloneScheduler, options=PrefillAloneOptions,
        description="prefill steps run alone, decodes stall for them; num_scheduler_steps decode steps a call "
                    "(vLLM V0 without chunked prefill, multi-step; SGLang <= 0.3)")]
