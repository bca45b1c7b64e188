"""Pricing expert and pipeline parallelism on a simulated accelerator and interconnect.

Expert parallelism (`ep_layer_cost`, `ep_step`): the tokens' attention is spread over the
EP ranks (each rank attends to its share of the batch), every token's hidden state
travels to the ranks holding its top-k experts and back (two all-to-alls of
tokens x top_k x hidden elements, the dispatch and the combine), and the experts of one
layer finish when the busiest rank does: the placement policy
(servelab.expert_placement) and the measured expert load decide that rank's rows and the
expert weights it reads. Imbalance costs straight throughput.

Pipeline parallelism (`pipeline_schedule`): the layers split into stages, a prompt cut
into chunks by a chunk-sizing policy (servelab.pipeline_chunks); stage s starts chunk j
when it has finished chunk j - 1 and stage s - 1 has handed chunk j over (activations over
the interconnect). The bubble is the stages' idle share of the makespan: (S - 1) / (M + S - 1)
for M equal chunks over S stages, more when chunks are unequal (a later chunk attends to
more context: `equal_time` sizing evens them out).

Each kernel is a roofline, max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth), as
in servelab.bench.sim.cost_model, plus the accelerator's per-step overhead for each chunk
a stage runs. The shapes include Mixtral-8x7B's (MOE_SHAPES).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs

from servelab.bench.sim.hardware import Accelerator, Interconnect
from servelab.bench.sim.shapes import MIXTRAL_8X7B
from servelab.contracts.moe import ExpertPlacement
from servelab.model.model_config import ModelConfig

MOE_SHAPES = {"mixtral-8x7b": MIXTRAL_8X7B}


def roofline(hw: Accelerator, flops: float, nbytes: float) -> float:
    return max(flops / (hw.peak_flops * hw.compute_efficiency), nbytes / (hw.memory_bandwidth * hw.bandwidth_efficiency))


def all_to_all_seconds(link: Interconnect, nbytes_per_rank: float, size: int) -> float:
    """Each rank sends (size - 1) / size of its `nbytes_per_rank` to the others."""
    return 0.0 if size <= 1 else link.latency_s + (size - 1) / size * nbytes_per_rank / link.bus_bandwidth


def attention_layer_seconds(shape: ModelConfig, hw: Accelerator, tokens: int, context: int,
                            dtype_bytes: int) -> float:
    """One layer's attention block (projections and attention over `context` earlier tokens)
    for `tokens` new tokens."""
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    params = shape.hidden_size * (q + 2 * kv) + q * shape.hidden_size
    flops = 2 * tokens * params + 4 * tokens * (context + tokens / 2) * q
    nbytes = params * dtype_bytes + 2 * (context + tokens) * kv * dtype_bytes + 4 * tokens * shape.hidden_size * dtype_bytes
    return roofline(hw, flops, nbytes)


def decode_attention_layer_seconds(shape: ModelConfig, hw: Accelerator, sequences: int, context: int,
                                   kv_bytes_per_token: float, dtype_bytes: int) -> float:
    """One layer's attention block for a decode step of `sequences` sequences, one new
    token each, every one reading its own `context` tokens of KV (`kv_bytes_per_token`:
    K and V of one token in this layer)."""
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    params = shape.hidden_size * (q + 2 * kv) + q * shape.hidden_size
    flops = 2 * sequences * params + 4 * sequences * context * q
    nbytes = (params * dtype_bytes + sequences * context * kv_bytes_per_token
              + 4 * sequences * shape.hidden_size * dtype_bytes)
    return roofline(hw, flops, nbytes)


def mlp_layer_seconds(shape: ModelConfig, hw: Accelerator, tokens: int, dtype_bytes: int) -> float:
    """One layer's feed-forward for `tokens` tokens: the dense MLP, or a MoE layer on one device."""
    moe = shape.moe
    if moe is None:
        params = 3 * shape.hidden_size * shape.intermediate_size
        return roofline(hw, 2 * tokens * params, params * dtype_bytes)
    expert = 3 * shape.hidden_size * moe.expert_intermediate_size
    touched = min(moe.num_experts, tokens * moe.top_k)  # experts with at least one row (at most)
    return roofline(hw, 2 * tokens * moe.top_k * expert, touched * expert * dtype_bytes)


@attrs.frozen
class EPLayerCost:
    seconds: float
    attention_s: float
    experts_s: float  # the busiest rank's
    all_to_all_s: float  # dispatch and combine
    all_to_all_bytes: float  # per rank, both directions
    imbalance: float  # the busiest rank's rows over the mean rank's


