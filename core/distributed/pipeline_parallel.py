"""Pipeline parallelism: the decoder's layers split into consecutive stages, one per rank.

Rank 0 holds the first stage (and the token embedding and the LM head, so it samples);
each later rank holds its stage's layers and KV cache only. A step runs down the
pipeline: rank 0 embeds and runs its layers and sends the hidden states on (point to
point, over the tensor-parallel launch's process group), each rank runs its layers and
passes them on, and the last normalises the rows whose logits are wanted and sends them
back to rank 0. Greedy output equals one process's.

One batch is in the pipeline at a time: while one stage computes the others wait, so
each stage idles (PP - 1) / PP of a step, the bubble `PipelineStats` measures on rank 0.
Several micro-batches in flight (the scheduler's batch queue of depth PP and long
prompts cut into pipelined chunks) are what docs/parallelism.md prices in the simulator
and lists as not built yet.
"""

from __future__ import annotations

import time
import types
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from servelab.distributed.comm import Communicator


class AbsentLayer(nn.Module):
    """A decoder layer another stage holds: no weights here."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("a decoder layer of another pipeline stage was asked to compute")


def stage_layers(num_layers: int, rank: int, size: int) -> range:
    """The layers of stage `rank`: consecutive, the first stages one more where the count does not divide."""
    if size > num_layers:
        raise ValueError(f"pipeline parallelism over {size} stages needs at least as many decoder layers "
                         f"(the model has {num_layers})")
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def prune_layers(model: nn.Module, layers: range) -> None:
    """Before the weights load: the layers of other stages become AbsentLayers."""
    for index in range(len(model.layers)):
        if index not in layers:
            model.layers[index] = AbsentLayer()


@attrs.define
class PipelineStats:
    """Rank 0's time computing its stage and waiting for the rest of the pipeline (its bubble)."""

    steps: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0

    @property
    def bubble_fraction(self) -> float | None:
        total = self.compute_s + self.wait_s
        return self.wait_s / total if total else None


def make_stage(model: nn.Module, comm: Communicator, layers: range) -> PipelineStats:
    """Turn a loaded model (its other stages' layers pruned) into stage `comm.rank`: its
    forward runs this stage and talks to its neighbours; rank 0's returns the logits."""
    stats = PipelineStats()
    model.forward = types.MethodType(_stage_forward, model)
    model.pipeline = (comm, layers, stats)
    return stats


def _wire(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype != torch.float32 else dtype  # what gloo sends of every float


@torch.inference_mode()
def _stage_forward(self: Any, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, backend: Any,
                   prepared: Any, logits_indices: torch.Tensor,
                   features: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    comm, layers, stats = self.pipeline
    rank, size, group = comm.rank, comm.size, comm.device_group
    dtype = self.embed_tokens.weight.dtype
    num_tokens, hidden_size = input_ids.shape[0], self.config.hidden_size
    started = time.perf_counter()
    waited = 0.0
    if rank == 0:
        hidden = self.embed_tokens(input_ids)
    else:
        received = torch.empty(num_tokens, hidden_size, dtype=_wire(dtype))
        dist.recv(received, src=rank - 1, group=group)
        hidden = received.to(dtype)
    cos, sin = self.rotary.tables(positions)
    for index in layers:
        hidden = self.layers[index](hidden, cos, sin, kv_caches[index], backend, prepared)
    if rank < size - 1:
        dist.send(hidden.to(_wire(dtype)).contiguous(), dst=rank + 1, group=group)
    else:
        dist.send(self.norm(hidden[logits_indices]).to(_wire(dtype)).contiguous(), dst=0, group=group)
    if rank != 0:
        return hidden[:0], hidden[:0]
    selected = torch.empty(logits_indices.shape[0], hidden_size, dtype=_wire(dtype))
    before = time.perf_counter()
    dist.recv(selected, src=size - 1, group=group)
    waited = time.perf_counter() - before
    selected = selected.to(dtype)
    stats.steps += 1
    stats.wait_s += waited
    stats.compute_s += time.perf_counter() - started - waited
    return self.lm_head(selected).float(), selected
