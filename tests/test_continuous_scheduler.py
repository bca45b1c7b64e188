"""The continuous scheduler, driven step by step without a model.

A real PagedAllocator sits under the scheduler; `Engine` below (servelab.testing's
SchedulerHarness, which checks every plan against the scheduler contract) stands in
for the engine's update after each step: every scheduled sequence advances its
computed tokens, a sequence that caught up gets one (dummy) output token, and one
holding max_tokens outputs is retired through `scheduler.finish`. That is the whole
contract the scheduler sees, so FCFS admission, the engine limits, preemption by
recompute and abort are all checked on exact queue and block states.
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from servelab.errors import ConfigError
from servelab.interfaces import AllocatorContext, Scheduler, SchedulerContext, SequenceStatus, StepPlan
from servelab.kit import PagedAllocator, blocks_for
from servelab.kit import ContinuousOptions, ContinuousScheduler
from servelab.sequence import Sequence
from servelab.testing import SchedulerHarness
from servelab.testing.scheduler_harness import OUTPUT_TOKEN_BASE  # dummy outputs are 1000, 1001, ...


class Engine(SchedulerHarness):
    """A continuous scheduler over a paged allocator, and the engine's per-step bookkeeping."""

    def __init__(self, *, num_blocks: int, block_size: int = 4, max_num_seqs: int = 4,
                 max_num_batched_tokens: int = 64, max_model_len: int = 64, options=None) -> None:
        super().__init__(
            lambda context: ContinuousScheduler(options, context),
            PagedAllocator(None, AllocatorContext(num_blocks=num_blocks, block_size=block_size,
                                                  max_model_len=max_model_len)),
            block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len)

    def add(self, prompt_len: int, max_tokens: int, request_id: str | None = None) -> Sequence:
        return super().add(prompt_len, max_tokens, request_id)

    @property
    def admission_order(self) -> list[str]:
        """Request ids in the order they were first scheduled."""
        return self.first_scheduled

    def check_plan(self, plan: StepPlan) -> None:
        super().check_plan(plan)
        held = [b for seq, _ in plan.scheduled for b in self.allocator.block_table(seq.request_id)]
        assert len(held) == len(set(held)), "two running sequences share a block"


def ids(plan: StepPlan) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in plan.scheduled]


# ---------------------------------------------------------------- construction


def test_satisfies_the_protocol():
    assert isinstance(Engine(num_blocks=4).scheduler, Scheduler)


def test_budget_below_max_model_len_is_a_config_error():
    allocator = PagedAllocator(None, AllocatorContext(num_blocks=16, block_size=4, max_model_len=32))
    context = SchedulerContext(allocator=allocator, max_num_seqs=4, max_num_batched_tokens=31, max_model_len=32,
                               clock=lambda: 0.0)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        ContinuousScheduler(None, context)
    # Equal is enough: a whole max_model_len prompt fits in one step.
    ContinuousScheduler(None, attrs.evolve(context, max_num_batched_tokens=32))


# ---------------------------------------------------------------- admission


def test_empty_scheduler_plans_nothing():
    engine = Engine(num_blocks=4)
    assert not engine.scheduler.has_unfinished()
    plan = engine.scheduler.schedule()
    assert plan.is_empty and plan.preempted == ()


def test_prefill_then_one_token_per_step():
    engine = Engine(num_blocks=8)
    seq = engine.add(prompt_len=6, max_tokens=3)
    assert ids(engine.step()) == [("r0", 6)]
    assert engine.allocator.block_table("r0") == [0, 1]
    assert ids(engine.step()) == [("r0", 1)]
    assert ids(engine.step()) == [("r0", 1)]
    assert engine.finished == [seq]
    assert seq.status is SequenceStatus.FINISHED
    assert seq.output_token_ids == [1000, 1001, 1002]
    assert not engine.scheduler.has_unfinished()
    assert engine.allocator.stats().num_used_blocks == 0


def test_fcfs_admission_order():
    engine = Engine(num_blocks=32, max_num_seqs=2)
    for prompt_len in (3, 7, 2, 5, 1):
        engine.add(prompt_len, max_tokens=2)
    assert ids(engine.step()) == [("r0", 3), ("r1", 7)]
    engine.run()
    assert engine.admission_order == ["r0", "r1", "r2", "r3", "r4"]
    assert [s.request_id for s in engine.finished] == ["r0", "r1", "r2", "r3", "r4"]


