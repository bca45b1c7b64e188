"""SchedulerContract: what every scheduler must do, whatever order it serves requests in.

    from servelab.testing import SchedulerContract

    class TestMine(SchedulerContract):
        plugin_name = "mine"           # or: factory = MyScheduler

The contract fixes no order (FCFS, priority, shortest job first are all fine); it fixes
the limits, and that every request is served exactly once. Its workloads press each
limit (many decodes running while long prompts arrive, more requests than slots, pools
that force preemption), so a scheduler overstepping one fails on every run; randomised
tests are derandomized unless pytest gets `--servelab-random`.
"""

from __future__ import annotations

from typing import Any

import pytest

from servelab.errors import ConfigError
from servelab.interfaces import ForkingScheduler, InFlightScheduler, Scheduler, SchedulerContext, SequenceStatus
from servelab.testing.contract import PolicyContract, check
from servelab.testing.objectives import ObjectiveChecks
from servelab.testing.scheduler_harness import PROGRESS, SchedulerHarness

LIVENESS = "no request starves"
HELD = "a sequence held in flight is neither planned nor preempted"


class SchedulerContract(PolicyContract, ObjectiveChecks):
    """Invariants (each failure message starts "invariant violated: <name>"):

    - implements Scheduler; an empty scheduler plans nothing
    - token budget exceeded: a plan never schedules more than max_num_batched_tokens
    - max_num_seqs exceeded: never more scheduled or running sequences than max_num_seqs
    - a sequence is scheduled at most once per step, for between 1 and its uncomputed
      tokens; only queued, unfinished, RUNNING sequences are scheduled
    - KV is allocated for every scheduled token
    - a preempted sequence is WAITING with no KV and no computed tokens
    - the scheduler never changes a sequence's tokens
    - scheduler stats agree with the plan
    - request dropped: every request finishes with all its tokens (or is aborted);
      has_unfinished is True exactly while requests are unfinished
    - request finished twice
    - a finished or aborted request holds no KV; abort removes it wherever it is
    - no progress: an empty plan while requests are unfinished
    - no request starves: a long request is served while short ones keep arriving
    - tokens identical to the reference policies, end to end on a tiny model
    - (InFlightScheduler) a sequence held in flight is neither planned nor preempted, and
      keeps its slot and KV until released

    Opt-in objective checks (`objectives = (...)`, servelab.testing.objectives) pin what
    the scheduler is for: `earliest_deadline_first()`, `shortest_job_first()`, ...
    """

    kind = "schedulers"
    allocator_names = ("paged", "radix", "naive")  # installed allocators the random workloads run over
    options_variants: tuple = ()  # options instances the random workloads draw from (default: `options`)
    max_idle_steps = 0  # empty plans in a row allowed while requests are unfinished
    liveness_steps = 60  # steps a long request may wait while short ones keep arriving
    max_examples = 40

    # Hooks for a subclass's own invariants (an ordering policy), around every harness step.
    def before_step(self, harness: SchedulerHarness) -> None:
        pass

    def after_step(self, harness: SchedulerHarness, plan: Any) -> None:
        pass

    def harness(self, *, allocator: str | None = None, num_blocks: int = 64, block_size: int = 4,
                max_num_seqs: int = 4, max_num_batched_tokens: int = 64, max_model_len: int = 64,
                options: Any = None, seconds_per_step: float = 1.0) -> SchedulerHarness:
        """A harness running this scheduler over an installed allocator; the contract's
        scenarios advance its clock one second a step."""
        from servelab.testing.scheduler_workloads import make_allocator

        options = self._options if options is None else options
        alloc = make_allocator(allocator or self.allocator_names[0], num_blocks, block_size, max_model_len)
        return SchedulerHarness(lambda context: self._factory(options, context), alloc, block_size=block_size,
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, observer=self, max_idle_steps=self.max_idle_steps,
                                seconds_per_step=seconds_per_step)

    def accepts_small_budget(self) -> bool:
        """Does it take max_num_batched_tokens below max_model_len (chunked prompts)?"""
        from servelab.testing.scheduler_workloads import make_allocator

        context = SchedulerContext(allocator=make_allocator("paged", 8, 4, 32), max_num_seqs=4,
                                   max_num_batched_tokens=8, max_model_len=32, clock=lambda: 0.0)
        try:
            self.make(context)
        except ConfigError:
            return False
        return True

    # ------------------------------------------------------------ scenarios

    def test_empty_scheduler_plans_nothing(self):
        harness = self.harness()
        check(isinstance(harness.scheduler, Scheduler), "implements Scheduler", type(harness.scheduler).__name__)
        check(not harness.scheduler.has_unfinished(), "has_unfinished is True exactly while requests are unfinished")
        check(harness.step().is_empty, "an empty scheduler plans nothing")

    def test_every_request_is_served_once(self):
        harness = self.harness()
        for prompt, max_tokens in ((10, 4), (3, 1), (25, 6), (1, 9), (7, 2)):
            harness.add(prompt, max_tokens)
        harness.run()
        harness.check_all_done()

    def test_limits_hold_under_load(self):
        """Twelve prompts of 10 tokens against a 16-token budget and three slots."""
        budget = 16 if not self.accepts_small_budget() else 12
        harness = self.harness(max_num_seqs=3, max_num_batched_tokens=budget, max_model_len=16)
        for index in range(12):
            harness.add([5 + index % 3] * 10, max_tokens=3 + index % 4, priority=index % 2)
        harness.run()
        harness.check_all_done()

    def test_budget_holds_with_many_decodes_and_long_prompts(self):
        """Six sequences decode while prompts of nearly max_model_len arrive: a step that
        admits one leaves the decodes only what is left of the budget."""
        harness = self.harness(num_blocks=96, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=32)
        for index in range(6):
            harness.add([3 + index, 4], max_tokens=24)
        for _ in range(3):
            harness.step()
        for index in range(3):
            harness.add([40 + index] * 30, max_tokens=2)
        harness.run()
        harness.check_all_done()

    def test_slots_hold_with_more_requests_than_slots(self):
        """Twenty one-token prompts and a roomy budget: only max_num_seqs may run at once."""
        harness = self.harness(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=16)
        for index in range(20):
            harness.add([5 + index % 7], max_tokens=1 + index % 5)
        harness.run()
        harness.check_all_done()

    def test_preemption_keeps_every_request(self):
        """A 16-token pool for four requests growing to 14 tokens each: someone must yield."""
        harness = self.harness(num_blocks=4, max_model_len=16, max_num_batched_tokens=16)
        for index in range(4):
            harness.add(6, max_tokens=8, priority=index % 2)
        harness.run()
        harness.check_all_done()

    def test_no_request_starves(self):
        """One slot, a 40-token job, then a 2-token job arriving every second from one
        second later: whatever the order, the long job is served within `liveness_steps`
        steps. It arrives strictly first, so no tie with the first short job (broken by the
        order of `add`) can serve it by accident: a policy serving the newest first fails."""
        harness = self.harness(max_num_seqs=1, num_blocks=64, max_num_batched_tokens=64, max_model_len=64)
        harness.add(20, max_tokens=20, request_id="long")
        harness.now += 1.0
        for _ in range(self.liveness_steps):
            harness.add(1, max_tokens=1)
            harness.step()
        check("long" in harness.first_scheduled, LIVENESS,
              lambda: f"request 'long' (40 tokens of work, arrived first) was never scheduled in "
                      f"{self.liveness_steps} steps while {len(harness.first_scheduled)} later requests were")

    @pytest.mark.parametrize("allocator", ["paged", "radix"])
    def test_abort_frees_kv_at_once(self, allocator):
        harness = self.harness(allocator=allocator, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16,
                               max_model_len=16)
        first = harness.add([7] * 12, max_tokens=4)
        second = harness.add([8] * 5, max_tokens=3)
        third = harness.add([9] * 3, max_tokens=2)
        harness.step()
        harness.abort(first.request_id)
        harness.abort(third.request_id)
        check(harness.scheduler.abort(first.request_id) is None, "abort removes the request wherever it is",
              "a second abort of the same request returned it again")
        harness.run()
        harness.check_all_done()
        check(second.request_id in [s.request_id for s in harness.finished], "request dropped", second.request_id)

    def test_sequences_held_in_flight_are_neither_planned_nor_preempted(self):
        """Pipeline parallelism holds the sequences of a batch still in flight: with the pool
        too small for everyone (a preemption is due), the held sequence keeps its KV and is
        never planned; released, every request still finishes."""
        harness = self.harness(num_blocks=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
        if not isinstance(harness.scheduler, InFlightScheduler):
            pytest.skip("not an InFlightScheduler (an optional capability)")
        for _ in range(4):
            harness.add(4, max_tokens=12)
        first = harness.step()
        check(first.scheduled, PROGRESS, "the first step planned nothing")
        held = first.scheduled[-1][0]
        table = list(harness.allocator.block_table(held.request_id))
        harness.scheduler.hold_in_flight([held])
        for _ in range(12):
            plan = harness.step()
            check(all(seq is not held for seq, _ in plan.scheduled), HELD,
                  lambda: f"{held.request_id} was planned while held")
            check(held not in plan.preempted and held.status is SequenceStatus.RUNNING, HELD,
                  lambda: f"{held.request_id} was preempted while held")
            check(list(harness.allocator.block_table(held.request_id)) == table, HELD,
                  lambda: f"{held.request_id}'s blocks changed while held")
        harness.scheduler.release_in_flight([held])
        harness.run()
        harness.check_all_done()

    def test_parallel_sampling_forks(self):
        harness = self.harness(num_blocks=24, max_model_len=24, max_num_batched_tokens=24)
        if not harness.supports_fork(harness.scheduler, harness.allocator):
            pytest.skip("not a ForkingScheduler")
        harness.add(9, max_tokens=5, n=3)
        harness.add(4, max_tokens=1, n=2)
        harness.add(6, max_tokens=3)
        harness.run()
        harness.check_all_done()

    # ------------------------------------------------------------ random workloads

    def test_random_workloads(self):
        from hypothesis import given

        from servelab.testing.scheduler_workloads import make_allocator, run_workload, workloads

        variants = list(self.options_variants) or [self._options]
        probe = self.make(SchedulerContext(allocator=make_allocator("paged", 16, 4, 16), max_num_seqs=4,
                                           max_num_batched_tokens=64, max_model_len=16, clock=lambda: 0.0))
        strategy = workloads(tuple(self.allocator_names), len(variants), self.accepts_small_budget(),
                             isinstance(probe, ForkingScheduler))

        @self.hypothesis_settings()
        @given(w=strategy)
        def run(w):
            run_workload(self, w, variants[w["options_index"]])

        run()

    # ------------------------------------------------------------ end to end

    @pytest.mark.parametrize("case", ["roomy", "tight", "chunked", "parallel"])
    def test_greedy_tokens_match_the_reference_policies(self, case):
        from servelab.testing.e2e import check_against_reference
        from servelab.testing.scheduler_workloads import make_allocator

        if case == "chunked" and not self.accepts_small_budget():
            pytest.skip("takes no token budget below max_model_len")
        if case == "parallel":
            probe = self.make(SchedulerContext(allocator=make_allocator("paged", 16, 8, 128), max_num_seqs=4,
                                               max_num_batched_tokens=128, max_model_len=128, clock=lambda: 0.0))
            if not isinstance(probe, ForkingScheduler):
                pytest.skip("not a ForkingScheduler")
        name, registry = self.policy_section()
        check_against_reference(self.kind, name, registry, case)


__all__ = ["SchedulerContract"]
