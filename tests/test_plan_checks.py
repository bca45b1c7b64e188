"""The engine holds every plan to what the step relies on: a broken scheduler fails the
step with the invariant named, instead of corrupting state or hanging."""

from __future__ import annotations

import attrs
import pytest

import servelab
from servelab import LLM, PluginRegistry, SamplingParams
from servelab.errors import PolicyViolation
from servelab.interfaces import StepPlan
from servelab.kit import ContinuousScheduler
from servelab.plugin_types import SchedulerPlugin


class SchedulesTwice(ContinuousScheduler):
    def schedule(self):
        plan = super().schedule()
        return attrs.evolve(plan, scheduled=plan.scheduled + plan.scheduled[:1])


class TooManyTokens(ContinuousScheduler):
    def schedule(self):
        plan = super().schedule()
        return attrs.evolve(plan, scheduled=tuple((seq, n + 1) for seq, n in plan.scheduled))


class SchedulesTheFinished(ContinuousScheduler):
    def __init__(self, options, context):
        super().__init__(options, context)
        self.retired = []

    def finish(self, seqs):
        self.retired.extend(seqs)
        super().finish(seqs)

    def schedule(self):
        plan = super().schedule()
        return attrs.evolve(plan, scheduled=plan.scheduled + tuple((seq, 1) for seq in self.retired))


class Stalls(ContinuousScheduler):
    def schedule(self):
        return StepPlan(scheduled=())


def llm_with(checkpoint, scheduler_class):
    class Plugin:
        @staticmethod
        @servelab.hookimpl
        def servelab_register_schedulers():
            return [SchedulerPlugin(name="broken", factory=scheduler_class)]

    registry = PluginRegistry.from_entry_points()
    registry.register(Plugin)
    return LLM(checkpoint, max_model_len=64, registry=registry, **{"scheduler.name": "broken"})


@pytest.mark.parametrize("scheduler_class, invariant", [
    (SchedulesTwice, "a sequence is scheduled at most once per step: scheduler 'broken' planned req-0 twice"),
    (TooManyTokens, "each scheduled sequence processes between 1 and its uncomputed tokens: scheduler 'broken' "
                    "planned 5 tokens for req-0, which has 4 uncomputed"),
    (SchedulesTheFinished, "only queued, unfinished sequences are scheduled: scheduler 'broken' planned req-0, "
                           "not in flight"),
    (Stalls, "no progress: an empty plan while requests are unfinished: scheduler 'broken' returned 10001 empty "
             "plans in a row while req-0, req-1 wait"),
])
def test_a_broken_plan_fails_the_step_naming_the_invariant(servelab_tiny_checkpoint, scheduler_class, invariant):
    llm = llm_with(servelab_tiny_checkpoint, scheduler_class)
    with pytest.raises(PolicyViolation) as excinfo:
        llm.generate([[5, 6, 7, 8], [9, 10]], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                               for n in (2, 5)])
    assert f"invariant violated: {invariant}" in str(excinfo.value)
