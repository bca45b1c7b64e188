"""LoRA updates in the forward pass, for batches that mix adapters (and the base model).

Each decoder linear layer that an adapter may target is wrapped in a `LoRALinear`: the
base layer runs over every row as it is (float, packed, or quantized blocks), then each
adapter present in the step adds its update to its own rows only. The update of one
adapter over its rows is a shrink (x [n, in] @ A^T -> [n, r]) and an expand ([n, r] @
B^T -> [n, out]); rows are gathered per adapter (Punica's SGMV: one segment per adapter,
each at its own rank, none padded to the largest), computed in float32 and added in the
base output's dtype, as peft adds its update.

The fused projections hold several Hugging Face modules side by side (qkv_proj: q, k, v;
gate_up_proj: gate, up): each module's update lands on its slice of the output columns.

Which adapter each row uses is the step's `LoRABatch`, set on the model's `LoRAState`
before the forward and read by every wrapped layer. The last decoder layer runs its
output projection and MLP on the rows whose logits are wanted only (`keep_rows`), so the
batch carries both row maps, told apart by row count.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence as Seq, runtime_checkable

import attrs
import torch
from torch import nn

from servelab.model.lora_adapter import LoRAModule

# (x [T, in], rows [n] int64, lora_a [r, in], lora_b [out, r], scale) -> [n, out] float32
ShrinkExpand = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def shrink_expand_reference(x: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """scale * (x[rows] @ lora_a^T) @ lora_b^T in float32: x [T, in], rows [n], lora_a [r, in],
    lora_b [out, r] -> [n, out]."""
    return ((x.index_select(0, rows).float() @ lora_a.t()) @ lora_b.t()) * scale


@runtime_checkable
class LoRAKernels(Protocol):
    """A native library's shrink/expand (plugins/kernels/cpu_lora.cpp), the reference's equal
    to float rounding, for float32 rows."""

    def lora_shrink_expand(self, x: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                           scale: float) -> torch.Tensor: ...


def native_shrink_expand(kernels: LoRAKernels) -> ShrinkExpand:
    """The library's shrink/expand where it applies (float32 rows on the CPU), else the reference's."""

    def shrink_expand(x: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      scale: float) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return shrink_expand_reference(x, rows, lora_a, lora_b, scale)
        return kernels.lora_shrink_expand(x.contiguous(), rows, lora_a, lora_b, scale)

    return shrink_expand


def segments_of(row_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its row indices) for each adapter slot with rows; row_slots [T] int64, -1 for
    base-model rows."""
    return [(slot, (row_slots == slot).nonzero().squeeze(1)) for slot in torch.unique(row_slots).tolist() if slot >= 0]


