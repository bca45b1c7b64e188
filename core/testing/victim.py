"""VictimContract: what a preemption victim policy (`servelab.kit.victims`) must do.

    from servelab.testing import VictimContract

    class TestMine(VictimContract):
        victim = staticmethod(my_victim)     # (running, allocator) -> one of running
        # or: victim_name = "most-kv-blocks" (a built-in, by name)

Checked on crafted running batches and inside the kit's continuous scheduler on pools
that force preemption, where the scheduler contract's invariants hold every step.
"""

from __future__ import annotations

from typing import Any, Callable

from servelab.interfaces import AllocatorContext, Sequence, SequenceStatus
from servelab.kit import VICTIMS, ContinuousScheduler
from servelab.kit.victims import VICTIM_IS_RUNNING
from servelab.sampling_params import SamplingParams
from servelab.testing.contract import check, exercising, installed_factory
from servelab.testing.objectives import ObjectiveChecks
from servelab.testing.scheduler_harness import SchedulerHarness

DETERMINISTIC = "the victim policy is deterministic"


def running_batches() -> list[list[Sequence]]:
    """Running batches in rank order, with priorities, arrivals and computed tokens varied."""
    batches = []
    for size in (1, 2, 3, 5):
        batch = []
        for index in range(size):
            seq = Sequence(f"b{size}-{index}", [1] * (3 + 2 * index), SamplingParams(max_tokens=4),
                           float(index % 3), priority=(index * 7) % 3)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = (index * 5) % 7
            batch.append(seq)
        batches.append(batch)
    return batches


def describe(victim: Any) -> str:
    return f"{victim.request_id} ({victim.status.value})" if isinstance(victim, Sequence) else repr(victim)


class VictimContract(ObjectiveChecks):
    """Invariants: the victim is a running sequence (one of those given, never a waiting,
    finished or unknown one); deterministic; and a scheduler preempting by it keeps every
    scheduler invariant (budget, slots, no request lost or duplicated)."""

    kind = "victims"
    victim: Callable[..., Any] | None = None
    victim_name: str | None = None

    def _policy(self) -> Callable[..., Any]:
        if self.victim is not None:
            return self.victim
        return VICTIMS[self.victim_name or "newest"]

    def choose_victim(self, running: list[Sequence], allocator: Any) -> Any:
        """The policy's victim among `running` (what objectives ask it)."""
        return self._policy()(running, allocator)

    def test_victim_is_running(self):
        from servelab.testing.scheduler_workloads import make_allocator

        policy = self._policy()
        allocator = make_allocator("paged", 64, 4, 64)
        for batch in running_batches():
            for seq in batch:
                allocator.allocate(seq.request_id, max(1, seq.num_computed_tokens))
            with exercising(VICTIM_IS_RUNNING):
                victim = policy(list(batch), allocator)
            check(any(victim is seq for seq in batch), VICTIM_IS_RUNNING,
                  lambda: f"chose {describe(victim)}; running: {[seq.request_id for seq in batch]}")
            check(policy(list(batch), allocator) is victim, DETERMINISTIC, victim.request_id)
            for seq in batch:
                allocator.free(seq.request_id)

    def test_scheduler_invariants_hold_under_preemption(self):
        policy = self._policy()

        class Preempting(ContinuousScheduler):
            def victim(self, running):
                return policy(running, self.allocator)

        for allocator_name in ("paged", "radix"):
            factory, options_class = installed_factory("allocators", allocator_name)
            allocator = factory(options_class(), AllocatorContext(num_blocks=6, block_size=4, max_model_len=16))
            harness = SchedulerHarness(lambda context: Preempting(None, context), allocator, block_size=4,
                                       max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16,
                                       seconds_per_step=1.0)
            for index in range(5):
                harness.add([7 + index] * (3 + index), params=SamplingParams(max_tokens=8), priority=index % 2)
            harness.run()
            harness.check_all_done()
            check(harness.scheduler.num_preemptions > 0, "the scenario preempts",
                  "the pool was meant to be too small for every request at once")


__all__ = ["VictimContract"]