def ep_layer_cost(shape: ModelConfig, hw: Accelerator, link: Interconnect, tokens: int, context: int,
                  placement: ExpertPlacement, load: Sequence[float], dtype_bytes: int = 2) -> EPLayerCost:
    """One sparse layer of a step of `tokens` tokens over `placement.ep_size` ranks, the
    experts' share of the rows as `load` (per expert, any scale)."""
    moe = shape.moe
    ranks = placement.ep_size
    experts, imbalance = busiest_rank_experts(shape, hw, tokens, placement, load, dtype_bytes)
    attention = attention_layer_seconds(shape, hw, -(-tokens // ranks), context, dtype_bytes)
    moved = (tokens / ranks) * moe.top_k * shape.hidden_size * dtype_bytes
    exchange = 2 * all_to_all_seconds(link, moved, ranks)
    return EPLayerCost(seconds=attention + experts + exchange, attention_s=attention, experts_s=experts,
                       all_to_all_s=exchange, all_to_all_bytes=2 * moved * (ranks - 1) / ranks, imbalance=imbalance)


def busiest_rank_experts(shape: ModelConfig, hw: Accelerator, tokens: int, placement: ExpertPlacement,
                         load: Sequence[float], dtype_bytes: int = 2) -> tuple[float, float]:
    """One sparse layer's experts for `tokens` tokens over `placement`'s ranks, routed in
    the shares of `load`: the busiest rank's seconds (its rows and the expert weights it
    reads) and its rows over the mean rank's."""
    moe = shape.moe
    total = sum(load) or 1.0
    rows = [share / total * tokens * moe.top_k for share in placement.rank_loads(load)]
    expert = 3 * shape.hidden_size * moe.expert_intermediate_size
    per_rank = [roofline(hw, 2 * r * expert, len(held) * expert * dtype_bytes)
                for r, held in zip(rows, placement.ranks)]
    mean_rows = sum(rows) / placement.ep_size
    return max(per_rank), (max(rows) / mean_rows if mean_rows else 1.0)


def ep_step(shape: ModelConfig, hw: Accelerator, link: Interconnect, tokens: int, context: int,
            placement: ExpertPlacement, load: Sequence[float], dtype_bytes: int = 2) -> dict[str, Any]:
    """A whole step's price under EP (every layer sparse, as in Mixtral), and its tokens per second."""
    layer = ep_layer_cost(shape, hw, link, tokens, context, placement, load, dtype_bytes)
    seconds = shape.num_layers * layer.seconds + hw.step_overhead_s
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "imbalance": layer.imbalance,
            "all_to_all_bytes_per_rank": shape.num_layers * layer.all_to_all_bytes,
            "share_all_to_all": shape.num_layers * layer.all_to_all_s / seconds,
            "share_experts": shape.num_layers * layer.experts_s / seconds}


def stage_seconds(shape: ModelConfig, hw: Accelerator, layers: int, tokens: int, context: int,
                  dtype_bytes: int = 2) -> float:
    """One pipeline stage of `layers` layers running a chunk, its per-step overhead included."""
    per_layer = (attention_layer_seconds(shape, hw, tokens, context, dtype_bytes)
                 + mlp_layer_seconds(shape, hw, tokens, dtype_bytes))
    return layers * per_layer + hw.step_overhead_s


@attrs.frozen
class PipelineRun:
    chunks: tuple[int, ...]
    makespan_s: float
    busy_s: tuple[float, ...]  # per stage
    bubble_s: tuple[float, ...]  # per stage: the makespan less its busy time

    @property
    def bubble_fraction(self) -> float:
        return sum(self.bubble_s) / (len(self.busy_s) * self.makespan_s)


def pipeline_schedule(shape: ModelConfig, hw: Accelerator, link: Interconnect, stages: int, prompt_len: int,
                      max_chunk: int, sizing: Any, dtype_bytes: int = 2,
                      chunk_time: Callable[[int, int], float] | None = None) -> PipelineRun:
    """One prompt's prefill through `stages` stages, cut into chunks by `sizing`;
    `chunk_time(tokens, context)` is one stage's time for a chunk (default: the largest
    stage's `stage_seconds` on one device)."""
    layers = -(-shape.num_layers // stages)
    if chunk_time is None:
        def chunk_time(tokens: int, context: int) -> float:
            return stage_seconds(shape, hw, layers, tokens, context, dtype_bytes)

    chunks = sizing.chunks(prompt_len, max_chunk, chunk_time)
    finish = [0.0] * stages
    busy = [0.0] * stages
    context = 0
    for tokens in chunks:
        handed = 0.0  # when the previous stage handed this chunk over
        for stage in range(stages):
            cost = chunk_time(tokens, context)
            start = max(finish[stage], handed)
            finish[stage] = start + cost
            busy[stage] += cost
            handed = finish[stage] + (link.latency_s + tokens * shape.hidden_size * dtype_bytes / link.bus_bandwidth
                                      if stage < stages - 1 else 0.0)
        context += tokens
    makespan = max(finish)
    return PipelineRun(tuple(chunks), makespan, tuple(busy), tuple(makespan - b for b in busy))
