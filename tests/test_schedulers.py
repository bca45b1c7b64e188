"""The three built-in schedulers (static, continuous, chunked-prefill), driven step by
step without a model over the real allocators (paged, radix, naive): exact plans,
queues and accounting.

`Harness` is servelab.testing's SchedulerHarness (the engine's per-step bookkeeping,
checking every plan against the scheduler contract's invariants) over a scheduler and
an allocator chosen by name: scheduled sequences advance their computed tokens, one
that caught up gets a dummy output token (1000, 1001, ...), prefix-caching allocators
cache the computed blocks, and one holding max_tokens outputs is retired through
`finish`. Its clock advances one second per step. The invariants over random
workloads (limits, no request lost or duplicated, rank order) run in
test_builtin_contracts.py.
"""

from __future__ import annotations

import pytest

from servelab.errors import ConfigError
from servelab.interfaces import AllocatorContext, Scheduler, StepPlan
from servelab.plugins.allocators.naive import NaiveAllocator
from servelab.kit import PagedAllocator
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.plugins.schedulers.chunked_prefill import ChunkedPrefillScheduler
from servelab.kit import ContinuousOptions, ContinuousScheduler
from servelab.kit import QueueOptions
from servelab.plugins.schedulers.static import StaticScheduler
from servelab.sequence import Sequence, SequenceStatus
from servelab.testing import SchedulerHarness
from servelab.testing.scheduler_harness import OUTPUT_TOKEN_BASE

SCHEDULERS = {"static": StaticScheduler, "continuous": ContinuousScheduler, "chunked-prefill": ChunkedPrefillScheduler}
ALLOCATORS = {"paged": PagedAllocator, "radix": RadixAllocator, "naive": NaiveAllocator}


class Harness(SchedulerHarness):
    """A scheduler over a real allocator, both by name, plus the engine's per-step bookkeeping."""

    def __init__(self, scheduler: str = "continuous", allocator: str = "paged", *, num_blocks: int = 64,
                 block_size: int = 4, max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                 max_model_len: int = 64, options=None) -> None:
        super().__init__(
            lambda context: SCHEDULERS[scheduler](options, context),
            ALLOCATORS[allocator](None, AllocatorContext(num_blocks=num_blocks, block_size=block_size,
                                                         max_model_len=max_model_len)),
            block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, seconds_per_step=1.0)


def options(name: str, priority_aging_s: float = 10.0, policy: str = "prefill-first"):
    if name == "continuous":
        return ContinuousOptions(priority_aging_s=priority_aging_s, policy=policy)
    return QueueOptions(priority_aging_s=priority_aging_s)


def ids(plan: StepPlan) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in plan.scheduled]


def outputs_of(seq: Sequence) -> list[int]:
    return [OUTPUT_TOKEN_BASE + i for i in range(seq.params.max_tokens)]


# ---------------------------------------------------------------- construction and options


@pytest.mark.parametrize("name", SCHEDULERS)
def test_satisfies_the_protocol(name):
    assert isinstance(Harness(name).scheduler, Scheduler)


@pytest.mark.parametrize("name", ["static", "continuous"])
def test_whole_prompt_schedulers_need_a_budget_of_max_model_len(name):
    with pytest.raises(ConfigError, match="chunked-prefill"):
        Harness(name, max_num_batched_tokens=31, max_model_len=32)


def test_chunked_prefill_takes_a_budget_below_max_model_len():
    harness = Harness("chunked-prefill", max_num_batched_tokens=4, max_model_len=64)
    seq = harness.add(prompt=30, max_tokens=2)
    harness.run()
    assert seq.output_token_ids == [1000, 1001]


def test_options_are_validated_with_the_key_named():
    with pytest.raises(ConfigError, match=r"\[scheduler\] policy must be one of 'prefill-first', 'decode-first'"):
        ContinuousOptions(policy="fcfs")
    with pytest.raises(ConfigError, match=r"\[scheduler\] priority_aging_s must be a number >= 0"):
        QueueOptions(priority_aging_s=-1)


