"""A layout's priced decode step and prompt prefill (`servelab size` over EP/PP layouts),
from servelab.bench.sim.parallel_cost's rooflines, on the device that paces the layout:
one of stage 0's (the most layers, and the LM head), its EP rank the busiest.

Decode: `batch` sequences, each at `context` tokens, cut into one micro-batch per stage
that follow each other through the stages (PP batches in flight: vLLM's batch queue, and
the engine's `pipeline_batches_in_flight` default), each micro-batch's sequences spread
over the EP ranks. Per layer a stage runs attention over its sequences' KV; the MLP, or
the experts (under EP the busiest rank's rows under the placement and the expert load,
and the dispatch and combine all-to-alls); under TP two all-reduces of its rows. Stage 0
then runs the LM head. A token takes the longer of one micro-batch's trip through the stages and stage 0's work on
every micro-batch (the same once there are as many micro-batches as stages), plus the
hand-offs between stages (the last sends its rows back to stage 0, which samples).

Prefill: one prompt on an idle layout (its time to first token), cut into chunks by the
chunk sizing and pipelined through the stages (parallel_cost.pipeline_schedule, whose
bubble is the stages' idle share of the makespan). The prompt lives on one EP rank, which
sends all its rows to the experts' ranks.

Under TP x EP each TP rank of a group dispatches 1/TP of its group's rows (the
sequence-parallel dispatch between the reduce-scatter and the all-gather TP's all-reduce
splits into), so a device's all-to-all carries rows / TP.

EP x TP on the same ranks (`Layout.attention_tp`, N = TP = EP): every rank runs every
sequence (no data-parallel attention), attention over its heads and their KV, one
all-reduce of the hidden state a layer (the row-parallel output projection); it
dispatches 1/N of the rows (between that all-reduce's reduce-scatter and its all-gather,
as above), its experts take the busiest rank's rows of the whole batch at their whole
width, and the dense MLP layers and the LM head run whole on every rank over every row.
The prompt of a prefill is on every rank, its attention split by heads.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from servelab.bench.sim.hardware import Accelerator, Interconnect
from servelab.bench.sim.layouts import Layout, layout_shard, stage_layers
from servelab.bench.sim.parallel_cost import (all_to_all_seconds, attention_layer_seconds, busiest_rank_experts,
                                              decode_attention_layer_seconds, mlp_layer_seconds, pipeline_schedule,
                                              roofline)
from servelab.contracts.moe import ExpertPlacement
from servelab.model.model_config import ModelConfig


@attrs.frozen
class LayoutPrice:
    decode_batch: int
    decode_step_s: float  # between two output tokens of every sequence in the batch
    decode_tokens_per_s: float
    all_to_all_bytes: float  # per device per decode step, dispatch and combine over its stage's sparse layers
    expert_imbalance: float  # the busiest EP rank's expert rows over the mean's (1.0 without EP)
    prompt_len: int
    prefill_s: float
    prefill_chunks: int
    bubble_fraction: float  # of the prefill: the stages' idle share of its makespan


class LayoutCost:
    def __init__(self, shape: ModelConfig, hw: Accelerator, link: Interconnect, layout: Layout,
                 placement: ExpertPlacement | None, load: Sequence[float] | None, kv_bytes_per_token_layer: float,
                 dtype_bytes: int = 2) -> None:
        """`kv_bytes_per_token_layer`: K and V of one token in one layer on one device."""
        self.shape, self.hw, self.link, self.layout = shape, hw, link, layout
        self.placement, self.dtype_bytes = placement, dtype_bytes
        self.local = layout_shard(shape, layout)
        self.dense_local = attrs.evolve(self.local, moe=None)
        shared = self.local.moe.shared_expert_intermediate_size if self.local.moe is not None else 0
        self.shared_local = attrs.evolve(self.dense_local, intermediate_size=shared) if shared else None
        # TP's row-parallel projections: attention's and the MLP's, or attention's alone where the MLP is whole
        self.all_reduces_per_layer = 0 if layout.tp == 1 else (1 if layout.attention_tp else 2)
        moe = shape.moe
        self.load = list(load) if load is not None else ([1.0] * moe.num_experts if moe else [])
        layers = stage_layers(shape.num_layers, 0, layout.pp)
        self.sparse_layers = sum(1 for layer in layers if moe is not None and layer in moe.sparse_layers)
        self.dense_layers = len(layers) - self.sparse_layers
        self.kv_bytes_per_token_layer = kv_bytes_per_token_layer

    def _stage(self, attention_s: float, group_rows: int, step_rows: int,
               dispatched_rows: float) -> tuple[float, float, float]:
        """Stage 0's time for one chunk, its all-to-all bytes (per device) and the EP
        imbalance: `attention_s` a layer; `group_rows` rows on this EP rank, `step_rows`
        on all of them; `dispatched_rows` leave this device for the experts' ranks."""
        hw, layout, shape, size = self.hw, self.layout, self.shape, self.dtype_bytes
        all_reduces = self.all_reduces_per_layer * self.link.all_reduce_seconds(group_rows * shape.hidden_size * size,
                                                                                layout.tp)
        seconds = self.dense_layers * (attention_s + mlp_layer_seconds(self.dense_local, hw, group_rows, size)
                                       + all_reduces)
        exchanged, imbalance = 0.0, 1.0
        if self.sparse_layers:
            if layout.ep > 1:
                experts, imbalance = busiest_rank_experts(self.local, hw, step_rows, self.placement, self.load, size)
                moved = dispatched_rows * shape.moe.top_k * shape.hidden_size * size
                experts += 2 * all_to_all_seconds(self.link, moved, layout.ep)
                exchanged = self.sparse_layers * 2 * moved * (layout.ep - 1) / layout.ep
            else:
                experts = mlp_layer_seconds(self.local, hw, group_rows, size)
            if self.shared_local is not None:  # on every row of this device, beside the routed experts
                experts += mlp_layer_seconds(self.shared_local, hw, group_rows, size)
            seconds += self.sparse_layers * (attention_s + experts + all_reduces)
        return seconds + hw.step_overhead_s, exchanged, imbalance

    def _handoff(self, rows: int) -> float:
        return self.link.latency_s + rows * self.shape.hidden_size * self.dtype_bytes / self.link.bus_bandwidth

    def decode(self, batch: int, context: int) -> dict[str, Any]:
        layout, local = self.layout, self.local
        micro_batches = min(layout.pp, batch)
        micro_batch = -(-batch // micro_batches)
        group = -(-micro_batch // layout.sequence_groups)
        attention = decode_attention_layer_seconds(local, self.hw, group, context, self.kv_bytes_per_token_layer,
                                                   self.dtype_bytes)
        stage, exchanged, imbalance = self._stage(attention, group, micro_batch, group / layout.tp)
        head = local.vocab_size * self.shape.hidden_size
        lm_head = roofline(self.hw, 2 * group * head, head * self.dtype_bytes)
        handoffs = layout.pp * self._handoff(group) if layout.pp > 1 else 0.0
        step = max(layout.pp * stage + lm_head, micro_batches * (stage + lm_head)) + handoffs
        return {"decode_batch": batch, "decode_step_s": step, "decode_tokens_per_s": batch / step,
                "all_to_all_bytes": layout.pp * exchanged, "expert_imbalance": imbalance}

    def prefill(self, prompt_len: int, max_chunk: int, sizing: Any) -> dict[str, Any]:
        def chunk_time(tokens: int, context: int) -> float:
            attention = attention_layer_seconds(self.local, self.hw, tokens, context, self.dtype_bytes)
            return self._stage(attention, tokens, tokens, tokens / self.layout.tp)[0]

        run = pipeline_schedule(self.shape, self.hw, self.link, self.layout.pp, prompt_len, max_chunk, sizing,
                                self.dtype_bytes, chunk_time=chunk_time)
        return {"prompt_len": prompt_len, "prefill_s": run.makespan_s, "prefill_chunks": len(run.chunks),
                "bubble_fraction": run.bubble_fraction}

    def price(self, batch: int, context: int, prompt_len: int, max_chunk: int, sizing: Any) -> LayoutPrice:
        return LayoutPrice(**self.decode(batch, context), **self.prefill(prompt_len, max_chunk, sizing))
