"""Pipeline parallelism: the decoder's layers split into consecutive stages, one per rank
(or, with tensor parallelism inside each stage, one per group of TP ranks).

Rank 0 holds the first stage (and the token embedding and the LM head, so it samples);
each later stage holds its layers and KV cache only. A step runs down the pipeline: the
first stage embeds and runs its layers and sends the hidden states on (point to point,
over the launch's process group), each stage runs its layers and passes them on, and the
last normalises the rows whose logits are wanted and sends them back to the first. Under
PP x TP, stage s is the ranks s * TP .. s * TP + TP - 1, each holding its heads and its
share of the MLP width of the stage's layers (servelab.distributed.sharded_model), their
all-reduces over a group of their own; TP rank t of a stage sends to TP rank t of the
next (every TP rank holds the whole hidden state after its all-reduces), and the first
stage's TP ranks compute the LM head's vocabulary columns together. Greedy output equals
one process's.

A step whose rows can be cut (`splittable`) runs as micro-batches in flight
(`start_pipelined`, then `finish_pipelined`): its rows are cut into `[engine]
pipeline_micro_batches` pieces (0: as many as stages) by `[engine] pipeline_chunk_sizing`
(`piece_sizes`, servelab.pipeline_chunks), a long prompt's rows split across pieces, and
each stage sends a piece on and starts the next, so the stages work on different pieces at
once; a stage idles about (PP - 1) / (M + PP - 1) of the step instead of (PP - 1) / PP.
Other steps (one row, token trees, prompt logprobs) run whole. Several steps' batches may
be in flight at once (servelab.batch_queue): a batch finishes when rank 0 completes it.
`PipelineStats` measures each stage's compute and wait (its bubble).
"""

from __future__ import annotations

import itertools
import time
import types
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn



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
    """A rank's time computing its stage and waiting for its input (its bubble): for the
    first stage, the last stage's rows; for the others, the previous stage's hidden states.
    Rank 0's also holds every stage's (`stage_times`)."""

    steps: int = 0
    micro_batches: int = 0  # pieces of the steps cut into micro-batches
    compute_s: float = 0.0
    wait_s: float = 0.0
    # the engine's batch queue (servelab.batch_queue): batches allowed in flight at once,
    # and of the batches submitted, those submitted while another was still in flight
    batches_in_flight: int = 1
    overlapped_batches: int = 0

    # (compute_s, wait_s) of each stage, the first stage's first (its first TP rank's under
    # PP x TP); empty where the other ranks' times are not known (under torchrun)
    stage_times: tuple[tuple[float, float], ...] = ()

    @property
    def bubble_fraction(self) -> float | None:
        total = self.compute_s + self.wait_s
        return self.wait_s / total if total else None

    @property
    def stage_bubble_fractions(self) -> list[float | None]:
        return [wait / (compute + wait) if compute + wait else None for compute, wait in self.stage_times]


@attrs.frozen
class StageLinks:
    """Where a rank sits in the pipeline and whom it talks to (global ranks): stage
    `stage` of `stages`, TP rank `tp_rank` of `tp_size` within it."""

    stage: int
    stages: int
    tp_size: int = 1
    tp_rank: int = 0
    group: Any = None  # the process group the activations travel on (None: the default)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def previous(self) -> int:
        return (self.stage - 1) * self.tp_size + self.tp_rank

    @property
    def next(self) -> int:
        """The next stage's counterpart; from the last stage, the first stage's."""
        return ((self.stage + 1) % self.stages) * self.tp_size + self.tp_rank

    @classmethod
    def of_rank(cls, rank: int, stages: int, tp_size: int = 1, group: Any = None) -> "StageLinks":
        stage, tp_rank = divmod(rank, tp_size)
        return cls(stage, stages, tp_size, tp_rank, group)


def make_stage(model: nn.Module, links: StageLinks, layers: range) -> PipelineStats:
    """Turn a loaded model (its other stages' layers pruned) into stage `links.stage`: its
    forward runs this stage and talks to its neighbours; the first stage's returns the logits."""
    stats = PipelineStats()
    model.forward = types.MethodType(_stage_forward, model)
    model.pipeline = (links, layers, stats)
    return stats


