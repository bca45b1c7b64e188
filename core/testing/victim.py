"""VictimContract: what a preemption victim policy (kind `victims`,
`servelab.contracts.victim`) must do.

    from servelab.testing import VictimContract

    class TestMine(VictimContract):
        factory = MyVictim                   # factory(options, VictimContext) -> policy
        # or: plugin_name = "most-kv-blocks" (an installed one, by name)

Checked on crafted running batches and inside the kit's continuous scheduler on pools
that force preemption, where the scheduler contract's invariants hold every step.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from servelab.contracts.victim import Preemption, VictimContext, VictimPolicy
from servelab.interfaces import AllocatorContext, Sequence, SequenceStatus
from servelab.kit import ContinuousScheduler
from servelab.kit.victims import VICTIM_IS_RUNNING
from servelab.sampling_params import SamplingParams
from servelab.testing.contract import PolicyContract, check, exercising, installed_factory
from servelab.testing.objectives import ObjectiveChecks
from servelab.testing.scheduler_harness import SchedulerHarness

DETERMINISTIC = "the victim policy is deterministic"
IMPLEMENTS = "implements VictimPolicy"
SWAP_CHOICE = "a Preemption's swap is True, False or None"


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


class VictimContract(PolicyContract, ObjectiveChecks):
    """Invariants: implements VictimPolicy; the victim is a running sequence (one of those
    given, never a waiting, finished, copied or unknown one), alone or in a Preemption
    whose swap is True, False or None; deterministic; and a scheduler preempting by it
    keeps every scheduler invariant (budget, slots, no request lost or duplicated)."""

    kind = "victims"
    victim: Callable[..., Any] | None = None  # or: a plain function (running, allocator) -> one of running
    victim_name: str | None = None  # or: an installed policy, by name (as plugin_name)

    def context(self, can_swap: bool = False) -> VictimContext:
        return VictimContext(block_size=4, max_num_seqs=4, can_swap=can_swap)

    _factory: Callable[..., Any] | None = None  # set by the contract's fixtures

    @pytest.fixture
    def servelab_factory(self) -> Callable[..., Any]:
        """`victim` or `victim_name` where given, else `factory` / `plugin_name`."""
        return self._victim_factory() or self.declared_factory()

    def _victim_factory(self) -> Callable[..., Any] | None:
        if self.victim is not None:
            function = self.victim
            return lambda options, context: FunctionVictim(function)
        if self.victim_name is not None:
            factory, options_class = installed_factory(self.kind, self.victim_name)
            return lambda options, context: factory(options_class(), context)
        return None

    def policy(self, context: VictimContext | None = None) -> Any:
        context = context or self.context()
        if self._factory is None:  # a contract built outside pytest's fixtures
            return self._victim_factory()(None, context)
        return self.make(context)

    def test_implements_victim_policy(self):
        for can_swap in (False, True):
            policy = self.policy(self.context(can_swap))
            check(isinstance(policy, VictimPolicy), IMPLEMENTS, f"{type(policy).__name__} has no choose()")

    def choose_victim(self, running: list[Sequence], allocator: Any) -> Any:
        """The policy's victim among `running` (what objectives ask it)."""
        choice = self.policy().choose(running, allocator)
        return choice.victim if isinstance(choice, Preemption) else choice

    def test_victim_is_running(self):
        from servelab.testing.scheduler_workloads import make_allocator

        for can_swap in (False, True):
            policy = self.policy(self.context(can_swap))
            allocator = make_allocator("paged", 64, 4, 64)
            for batch in running_batches():
                for seq in batch:
                    allocator.allocate(seq.request_id, max(1, seq.num_computed_tokens))
                with exercising(VICTIM_IS_RUNNING):
                    choice = policy.choose(list(batch), allocator)
                victim = choice.victim if isinstance(choice, Preemption) else choice
                check(any(victim is seq for seq in batch), VICTIM_IS_RUNNING,
                      lambda: f"chose {describe(victim)}; running: {[seq.request_id for seq in batch]}")
                if isinstance(choice, Preemption):
                    check(choice.swap in (True, False, None), SWAP_CHOICE, repr(choice.swap))
                again = policy.choose(list(batch), allocator)
                check(again == choice if isinstance(choice, Preemption) else again is victim, DETERMINISTIC,
                      victim.request_id)
                for seq in batch:
                    allocator.free(seq.request_id)

    def test_scheduler_invariants_hold_under_preemption(self):
        policy = self.policy()

        class Preempting(ContinuousScheduler):
            def victim(self, running):
                return policy.choose(running, self.allocator)

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


class FunctionVictim:
    """A plain function (running, allocator) -> victim, as a VictimPolicy."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def choose(self, running: Any, allocator: Any) -> Any:
        return self.function(running, allocator)


__all__ = ["VictimContract"]
