"""What every rank runs: its decoder shard, its attention backend (built for its local
heads) and the KV cache of those heads, behind the ordinary `ModelRunner`; and the
step messages rank 0 sends the others."""

from __future__ import annotations

import collections
from typing import Any

import attrs
import numpy as np
import torch

from servelab.config import EngineSection
from servelab.distributed.comm import Communicator
from servelab.model.shard_layout import ShardLayout
from servelab.distributed.sharded_model import build_shard
from servelab.interfaces import AttentionContext, AttentionMetadata
from servelab.model.loader import DTYPES, Checkpoint
from servelab.registry import RegisteredPolicy, build_policy
from servelab.runner import ModelInputs, ModelRunner


@attrs.frozen
class ShardSpec:
    """Everything a rank needs to build its shard; picklable, sent to spawned workers."""

    model_path: str
    engine: EngineSection
    attention: RegisteredPolicy
    attention_options: Any
    attention_context: AttentionContext  # the local head counts; device set per rank
    num_blocks: int
    max_positions: int
    size: int
    # Expert parallelism instead of tensor parallelism: the whole model on every rank but
    # the experts, placed by this policy (servelab.distributed.expert_parallel)
    expert_parallel: bool = False
    pipeline_parallel: bool = False  # consecutive layers per rank (servelab.distributed.pipeline_parallel)
    expert_placement: str = "linear"
    redundant_experts: int = 0
    # TP inside the layout: under pipeline parallelism the TP ranks of each stage (size =
    # stages x this); under expert parallelism the same ranks split the attention heads (= size)
    tensor_parallel_size: int = 1


