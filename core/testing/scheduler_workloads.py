"""Random workloads for the scheduler contract: requests of random lengths, priorities,
arrival steps and parallel-sampling widths, with aborts, over a random engine shape
and a real allocator, run step by step through a `SchedulerHarness`. Half of them are
shaped to press the limits: short prompts that then decode for long, joined a few steps
later by prompts of nearly max_model_len, against a budget of about max_model_len.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import event

from servelab.interfaces import AllocatorContext
from servelab.testing.contract import check, installed_factory
from servelab.testing.scheduler_harness import PROGRESS, SchedulerHarness


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@st.composite
def workloads(draw, allocator_names: tuple[str, ...], num_options: int, chunking: bool, forking: bool):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 40))
    prefixes = [[3 + i] * max_model_len for i in range(2)]  # shared prefixes give prefix-cache hits

    def request(prompt_len: int) -> tuple:
        prefix = draw(st.sampled_from(prefixes))
        cut = draw(st.integers(0, prompt_len))
        prompt = prefix[:cut] + [50 + (7 * i) % 13 for i in range(prompt_len - cut)]
        n = draw(st.sampled_from([1, 1, 1, 2, 3])) if forking else 1
        arrival = draw(st.just(0) | st.integers(0, 10))  # a burst at step 0 contends for the budget
        return prompt, draw(st.integers(1, max_model_len - prompt_len)), arrival, draw(st.integers(0, 2)), n

    # (prompt, max_tokens, arrival step, priority, n)
    requests = [request(draw(st.integers(1, max_model_len - 1))) for _ in range(draw(st.integers(1, 12)))]
    pressing = max_model_len >= 8 and draw(st.booleans())
    if pressing:  # decodes still running when two long prompts arrive together
        arrival = draw(st.integers(2, 4))
        decoders = [([5 + i, 6], max_model_len - 2, 0, draw(st.integers(0, 2)), 1)
                    for i in range(draw(st.integers(3, 6)))]
        long_prompts = [([60 + i] * (max_model_len - 2), 2, arrival, draw(st.integers(0, 2)), 1) for i in range(2)]
        requests = decoders + long_prompts + requests[:2]
    allocator = draw(st.sampled_from(allocator_names))
    longest = blocks_for(max_model_len, block_size)
    budget = max_model_len + draw(st.sampled_from([0, 0, 1, 4, 24]))  # mostly tight
    if chunking and draw(st.booleans()):
        budget = draw(st.integers(1, max_model_len))  # below max_model_len: prompts are chunked
    num_blocks = draw(st.integers(longest, longest * 3 // 2 + 1))
    max_num_seqs = draw(st.integers(1, 6))
    if pressing:  # room and slots for everyone, and a budget of one long prompt and two decodes
        num_blocks, max_num_seqs, budget = longest * len(requests), len(requests), max_model_len
    return dict(
        block_size=block_size, max_model_len=max_model_len, requests=requests, allocator=allocator,
        num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget,
        options_index=draw(st.integers(0, num_options - 1)),
        aborts=draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, len(requests) - 1)), max_size=2)))


def make_allocator(name: str, num_blocks: int, block_size: int, max_model_len: int) -> Any:
    factory, options_class = installed_factory("allocators", name)
    return factory(options_class(), AllocatorContext(num_blocks=num_blocks, block_size=block_size,
                                                     max_model_len=max_model_len))


def run_workload(contract: Any, w: dict, options: Any) -> SchedulerHarness:
    allocator = make_allocator(w["allocator"], w["num_blocks"], w["block_size"], w["max_model_len"])
    harness = SchedulerHarness(lambda context: contract._factory(options, context), allocator,
                               block_size=w["block_size"], max_num_seqs=w["max_num_seqs"],
                               max_num_batched_tokens=w["budget"], max_model_len=w["max_model_len"],
                               observer=contract, max_idle_steps=contract.max_idle_steps, seconds_per_step=1.0)
    requests = w["requests"]
    request_ids: list[str | None] = [None] * len(requests)
    last_arrival = max(r[2] for r in requests)
    bound = last_arrival + 10 * sum((len(p) + m) * n for p, m, _, _, n in requests) + 20
    step = 0
    while step <= last_arrival or harness._unfinished():
        check(step <= bound, PROGRESS, f"not done after {bound} steps")
        for index, (prompt, max_tokens, arrival, priority, n) in enumerate(requests):
            if arrival == step:
                request_ids[index] = harness.add(prompt, max_tokens, request_id=f"r{index}", priority=priority,
                                                 n=n).request_id
        for abort_step, index in w["aborts"]:
            request_id = request_ids[index]
            if abort_step == step and request_id is not None and request_id not in harness.aborted:
                if any(s.finish_reason is None for s in harness.requests[request_id]):
                    harness.abort(request_id)
        harness.step()
        step += 1
    harness.check_all_done()
    event(f"preempted: {any(p.preempted for p in harness.plans)}")
    event(f"chunked: {harness.num_partial_chunks > 0}")
    return harness
