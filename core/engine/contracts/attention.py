"""The attention-backend (kernel) contract (kind `attention`, `[attention]`): the geometry
a backend is built for (`AttentionContext`), the step layout it gets (`AttentionMetadata`),
the Protocol, the layout of a quantized KV row, and the optional capabilities (tree masks,
quantized caches, the native decoder and the kernels the model may borrow). Changes by
version: docs/contract-versions.md ("attention").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from servelab.kv_sizing import (KV_CACHE_DTYPES, QUANTIZED_KV_MAX, QUANTIZED_KV_TORCH_DTYPE, kv_row_elements,
                                kv_scale_offset)

if TYPE_CHECKING:  # torch stays out of imports that plugin discovery triggers
    import torch

__all__ = [
    "KV_CACHE_DTYPES",
    "QUANTIZED_KV_MAX",
    "QUANTIZED_KV_TORCH_DTYPE",
    "kv_row_elements",
    "kv_scale_offset",
    "AttentionContext",
    "AttentionMetadata",
    "AttentionBackend",
    "ContiguousBlockTablesBackend",
    "TreeAttentionBackend",
    "QuantizedKVBackend",
    "LayerOpsBackend",
    "NativeDecoderBackend",
    "PanelKernelsBackend",
    "SamplingKernelsBackend",
    "QuantKernelsBackend",
    "QuantizedLinearLayer",
    "LoRALinearLayer",
    "LoRAServingModel",
]


@attrs.frozen
class AttentionContext:
    """Model and cache geometry an attention backend is built for."""

    num_heads: int  # under tensor parallelism: this rank's query heads
    num_kv_heads: int  # and this rank's KV heads
    head_dim: int
    block_size: int
    num_blocks: int  # blocks in each layer's cache
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    # `[engine] kv_cache_dtype`: "auto" (K/V in `dtype`) or a quantized cache ("int8",
    # "fp8_e4m3", "fp8_e5m2"; rows laid out by servelab.interfaces.kv_row_elements), which
    # only a QuantizedKVBackend that lists it in supported_kv_cache_dtypes is built for.
    kv_cache_dtype: str = "auto"


@attrs.frozen
class AttentionMetadata:
    """One step's batch layout, built once per step and shared by every layer.

    T = total scheduled tokens, B = scheduled sequences, M = max blocks per sequence.
    Tokens of sequence b are rows query_start_loc[b]:query_start_loc[b+1] of the
    flattened batch; they sit at the last query_lens[b] positions of its context.
    """

    query_start_loc: "torch.Tensor"  # [B + 1] int64, prefix sums of query_lens
    query_lens: "torch.Tensor"  # [B] int64, new tokens per sequence
    context_lens: "torch.Tensor"  # [B] int64, tokens in cache after this step's writes
    block_tables: "torch.Tensor"  # [B, M] int64, padded with 0 past each table's end
    slot_mapping: "torch.Tensor"  # [T] int64, cache slot (block * block_size + offset) per token
    max_query_len: int
    max_context_len: int
    query_lens_list: tuple[int, ...]  # the same as query_lens, on the host
    context_lens_list: tuple[int, ...]
    # Per sequence, None (causal) or the parents of its query rows (row 0: -1; row r > 0: an
    # earlier row): a token tree, attended under the tree mask by a TreeAttentionBackend.
    # None for the whole step when no sequence has one.
    tree_parents: tuple[tuple[int, ...] | None, ...] | None = None


@runtime_checkable
class AttentionBackend(Protocol):
    """Writes a step's new K/V into the paged cache and attends over it.

    The backend chooses the cache layout (the runner allocates one key and one value
    tensor per layer of `kv_cache_shape()`); allocator block ids index its block dimension.
    """

    def kv_cache_shape(self) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache holding context.num_blocks blocks."""

    def kv_cache_block_dim(self) -> int:
        """The dimension of kv_cache_shape() that allocator block ids index (block copies use it)."""

    def prepare(self, metadata: AttentionMetadata) -> Any:
        """Per-step precomputation shared by every layer (gather indices, masks)."""

    def forward(
        self,
        query: "torch.Tensor",  # [T, num_heads, head_dim]
        key: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        value: "torch.Tensor",  # [T, num_kv_heads, head_dim]
        key_cache: "torch.Tensor",  # kv_cache_shape()
        value_cache: "torch.Tensor",  # kv_cache_shape()
        prepared: Any,  # what prepare() returned for this step
        scale: float,
    ) -> "torch.Tensor":  # [T, num_heads, head_dim]
        """Store key/value at the step's slots, then attend causally for every query."""


