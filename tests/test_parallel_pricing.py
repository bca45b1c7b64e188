"""The simulator prices expert and pipeline parallelism: placement policies and chunk
sizing run in it as in the engine, the direction of the published results holds, and the
pipeline's bubble matches its closed form where chunks are equal."""

from __future__ import annotations

import attrs
import pytest

from servelab.bench.sim.hardware import accelerator, interconnect
from servelab.bench.sim.parallel_cost import MOE_SHAPES, ep_step, pipeline_schedule
from servelab.bench.sim.shapes import model_shape
from servelab.expert_placement import placement_policy
from servelab.pipeline_chunks import EqualTimeChunks, FixedChunks, chunk_sizing
from servelab.testing.pipeline import ChunkSizingContract

MIXTRAL = MOE_SHAPES["mixtral-8x7b"]


class TestFixedChunks(ChunkSizingContract):
    sizing = FixedChunks()


class TestEqualTimeChunks(ChunkSizingContract):
    sizing = EqualTimeChunks()


class RemainderDropped(FixedChunks):
    def chunks(self, prompt_len, max_chunk, chunk_time):
        return [max_chunk] * (prompt_len // max_chunk) or [prompt_len]


class OverLong(FixedChunks):
    def chunks(self, prompt_len, max_chunk, chunk_time):
        return [prompt_len]


class EqualTimeTooTimid(EqualTimeChunks):
    def chunks(self, prompt_len, max_chunk, chunk_time):
        return [1] * prompt_len


@pytest.mark.parametrize("sizing, check, message", [
    (RemainderDropped(), "test_chunks_cover_the_prompt_within_bounds", "sum to the prompt's"),
    (OverLong(), "test_chunks_cover_the_prompt_within_bounds", "every chunk lies in"),
    (EqualTimeTooTimid(), "test_named_policies_keep_their_definition", "as long as the first chunk's time allows"),
], ids=["RemainderDropped", "OverLong", "EqualTimeTooTimid"])
def test_the_chunk_sizing_contract_catches_seeded_faults(sizing, check, message):
    contract = type("Faulty", (ChunkSizingContract,), {"sizing": sizing})()
    with pytest.raises(AssertionError, match=message):
        getattr(contract, check)()


def test_equal_chunks_leave_the_closed_form_bubble():
    """With a stage's time all fixed cost (no context, a free link), M chunks over S stages
    idle each stage (S - 1) / (M + S - 1) of the makespan."""
    hw = attrs.evolve(accelerator("h100"), step_overhead_s=1.0, peak_flops=1e30, memory_bandwidth=1e30)
    link = attrs.evolve(interconnect("nvlink4"), latency_s=0.0, bus_bandwidth=1e30)
    for stages, prompt, chunk in ((2, 4096, 512), (4, 4096, 1024), (4, 1000, 1000), (1, 300, 100)):
        run = pipeline_schedule(model_shape("llama-3-70b"), hw, link, stages, prompt, chunk, FixedChunks())
        m = len(run.chunks)
        assert run.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1), abs=1e-6)


def test_smaller_chunks_shrink_the_bubble_and_equal_time_evens_the_chunks():
    """Llama-3-70B over 4 H100 stages, an 8k prompt: the bubble falls as chunks shrink
    (more in flight), and equal-time chunks (shorter as the context grows) spread the
    stage times less than fixed ones."""
    shape, hw, link = model_shape("llama-3-70b"), accelerator("h100"), interconnect("nvlink4")
    bubbles = [pipeline_schedule(shape, hw, link, 4, 8192, chunk, FixedChunks()).bubble_fraction
               for chunk in (8192, 4096, 2048, 1024)]
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[0] > 0.7 and bubbles[-1] < 0.4
    fixed = pipeline_schedule(shape, hw, link, 4, 32768, 4096, FixedChunks())
    equal = pipeline_schedule(shape, hw, link, 4, 32768, 4096, chunk_sizing("equal_time"))
    assert len(equal.chunks) > len(fixed.chunks) and equal.chunks[-2] < equal.chunks[0]
    assert equal.bubble_fraction < fixed.bubble_fraction


def test_round_robin_and_balanced_placement_beat_linear_on_neighbouring_hot_experts():
    """Mixtral-8x7B over 4 H100s, a 4k-token prefill step whose router favours experts 0
    and 1 (neighbours: linear puts both on rank 0): round_robin splits them (the direction
    of the published +14.6%), balanced with redundant replicas evens the ranks further."""
    hw, link = accelerator("h100"), interconnect("nvlink4")
    load = [30, 25, 10, 9, 8, 7, 6, 5]
    results = {}
    for name, redundant in (("linear", 0), ("round_robin", 0), ("balanced", 4)):
        placement = placement_policy(name, redundant).place(8, 4, [float(x) for x in load])
        results[name] = ep_step(MIXTRAL, hw, link, 4096, 0, placement, load)
    assert (results["linear"]["tokens_per_s"] < results["round_robin"]["tokens_per_s"]
            < results["balanced"]["tokens_per_s"])
    assert results["linear"]["imbalance"] > results["round_robin"]["imbalance"] > results["balanced"]["imbalance"]
    assert results["linear"]["all_to_all_bytes_per_rank"] == results["balanced"]["all_to_all_bytes_per_rank"] > 0


def test_a_slower_interconnect_costs_expert_parallelism_its_all_to_all():
    hw = accelerator("h100")
    placement = placement_policy("linear").place(8, 4)
    fast = ep_step(MIXTRAL, hw, interconnect("nvlink4"), 4096, 0, placement, [1.0] * 8)
    slow = ep_step(MIXTRAL, hw, interconnect("pcie4"), 4096, 0, placement, [1.0] * 8)
    assert slow["share_all_to_all"] > fast["share_all_to_all"] and slow["tokens_per_s"] < fast["tokens_per_s"]