def test_head_of_queue_blocks_later_requests():
    """FCFS: a waiting request that does not fit is not overtaken by a smaller one."""
    engine = Engine(num_blocks=4, max_num_seqs=4)
    engine.add(prompt_len=8, max_tokens=4)  # 2 blocks, grows to 3
    engine.add(prompt_len=9, max_tokens=1)  # needs 3 blocks: does not fit next to r0
    engine.add(prompt_len=1, max_tokens=1)  # would fit, but must wait behind r1
    assert ids(engine.step()) == [("r0", 8)]
    assert [s.request_id for s in engine.scheduler.waiting] == ["r1", "r2"]
    assert ids(engine.step()) == [("r0", 1)]
    engine.run()
    assert engine.admission_order == ["r0", "r1", "r2"]


def test_max_num_seqs_caps_the_batch():
    engine = Engine(num_blocks=64, max_num_seqs=3)
    for _ in range(7):
        engine.add(prompt_len=2, max_tokens=3)
    plans = engine.run()
    assert max(len(p.scheduled) for p in plans) == 3
    assert len(engine.finished) == 7


def test_token_budget_caps_admission():
    engine = Engine(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=16)
    for prompt_len in (10, 5, 4, 1):
        engine.add(prompt_len, max_tokens=2)
    # 10 + 5 fits in 16; the next prompt of 4 would not, so it (and everyone behind) waits.
    assert ids(engine.step()) == [("r0", 10), ("r1", 5)]
    # Two decode tokens leave 14: 4 and 1 are admitted.
    assert ids(engine.step()) == [("r0", 1), ("r1", 1), ("r2", 4), ("r3", 1)]
    engine.run()
    assert len(engine.finished) == 4


def test_token_budget_caps_decode_steps_too():
    # Decode-first: six slots but four tokens a step. The budget, not max_num_seqs, bounds
    # the batch, and the two later requests wait until a running one finishes.
    engine = Engine(num_blocks=16, max_num_seqs=6, max_num_batched_tokens=4, max_model_len=4,
                    options=ContinuousOptions(policy="decode-first"))
    for _ in range(6):
        engine.add(prompt_len=1, max_tokens=3)
    assert ids(engine.step()) == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 1)]
    assert ids(engine.step()) == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 1)]
    assert engine.scheduler.stats().num_waiting == 2
    assert engine.scheduler.stats().num_idle_slots == 0
    plans = engine.run()
    assert all(p.num_scheduled_tokens <= 4 for p in plans)
    assert len(engine.finished) == 6


def test_prefill_first_admits_before_decoding():
    # Prefill-first (the default): the two waiting prompts take the budget first, and the
    # decodes of r2 and r3 (which the budget no longer covers) sit the step out.
    engine = Engine(num_blocks=16, max_num_seqs=6, max_num_batched_tokens=4, max_model_len=4)
    for _ in range(6):
        engine.add(prompt_len=1, max_tokens=3)
    assert ids(engine.step()) == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 1)]
    assert ids(engine.step()) == [("r0", 1), ("r1", 1), ("r4", 1), ("r5", 1)]
    stats = engine.scheduler.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_idle_slots) == (0, 6, 2)
    assert (stats.slot_steps_used, stats.slot_steps_wasted, stats.num_scheduled_tokens) == (8, 2, 4)
    plans = engine.run()
    assert all(p.num_scheduled_tokens <= 4 for p in plans)
    assert len(engine.finished) == 6


def test_new_request_is_admitted_the_step_a_slot_frees():
    """Continuous batching: r2 joins while r1 is still decoding, not after the batch drains."""
    engine = Engine(num_blocks=32, max_num_seqs=2)
    engine.add(prompt_len=3, max_tokens=2)
    engine.add(prompt_len=3, max_tokens=6)
    engine.add(prompt_len=5, max_tokens=2)
    assert ids(engine.step()) == [("r0", 3), ("r1", 3)]
    assert ids(engine.step()) == [("r0", 1), ("r1", 1)]
    assert [s.request_id for s in engine.finished] == ["r0"]
    assert engine.allocator.block_table("r0") == []
    assert ids(engine.step()) == [("r1", 1), ("r2", 5)]


def test_request_arriving_mid_run_joins_the_next_step():
    engine = Engine(num_blocks=32, max_num_seqs=4)
    engine.add(prompt_len=4, max_tokens=5)
    engine.step()
    engine.step()
    engine.add(prompt_len=6, max_tokens=1)
    assert ids(engine.step()) == [("r0", 1), ("r1", 6)]


