"""The model runner: owns the KV cache tensors, turns a StepPlan into input tensors
(token ids, positions, slot mapping, block tables) and runs the model."""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Sequence as Seq

import attrs
import numpy as np
import torch

from servelab.interfaces import (AttentionMetadata, KVAllocator, KVMove, QuantizedKVBackend, QuantKernelsBackend,
                                 Runner, SlotMovingRunner, StepPlan, TieredRunner, sampling_rows)
from servelab.model.llama import LlamaForCausalLM
from servelab.model.moe import expert_load, sparse_blocks
from servelab.model.lora_layers import LoRABatch
from servelab.model.memory import zeros_on_huge_pages
from servelab.tier_copy import CpuTierCopier, CudaTierCopier, copy_indexed, perform_moves, tier_copier
from servelab.tier_file import reserve_tier_file
from servelab.token_tree import query_parents, row_depths


@attrs.frozen
class ModelInputs:
    """One step's tensors, built once and shared by every layer."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    # Rows of the batch whose next-token logits are wanted: for each sequence that gets new
    # tokens, its last verified token and every draft token after it, in batch order.
    logits_indices: torch.Tensor  # [R]
    sampled_seq_rows: list[int]  # [S] index into plan.scheduled of each sequence that gets tokens
    num_logits_rows: list[int]  # [S] logits rows of each: 1 + the drafts scheduled with it
    # SamplingParams.prompt_logprobs: (plan row, first position, count) of prompt positions
    # whose logits follow the sampling rows, in this order (prepare(..., prompt_logprobs=True)).
    prompt_logits: tuple[tuple[int, int, int], ...] = ()
    # Which LoRA adapter slot each row runs with; None: every row runs the base model alone.
    lora: LoRABatch | None = None


def new_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's zeroed K or V cache; on the CPU on huge pages where the OS grants them."""
    if device.type == "cpu":
        return zeros_on_huge_pages(tuple(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner(Runner, TieredRunner, SlotMovingRunner):
    supports_prompt_logprobs = True  # prepare(..., prompt_logprobs=True) adds prompt positions' logits rows

    def __init__(self, model: LlamaForCausalLM, backend: Any, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        config = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        shape = backend.kv_cache_shape()
        self.block_dim = backend.kv_cache_block_dim()  # the dimension block ids index
        # A quantized cache (`[engine] kv_cache_dtype`) is allocated in its element's dtype.
        cache_dtype = backend.kv_cache_storage_dtype() if isinstance(backend, QuantizedKVBackend) else dtype
        self.kv_cache_dtype = cache_dtype
        # The runner owns the cache; allocators only hand out block ids into it.
        self.kv_caches = [(new_kv_cache(shape, cache_dtype, device), new_kv_cache(shape, cache_dtype, device))
                          for _ in range(config.num_layers)]
        self._kv_shape, self._kv_dtype = shape, cache_dtype
        # The host tier ([kv_offload]) and its copies, chosen by the device (servelab.tier_copy).
        self.tier: CpuTierCopier | CudaTierCopier | None = None
        self._sparse_blocks = sparse_blocks(model)  # a mixture-of-experts model's, for its load
        # The LoRA adapters (servelab.lora_manager.LoRAManager) when `[engine] enable_lora`.
        self.lora: Any = None

    def expert_load(self) -> dict[int, list[int]]:
        """Per sparse layer of a mixture-of-experts model, each expert's assignments so far."""
        return expert_load(self._sparse_blocks)

    def attach_host_tier(self, num_host_blocks: int, path: str | None) -> None:
        """The host tier's K and V per layer, `num_host_blocks` blocks of host memory
        (memory-mapped from `path` when given): the device cache's layout on the CPU,
        block-major and pinned for asynchronous copies on CUDA."""
        self.tier = tier_copier(self.kv_caches, self.block_dim, num_host_blocks, path, self.device, host_kv_caches)

    @property
    def host_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.tier.host_caches if self.tier is not None else []

    def move_blocks(self, moves: Seq[KVMove]) -> None:
        """Perform the step's moves between tiers (and the copies among them), in order,
        in every layer's K and V; on CUDA offloads and loads are asynchronous, ordered
        before the step's forward (servelab.tier_copy)."""
        perform_moves(self.tier, self.kv_caches, self.block_dim, moves)

    def prepare(self, plan: StepPlan, allocator: KVAllocator, prompt_logprobs: bool = False) -> ModelInputs:
        """The step's tensors. With `prompt_logprobs`, sequences asking for prompt logprobs
        also get logits rows for their prompt positions not scored yet (after the sampling rows)."""
        token_ids: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[Any] = []
        sampled_rows, num_logits_rows = sampling_rows(plan)
        for seq, num_new in plan.scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            token_ids.extend(seq.token_slice(start, end))
            query_lens.append(num_new)
            context_lens.append(end)
            tables.append(allocator.block_table(seq.request_id))
        num_tokens = len(token_ids)
        query_lens_np = np.asarray(query_lens, dtype=np.int64)
        context_lens_np = np.asarray(context_lens, dtype=np.int64)
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=query_start[1:])
        # A sampling row's logits rows are its last scheduled tokens: its last verified
        # token and the drafts after it.
        ends = query_start[1:].tolist()
        logits_indices: list[int] = []
        for row, count in zip(sampled_rows, num_logits_rows):
            logits_indices.extend(range(ends[row] - count, ends[row]))
        prompt_logits = self._prompt_logits_rows(plan, query_lens, logits_indices) if prompt_logprobs else ()
        seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens_np)
        # Token t of sequence b sits at position (context_len - query_len) + (t - query_start[b]).
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - (context_lens_np - query_lens_np),
                                                      query_lens_np)
        block_tables = _pad_tables(tables)
        # Slots follow the logical order (a tree's node i in the i-th slot after its root)...
        slots = block_tables[seq_of_token, positions // self.block_size] * self.block_size + positions % self.block_size
        tree_parents = None
        if plan.draft_trees:  # ...positions follow depth: a node sits one after its parent
            tree_parents = [None] * len(query_lens)
            for row, parents in plan.draft_trees:
                row_parents = query_parents(parents)
                tree_parents[row] = row_parents
                first = int(query_start[row])
                positions[first: first + len(row_parents)] = positions[first] + row_depths(row_parents)
            tree_parents = tuple(tree_parents)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device)

        metadata = AttentionMetadata(
            query_start_loc=to_device(query_start),
            query_lens=to_device(query_lens_np),
            context_lens=to_device(context_lens_np),
            block_tables=to_device(block_tables),
            slot_mapping=to_device(slots),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            query_lens_list=tuple(query_lens),
            context_lens_list=tuple(context_lens),
            tree_parents=tree_parents,
        )
        logits_rows = to_device(np.asarray(logits_indices, dtype=np.int64))
        return ModelInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=to_device(positions),
            attention=metadata,
            logits_indices=logits_rows,
            sampled_seq_rows=sampled_rows,
            num_logits_rows=num_logits_rows,
            prompt_logits=prompt_logits,
            lora=self._lora_batch(plan, query_lens_np, logits_rows),
        )

    def _lora_batch(self, plan: StepPlan, query_lens: np.ndarray, logits_rows: torch.Tensor) -> LoRABatch | None:
        """The step's rows by adapter slot, its adapters placed in the fast pool first."""
        if self.lora is None or not any(seq.lora_id for seq, _ in plan.scheduled):
            return None
        slots = self.lora.slots_for([seq.lora_id for seq, _ in plan.scheduled])
        token_slots = torch.from_numpy(np.repeat(np.asarray(slots, dtype=np.int64), query_lens)).to(self.device)
        kept = token_slots.index_select(0, logits_rows) if logits_rows.shape[0] < token_slots.shape[0] else None
        return LoRABatch(token_slots, kept)

    @staticmethod
    def _prompt_logits_rows(plan: StepPlan, query_lens: list[int], logits_indices: list[int]):
        """Append the token rows whose logits score the next prompt token, for each sequence
        collecting prompt logprobs (seq.prompt_logprobs holds the positions scored so far)."""
        rows = []
        first_token = 0
        for row, (seq, num_new) in enumerate(plan.scheduled):
            scored = seq.prompt_logprobs
            if scored is not None:
                start = seq.num_computed_tokens
                # Position p's logits score prompt token p + 1; tokens 1..len(scored) - 1 are done.
                first = max(start, len(scored) - 1)
                stop = min(start + num_new, len(seq.prompt_token_ids) - 1)
                if stop > first:
                    logits_indices.extend(range(first_token + first - start, first_token + stop - start))
                    rows.append((row, first, stop - first))
            first_token += query_lens[row]
        return tuple(rows)

    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination), in order, in every layer's K and V cache.

        Copy-on-write hands these out before a step; the order matters when a block is the
        destination of one copy and the source of a later one, so only independent copies
        are batched into one gather and one scatter.
        """
        sources = [source for source, _ in copies]
        destinations = [destination for _, destination in copies]
        if len(set(destinations)) == len(destinations) and set(sources).isdisjoint(destinations):
            batches = [(sources, destinations)]
        else:
            batches = [([source], [destination]) for source, destination in copies]
        for batch_sources, batch_destinations in batches:
            index_from = torch.tensor(batch_sources, dtype=torch.int64, device=self.device)
            index_to = torch.tensor(batch_destinations, dtype=torch.int64, device=self.device)
            for key_cache, value_cache in self.kv_caches:
                for cache in (key_cache, value_cache):
                    copy_indexed(cache, self.block_dim, index_from, index_to)

    def move_slots(self, moves: Seq[tuple[int, int]]) -> None:
        """Copy single token slots (source, destination) in every layer's K and V; all
        sources are read before any destination is written."""
        if not moves:
            return
        dim = self.block_dim
        index_from = torch.tensor([source for source, _ in moves], dtype=torch.int64, device=self.device)
        index_to = torch.tensor([destination for _, destination in moves], dtype=torch.int64, device=self.device)
        for key_cache, value_cache in self.kv_caches:
            for cache in (key_cache, value_cache):
                # The slot dimension is the block dimension and the one after it (block_size slots).
                shape = cache.shape
                if shape[dim + 1] != self.block_size:
                    raise RuntimeError(f"cannot move KV slots in a cache of shape {tuple(shape)}: the dimension "
                                       f"after the block dimension {dim} is not the block size {self.block_size}")
                slots = cache.view(*shape[:dim], shape[dim] * shape[dim + 1], *shape[dim + 2:])
                copy_indexed(slots, dim, index_from, index_to)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits [R, vocab] float32 for the rows in inputs.logits_indices."""
        return self.execute_with_hidden(inputs)[0]

    def execute_with_hidden(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [R, vocab] float32 and the final-normed hidden states [R, hidden] they
        were computed from, for the rows in inputs.logits_indices."""
        prepared = self.backend.prepare(inputs.attention)
        with self._adapters(inputs):
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.backend, prepared,
                              inputs.logits_indices)

    def execute_with_features(self, inputs: ModelInputs, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [R, vocab] float32 and the residual stream after each decoder layer in
        `layers` at every input row: [T, len(layers) * hidden] (FeatureRunner)."""
        prepared = self.backend.prepare(inputs.attention)
        with self._adapters(inputs):
            return self.model.forward_with_features(inputs.input_ids, inputs.positions, self.kv_caches,
                                                    self.backend, prepared, inputs.logits_indices, layers)

    @contextlib.contextmanager
    def _adapters(self, inputs: ModelInputs):
        """The step's LoRA rows set on the model for the forward (and cleared after it)."""
        state = self.model.lora
        if state is None:
            yield
            return
        # the backend's native library (the one whose quantized matmul it hands out), once built
        if isinstance(self.backend, QuantKernelsBackend):
            state.use_kernels(self.backend.quant_kernels)
        state.batch = inputs.lora
        try:
            yield
        finally:
            state.batch = None

    def close(self) -> None:
        """Waits for the host tier's copies still in flight (CUDA); nothing else outlives
        this process's step loop."""
        if self.tier is not None:
            self.tier.synchronize()

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden states."""
        with torch.inference_mode():
            return self.model.lm_head(hidden.to(self.model.lm_head.weight.dtype)).float()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The model's input embeddings of token_ids [N]: [N, hidden]."""
        with torch.inference_mode():
            return self.model.embed_tokens(token_ids.to(self.model.embed_tokens.weight.device))


def host_kv_caches(shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, path: str | None,
                   pin: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A host tier's K and V per layer: zeroed host memory (pinned for a GPU's copies), or
    views of one file, memory-mapped (created, or resized, to fit)."""
    numel = int(np.prod(shape))
    if path is None:
        def new() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin and torch.cuda.is_available())
        return [(new(), new()) for _ in range(num_layers)]
    element = torch.empty((), dtype=dtype).element_size()
    fd = reserve_tier_file(path, numel * element * 2 * num_layers)  # locked and allocated: see tier_file
    try:
        flat = torch.from_file(path, shared=True, size=numel * 2 * num_layers, dtype=dtype)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(flat, os.close, fd)  # the lock lasts as long as the mapping (every view keeps `flat`)
    views = flat.view(num_layers, 2, *shape)
    return [(views[layer, 0], views[layer, 1]) for layer in range(num_layers)]


def _pad_tables(tables: list[Any]) -> np.ndarray:
    width = max((len(t) for t in tables), default=0)
    padded = np.zeros((len(tables), max(width, 1)), dtype=np.int64)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    return padded
