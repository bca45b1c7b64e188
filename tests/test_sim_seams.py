"""What the simulator hands the policies a researcher benches there: simulated replicas
report their prefix caches to the router, and tree drafters run in the simulator."""

from __future__ import annotations

import pytest

from servelab.bench.sim.fleet import SimFleet, run_fleet
from servelab.config import EngineConfig
from servelab.interfaces import AllocatorContext, PrefixSummary, prefix_block_hashes
from servelab.plugins.allocators.hash_prefix import HashAllocator
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.workload import build_workload


class _Recording:
    """Round robin that keeps every snapshot list it was shown."""

    def __init__(self) -> None:
        self.seen = []

    def route(self, request, replicas):
        self.seen.append((list(request.prompt_token_ids), replicas))
        return replicas[len(self.seen) % len(replicas)].replica_id


@pytest.mark.parametrize("allocator", ["radix", "hash"])
def test_simulated_replicas_report_their_prefix_caches_to_the_router(allocator):
    config = EngineConfig.from_dict({"engine": {"max_num_seqs": 8, "max_model_len": 1024, "block_size": 16},
                                     "allocator": {"name": allocator}, "router": {"name": "round-robin"}})
    fleet = SimFleet("f", config, 2, "h100", "llama-3-8b")
    fleet.router = _Recording()
    workload = build_workload("shared-prefix:num_groups=1,prefix_len=64,num_requests=6,tail_len=16,output_len=2,"
                              "arrival=poisson,rate=5", 1000)
    run_fleet(fleet, workload)
    prompt, last = fleet.router.seen[-1]
    assert all(r.prefix_summary is not None and r.prefix_summary.block_size == 16 for r in last)
    # every replica has served the group by the last request: each holds its 64-token prefix
    assert [r.prefix_summary.cached_tokens(prompt) for r in last] == [64, 64]
    first_prompt, first = fleet.router.seen[0]
    assert [r.prefix_summary.cached_tokens(first_prompt) for r in first] == [0, 0]


def test_the_radix_summary_names_blocks_as_the_hash_allocator_does():
    context = AllocatorContext(num_blocks=16, block_size=4, max_model_len=64)
    summaries = []
    for allocator in (RadixAllocator(None, context), HashAllocator(None, context)):
        from servelab.interfaces import Sequence
        from servelab.sampling_params import SamplingParams

        for name, prompt in (("a", list(range(3, 15))), ("b", list(range(3, 11)) + [40, 41, 42, 43])):
            seq = Sequence(name, prompt, SamplingParams(), 0.0)
            assert allocator.allocate(name, len(prompt))
            seq.num_computed_tokens = len(prompt)
            allocator.cache_blocks(seq)
        summaries.append(allocator.prefix_summary())
    radix, hashed = summaries
    assert radix == hashed
    expected = set(prefix_block_hashes(list(range(3, 15)), 4)) | set(prefix_block_hashes(list(range(3, 11)) + [40, 41, 42, 43], 4))
    assert radix == PrefixSummary(4, expected) and len(expected) == 4


def test_a_tree_drafter_runs_in_the_simulator():
    from servelab.bench.session import BenchOptions, run_bench

    chain = EngineConfig.from_dict({"engine": {"max_num_seqs": 8, "max_model_len": 1024},
                                    "drafter": {"name": "suffix", "num_speculative_tokens": 3}})
    tree = chain.with_overrides({"drafter.tree_nodes": 6})
    result = run_bench([("chain", chain), ("tree", tree)],
                       BenchOptions(workload="repetitive:passage_len=64,num_requests=4,output_len=32", repeats=1,
                                    sim_accelerator="h100"))
    for run in result["runs"]:
        metrics = run["metrics"]
        assert metrics["output_tokens"] == 4 * 32
        assert metrics["draft_tokens"] > 0 and metrics["accepted_tokens"] > 0
    # The simulated model's vocabulary is one token, so a tree's continuations collapse to
    # the chain's: the bench says the comparison measured nothing, as it should.
    assert [w["kind"] for w in result["warnings"]] == ["identical"]