def lora_delta_reference(x: torch.Tensor, row_slots: torch.Tensor, slot_modules: Seq[LoRAModule | None],
                         shrink_expand: ShrinkExpand = shrink_expand_reference,
                         segments: Seq[tuple[int, torch.Tensor]] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-adapter segments of a mixed batch's update: for each slot s with a module
    and rows in the batch, (row indices [n_s], delta [n_s, out] float32). x [T, in];
    row_slots [T] int64, -1 for base-model rows; slot_modules[s] the module of slot s;
    `segments`: segments_of(row_slots), when already known."""
    deltas = []
    for slot, rows in segments if segments is not None else segments_of(row_slots):
        module = slot_modules[slot]
        if module is not None:
            deltas.append((rows, shrink_expand(x, rows, module.lora_a, module.lora_b, module.scale)))
    return deltas


@attrs.frozen
class LoRABatch:
    """Which adapter slot each row of a step uses (-1: the base model)."""

    token_slots: torch.Tensor  # [T] int64, one per input row
    kept_slots: torch.Tensor | None = None  # [S] int64, the rows whose logits are wanted (keep_rows), when fewer
    # row map -> its segments_of, computed once a step (every wrapped layer reads them)
    _segments: dict[int, list[tuple[int, torch.Tensor]]] = attrs.field(factory=dict, eq=False, repr=False)

    def segments_for(self, num_rows: int) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """The row map of a layer input of `num_rows` rows, and its per-adapter segments."""
        row_slots = self.slots_for(num_rows)
        if num_rows not in self._segments:
            self._segments[num_rows] = segments_of(row_slots)
        return row_slots, self._segments[num_rows]

    def slots_for(self, num_rows: int) -> torch.Tensor:
        if num_rows == self.token_slots.shape[0]:
            return self.token_slots
        if self.kept_slots is not None and num_rows == self.kept_slots.shape[0]:
            return self.kept_slots
        raise RuntimeError(f"a LoRA layer got {num_rows} rows in a step of {self.token_slots.shape[0]} "
                           f"(kept: {None if self.kept_slots is None else self.kept_slots.shape[0]})")


class LoRAState:
    """The adapters loaded in the fast pool (by slot) and the current step's rows; one per
    model, shared by its wrapped layers."""

    def __init__(self, num_slots: int) -> None:
        # slot -> {(layer, module name) -> LoRAModule}; None: an empty slot
        self.slots: list[dict[tuple[int, str], LoRAModule] | None] = [None] * num_slots
        self.batch: LoRABatch | None = None  # None: every row is the base model's
        self.shrink_expand: ShrinkExpand = shrink_expand_reference
        self._kernels: Any = None  # the library whose shrink/expand serves, once handed over

    def use_kernels(self, kernels: Any) -> None:
        """Run the updates on a native library's kernel (LoRAKernels), when it has one; the
        torch reference otherwise (no library, or one built without the kernel)."""
        if kernels is self._kernels:
            return
        self._kernels = kernels
        self.shrink_expand = (native_shrink_expand(kernels) if isinstance(kernels, LoRAKernels)
                              else shrink_expand_reference)

    def modules_of(self, layer: int, module: str) -> list[LoRAModule | None]:
        return [None if slot is None else slot.get((layer, module)) for slot in self.slots]


class LoRALinear(nn.Module):
    """A base linear layer plus the LoRA updates of the adapters in the step."""

    def __init__(self, base: nn.Module, layer: int, parts: Seq[tuple[str, int, int]], state: LoRAState) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.parts = tuple(parts)  # (Hugging Face module name, first output column, end column)
        self.state = state
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        row_slots, segments = batch.segments_for(x.shape[0])
        for module, start, end in self.parts:
            modules = self.state.modules_of(self.layer, module)
            if not any(modules):
                continue
            for rows, delta in lora_delta_reference(x, row_slots, modules, self.state.shrink_expand, segments):
                y[:, start:end].index_add_(0, rows, delta.to(y.dtype))
        return y

    def extra_repr(self) -> str:
        return f"layer={self.layer}, parts={[name for name, _, _ in self.parts]}"


def install_lora(model: nn.Module, num_slots: int) -> LoRAState:
    """Wrap every target linear layer of a loaded model (after packing or quantizing it) in
    a LoRALinear sharing one LoRAState of `num_slots` slots; the model's `lora` is that state.

    The MLP then runs on all its rows at once (its row chunks would not be told apart from
    the step's row maps); the model's native decoder, which runs no Python layer, is skipped
    by a model with LoRA (servelab.model.llama)."""
    state = LoRAState(num_slots)
    config = model.config
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    for index, layer in enumerate(model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = LoRALinear(attention.qkv_proj, index, [("q_proj", 0, q), ("k_proj", q, q + kv),
                                                                     ("v_proj", q + kv, q + 2 * kv)], state)
        attention.o_proj = LoRALinear(attention.o_proj, index, [("o_proj", 0, config.hidden_size)], state)
        mlp.gate_up_proj = LoRALinear(mlp.gate_up_proj, index, [("gate_proj", 0, inter),
                                                                ("up_proj", inter, 2 * inter)], state)
        mlp.down_proj = LoRALinear(mlp.down_proj, index, [("down_proj", 0, config.hidden_size)], state)
        mlp.rows_at_once = 1 << 62
    model.lora = state
    return state
