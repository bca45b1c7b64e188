"""The three built-in schedulers (static, continuous, chunked-prefill), driven step by
step without a model over the real allocators (paged, radix, naive).

`Harness` stands in for the engine's update after each step, as in
test_continuous_scheduler.py: scheduled sequences advance their computed tokens, one
that caught up gets a dummy output token (1000, 1001, ...), prefix-caching allocators
cache the computed blocks, and one holding max_tokens outputs is retired through
`finish`. Its clock advances one second per step.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import event, given, settings

from servelab.errors import ConfigError
from servelab.interfaces import (
    AllocatorContext,
    PrefixCachingAllocator,
    Scheduler,
    SchedulerContext,
    SequenceStatus,
    StepPlan,
)
from servelab.plugins.allocators.naive import NaiveAllocator
from servelab.plugins.allocators.paged import PagedAllocator, blocks_for
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.plugins.schedulers.chunked_prefill import ChunkedPrefillScheduler
from servelab.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler
from servelab.plugins.schedulers.queues import QueueOptions
from servelab.plugins.schedulers.static import StaticScheduler
from servelab.sampling_params import SamplingParams
from servelab.sequence import Sequence

OUTPUT_TOKEN_BASE = 1000
SCHEDULERS = {"static": StaticScheduler, "continuous": ContinuousScheduler, "chunked-prefill": ChunkedPrefillScheduler}
ALLOCATORS = {"paged": PagedAllocator, "radix": RadixAllocator, "naive": NaiveAllocator}


class Harness:
    """A scheduler over a real allocator, plus the engine's per-step bookkeeping."""

    def __init__(self, scheduler: str = "continuous", allocator: str = "paged", *, num_blocks: int = 64,
                 block_size: int = 4, max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                 max_model_len: int = 64, options=None) -> None:
        self.now = 0.0
        self.allocator = ALLOCATORS[allocator](None, AllocatorContext(
            num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len))
        self.scheduler = SCHEDULERS[scheduler](options, SchedulerContext(
            allocator=self.allocator, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, clock=lambda: self.now))
        self.prefix_cache = self.allocator if isinstance(self.allocator, PrefixCachingAllocator) else None
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.finished: list[Sequence] = []
        self.first_scheduled: list[str] = []  # request ids, in the order they first ran
        self.plans: list[StepPlan] = []
        self.add_order: dict[str, int] = {}
        self.num_partial_chunks = 0  # scheduled token counts short of a sequence's uncomputed tokens
        self._ids = itertools.count()

    def add(self, prompt: int | list[int], max_tokens: int, request_id: str | None = None,
            priority: int = 0) -> Sequence:
        prompt_ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
        seq = Sequence(request_id or f"r{next(self._ids)}", prompt_ids, SamplingParams(max_tokens=max_tokens),
                       self.now, priority=priority)
        self.add_order[seq.request_id] = len(self.add_order)
        self.scheduler.add(seq)
        return seq

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        self.check_plan(plan)
        done = []
        for seq, num_new in plan.scheduled:
            if seq.request_id not in self.first_scheduled:
                self.first_scheduled.append(seq.request_id)
            seq.num_computed_tokens += num_new
            if self.prefix_cache is not None:
                self.prefix_cache.cache_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(OUTPUT_TOKEN_BASE + len(seq.output_token_ids))
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    done.append(seq)
        self.scheduler.finish(done)
        for seq in done:
            assert seq.status is SequenceStatus.FINISHED
            assert list(self.allocator.block_table(seq.request_id)) == [], "a finished request holds KV"
        self.finished.extend(done)
        self.plans.append(plan)
        self.now += 1.0
        return plan

    def check_plan(self, plan: StepPlan) -> None:
        """What must hold for every plan, before the engine touches the sequences."""
        assert len(plan.scheduled) <= self.max_num_seqs
        assert plan.num_scheduled_tokens <= self.max_num_batched_tokens
        stats = self.scheduler.stats()
        assert stats.num_running <= self.max_num_seqs
        assert stats.num_scheduled_seqs == len(plan.scheduled)
        assert stats.num_scheduled_tokens == plan.num_scheduled_tokens
        if plan.scheduled:
            assert stats.num_idle_slots >= 0
            assert stats.num_scheduled_seqs + stats.num_idle_slots <= self.max_num_seqs
        seqs = [seq for seq, _ in plan.scheduled]
        assert len({id(s) for s in seqs}) == len(seqs), "a sequence scheduled twice in one step"
        for seq, num_new in plan.scheduled:
            assert 1 <= num_new <= seq.num_uncomputed_tokens
            self.num_partial_chunks += num_new < seq.num_uncomputed_tokens
            assert seq.status is SequenceStatus.RUNNING
            needed = blocks_for(seq.num_computed_tokens + num_new, self.block_size)
            assert len(self.allocator.block_table(seq.request_id)) >= needed, "room not allocated"
        for seq in plan.preempted:
            assert seq not in seqs
            assert seq.status is SequenceStatus.WAITING
            assert seq.num_computed_tokens == 0
            assert list(self.allocator.block_table(seq.request_id)) == []

    def run(self, max_steps: int = 1000) -> list[StepPlan]:
        start = len(self.plans)
        while self.scheduler.has_unfinished():
            assert len(self.plans) - start < max_steps, "scheduler made no progress"
            self.step()
        return self.plans[start:]


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