# ---------------------------------------------------------------- preemption


def test_preemption_evicts_most_recent_and_recomputes_later():
    # Three short prompts take one block each of a 3-block pool. On step 2 r0 crosses
    # into a second block; the pool is dry, so the most recently admitted sequence (r2)
    # is preempted, not r1, which also sits after r0 but was admitted before r2.
    engine = Engine(num_blocks=3, max_num_seqs=3)
    r0 = engine.add(prompt_len=4, max_tokens=3)
    r1 = engine.add(prompt_len=3, max_tokens=3)
    r2 = engine.add(prompt_len=3, max_tokens=3)
    r3 = engine.add(prompt_len=1, max_tokens=1)
    assert ids(engine.step()) == [("r0", 4), ("r1", 3), ("r2", 3)]
    r2_blocks = list(engine.allocator.block_table("r2"))
    assert r2_blocks == [2]

    plan = engine.step()
    assert plan.preempted == (r2,)
    assert ids(plan) == [("r0", 1), ("r1", 1)]
    assert engine.allocator.block_table("r0") == [0, 2], "r0 took the block r2 gave back"
    assert r2.status is SequenceStatus.WAITING
    assert r2.num_computed_tokens == 0
    assert r2.output_token_ids == [1000], "preemption must keep generated tokens"
    assert r2.num_preemptions == 1
    assert list(engine.scheduler.waiting) == [r2, r3], "the preempted request goes to the front"
    assert engine.scheduler.stats().num_preemptions == 1
    assert engine.scheduler.stats().num_running == 2

    # r2 resumes by recomputing prompt + output in one go, then finishes normally.
    resumed = None
    while engine.scheduler.has_unfinished():
        plan = engine.step()
        for seq, num_new in plan.scheduled:
            if seq is r2 and resumed is None:
                resumed = num_new
    assert resumed == 3 + 1
    assert r2.output_token_ids == [1000, 1001, 1002]
    assert [s.request_id for s in engine.finished].count("r2") == 1
    assert {s.request_id for s in engine.finished} == {"r0", "r1", "r2", "r3"}
    assert all(s.output_token_ids == [1000 + i for i in range(s.params.max_tokens)] for s in (r0, r1, r2, r3))
    assert engine.allocator.stats().num_used_blocks == 0


def test_several_victims_go_newest_first_and_keep_their_order():
    engine = Engine(num_blocks=3, max_num_seqs=4)
    engine.add(prompt_len=4, max_tokens=4)
    engine.add(prompt_len=4, max_tokens=4)
    engine.add(prompt_len=4, max_tokens=4)
    engine.add(prompt_len=2, max_tokens=1)
    engine.step()  # r0, r1, r2 take one block each; r3 finds no room
    # r0 grows into a second block and evicts r2; r1 then needs a second block too, and
    # with nobody newer left it is itself the victim.
    plan = engine.step()
    assert [s.request_id for s in plan.preempted] == ["r2", "r1"]
    assert ids(plan) == [("r0", 1)]
    assert [s.request_id for s in engine.scheduler.waiting] == ["r1", "r2", "r3"], "admission order kept"
    assert engine.allocator.block_table("r0") == [0, 2]
    assert engine.allocator.stats().num_free_blocks == 1
    engine.run()
    assert sorted(s.request_id for s in engine.finished) == ["r0", "r1", "r2", "r3"]
    assert engine.admission_order == ["r0", "r1", "r2", "r3"]
    assert engine.allocator.stats().num_used_blocks == 0


def test_oldest_request_always_progresses_under_thrash():
    # The pool holds exactly one max-length request; a second one keeps being preempted
    # while the first always makes progress, and both finish.
    engine = Engine(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16)
    a = engine.add(prompt_len=4, max_tokens=12)
    b = engine.add(prompt_len=4, max_tokens=12)
    engine.run(max_steps=40)
    assert a.output_token_ids == [1000 + i for i in range(12)]
    assert b.output_token_ids == [1000 + i for i in range(12)]
    assert b.num_preemptions >= 1 and a.num_preemptions == 0


# ---------------------------------------------------------------- abort


def test_abort_waiting_request():
    engine = Engine(num_blocks=8, max_num_seqs=1)
    engine.add(prompt_len=4, max_tokens=3)
    waiting = engine.add(prompt_len=4, max_tokens=3)
    engine.step()
    assert engine.scheduler.abort("r1") is waiting
    assert waiting.status is SequenceStatus.FINISHED and waiting.finish_reason == "abort"
    assert list(engine.scheduler.waiting) == []
    engine.run()
    assert "r1" not in engine.admission_order


