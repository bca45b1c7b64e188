"""The sparse mixture-of-experts block: a router, its experts, and Qwen2-MoE's shared expert.

Expert compute groups the batch's tokens by expert (`grouped_experts`): the (token, k)
pairs are sorted by expert once, each expert runs one matmul pair over its contiguous
rows, and the results go back to their tokens, weighted, in one index-add. `loop_experts`
is the plain per-expert loop (as `transformers` runs it): the oracle the grouped path is
checked against. Both add a token's contributions in expert order, so in float32 they
agree with each other and with `transformers` to the bit on the same rows.

Where every expert's linears sit on a native library's panels (servelab.model.packed_linear.
use_panel_linears) and the library runs grouped experts itself (`ExpertKernels`, the
cpu-paged library's plugins/kernels/cpu_moe.cpp), the block runs them in one native call
instead (`native_experts`): the same permute, matmuls, SiLU-and-multiply and weighted reduce
over the same panels, equal to `grouped_experts` over those panels to the bit (in bfloat16
too), without the Python per expert. Quantized experts keep the grouped path.

Each block counts the (token, expert) assignments it routes (`expert_load`), the
per-layer load histogram that placement policies and the metrics read.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn import functional as F

from servelab.logging_setup import get_logger
from servelab.model.model_config import ModelConfig

logger = get_logger(__name__)


class Expert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)), gate and up fused in one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Projection(nn.Module):
    """x W^T with a plain weight: the router and the shared expert's gate. Not an
    nn.Linear, so the packed and quantized weight formats leave them in float (routing
    decides which experts run at all; llama.cpp keeps them unquantized too)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ExpertDispatcher(Protocol):
    """Runs a block's routed experts somewhere else (expert parallelism): given the
    block, the tokens and their routing, returns the weighted sum of their experts'
    outputs [T, hidden], as `grouped_experts` would."""

    def run_experts(self, block: "SparseMoeBlock", x: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ExpertKernels(Protocol):
    """A native library whose panels (servelab.model.packed_linear.PanelKernels) the experts'
    linears sit on, that also runs a block's routed experts in one call: `panel_experts`
    takes every expert's gate_up and down panels once (as `use_panels` packed them: one
    dtype, [2 x intermediate, hidden] and [hidden, intermediate] weights) and returns an
    object whose `forward(x, weights, ids)` is `grouped_experts` over those experts."""

    def panel_experts(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], hidden: int,
                      intermediate: int) -> Any: ...


def prepare_native_experts(experts: nn.ModuleList) -> Any | None:
    """The library's one-call form of `experts` (ExpertKernels.panel_experts), where every
    expert's two linears sit on the panels of one library with that capability, without
    biases; None otherwise (experts on oneDNN or torch, quantized, absent, or a library
    without it), and the block keeps the grouped path (as it does, with one warning, where
    the library refuses the panels)."""
    from servelab.model.packed_linear import PackedLinear

    kernels, gate_up, down, sizes = None, [], [], set()
    for expert in experts:
        if not isinstance(expert, Expert):
            return None  # another rank's (expert parallelism)
        first, second = expert.gate_up_proj, expert.down_proj
        if not (isinstance(first, PackedLinear) and isinstance(second, PackedLinear)
                and first.panels is not None and second.panels is not None):
            return None
        if first.bias is not None or second.bias is not None or first.dtype != second.dtype:
            return None
        kernels = first._kernels if kernels is None else kernels
        if first._kernels is not kernels or second._kernels is not kernels:
            return None
        gate_up.append(first.panels)
        down.append(second.panels)
        sizes.add((first.in_features, first.out_features, second.in_features, second.out_features, first.dtype))
    if kernels is None or len(sizes) != 1 or not isinstance(kernels, ExpertKernels):
        return None
    hidden, gate_up_width, intermediate, out_features, _ = sizes.pop()
    if gate_up_width != 2 * intermediate or out_features != hidden:
        return None
    try:
        return kernels.panel_experts(gate_up, down, hidden, intermediate)
    except RuntimeError as exc:
        logger.warning("moe.native_experts_unavailable", reason=str(exc).splitlines()[0][:200],
                       fallback="grouped_experts (same results)")
        return None


def native_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, native: Any) -> torch.Tensor:
    """`grouped_experts` in one native call over the experts `prepare_native_experts` took."""
    return native.forward(x, weights, ids)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """sum_k weights[t, k] * experts[ids[t, k]](x[t]) for every token t, the tokens grouped
    by expert: permute, one matmul pair per expert over its rows, unpermute and reduce."""
    scaled, token_of = expert_rows(x, weights, ids, experts)
    return combine_rows(x, scaled, token_of)