# ---------------------------------------------------------------- random workloads


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 40))
    prefixes = [[3 + i] * max_model_len for i in range(2)]  # shared prefixes give radix hits

    def request(prompt_len):
        prefix = draw(st.sampled_from(prefixes))
        cut = draw(st.integers(0, prompt_len))
        prompt = prefix[:cut] + [50 + (7 * i) % 13 for i in range(prompt_len - cut)]
        return (prompt, draw(st.integers(1, max_model_len - prompt_len)), draw(st.integers(0, 10)),
                draw(st.integers(0, 2)))

    requests = [request(draw(st.integers(1, max_model_len - 1)))
                for _ in range(draw(st.integers(1, 12)))]  # (prompt, max_tokens, arrival step, priority)
    allocator = draw(st.sampled_from(sorted(ALLOCATORS)))
    longest = max(blocks_for(len(p) + m, block_size) for p, m, _, _ in requests)
    if allocator == "naive":
        longest = blocks_for(max_model_len, block_size)
    return dict(
        block_size=block_size, max_model_len=max_model_len, requests=requests, allocator=allocator,
        num_blocks=draw(st.integers(longest, longest * 3 // 2)), max_num_seqs=draw(st.integers(1, 6)),
        budget_extra=draw(st.integers(0, 24)), small_budget=draw(st.integers(1, max_model_len)),
        aging_s=draw(st.sampled_from([0.0, 3.0])), policy=draw(st.sampled_from(["prefill-first", "decode-first"])),
        aborts=draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, len(requests) - 1)), max_size=2)))


def expected_rank(seq: Sequence, order: int, aging_s: float) -> tuple:
    if aging_s:
        return seq.arrival_time + seq.priority * aging_s, order
    return seq.priority, seq.arrival_time, order


@pytest.mark.parametrize("name", SCHEDULERS)
@settings(max_examples=200, deadline=None)
@given(w=workloads())
def test_random_workloads(name, w):
    budget = w["max_model_len"] + w["budget_extra"]
    if name == "chunked-prefill":
        budget = w["small_budget"]  # below max_model_len: prompts are chunked
    harness = Harness(name, w["allocator"], num_blocks=w["num_blocks"], block_size=w["block_size"],
                      max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=budget,
                      max_model_len=w["max_model_len"], options=options(name, w["aging_s"], w["policy"]))
    requests = w["requests"]
    seqs: list[Sequence | None] = [None] * len(requests)
    aborted: set[str] = set()
    last_arrival = max(r[2] for r in requests)
    bound = last_arrival + 10 * sum(len(p) + m for p, m, _, _ in requests) + 20
    step = 0
    while step <= last_arrival or harness.scheduler.has_unfinished():
        assert step <= bound, "scheduler failed to make progress"
        for index, (prompt, max_tokens, arrival, priority) in enumerate(requests):
            if arrival == step:
                seqs[index] = harness.add(prompt, max_tokens, request_id=f"r{index}", priority=priority)
        for abort_step, index in w["aborts"]:
            seq = seqs[index]
            if abort_step == step and seq is not None and not seq.is_finished:
                assert harness.scheduler.abort(seq.request_id) is seq
                assert harness.allocator.block_table(seq.request_id) == []
                aborted.add(seq.request_id)
        waiting = list(harness.scheduler.waiting)
        ranks = [expected_rank(s, harness.add_order[s.request_id], w["aging_s"]) for s in waiting]
        assert ranks == sorted(ranks), "the queue is out of rank order"
        outputs_before = {s.request_id: list(s.output_token_ids) for s in seqs if s is not None}
        unfinished = harness.scheduler.has_unfinished()
        plan = harness.step()
        assert plan.scheduled or not unfinished, "idle step with work queued"
        # Admission takes the head of the queue, in order: nobody overtakes a better rank.
        left = [s for s in waiting if s not in harness.scheduler.waiting]
        assert left == waiting[: len(left)]
        for seq in plan.preempted:
            assert seq.output_token_ids == outputs_before[seq.request_id], "preemption lost tokens"
        step += 1

    finished_ids = [s.request_id for s in harness.finished]
    assert len(finished_ids) == len(set(finished_ids)), "a request finished twice"
    assert not set(finished_ids) & aborted
    for seq in seqs:
        assert seq.is_finished
        assert harness.allocator.block_table(seq.request_id) == []
        if seq.request_id not in aborted:
            assert seq.request_id in finished_ids
            assert seq.output_token_ids == outputs_of(seq)
    stats = harness.allocator.stats()
    assert stats.num_used_blocks == 0
    event(f"preempted: {any(p.preempted for p in harness.plans)}")
    event(f"prefix hits: {stats.prefix_hit_tokens > 0}")
    event(f"chunked: {harness.num_partial_chunks > 0}")
    scheduler_stats = harness.scheduler.stats()
    assert scheduler_stats.num_waiting == scheduler_stats.num_running == 0
    assert scheduler_stats.slot_steps_used == sum(len(p.scheduled) for p in harness.plans)
    assert scheduler_stats.num_preemptions == sum(len(p.preempted) for p in harness.plans)
