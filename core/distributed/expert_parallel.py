"""Expert parallelism: a mixture-of-experts model's experts spread over ranks.

Every rank holds the whole model but the experts (attention, norms, routers, shared
experts and the LM head are replicated and run on every rank, in lockstep, as the ranks
of tensor parallelism do, over the same launch: servelab.distributed.launch), and of the
experts only those its placement gives it (`[engine] expert_placement`, a policy of
servelab.expert_placement; one placement per sparse layer).

At each sparse layer (`ExpertParallelDispatcher.run_experts`):

1. dispatch: rank 0's tokens and their routing (weights, expert ids) are broadcast, so
   every rank computes on exactly rank 0's rows;
2. each rank computes the (token, expert) pairs whose expert it holds (an expert with
   replicas: its replicas take the tokens in turn), grouped by expert as one process does,
   the other pairs' rows left zero;
3. combine: the rows are summed over the ranks (all-reduce; each row is one rank's or
   zero, so the sum is exact) and reduced into their tokens in expert order, as one
   process does. Greedy output equals one process's, to the bit while each expert sits
   wholly on one rank.

The broadcast and all-reduce stand in for the all-to-all of a GPU deployment (which moves
only each rank's tokens); docs/parallelism.md prices both.

`rebalance` re-places the experts from the load rank 0 measured (the `balanced`
placement's redundant replicas of hot experts): each rank loads the experts it gains
from the checkpoint and drops those it loses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from servelab.contracts.moe import ExpertPlacement
from servelab.distributed.comm import Communicator
from servelab.model.moe import Expert, SparseMoeBlock, combine_rows, expert_rows, sparse_blocks
from servelab.model.moe_weights import moe_source
from servelab.model.packed_linear import can_prepack, prepack_linears
from servelab.model.quantized_linear import quantize_linears


class AbsentExpert(nn.Module):
    """An expert another rank holds: no weights here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an expert this rank does not hold was asked to compute")


class ExpertParallelDispatcher:
    """One sparse block's dispatch and combine over the ranks."""

    def __init__(self, comm: Communicator, placement: ExpertPlacement) -> None:
        self.comm = comm
        self.placement = placement
        num_experts, ranks = placement.num_experts, placement.ep_size
        self.replica_counts = torch.tensor([len(placement.replicas(e)) for e in range(num_experts)])
        self.replica_ranks = torch.tensor([[placement.replicas(e)[j % len(placement.replicas(e))]
                                            for j in range(ranks)] for e in range(num_experts)])

    def owners(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank computing each (token, k) pair: the expert's replicas in turn by token."""
        tokens = torch.arange(ids.shape[0]).unsqueeze(1)
        return self.replica_ranks[ids, tokens % self.replica_counts[ids]]

    def run_experts(self, block: SparseMoeBlock, x: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
        group = self.comm.device_group
        wire = torch.float32 if x.dtype != torch.float32 else x.dtype  # gloo's widest-supported float
        sent = x.to(wire).contiguous()
        sent_weights = weights.to(torch.float32).contiguous()
        sent_ids = ids.contiguous()
        for tensor in (sent, sent_weights, sent_ids):
            dist.broadcast(tensor, src=0, group=group)
        x = sent.to(x.dtype)
        weights = sent_weights.to(weights.dtype)
        scaled, token_of = expert_rows(x, weights, sent_ids, block.experts, self.owners(sent_ids) == self.comm.rank)
        summed = scaled.to(wire)
        dist.all_reduce(summed, group=group)
        return combine_rows(x, summed.to(x.dtype), token_of)


def prune_experts(model: nn.Module, placements: Mapping[int, ExpertPlacement], rank: int) -> None:
    """Before the weights load: the experts this rank does not hold become AbsentExperts."""
    for layer, block in sparse_blocks(model).items():
        held = set(placements[layer].ranks[rank])
        for expert in range(len(block.experts)):
            if expert not in held:
                block.experts[expert] = AbsentExpert()


def attach_dispatchers(model: nn.Module, comm: Communicator, placements: Mapping[int, ExpertPlacement]) -> None:
    for layer, block in sparse_blocks(model).items():
        block.dispatcher = ExpertParallelDispatcher(comm, placements[layer])


def initial_placements(model_config: Any, policy: Any, ranks: int) -> dict[int, ExpertPlacement]:
    """Before any load is measured: the policy's placement of every sparse layer."""
    shape = model_config.moe
    return {layer: policy.place(shape.num_experts, ranks, None) for layer in shape.sparse_layers}


def rebalanced_placements(load: Mapping[int, list[int]], policy: Any, ranks: int) -> dict[int, ExpertPlacement]:
    """Each sparse layer placed by its own measured load."""
    return {layer: policy.place(len(counts), ranks, [float(c) for c in counts]) for layer, counts in load.items()}


def apply_placements(model: nn.Module, comm: Communicator, placements: Mapping[int, ExpertPlacement],
                     tensors: Mapping[str, torch.Tensor], weights: str, prepack: bool) -> int:
    """Make this rank hold what `placements` gives it: experts it gains are loaded from
    `tensors` (the checkpoint), experts it loses are dropped; returns how many it loaded."""
    loaded = 0
    for layer, block in sparse_blocks(model).items():
        placement = placements[layer]
        held = set(placement.ranks[comm.rank])
        dtype = block.gate.weight.dtype
        for expert_id in range(len(block.experts)):
            present = not isinstance(block.experts[expert_id], AbsentExpert)
            if expert_id in held and not present:
                block.experts[expert_id] = _load_expert(block, layer, expert_id, tensors, dtype, weights, prepack)
                loaded += 1
            elif expert_id not in held and present:
                block.experts[expert_id] = AbsentExpert()
        block.dispatcher = ExpertParallelDispatcher(comm, placement)
    if loaded:  # the new experts' linears take the backend's kernels at the next step
        model._panel_kernels = model._quant_kernels = None
    return loaded


def _load_expert(block: SparseMoeBlock, layer: int, expert_id: int, tensors: Mapping[str, torch.Tensor],
                 dtype: torch.dtype, weights: str, prepack: bool) -> nn.Module:
    shape = block.shape
    expert = Expert(block.gate.weight.shape[1], shape.expert_intermediate_size).to(dtype)
    with torch.no_grad():
        for projection in ("gate_up_proj", "down_proj"):
            name = f"layers.{layer}.mlp.experts.{expert_id}.{projection}.weight"
            getattr(expert, projection).weight.copy_(moe_source(name, tensors, shape))
    if weights != "dequantize":
        quantize_linears(expert, weights)
    elif prepack and can_prepack(torch.device("cpu"), dtype):
        prepack_linears(expert)
    return expert
