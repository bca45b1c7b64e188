"""LoRA updates in the forward pass, for batches that mix adapters (and the base model).

Each decoder linear layer that an adapter may target is wrapped in a `LoRALinear`: the
base layer runs over every row as it is (float, packed, or quantized blocks), then each
adapter present in the step adds its update to its own rows only. The update of one
adapter over its rows is a shrink (x [n, in] @ A^T -> [n, r]) and an expand ([n, r] @
B^T -> [n, out]); rows are gathered per adapter (Punica's SGMV: one segment per adapter,
each at its own rank, none padded to the largest), computed in float32 and added in the
base output's dtype, as peft adds its update. The native library does a whole layer (every
adapter, every part) in one call over the slots' updates packed in place, each slot in a
region of its own (`PackedUpdates`: loading an adapter rewrites its slot alone); the torch
reference below is its oracle and the fallback.

The fused projections hold several Hugging Face modules side by side (qkv_proj: q, k, v;
gate_up_proj: gate, up): each module's update lands on its slice of the output columns.

Which adapter each row uses is the step's `LoRABatch`, set on the model's `LoRAState`
before the forward and read by every wrapped layer. The last decoder layer runs its
output projection and MLP on the rows whose logits are wanted only (`keep_rows`), so the
batch carries both row maps, told apart by row count.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence as Seq, runtime_checkable

import attrs
import torch
from torch import nn

from servelab.model.lora_adapter import LoRAModule

def shrink_expand_reference(x: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """scale * (x[rows] @ lora_a^T) @ lora_b^T in float32: x [T, in], rows [n], lora_a [r, in],
    lora_b [out, r] -> [n, out]."""
    return ((x.index_select(0, rows).float() @ lora_a.t()) @ lora_b.t()) * scale


@runtime_checkable
class LoRAKernels(Protocol):
    """A native library's in-place update of a whole layer (plugins/kernels/cpu_lora.cpp):
    every row's adapter, every part, in one call; the reference's equal to float rounding,
    for float32 and bfloat16 layers on the CPU."""

    def lora_add_(self, y: torch.Tensor, x: torch.Tensor, row_slots: torch.Tensor, a_t: torch.Tensor,
                  bt: torch.Tensor, table: torch.Tensor, scales: torch.Tensor) -> None: ...


LANES = 16  # the kernel's vector width in floats: a slot's A columns are padded to a multiple of it


@attrs.frozen
class PackedUpdates:
    """Every slot's updates of one wrapped layer, laid out for LoRAKernels.lora_add_. Each
    slot owns a fixed region sized for `max_rank`, so loading an adapter into a slot
    rewrites that slot's region alone, in place; ranks are the adapters' own (the table),
    so nothing is padded in the arithmetic but a slot's last vector of A columns."""

    # [slots, width / LANES, in, LANES] float32: each slot's lora_a transposed, part after
    # part, then zeros, in tiles of LANES columns stored one after another
    a_t: torch.Tensor
    bt: torch.Tensor  # [slots * max_rank * out] float32: lora_b transposed, [rank, columns], part p of slot s
    #                   from (s * out + start_p) * max_rank
    table: torch.Tensor  # [slots, parts, 5] int64: first column of a_t, rank (0: none), offset in bt, columns
    scales: torch.Tensor  # [slots, parts] float32

    @classmethod
    def empty(cls, num_slots: int, columns: Seq[tuple[int, int]], in_features: int, out_features: int,
              max_rank: int) -> "PackedUpdates":
        width = -(-len(columns) * max_rank // LANES) * LANES
        # torch.empty: a slot's region becomes resident memory once an adapter first fills the slot
        return cls(a_t=torch.empty(num_slots, width // LANES, in_features, LANES),
                   bt=torch.empty(num_slots * max_rank * out_features),
                   table=torch.zeros(num_slots, len(columns), 5, dtype=torch.int64),
                   scales=torch.zeros(num_slots, len(columns)))

    def fill(self, slot: int, modules: Seq[LoRAModule | None], columns: Seq[tuple[int, int]], max_rank: int) -> None:
        """Slot `slot`'s updates (modules[p] for part p; None: none)."""
        out_features = self.bt.shape[0] // (self.table.shape[0] * max_rank)
        used, a_rows = 0, []
        for part, (module, (start, end)) in enumerate(zip(modules, columns)):
            if module is None:
                self.table[slot, part] = 0
                self.scales[slot, part] = 0.0
                continue
            rank, bt_offset = module.rank, (slot * out_features + start) * max_rank
            a_rows.append(module.lora_a)
            self.bt[bt_offset:bt_offset + rank * (end - start)].view(rank, end - start).copy_(module.lora_b.t())
            self.table[slot, part] = torch.tensor([used, rank, bt_offset, start, end])
            self.scales[slot, part] = module.scale
            used += rank
        if a_rows:
            tiles = -(-used // LANES)
            a = torch.zeros(tiles * LANES, self.a_t.shape[2])  # the kernel reads whole tiles: zeros past `used`
            torch.cat(a_rows, out=a[:used])
            self.a_t[slot, :tiles].copy_(a.view(tiles, LANES, -1).transpose(1, 2))

    @property
    def any(self) -> bool:
        return bool(self.table[:, :, 1].any())


def segments_of(row_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its row indices) for each adapter slot with rows; row_slots [T] int64, -1 for
    base-model rows."""
    return [(slot, (row_slots == slot).nonzero().squeeze(1)) for slot in torch.unique(row_slots).tolist() if slot >= 0]


def lora_delta_reference(x: torch.Tensor, row_slots: torch.Tensor, slot_modules: Seq[LoRAModule | None],
                         segments: Seq[tuple[int, torch.Tensor]] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The per-adapter segments of a mixed batch's update: for each slot s with a module
    and rows in the batch, (row indices [n_s], delta [n_s, out] float32). x [T, in];
    row_slots [T] int64, -1 for base-model rows; slot_modules[s] the module of slot s;
    `segments`: segments_of(row_slots), when already known."""
    deltas = []
    for slot, rows in segments if segments is not None else segments_of(row_slots):
        module = slot_modules[slot]
        if module is not None:
            deltas.append((rows, shrink_expand_reference(x, rows, module.lora_a, module.lora_b, module.scale)))
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

    def __init__(self, num_slots: int, max_rank: int = 64) -> None:
        # slot -> {(layer, module name) -> LoRAModule}; None: an empty slot
        self._slots: list[dict[tuple[int, str], LoRAModule] | None] = [None] * num_slots
        self.max_rank = max_rank  # the largest rank a slot holds (`[engine] max_lora_rank`): its region's size
        self.generation = 0  # moves on with every change of a slot (the layers' packed updates follow it)
        self.slot_generations = [0] * num_slots  # the generation at which each slot last changed
        self.batch: LoRABatch | None = None  # None: every row is the base model's
        self.kernels: LoRAKernels | None = None  # the library that adds the updates; None: the torch reference

    @property
    def slots(self) -> tuple[dict[tuple[int, str], LoRAModule] | None, ...]:
        return tuple(self._slots)

    def set_slot(self, slot: int, modules: dict[tuple[int, str], LoRAModule] | None) -> None:
        """Load an adapter's modules into `slot` (None: empty it)."""
        self._slots[slot] = modules
        self.generation += 1
        self.slot_generations[slot] = self.generation

    def use_kernels(self, kernels: Any) -> None:
        """Add the updates with a native library's kernel (LoRAKernels), when it has one; the
        torch reference otherwise (no library, or one built without the kernel)."""
        self.kernels = kernels if isinstance(kernels, LoRAKernels) else None

    def modules_of(self, layer: int, module: str) -> list[LoRAModule | None]:
        return [None if slot is None else slot.get((layer, module)) for slot in self._slots]


class LoRALinear(nn.Module):
    """A base linear layer plus the LoRA updates of the adapters in the step."""

    def __init__(self, base: nn.Module, layer: int, parts: Seq[tuple[str, int, int]], state: LoRAState) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.parts = tuple(parts)  # (Hugging Face module name, first output column, end column)
        self.state = state
        self.in_features, self.out_features = base.in_features, base.out_features
        self._packed: PackedUpdates | None = None  # allocated when an adapter first targets this layer
        self._packed_generation = -1
        self._has_updates = False  # some slot's adapter targets this layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        kernels = self.state.kernels
        if (kernels is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and y.dtype == x.dtype and y.is_contiguous()):
            packed = self.packed_updates()
            if packed is not None:
                kernels.lora_add_(y, x.contiguous(), batch.slots_for(x.shape[0]), packed.a_t, packed.bt, packed.table,
                                  packed.scales)
            return y
        row_slots, segments = batch.segments_for(x.shape[0])
        for module, start, end in self.parts:
            modules = self.state.modules_of(self.layer, module)
            if not any(modules):
                continue
            for rows, delta in lora_delta_reference(x, row_slots, modules, segments):
                y[:, start:end].index_add_(0, rows, delta.to(y.dtype))
        return y

    def packed_updates(self) -> PackedUpdates | None:
        """This layer's updates in every slot, the slots that changed since the last call
        rewritten in place; None where no slot's adapter targets this layer."""
        state = self.state
        if self._packed_generation == state.generation:
            return self._packed if self._has_updates else None
        columns = [(start, end) for _, start, end in self.parts]
        changed = [slot for slot, generation in enumerate(state.slot_generations) if generation > self._packed_generation]
        with torch.inference_mode():  # the buffers are made and rewritten in one mode, whoever asks
            for slot in changed:
                modules = [None if state.slots[slot] is None else state.slots[slot].get((self.layer, name))
                           for name, _, _ in self.parts]
                if self._packed is None:
                    if not any(modules):
                        continue
                    self._packed = PackedUpdates.empty(len(state.slots), columns, self.in_features, self.out_features,
                                                       state.max_rank)
                self._packed.fill(slot, modules, columns, state.max_rank)
        self._packed_generation = state.generation
        self._has_updates = self._packed is not None and self._packed.any
        return self._packed if self._has_updates else None

    def extra_repr(self) -> str:
        return f"layer={self.layer}, parts={[name for name, _, _ in self.parts]}"


def install_lora(model: nn.Module, num_slots: int, max_rank: int = 64) -> LoRAState:
    """Wrap every target linear layer of a loaded model (after packing or quantizing it) in
    a LoRALinear sharing one LoRAState of `num_slots` slots; the model's `lora` is that state.

    The MLP then runs on all its rows at once (its row chunks would not be told apart from
    the step's row maps). The model's native decoder unwraps the layers and adds the same
    packed updates itself (servelab.plugins.kernels.cpu_decoder)."""
    state = LoRAState(num_slots, max_rank)
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