def test_options_come_from_the_config(llama_checkpoint):
    from servelab import LLM

    llm = LLM(llama_checkpoint, max_model_len=64,
              **{"scheduler.name": "continuous", "scheduler.policy": "decode-first", "scheduler.priority_aging_s": 0})
    assert llm.engine.scheduler.options == ContinuousOptions(policy="decode-first", priority_aging_s=0)
    with pytest.raises(ConfigError, match="policy"):
        LLM(llama_checkpoint, max_model_len=64, **{"scheduler.name": "static", "scheduler.policy": "decode-first"})


# ---------------------------------------------------------------- static


def test_static_runs_a_batch_to_completion_and_finished_slots_idle():
    harness = Harness("static", max_num_seqs=3)
    for max_tokens in (1, 3, 2, 1):
        harness.add(prompt=2, max_tokens=max_tokens)
    assert ids(harness.step()) == [("r0", 2), ("r1", 2), ("r2", 2)]  # r0 finishes: its slot idles
    assert harness.scheduler.stats().num_idle_slots == 0
    assert ids(harness.step()) == [("r1", 1), ("r2", 1)]  # r2 finishes
    assert harness.scheduler.stats().num_idle_slots == 1
    assert ids(harness.step()) == [("r1", 1)]  # r3 waits although two slots are free
    stats = harness.scheduler.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_idle_slots) == (1, 0, 2)
    assert ids(harness.step()) == [("r3", 2)]  # the next batch
    assert not harness.scheduler.has_unfinished()
    stats = harness.scheduler.stats()
    assert (stats.slot_steps_used, stats.slot_steps_wasted, stats.num_steps) == (7, 3, 4)


def test_static_prefills_over_several_steps_when_the_budget_is_short():
    harness = Harness("static", max_num_seqs=4, max_num_batched_tokens=9, max_model_len=9)
    for _ in range(4):
        harness.add(prompt=4, max_tokens=2)
    assert ids(harness.step()) == [("r0", 4), ("r1", 4)]
    assert harness.scheduler.stats().num_idle_slots == 2  # members whose prompt waits
    assert ids(harness.step()) == [("r0", 1), ("r1", 1), ("r2", 4)]
    assert ids(harness.step()) == [("r2", 1), ("r3", 4)]
    assert ids(harness.step()) == [("r3", 1)]
    assert [s.request_id for s in harness.finished] == ["r0", "r1", "r2", "r3"]
    stats = harness.scheduler.stats()
    assert (stats.slot_steps_used, stats.slot_steps_wasted) == (8, 2 + 1 + 2 + 3)


def test_static_preempted_member_resumes_in_its_batch_before_anyone_new():
    # Three members of one block each fill the pool; r0 grows into a second block and
    # preempts r2, which resumes (recomputing prompt and output) once r1 finishes,
    # while r3 waits for the batch to end.
    harness = Harness("static", num_blocks=3, max_num_seqs=3)
    r0 = harness.add(prompt=4, max_tokens=3)
    r1 = harness.add(prompt=3, max_tokens=2)
    r2 = harness.add(prompt=3, max_tokens=3)
    r3 = harness.add(prompt=1, max_tokens=1)
    harness.step()
    plan = harness.step()
    assert plan.preempted == (r2,) and ids(plan) == [("r0", 1), ("r1", 1)]
    assert r2.output_token_ids == [1000] and r2.num_preemptions == 1
    assert harness.scheduler.stats().num_waiting == 2  # r2 (pending, in the batch) and r3
    plan = harness.step()
    assert ids(plan) == [("r0", 1), ("r2", 4)], "r2 resumes in its batch, r3 still waits"
    harness.run()
    assert harness.first_scheduled == ["r0", "r1", "r2", "r3"]
    assert all(s.output_token_ids == outputs_of(s) for s in (r0, r1, r2, r3))
    assert harness.allocator.stats().num_used_blocks == 0


# ---------------------------------------------------------------- chunked prefill