def expert_rows(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList,
                mine: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted expert output of every (token, k) pair, the pairs sorted by expert
    ([T * k, hidden]), and each row's token. `mine` ([T, k] bool): only those pairs are
    computed, the others' rows are zero (another rank computes them)."""
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()
    permuted = x.index_select(0, token_of)
    outputs = torch.empty_like(permuted) if mine is None else torch.zeros_like(permuted)
    computed = None if mine is None else mine.reshape(-1).index_select(0, order)
    start = 0
    for expert_id, count in enumerate(counts):
        if count and computed is None:
            outputs[start:start + count] = experts[expert_id](permuted[start:start + count])
        elif count:
            rows = computed[start:start + count].nonzero().squeeze(1) + start
            if rows.numel():  # a rank computes its replica's rows, the pairs' order kept
                outputs[rows] = experts[expert_id](permuted.index_select(0, rows))
        start += count
    scaled = (outputs * weights.reshape(-1).index_select(0, order).unsqueeze(1)).to(x.dtype)
    return scaled, token_of


def combine_rows(x: torch.Tensor, scaled: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    """Each token's rows summed back into it, in expert order."""
    return torch.zeros_like(x).index_add_(0, token_of, scaled)


def loop_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """The same sum, one expert at a time over the tokens that chose it: the oracle."""
    out = torch.zeros_like(x)
    for expert_id, expert in enumerate(experts):
        token, slot = torch.where(ids == expert_id)
        if token.numel():
            out.index_add_(0, token, (expert(x[token]) * weights[token, slot, None]).to(x.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the shared expert behind its sigmoid gate."""

    def __init__(self, config: ModelConfig, routing: Any) -> None:
        super().__init__()
        shape = config.moe
        self.shape = shape
        self.routing = routing
        self.gate = Projection(config.hidden_size, shape.num_experts)
        self.experts = nn.ModuleList(Expert(config.hidden_size, shape.expert_intermediate_size)
                                     for _ in range(shape.num_experts))
        if shape.shared_expert_intermediate_size:
            self.shared_expert = Expert(config.hidden_size, shape.shared_expert_intermediate_size)
            self.shared_expert_gate = Projection(config.hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.grouped = True  # False: the per-expert loop (the oracle; for measurements)
        self.native = True  # False: the grouped torch path even where the library could run the experts
        self._native_experts: Any = None  # the library's one-call form of the experts (use_native_experts)
        self.dispatcher: ExpertDispatcher | None = None
        self.expert_load: torch.Tensor | None = None  # int64 [num_experts], assignments routed so far

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]); counts them into `expert_load`."""
        weights, ids = self.routing.select(self.gate(x), self.shape.top_k, self.shape.norm_topk_prob)
        if not self.shape.float_weights:
            weights = weights.to(x.dtype)
        counts = torch.bincount(ids.reshape(-1), minlength=self.shape.num_experts).cpu()
        self.expert_load = counts if self.expert_load is None else self.expert_load + counts
        return weights, ids

    def use_native_experts(self) -> bool:
        """Take (or drop) the library's one-call form of the experts as they are now: the model
        calls it whenever its linears move onto a library's panels. Whether the block now has it."""
        self._native_experts = prepare_native_experts(self.experts)
        return self._native_experts is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.dispatcher is not None:
            out = self.dispatcher.run_experts(self, x, weights, ids)
        elif self.grouped and self.native and self._native_experts is not None:
            out = self._native_experts.forward(x, weights, ids)
        elif self.grouped:
            out = grouped_experts(x, weights, ids, self.experts)
        else:
            out = loop_experts(x, weights, ids, self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def sparse_blocks(model: nn.Module) -> dict[int, SparseMoeBlock]:
    """The sparse block of each sparse layer of `model`, by layer index."""
    return {int(name.split(".")[1]): module for name, module in model.named_modules()
            if isinstance(module, SparseMoeBlock)}


def expert_load(blocks: dict[int, SparseMoeBlock]) -> dict[int, list[int]]:
    """Per sparse layer, the assignments each expert has taken so far."""
    return {layer: [0] * block.shape.num_experts if block.expert_load is None else block.expert_load.tolist()
            for layer, block in blocks.items()}
