"""The model runner: owns the KV cache tensors, turns a StepPlan into input tensors
(token ids, positions, slot mapping, block tables) and runs the model."""

from __future__ import annotations

from typing import Any, Sequence as Seq

import attrs
import numpy as np
import torch

from servelab.interfaces import AttentionMetadata, KVAllocator, StepPlan
from servelab.model.llama import LlamaForCausalLM


@attrs.frozen
class ModelInputs:
    """One step's tensors, built once and shared by every layer."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # [S] last row of each sequence that gets a new token
    sampled_seq_rows: list[int]  # [S] index into plan.scheduled of each such sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend: Any, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        config = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        shape = backend.kv_cache_shape()
        self.block_dim = backend.kv_cache_block_dim()  # the dimension block ids index
        # The runner owns the cache; allocators only hand out block ids into it.
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]

    def prepare(self, plan: StepPlan, allocator: KVAllocator) -> ModelInputs:
        token_ids: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[Any] = []
        sampled_rows: list[int] = []
        for row, (seq, num_new) in enumerate(plan.scheduled):
            start = seq.num_computed_tokens
            token_ids.extend(seq.token_slice(start, start + num_new))
            query_lens.append(num_new)
            context_lens.append(start + num_new)
            tables.append(allocator.block_table(seq.request_id))
            if start + num_new == seq.num_tokens:
                sampled_rows.append(row)
        query_lens_np = np.asarray(query_lens, dtype=np.int64)
        context_lens_np = np.asarray(context_lens, dtype=np.int64)
        query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=query_start[1:])
        num_tokens = int(query_start[-1])
        seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens_np)
        # Token t of sequence b sits at position (context_len - query_len) + (t - query_start[b]).
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - (context_lens_np - query_lens_np),
                                                      query_lens_np)
        block_tables = _pad_tables(tables)
        slots = block_tables[seq_of_token, positions // self.block_size] * self.block_size + positions % self.block_size
        logits_indices = query_start[1:][sampled_rows] - 1

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device)

        metadata = AttentionMetadata(
            query_start_loc=to_device(query_start),
            query_lens=to_device(query_lens_np),
            context_lens=to_device(context_lens_np),
            block_tables=to_device(block_tables),
            slot_mapping=to_device(slots),
            max_query_len=int(query_lens_np.max()),
            max_context_len=int(context_lens_np.max()),
            query_lens_list=tuple(query_lens),
            context_lens_list=tuple(context_lens),
        )
        return ModelInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
            positions=to_device(positions),
            attention=metadata,
            logits_indices=to_device(np.asarray(logits_indices, dtype=np.int64)),
            sampled_seq_rows=sampled_rows,
        )

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
                    cache.index_copy_(self.block_dim, index_to, cache.index_select(self.block_dim, index_from))

    def execute(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits [S, vocab] float32 for the rows in inputs.logits_indices."""
        prepared = self.backend.prepare(inputs.attention)
        logits, _ = self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.backend, prepared,
                               inputs.logits_indices)
        return logits


def _pad_tables(tables: list[Any]) -> np.ndarray:
    width = max((len(t) for t in tables), default=0)
    padded = np.zeros((len(tables), max(width, 1)), dtype=np.int64)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    return padded
