"""What the engine needs of a model runner (not a policy kind: the model source builds
it, or a `servelab_build_runner` hook): the `Runner` Protocol, the inputs record it
prepares, the rows that sample, and the optional capabilities (a host KV tier, slot
moves for token trees, features and the output head for drafters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence as Seq, runtime_checkable

import attrs

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.scheduler import KVMove, StepPlan

if TYPE_CHECKING:  # torch stays out of imports that plugin discovery triggers
    import torch

__all__ = [
    "LoRARunner",
    "SimulatedLoRARunner",
    "KVMove",
    "sampling_rows",
    "StepInputs",
    "Runner",
    "TieredRunner",
    "TierStats",
    "SlotMovingRunner",
    "FeatureRunner",
    "LMHeadRunner",
    "BatchQueueRunner",
]


def sampling_rows(plan: StepPlan) -> tuple[list[int], list[int]]:
    """Which rows of `plan.scheduled` sample this step, and how many logits rows each
    needs: a sequence samples once its scheduled tokens reach its last verified token,
    with one row for that token and one per draft scheduled after it."""
    past_end = [seq.num_computed_tokens + num_new - len(seq.prompt_token_ids) - len(seq.output_token_ids)
                for seq, num_new in plan.scheduled]
    rows = [row for row, past in enumerate(past_end) if past >= 0]
    return rows, [past_end[row] + 1 for row in rows]


@runtime_checkable
class StepInputs(Protocol):
    """What the engine reads of the inputs a runner prepared for a step."""

    sampled_seq_rows: list[int]  # sampling_rows(plan)[0]
    num_logits_rows: list[int]  # sampling_rows(plan)[1]
    # (plan row, first prompt position, count) of the prompt positions whose logits follow
    # the sampling rows (prompt logprobs); () when none were asked for.
    prompt_logits: tuple[tuple[int, int, int], ...]


@runtime_checkable
class Runner(Protocol):
    """What the engine needs of a model runner: the single-process one, the tensor-parallel
    one and the simulator's all state it."""

    device: Any  # torch.device of the logits
    supports_prompt_logprobs: bool  # prepare(..., prompt_logprobs=True) adds prompt positions' rows

    @property
    def vocab_size(self) -> int: ...

    def prepare(self, plan: StepPlan, allocator: KVAllocator, prompt_logprobs: bool = False) -> StepInputs:
        """The step's inputs, slots taken from `allocator`'s block tables."""

    def execute(self, inputs: Any) -> "torch.Tensor":
        """float32 logits [sum(inputs.num_logits_rows) (+ prompt rows), vocab]."""

    def execute_with_hidden(self, inputs: Any) -> "tuple[torch.Tensor, torch.Tensor]":
        """The logits and the final-normed hidden states [rows, hidden] they came from."""

    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination), in order (copy-on-write)."""

    # A runner that can hold a host tier also states TieredRunner (attach_host_tier, move_blocks).

    def close(self) -> None:
        """Release what outlives the step loop (other ranks); idempotent."""


@runtime_checkable
class TieredRunner(Protocol):
    """A runner that holds a host KV tier beside its device cache and performs `KVMove`s."""

    def attach_host_tier(self, num_host_blocks: int, path: str | None) -> None:
        """Allocate the host tier's K/V (`num_host_blocks` blocks; memory-mapped from the
        file `path` when given)."""

    def move_blocks(self, moves: Seq["KVMove"]) -> None:
        """Perform `moves`, in order."""


@attrs.frozen
class TierStats:
    """The KV tiers' occupancy and traffic (StepReport.tier_stats, /metrics, the bench).

    Host blocks: num_host_free + num_host_cached + num_host_swapped == num_host_blocks."""

    num_host_blocks: int
    num_host_free: int
    num_host_cached: int  # prefix blocks a device prefix cache evicted, kept for reuse
    num_host_swapped: int  # blocks of sequences preempted by swap
    block_bytes: int  # bytes of one block (K and V, every layer)
    num_offloads: int = 0  # device -> host block moves, in total
    num_loads: int = 0  # host -> device block moves, in total
    num_swap_outs: int = 0  # sequences swapped out, in total
    num_swap_ins: int = 0
    host_hit_blocks: int = 0  # prefix blocks found in the host tier and brought back
    num_host_evictions: int = 0  # host blocks dropped to make room
    moves_last_step: int = 0  # block moves in the last step's plan
    bytes_last_step: int = 0

    @property
    def num_host_used(self) -> int:
        return self.num_host_cached + self.num_host_swapped

    @property
    def bytes_moved(self) -> int:
        return (self.num_offloads + self.num_loads) * self.block_bytes


@runtime_checkable
class SlotMovingRunner(Protocol):
    """A runner that copies single KV slots (token positions) in every layer's K and V:
    the engine moves the accepted root path of a verified token tree into place."""

    def move_slots(self, moves: Seq[tuple[int, int]]) -> None:
        """Copy slot `source` to slot `destination` (block * block_size + offset) for each
        (source, destination), every source read before any destination is written."""


@runtime_checkable
class FeatureRunner(Protocol):
    """A runner that returns the residual stream of chosen decoder layers at every row."""

    def execute_with_features(self, inputs: Any, layers: tuple[int, ...]) -> "tuple[torch.Tensor, torch.Tensor]":
        """Logits as `execute`, and features [T, len(layers) * hidden] in input-row order."""

    def embed(self, token_ids: "torch.Tensor") -> "torch.Tensor":
        """The target's input embeddings of token_ids [N]: [N, hidden], in its dtype."""


@runtime_checkable
class LMHeadRunner(Protocol):
    """A runner whose model has an output head drafters may use (servelab.interfaces.TargetModel)."""

    def lm_head(self, hidden: "torch.Tensor") -> "torch.Tensor":
        """float32 logits of final-normed hidden states."""


@runtime_checkable
class BatchQueueRunner(Protocol):
    """A runner that keeps several batches in flight (pipeline parallelism): `submit`
    starts a batch and returns at once, `complete` returns the oldest one's logits and
    hidden rows; batches complete in submission order, at most `max_batches_in_flight`
    outstanding. The engine submits only plans of sequences in no other outstanding batch
    (servelab.contracts.scheduler.InFlightScheduler)."""

    @property
    def max_batches_in_flight(self) -> int: ...

    def submit(self, inputs: Any) -> Any:
        """Start the batch of `inputs` (as `execute` would run it); a ticket for `complete`."""

    def complete(self, ticket: Any) -> "tuple[torch.Tensor, torch.Tensor]":
        """The oldest outstanding batch's float32 logits and final-normed hidden rows."""


@runtime_checkable
class LoRARunner(Protocol):
    """A runner that serves LoRA adapters (`[engine] enable_lora`): its `model`'s target
    layers are wrapped (servelab.model.lora_layers.install_lora) and `lora` is set to the
    engine's adapter manager (servelab.lora_manager.LoRAManager; None until then)."""

    model: Any
    lora: Any


@runtime_checkable
class SimulatedLoRARunner(Protocol):
    """A runner that prices LoRA adapters instead of running them (the simulator): no
    model; the adapter manager keeps its pool as it would, over adapters `load_adapter`
    reads as shapes."""

    model_config: Any
    lora: Any

    def load_adapter(self, name: str, path: str, config: Any, max_rank: int) -> Any:
        """The adapter at `path` (servelab.model.lora_adapter.LoRAAdapter), as the manager's loader."""