def _wire(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype != torch.float32 else dtype  # what gloo sends of every float


@torch.inference_mode()
def _stage_forward(self: Any, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, backend: Any,
                   prepared: Any, logits_indices: torch.Tensor,
                   features: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    links, layers, stats = self.pipeline
    group = links.group
    dtype = self.embed_tokens.weight.dtype
    num_tokens, hidden_size = input_ids.shape[0], self.config.hidden_size
    started = time.perf_counter()
    waited = 0.0
    if links.is_first:
        hidden = self.embed_tokens(input_ids)
    else:
        received = torch.empty(num_tokens, hidden_size, dtype=_wire(dtype))
        dist.recv(received, src=links.previous, group=group)
        waited = time.perf_counter() - started
        hidden = received.to(dtype)
    cos, sin = self.rotary.tables(positions)
    for index in layers:
        hidden = self.layers[index](hidden, cos, sin, kv_caches[index], backend, prepared)
    if not links.is_last:
        dist.send(hidden.to(_wire(dtype)).contiguous(), dst=links.next, group=group)
    else:
        dist.send(self.norm(hidden[logits_indices]).to(_wire(dtype)).contiguous(), dst=links.next, group=group)
    if not links.is_first:
        _count(stats, 1, time.perf_counter() - started - waited, waited)
        return hidden[:0], hidden[:0]
    selected = torch.empty(logits_indices.shape[0], hidden_size, dtype=_wire(dtype))
    before = time.perf_counter()
    dist.recv(selected, src=(links.stages - 1) * links.tp_size + links.tp_rank, group=group)
    waited = time.perf_counter() - before
    selected = selected.to(dtype)
    _count(stats, 1, time.perf_counter() - started - waited, waited)
    return self.lm_head(selected).float(), selected


def _count(stats: PipelineStats, pieces: int, compute_s: float, wait_s: float) -> None:
    stats.steps += 1
    stats.micro_batches += pieces if pieces > 1 else 0
    stats.compute_s += compute_s
    stats.wait_s += wait_s


def row_costs(positions: torch.Tensor, config: Any) -> list[float]:
    """Each row's FLOPs at one decoder layer, what `equal_time` chunk sizing balances: its
    matmuls (two per weight it multiplies: attention projections, and the MLP's, or its k
    experts' and a shared expert's) and its attention over the positions up to its own."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q, kv = config.num_heads * head_dim, config.num_kv_heads * head_dim
    weights = hidden * (q + 2 * kv) + q * hidden
    moe = config.moe
    if moe is None:
        weights += 3 * hidden * config.intermediate_size
    else:
        weights += 3 * hidden * (moe.top_k * moe.expert_intermediate_size + moe.shared_expert_intermediate_size)
    per_position = 4 * q  # Q K^T and P V over one cached position
    return [2.0 * weights + per_position * (position + 1) for position in positions.tolist()]


def piece_sizes(inputs: Any, pieces: int, sizing: str, config: Any) -> list[int]:
    """A step's rows cut for `pieces` micro-batches: `fixed` cuts equal counts; `equal_time`
    (servelab.pipeline_chunks) cuts the first piece as `fixed` does and each later one to
    about its FLOPs (later rows of a long prompt attend to more positions, so they get
    fewer rows, and the step may take more pieces)."""
    from servelab.pipeline_chunks import chunk_sizing

    rows = inputs.input_ids.shape[0]
    prefix = list(itertools.accumulate(row_costs(inputs.positions, config), initial=0.0)) if sizing != "fixed" else []

    def chunk_time(tokens: int, start: int) -> float:
        return prefix[start + tokens] - prefix[start] if prefix else 0.0

    return chunk_sizing(sizing).chunks(rows, -(-rows // pieces), chunk_time)


def split_inputs(inputs: Any, sizes: list[int]) -> list[Any]:
    """The step's rows cut into consecutive micro-batches of `sizes` tokens (summing to the
    step's), a sequence's rows (a long prompt's) split across micro-batches where a cut falls
    inside them: each piece attends to what the earlier pieces wrote, as a stage runs them
    in order. Each piece keeps its logits rows, renumbered."""
    from servelab.interfaces import AttentionMetadata
    from servelab.runner import ModelInputs

    meta = inputs.attention
    starts = meta.query_start_loc.tolist()
    wanted = inputs.logits_indices.tolist()
    pieces, row = [], 0
    for size in sizes:
        end = row + size
        segments = []  # (sequence, first row, end row)
        for seq, (first, last) in enumerate(zip(starts[:-1], starts[1:])):
            low, high = max(first, row), min(last, end)
            if low < high:
                segments.append((seq, low, high))
        query_lens = [high - low for _, low, high in segments]
        context_lens = [meta.context_lens_list[seq] - (starts[seq + 1] - high) for seq, _, high in segments]
        seqs = torch.tensor([seq for seq, _, _ in segments])
        attention = AttentionMetadata(
            query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)]),
            query_lens=torch.tensor(query_lens), context_lens=torch.tensor(context_lens),
            block_tables=meta.block_tables.index_select(0, seqs), slot_mapping=meta.slot_mapping[row:end],
            max_query_len=max(query_lens), max_context_len=max(context_lens),
            query_lens_list=tuple(query_lens), context_lens_list=tuple(context_lens))
        logits = torch.tensor([r - row for r in wanted if row <= r < end], dtype=inputs.logits_indices.dtype)
        pieces.append(ModelInputs(input_ids=inputs.input_ids[row:end], positions=inputs.positions[row:end],
                                  attention=attention, logits_indices=logits, sampled_seq_rows=[], num_logits_rows=[]))
        row = end
    return pieces


def splittable(inputs: Any) -> bool:
    """Whether a step's rows may be cut into micro-batches: causal rows only (no token
    trees), and its logits rows in batch order (no prompt-logprob rows after them)."""
    wanted = inputs.logits_indices.tolist()
    return (inputs.attention.tree_parents is None and not inputs.prompt_logits
            and wanted == sorted(wanted) and inputs.input_ids.shape[0] > 1)


@attrs.frozen
class PipelinedBatch:
    """One batch sent down the pipeline and not yet finished here: its pieces, the sends
    still in flight (their tensors kept alive until they arrive) and when it started."""

    pieces: list[Any]
    sends: list[tuple[torch.Tensor, Any]]
    compute_s: float


@torch.inference_mode()
def start_pipelined(runner: Any, pieces: list[Any]) -> PipelinedBatch:
    """This stage's compute for a batch cut into micro-batches: a stage sends a piece on
    (without waiting for it to arrive) and starts the next, so stage s runs piece j while
    stage s + 1 runs piece j - 1. Returns at once once this stage's part is computed: the
    sends (the last stage's rows back to rank 0 included) complete in `finish_pipelined`."""
    model = runner.model
    links, layers, _ = model.pipeline
    group = links.group
    dtype = model.embed_tokens.weight.dtype
    hidden_size = model.config.hidden_size
    started = time.perf_counter()
    waited = 0.0
    sends = []
    for piece in pieces:
        prepared = runner.backend.prepare(piece.attention)
        if links.is_first:
            hidden = model.embed_tokens(piece.input_ids)
        else:
            received = torch.empty(piece.input_ids.shape[0], hidden_size, dtype=_wire(dtype))
            before = time.perf_counter()
            dist.recv(received, src=links.previous, group=group)
            waited += time.perf_counter() - before
            hidden = received.to(dtype)
        cos, sin = model.rotary.tables(piece.positions)
        for index in layers:
            hidden = model.layers[index](hidden, cos, sin, runner.kv_caches[index], runner.backend, prepared)
        out = hidden if not links.is_last else model.norm(hidden[piece.logits_indices])
        if out.shape[0]:  # a prompt chunk whose logits nobody wants sends nothing back
            out = out.to(_wire(dtype)).contiguous()
            sends.append((out, dist.isend(out, dst=links.next, group=group)))
    compute_s = time.perf_counter() - started - waited
    if not links.is_first:  # the first stage counts the batch when its rows come back
        _count(model.pipeline[2], len(pieces), compute_s, waited)
    return PipelinedBatch(pieces, sends, compute_s)


@torch.inference_mode()
def finish_pipelined(runner: Any, batch: PipelinedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first stage: the batch's logits (on rank 0; under TP the other ranks of the
    stage compute their vocabulary columns with it) and hidden rows, received from the last
    stage piece by piece; every rank: its sends of the batch completed."""
    model = runner.model
    links, _, stats = model.pipeline
    group = links.group
    last = (links.stages - 1) * links.tp_size + links.tp_rank
    dtype = model.embed_tokens.weight.dtype
    result = None
    waited = 0.0
    started = time.perf_counter()
    if links.is_first:
        selected = []
        for piece in batch.pieces:
            if not piece.logits_indices.shape[0]:
                continue
            rows = torch.empty(piece.logits_indices.shape[0], model.config.hidden_size, dtype=_wire(dtype))
            before = time.perf_counter()
            dist.recv(rows, src=last, group=group)
            waited += time.perf_counter() - before
            selected.append(rows.to(dtype))
        hidden_rows = torch.cat(selected) if selected else torch.empty(0, model.config.hidden_size, dtype=dtype)
        result = (model.lm_head(hidden_rows).float(), hidden_rows)
    for _, handle in batch.sends:
        handle.wait()
    if links.is_first:
        _count(stats, len(batch.pieces), batch.compute_s + time.perf_counter() - started - waited, waited)
    return result