@runtime_checkable
class ContiguousBlockTablesBackend(Protocol):
    """An attention backend that reads each sequence's K/V as one contiguous run of blocks
    (when `requires_contiguous_block_tables` is True): only a ContiguousAllocator serves it."""

    requires_contiguous_block_tables: bool


@runtime_checkable
class TreeAttentionBackend(Protocol):
    """An attention backend that attends token trees (when `supports_tree_attention` is
    True): for a sequence whose `AttentionMetadata.tree_parents` entry is set, query row r
    sees the context before the sequence's first query row and the query rows on its own
    root path only, not causally every earlier row (servelab.token_tree.ancestor_mask)."""

    supports_tree_attention: bool


@runtime_checkable
class QuantizedKVBackend(Protocol):
    """An attention backend that can store K/V quantized (`[engine] kv_cache_dtype`).

    Each (token, KV head) row of a quantized cache is `kv_row_elements(head_dim, kv_cache_dtype)`
    one-byte elements: the head_dim quantized values, zero padding to a multiple of 4, then
    the row's float32 scale (its bytes), so a row dequantizes as values * scale and every
    whole-block move (copy-on-write, another tier) carries the scales with the values. The
    runner allocates the cache in `kv_cache_storage_dtype()`.
    """

    supported_kv_cache_dtypes: frozenset[str]  # the quantized kv_cache_dtypes it reads and writes

    def kv_cache_storage_dtype(self) -> Any:
        """The torch dtype of the cache tensors: the model's for "auto", else the element's."""


@runtime_checkable
class LayerOpsBackend(Protocol):
    """An attention backend offering the model fused element-wise ops (servelab.model.llama.LayerOps),
    or None while they are not ready."""

    @property
    def layer_ops(self) -> Any: ...


@runtime_checkable
class NativeDecoderBackend(Protocol):
    """An attention backend that can run the whole decoder of a step in one native call."""

    def decoder_forward(self, model: Any, input_ids: "torch.Tensor", positions: "torch.Tensor", kv_caches: Any,
                        prepared: Any, logits_indices: "torch.Tensor") -> "torch.Tensor | None":
        """The final-normed hidden states of the wanted rows, or None to decline this step."""


@runtime_checkable
class PanelKernelsBackend(Protocol):
    """An attention backend whose library has a matmul the model's packed linears may move
    to (servelab.model.packed_linear.use_panel_linears), or None while it is not ready. A
    library that also runs grouped experts over its panels (the optional
    servelab.model.moe.ExpertKernels) runs a MoE block's routed experts in one call."""

    @property
    def panel_kernels(self) -> Any: ...


@runtime_checkable
class SamplingKernelsBackend(Protocol):
    """An attention backend whose library draws random rows' tokens straight from their
    logits (`draw_from_logits(logits, inverse_temperature, uniform)`: servelab.sampler's
    inverse transform of softmax(logits / T), one uniform number per row), or None while it
    is not ready. The sampler uses it for rows that only scale by a temperature."""

    @property
    def sampling_kernels(self) -> Any: ...


@runtime_checkable
class QuantKernelsBackend(Protocol):
    """An attention backend whose library has a matmul on quantized weight blocks that the
    model's quantized linears take (servelab.model.quantized_linear), or None while it is
    not ready."""

    @property
    def quant_kernels(self) -> Any: ...


@runtime_checkable
class QuantizedLinearLayer(Protocol):
    """A linear layer holding its weight as quantized blocks
    (servelab.model.quantized_linear.QuantizedLinear), as a native decoder reads it."""

    # uint8 [out_features, bytes a row] of GGML blocks; once handed a library that reads them
    # so (InterleavingQuantKernels), interleaved: format_id + 32, rows rounded up to 16
    blocks: "torch.Tensor"
    bias32: "torch.Tensor | None"
    format_id: int  # the block format, as the library's quant_linear takes it
    out_features: int
    kernels: Any  # the library whose kernel it was handed, or None (the torch path)


@runtime_checkable
class LoRALinearLayer(Protocol):
    """A linear layer wrapped to add LoRA updates (servelab.model.lora_layers.LoRALinear), as
    a native decoder reads it: the layer it wraps, and every pool slot's updates packed for
    the library's `lora_add_` (servelab.model.lora_layers.PackedUpdates; None where no
    adapter in the pool targets the layer)."""

    base: Any

    def packed_updates(self) -> Any: ...


@runtime_checkable
class LoRAServingModel(Protocol):
    """A model that serves LoRA adapters: `lora` is its adapters' state
    (servelab.model.lora_layers.LoRAState: `generation`, and `batch`, the step's row slots;
    None when the model serves none)."""

    lora: Any