def test_abort_running_request_frees_its_blocks_at_once():
    engine = Engine(num_blocks=8, max_num_seqs=2)
    engine.add(prompt_len=8, max_tokens=5)
    victim = engine.add(prompt_len=9, max_tokens=5)
    engine.step()
    assert engine.allocator.stats().num_used_blocks == 2 + 3
    assert engine.scheduler.abort("r1") is victim
    assert victim.status is SequenceStatus.FINISHED and victim.finish_reason == "abort"
    assert engine.allocator.block_table("r1") == []
    assert engine.allocator.stats().num_used_blocks == 2
    assert engine.scheduler.stats().num_running == 1
    assert ids(engine.step()) == [("r0", 1)]
    engine.run()
    assert engine.allocator.stats().num_used_blocks == 0


def test_abort_unknown_or_finished_request_returns_none():
    engine = Engine(num_blocks=8)
    engine.add(prompt_len=2, max_tokens=1)
    engine.run()
    assert engine.scheduler.abort("r0") is None
    assert engine.scheduler.abort("nope") is None


# ---------------------------------------------------------------- random workloads


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    requests = draw(st.lists(
        st.integers(1, max_model_len - 1).flatmap(
            lambda p: st.tuples(st.just(p), st.integers(1, max_model_len - p), st.integers(0, 12))),
        min_size=1, max_size=12))  # (prompt_len, max_tokens, arrival step)
    longest = max(blocks_for(p + m, block_size) for p, m, _ in requests)
    num_blocks = draw(st.integers(longest, longest * 3))
    max_num_seqs = draw(st.integers(1, 10))
    max_num_batched_tokens = max_model_len + draw(st.integers(0, 40))
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, len(requests) - 1)), max_size=3))
    return dict(block_size=block_size, max_model_len=max_model_len, requests=requests, num_blocks=num_blocks,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, aborts=aborts)


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_random_workloads(w):
    engine = Engine(num_blocks=w["num_blocks"], block_size=w["block_size"], max_num_seqs=w["max_num_seqs"],
                    max_num_batched_tokens=w["max_num_batched_tokens"], max_model_len=w["max_model_len"])
    requests = w["requests"]
    seqs: list[Sequence | None] = [None] * len(requests)
    aborted: set[str] = set()
    # Each non-idle step gives the oldest running sequence one output token (it is never
    # the preemption victim when the pool fits it alone), and outputs are never lost.
    last_arrival = max(arrival for _, _, arrival in requests)
    bound = last_arrival + sum(m for _, m, _ in requests) + 1

    step = 0
    while step <= last_arrival or engine.scheduler.has_unfinished():
        assert step <= bound, "scheduler failed to make progress"
        for index, (prompt_len, max_tokens, arrival) in enumerate(requests):
            if arrival == step:
                seqs[index] = engine.add(prompt_len, max_tokens, request_id=f"r{index}")
        for abort_step, index in w["aborts"]:
            seq = seqs[index]
            if abort_step == step and seq is not None and not seq.is_finished:
                used = engine.allocator.stats().num_used_blocks
                held = len(engine.allocator.block_table(seq.request_id))
                assert engine.scheduler.abort(seq.request_id) is seq
                assert seq.finish_reason == "abort" and seq.is_finished
                assert engine.allocator.stats().num_used_blocks == used - held
                aborted.add(seq.request_id)
        engine.step()
        step += 1

    finished_ids = [s.request_id for s in engine.finished]
    assert len(finished_ids) == len(set(finished_ids)), "a request finished twice"
    assert not set(finished_ids) & aborted
    for seq in seqs:
        if seq.request_id in aborted:
            continue
        assert seq.request_id in finished_ids
        assert seq.status is SequenceStatus.FINISHED
        assert seq.output_token_ids == [OUTPUT_TOKEN_BASE + i for i in range(seq.params.max_tokens)]
    # FCFS: requests are first scheduled in arrival order (ties broken by index).
    arrival_rank = {f"r{i}": (arrival, i) for i, (_, _, arrival) in enumerate(requests)}
    assert engine.admission_order == sorted(engine.admission_order, key=arrival_rank.__getitem__)
    stats = engine.allocator.stats()
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == w["num_blocks"]
    assert engine.scheduler.stats().num_waiting == engine.scheduler.stats().num_running == 0