def test_chunked_prefill_schedules_decodes_first_then_chunks():
    harness = Harness("chunked-prefill", max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    harness.add(prompt=3, max_tokens=6)
    harness.add(prompt=2, max_tokens=6)
    assert ids(harness.step()) == [("r0", 3), ("r1", 2)]
    harness.add(prompt=20, max_tokens=2)  # a long prompt
    harness.add(prompt=5, max_tokens=2)
    # Two decodes, then the rest of the budget (6) goes to r2's first chunk.
    assert ids(harness.step()) == [("r0", 1), ("r1", 1), ("r2", 6)]
    assert ids(harness.step()) == [("r0", 1), ("r1", 1), ("r2", 6)]
    assert ids(harness.step()) == [("r0", 1), ("r1", 1), ("r2", 6)]
    # r2's last 2 tokens leave 4 for r3's first chunk: the chunk adapts to the budget.
    assert ids(harness.step()) == [("r0", 1), ("r1", 1), ("r2", 2), ("r3", 4)]
    assert harness.plans[-1].scheduled[2][0].output_token_ids == [1000]
    assert ids(harness.step()) == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 1)]
    harness.run()
    assert all(p.num_scheduled_tokens <= 8 for p in harness.plans)
    assert all(s.output_token_ids == outputs_of(s) for s in harness.finished) and len(harness.finished) == 4


def test_chunked_prefill_skips_the_cached_prefix():
    harness = Harness("chunked-prefill", "radix", max_num_batched_tokens=6, max_model_len=64)
    shared = list(range(3, 15))  # three full blocks of 4
    first = harness.add(shared + [20, 21], max_tokens=3)
    harness.run()
    assert harness.allocator.stats().num_cached_blocks >= 3
    second = harness.add(shared + [30, 31, 32, 33, 34], max_tokens=2)
    plan = harness.step()
    assert ids(plan) == [(second.request_id, 5)], "only the 5-token uncached tail is prefilled"
    assert second.num_computed_tokens == 17
    harness.run()
    assert first.output_token_ids == outputs_of(first) and second.output_token_ids == outputs_of(second)
    assert harness.allocator.stats().num_used_blocks == 0


def test_chunked_prefill_preempts_to_keep_the_best_ranked_moving():
    # The pool holds 16 tokens. r0 runs; r1's long prompt fills the rest chunk by chunk;
    # when r0 needs a new block, r1 (newest) is preempted and later resumes from scratch.
    harness = Harness("chunked-prefill", num_blocks=4, max_num_seqs=2, max_num_batched_tokens=4, max_model_len=16)
    r0 = harness.add(prompt=3, max_tokens=6)
    r1 = harness.add(prompt=12, max_tokens=2)
    harness.run(max_steps=40)
    assert r1.num_preemptions >= 1 and r0.num_preemptions == 0
    assert r0.output_token_ids == outputs_of(r0) and r1.output_token_ids == outputs_of(r1)
    assert harness.scheduler.stats().num_preemptions == r1.num_preemptions


@pytest.mark.parametrize("scheduler, budget", [("continuous", 16), ("chunked-prefill", 4)])
def test_discarded_tokens_count_what_recompute_preemption_computes_again(scheduler, budget):
    """Without a prefix cache, every token computed beyond each sequence's prompt and
    outputs (the last output is never computed) was computed again after a preemption
    threw it away: the scheduler's count is exactly that surplus."""
    harness = Harness(scheduler, num_blocks=4, max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=16)
    seqs = [harness.add(prompt=3, max_tokens=6), harness.add(prompt=12, max_tokens=2)]
    plans = harness.run(max_steps=60)
    computed = sum(n for plan in plans for _, n in plan.scheduled)
    needed = sum(len(s.prompt_token_ids) + s.params.max_tokens - 1 for s in seqs)
    stats = harness.scheduler.stats()
    assert stats.num_preemptions >= 1
    assert stats.num_discarded_tokens == computed - needed > 0


# ---------------------------------------------------------------- continuous policy


def test_continuous_decode_first_and_prefill_first_differ_only_under_a_tight_budget():
    plans = {}
    for policy in ("prefill-first", "decode-first"):
        harness = Harness("continuous", max_num_seqs=4, max_num_batched_tokens=6, max_model_len=6,
                          options=ContinuousOptions(policy=policy))
        harness.add(prompt=2, max_tokens=4)
        harness.add(prompt=2, max_tokens=4)
        harness.step()
        harness.add(prompt=5, max_tokens=1)
        plans[policy] = ids(harness.step())
    assert plans["prefill-first"] == [("r0", 1), ("r2", 5)]  # r1's decode sits out the step
    assert plans["decode-first"] == [("r0", 1), ("r1", 1)]  # r2 waits: 5 > 6 - 2


