"""The roofline: a step costs the larger of its compute time and its memory time, plus a
fixed overhead. Compute counts the GEMMs for every scheduled token, attention over each
sequence's context and the LM head for sampled rows; memory counts the weights once per
step and the KV bytes each sequence reads and writes."""

from __future__ import annotations

import attrs

from servelab.bench.sim.hardware import Accelerator
from servelab.bench.sim.shapes import num_parameters
from servelab.model.model_config import ModelConfig


@attrs.frozen
class StepCost:
    flops: float
    bytes: float
    seconds: float


class CostModel:
    def __init__(self, shape: ModelConfig, hardware: Accelerator, dtype_bytes: int = 2) -> None:
        self.hardware = hardware
        self.dtype_bytes = dtype_bytes
        self.layer_params, self.head_params = num_parameters(shape)
        self.weight_bytes = (self.layer_params + self.head_params) * dtype_bytes  # embedding rows are negligible
        self.kv_bytes_per_token = shape.kv_bytes_per_token(dtype_bytes)
        self.attention_width = shape.num_layers * shape.num_heads * shape.head_dim  # q.k and p.v per layer

    def step(self, query_lens: list[int], context_lens: list[int], num_sampled: int) -> StepCost:
        num_tokens = sum(query_lens)
        if num_tokens == len(query_lens):  # decodes only: every query token attends to its whole context
            attended = float(sum(context_lens))
        else:
            # Each query token attends to the context up to itself: q_len * (ctx - (q_len - 1) / 2) keys.
            attended = sum(q * (c - (q - 1) / 2) for q, c in zip(query_lens, context_lens))
        flops = 2 * self.layer_params * num_tokens + 2 * self.head_params * num_sampled
        flops += 4 * self.attention_width * attended
        kv_bytes = self.kv_bytes_per_token * (sum(context_lens) + num_tokens)
        memory = self.weight_bytes + kv_bytes
        hw = self.hardware
        seconds = max(flops / (hw.peak_flops * hw.compute_efficiency),
                      memory / (hw.memory_bandwidth * hw.bandwidth_efficiency)) + hw.step_overhead_s
        return StepCost(flops, memory, seconds)

    def kv_blocks(self, block_size: int, memory_fraction: float = 0.9) -> int:
        """Blocks that fit in the accelerator's memory after the weights."""
        free = self.hardware.memory_bytes * memory_fraction - self.weight_bytes
        return max(0, int(free // (self.kv_bytes_per_token * block_size)))