def rank_device(engine: EngineSection, local_rank: int) -> torch.device:
    """CUDA ranks each take their own GPU (by local rank); CPU ranks share the CPU."""
    device = torch.device(engine.device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def build_shard_runner(spec: ShardSpec, rank: int, comm: Communicator, backend: Any = None) -> ModelRunner:
    engine = spec.engine
    checkpoint = Checkpoint.open(spec.model_path)
    if spec.expert_parallel:
        model = build_expert_shard(checkpoint, spec, comm)
    elif spec.pipeline_parallel:
        model = build_pipeline_stage(checkpoint, spec, comm)
    else:
        layout = ShardLayout(checkpoint.config, rank, spec.size)
        model = build_shard(checkpoint, layout, comm, engine.dtype, str(comm.device), spec.max_positions,
                            engine.prepack_weights)
    if backend is None:
        context = attrs.evolve(spec.attention_context, device=comm.device)
        backend = build_policy(spec.attention, spec.attention_options, context)
    return ModelRunner(model, backend, spec.num_blocks, engine.block_size, DTYPES[engine.dtype], comm.device)


def build_expert_shard(checkpoint: Checkpoint, spec: ShardSpec, comm: Communicator) -> Any:
    """The whole model but the experts other ranks hold (expert parallelism)."""
    from servelab.distributed.expert_parallel import attach_dispatchers, initial_placements, prune_experts
    from servelab.expert_placement import placement_policy
    from servelab.model.loader import load_model

    engine = spec.engine
    placements = initial_placements(checkpoint.config, placement_policy(spec.expert_placement, spec.redundant_experts),
                                    spec.size)
    reshape = None
    if spec.tensor_parallel_size > 1:  # EP x TP: the same ranks split the attention heads
        from servelab.distributed.expert_tensor_parallel import shard_attention

        layout = ShardLayout(checkpoint.config, comm.rank, spec.size)
        reshape = lambda m: shard_attention(m, layout, comm)  # noqa: E731
    model = load_model(checkpoint, engine.dtype, str(comm.device), spec.max_positions, engine.prepack_weights,
                       engine.weights, prune=lambda m: prune_experts(m, placements, comm.rank),
                       quantized_activations=engine.quantized_activations, reshape=reshape)
    attach_dispatchers(model, comm, placements)
    return model


def build_pipeline_stage(checkpoint: Checkpoint, spec: ShardSpec, comm: Communicator) -> Any:
    """This rank's stage of the decoder's layers (pipeline parallelism); under PP x TP, its
    tensor-parallel shard of them, its all-reduces over its stage's group."""
    from servelab.distributed.pipeline_parallel import StageLinks, make_stage, prune_layers, stage_layers
    from servelab.model.loader import load_model

    engine = spec.engine
    tp = spec.tensor_parallel_size
    stages = spec.size // tp
    links = StageLinks.of_rank(comm.rank, stages, tp, comm.device_group)
    layers = stage_layers(checkpoint.config.num_layers, links.stage, stages)
    if tp > 1:
        import torch.distributed as dist

        groups = [dist.new_group([stage * tp + t for t in range(tp)]) for stage in range(stages)]  # on every rank
        stage_comm = Communicator(links.tp_rank, tp, comm.device, device_group=groups[links.stage])
        model = build_shard(checkpoint, ShardLayout(checkpoint.config, links.tp_rank, tp), stage_comm, engine.dtype,
                            str(comm.device), spec.max_positions, engine.prepack_weights, layers=layers)
    else:
        model = load_model(checkpoint, engine.dtype, str(comm.device), spec.max_positions, engine.prepack_weights,
                           engine.weights, prune=lambda m: prune_layers(m, layers),
                           quantized_activations=engine.quantized_activations)
    make_stage(model, links, layers)
    return model


def rebalance_shard(runner: ModelRunner, spec: ShardSpec, comm: Communicator, placements: Any) -> int:
    """Re-place this rank's experts (a `rebalance` message); how many it loaded."""
    from servelab.distributed.expert_parallel import apply_placements

    return apply_placements(runner.model, comm, placements, Checkpoint.open(spec.model_path).tensors(),
                            spec.engine.weights, spec.engine.prepack_weights)


def pack_inputs(inputs: ModelInputs) -> dict[str, Any]:
    """A step's inputs as host arrays (what rank 0 broadcasts)."""
    attention = {field.name: _host(getattr(inputs.attention, field.name))
                 for field in attrs.fields(AttentionMetadata)}
    return {"input_ids": _host(inputs.input_ids), "positions": _host(inputs.positions),
            "logits_indices": _host(inputs.logits_indices), "attention": attention}


def unpack_inputs(packed: dict[str, Any], device: torch.device) -> ModelInputs:
    attention = AttentionMetadata(**{name: _device(value, device) for name, value in packed["attention"].items()})
    return ModelInputs(input_ids=_device(packed["input_ids"], device), positions=_device(packed["positions"], device),
                       attention=attention, logits_indices=_device(packed["logits_indices"], device),
                       sampled_seq_rows=[], num_logits_rows=[])


def _host(value: Any) -> Any:
    return value.cpu().numpy() if isinstance(value, torch.Tensor) else value


def _device(value: Any, device: torch.device) -> Any:
    return torch.from_numpy(value).to(device) if isinstance(value, np.ndarray) else value


def lm_head(runner: ModelRunner, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits of final-normed hidden states through the vocab-parallel head (a collective)."""
    with torch.inference_mode():
        return runner.model.lm_head(hidden.to(runner.model.norm.weight.dtype)).float()


def serve(runner: ModelRunner, comm: Communicator, on_done: Any = None, spec: ShardSpec | None = None) -> None:
    """A worker rank's loop: run what rank 0 sends until it says stop.

    Under pipeline parallelism a batch starts (`step_micro`: this stage's compute, its
    sends left in flight) and finishes (`finish_micro`: the sends waited for; in the first
    stage, the rows received and the LM head computed) when rank 0 says, so several
    batches may be in flight at once: rank 0 completes a batch only after submitting the
    ones behind it."""
    from servelab.distributed.pipeline_parallel import finish_pipelined, start_pipelined

    unfinished: collections.deque = collections.deque()
    while True:
        kind, payload = comm.receive()
        if kind == "stop":
            return  # a batch rank 0 never completed is dropped: its rows would never be received
        if kind == "step":
            copies, packed = payload
            if copies:
                runner.copy_blocks(copies)
            runner.execute_with_hidden(unpack_inputs(packed, comm.device))
        elif kind == "lm_head":
            lm_head(runner, torch.from_numpy(payload).to(comm.device))
        elif kind == "step_micro":
            copies, packed = payload
            if copies:
                runner.copy_blocks(copies)
            unfinished.append(start_pipelined(runner, [unpack_inputs(piece, comm.device) for piece in packed]))
        elif kind == "finish_micro":
            finish_pipelined(runner, unfinished.popleft())
        elif kind == "rebalance" and spec is not None:
            rebalance_shard(runner, spec, comm, payload)
        else:
            raise RuntimeError(f"unknown tensor-parallel message {kind!r}")
        if on_done is not None:
            on_done()