# ---------------------------------------------------------------- priority and starvation


@pytest.mark.parametrize("name", ["continuous", "chunked-prefill", "static"])
def test_priority_orders_admission(name):
    harness = Harness(name, max_num_seqs=1, options=None)
    harness.add(prompt=2, max_tokens=1, request_id="low", priority=2)
    harness.add(prompt=2, max_tokens=1, request_id="mid-a", priority=1)
    harness.add(prompt=2, max_tokens=1, request_id="high", priority=0)
    harness.add(prompt=2, max_tokens=1, request_id="mid-b", priority=1)
    harness.run()
    assert harness.first_scheduled == ["high", "mid-a", "mid-b", "low"]


@pytest.mark.parametrize("name", ["continuous", "chunked-prefill"])
def test_higher_priority_running_sequence_is_not_the_victim(name):
    # Both fit the 4-block pool at first; when it runs dry, the older but low-priority
    # sequence is preempted, not the newer urgent one.
    harness = Harness(name, num_blocks=4, max_num_seqs=2, max_model_len=16, max_num_batched_tokens=16)
    low = harness.add(prompt=4, max_tokens=8, priority=5)
    harness.step()
    urgent = harness.add(prompt=7, max_tokens=6, priority=0)
    assert ids(harness.step()) == [(urgent.request_id, 7), (low.request_id, 1)], "rank order: urgent first"
    preempted = [p.preempted for p in harness.run() if p.preempted]
    assert preempted[0] == (low,)
    assert urgent.num_preemptions == 0 and low.output_token_ids == outputs_of(low)


def starve(name: str, aging_s: float, steps: int = 60) -> Harness:
    """One low-priority request under a steady stream of high-priority ones: a new one
    arrives every step, and one slot serves them."""
    harness = Harness(name, max_num_seqs=1, options=options(name, aging_s))
    harness.add(prompt=2, max_tokens=1, request_id="low", priority=10)
    for _ in range(steps):
        harness.add(prompt=1, max_tokens=1, priority=0)
        harness.step()
    return harness


@pytest.mark.parametrize("name", ["continuous", "chunked-prefill", "static"])
def test_low_priority_request_finishes_under_a_stream_of_high_priority_ones(name):
    # Aging: 10 priority levels x 2 s each, the clock advancing 1 s a step. "low" (arrival
    # 0) ranks like a priority-0 request arriving at 20 s, so it runs at step 20 or 21.
    harness = starve(name, aging_s=2.0)
    assert "low" in [s.request_id for s in harness.finished]
    assert harness.first_scheduled.index("low") in (20, 21)
    # Without aging it starves: proof that the stream is steady enough to starve it.
    assert "low" not in starve(name, aging_s=0.0).first_scheduled


# ---------------------------------------------------------------- abort


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("allocator", ["paged", "radix"])
def test_abort_frees_everything_at_once(name, allocator):
    harness = Harness(name, allocator, num_blocks=16, max_num_seqs=3, max_num_batched_tokens=16,
                      max_model_len=16)
    running = harness.add([7] * 12, max_tokens=4)
    other = harness.add([8] * 5, max_tokens=3)
    waiting = harness.add([9] * 3, max_tokens=2)
    harness.step()
    before = harness.allocator.stats().num_used_blocks
    held = len(harness.allocator.block_table(running.request_id))
    assert held > 0
    assert harness.scheduler.abort(running.request_id) is running
    assert running.status is SequenceStatus.FINISHED and running.finish_reason == "abort"
    assert harness.allocator.block_table(running.request_id) == []
    assert harness.allocator.stats().num_used_blocks == before - held
    assert harness.scheduler.abort(running.request_id) is None
    harness.run()
    assert {s.request_id for s in harness.finished} == {other.request_id, waiting.request_id}
    assert running.request_id not in [s.request_id for s, _ in harness.plans[-1].scheduled]
    assert harness.allocator.stats().num_used_blocks == 0
