"""Parallel layouts for `servelab size`: tensor x pipeline (x expert, for a mixture of
experts) parallelism over a number of devices, which layouts a model admits, and what
one device holds under a layout.

A layout of TP x PP x EP devices has PP stages; each stage has EP expert-parallel ranks;
each EP rank is a TP group. What a device holds:

- TP splits every layer as servelab.model.shard_layout does: the query heads, the KV
  heads (replicated once there are fewer than ranks), the MLP's width and each expert's,
  the vocabulary (embedding and LM head rows). The router is replicated.
- PP splits the layers into consecutive stages, the first stages one more where the
  count does not divide (servelab.distributed.pipeline_parallel.stage_layers); stage 0
  also holds the embedding and the LM head (servelab's engine samples on rank 0); a
  stage holds the KV of its own layers.
- EP spreads a MoE model's experts over the EP ranks by the placement policy (a rank
  holds at most ceil((experts + redundant) / EP) of them); everything else (attention,
  router, embedding, LM head) is on every EP rank. Each EP rank attends to its own share
  of the sequences (data-parallel attention, as vLLM's and SGLang's EP deployments run
  it and parallel_cost.ep_step prices it), so it holds only those sequences' KV: the
  layout holds EP times one rank's sequences.

EP x TP on the same ranks (`Layout.attention_tp`, the layout of servelab's EP x TP and of
vLLM's `--tensor-parallel-size N --enable-expert-parallel` without data parallelism):
N = tp = ep devices a stage, each an EP rank holding its placement's experts (whole
width) and, of every layer's attention, its heads as TP splits them (KV heads replicated
once there are fewer than ranks); the embedding, router, dense MLP layers, shared experts
and LM head are whole on every rank. Every rank attends to all the sequences with its
heads, so the layout holds one rank's sequences (not EP times them), each rank only its
KV heads' share of their KV.

Norms and biases (well under 0.1 % of the weights) are not counted, as in the cost model.
Every device's KV pool is sized as the fullest device's, as engines size one pool for all
ranks (the fewest blocks any rank holds).
"""

from __future__ import annotations

import attrs

from servelab.bench.sim.hardware import Accelerator
from servelab.config import EngineConfig
from servelab.contracts.moe import ExpertPlacement
from servelab.errors import ConfigError
from servelab.expert_placement import placement_policy
from servelab.kv_sizing import blocks_for, kv_pool_blocks
from servelab.model.model_config import ModelConfig
from servelab.model.shard_layout import check_experts_shardable, check_shardable, local_model_config


@attrs.frozen
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # EP x TP on the same ranks (tp == ep): the EP ranks split every layer's attention heads
    # TP-style and hold the rest whole, instead of each EP rank being a TP group of tp devices
    attention_tp: bool = False

    @property
    def devices(self) -> int:
        return self.pp * self.ep if self.attention_tp else self.tp * self.pp * self.ep

    @property
    def ffn_tp(self) -> int:
        """Ranks the MLP's, each expert's and the vocabulary's widths split over (attention's: tp)."""
        return 1 if self.attention_tp else self.tp

    @property
    def sequence_groups(self) -> int:
        """Groups of ranks attending to their own share of the sequences: EP's data-parallel
        attention, or 1 when every EP rank attends to all of them with its heads."""
        return 1 if self.attention_tp else self.ep

    @property
    def name(self) -> str:
        if self.attention_tp:
            return (f"PP{self.pp}x" if self.pp > 1 else "") + f"EP{self.ep}+TP-attn"
        parts = [f"{kind}{size}" for kind, size in (("TP", self.tp), ("PP", self.pp), ("EP", self.ep)) if size > 1]
        return "x".join(parts) or "TP1"


def check_layout(shape: ModelConfig, layout: Layout, hardware: Accelerator) -> None:
    """A ConfigError naming the constraint a layout breaks."""
    for flag, size in (("--tp", layout.tp), ("--pp", layout.pp), ("--ep", layout.ep)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {size!r}")
    if layout.attention_tp and (layout.tp != layout.ep or layout.ep < 2):
        raise ConfigError(f"EP x TP on the same ranks needs --tp equal to --ep, both above 1 (the EP ranks split "
                          f"the attention heads), got --tp {layout.tp} and --ep {layout.ep}")
    check_shardable(shape, layout.tp)
    if layout.pp > shape.num_layers:
        raise ConfigError(f"[engine] pipeline_parallel_size={layout.pp} exceeds the model's {shape.num_layers} "
                          f"decoder layers (a stage holds at least one)")
    moe = shape.moe
    if layout.ep > 1 and moe is None:
        raise ConfigError(f"[engine] expert_parallel_size={layout.ep} needs a mixture-of-experts model; this "
                          f"{shape.model_type} shape is dense (no experts to spread)")
    if moe is not None and layout.ep > moe.num_experts:
        raise ConfigError(f"[engine] expert_parallel_size={layout.ep} exceeds the model's {moe.num_experts} experts")
    if moe is not None and moe.expert_intermediate_size < layout.ffn_tp:
        raise ConfigError(f"[engine] tensor_parallel_size={layout.tp} exceeds the experts' width "
                          f"{moe.expert_intermediate_size}")
    if layout.devices > 1 and not hardware.per_kernel:
        raise ConfigError(f"{hardware.name} is priced by step terms fitted to one process and has no interconnect "
                          f"between devices: size layouts on a GPU profile (h100, h200, a100, l4)")


def admissible_layouts(shape: ModelConfig, devices: int, hardware: Accelerator) -> list[Layout]:
    """Every TP x PP (x EP for a mixture of experts) layout of exactly `devices` devices
    the model admits, fewest pipeline stages, then fewest EP ranks first; for a mixture of
    experts, after each stage count's grids, EP x TP on the same ranks of its devices."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"--layouts needs a positive number of devices, got {devices!r}")
    found = []
    for pp in _divisors(devices):
        candidates = [Layout(tp=devices // (pp * ep), pp=pp, ep=ep)
                      for ep in (_divisors(devices // pp) if shape.moe is not None else [1])]
        if shape.moe is not None and devices // pp > 1:
            candidates.append(Layout(tp=devices // pp, pp=pp, ep=devices // pp, attention_tp=True))
        for layout in candidates:
            try:
                check_layout(shape, layout, hardware)
            except ConfigError:
                continue
            found.append(layout)
    if not found:
        raise ConfigError(f"no layout of {devices} devices fits this shape ({shape.num_heads} attention heads, "
                          f"{shape.num_layers} layers): tensor parallelism must divide the heads and pipeline "
                          f"parallelism stay within the layers")
    return found


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """The layers of `stage`, split as the engine splits them (servelab.distributed.pipeline_parallel)."""
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def tp_shard(shape: ModelConfig, tp: int) -> ModelConfig:
    """What one TP rank (rank 0) holds of each layer: shard_layout's shard, the experts' widths split too."""
    local = local_model_config(shape, tp)
    if shape.moe is None or tp == 1:
        return local
    moe = attrs.evolve(shape.moe, expert_intermediate_size=shape.moe.expert_intermediate_size // tp,
                       shared_expert_intermediate_size=shape.moe.shared_expert_intermediate_size // tp)
    return attrs.evolve(local, moe=moe)


def layout_shard(shape: ModelConfig, layout: Layout) -> ModelConfig:
    """The shape one device of `layout` computes and holds of each layer: `tp_shard`'s;
    under EP x TP on the same ranks, attention's heads split over tp (servelab's
    expert_tensor_parallel) and the rest (MLP, experts, vocabulary) whole."""
    local = tp_shard(shape, layout.ffn_tp)
    if layout.ffn_tp == layout.tp:
        return local
    heads = local_model_config(shape, layout.tp)
    return attrs.evolve(local, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads)


def expert_placement(shape: ModelConfig, ep: int, policy: str, redundant_experts: int,
                     load: list[float] | None) -> ExpertPlacement | None:
    """The experts each EP rank holds (None for a dense shape)."""
    if shape.moe is None:
        return None
    try:
        return placement_policy(policy, redundant_experts).place(shape.moe.num_experts, ep, load)
    except ValueError as exc:
        raise ConfigError(f"expert placement: {exc}") from None


def device_parameters(shape: ModelConfig, layout: Layout, stage: int, experts_held: int) -> int:
    """Weights one device of `stage` holds, its EP rank holding `experts_held` experts."""
    local = layout_shard(shape, layout)
    hidden = shape.hidden_size
    q = local.num_heads * shape.head_dim
    kv = local.num_kv_heads * shape.head_dim
    attention = hidden * (q + 2 * kv) + q * hidden
    moe = local.moe
    total = 0
    for layer in stage_layers(shape.num_layers, stage, layout.pp):
        if moe is not None and layer in moe.sparse_layers:
            shared = moe.shared_expert_intermediate_size
            ffn = (hidden * moe.num_experts + experts_held * 3 * hidden * moe.expert_intermediate_size
                   + (3 * hidden * shared + hidden if shared else 0))
        else:
            ffn = 3 * hidden * local.intermediate_size
        total += attention + ffn
    if stage == 0:
        total += local.vocab_size * hidden * (1 if shape.tie_word_embeddings else 2)
    return total


def layer_kv_bytes_per_token(shape: ModelConfig, layout: Layout, kv_cache_dtype: str = "auto",
                             dtype_bytes: int = 2) -> int:
    """K and V of one token in one layer, on one device (its TP rank's KV heads)."""
    return layout_shard(shape, layout).kv_bytes_per_token(dtype_bytes, kv_cache_dtype) // shape.num_layers


@attrs.frozen
class LayoutMemory:
    """One device's memory under a layout, in bytes: the fullest device's (which sizes
    every device's KV pool), and how many sequences the layout's pools hold."""

    memory_bytes: float
    reserved_bytes: float
    weight_bytes: float  # the fullest device's weights (stage 0's: the most layers, the embedding and LM head)
    stage_weight_bytes: tuple[float, ...]  # one device of each stage (its EP rank with the most experts)
    total_weight_bytes: float  # summed over every device: the model, plus what TP and EP replicate
    free_bytes: float  # on the fullest device: what weights and runtime leave
    memory_utilization: float
    kv_pool_bytes: float  # memory_utilization * free_bytes
    kv_bytes_per_token: float  # on the fullest device: its stage's layers, its KV heads
    block_bytes: float
    num_blocks: int  # every device's pool
    kv_tokens_per_device: int
    context_len: int
    blocks_per_sequence: int
    # sequences of context_len tokens the whole layout holds: EP ranks x one rank's under data-parallel
    # attention, one rank's under EP x TP on the same ranks (every rank attends to all of them)
    max_concurrent_seqs: int

    @property
    def fits(self) -> bool:
        return self.max_concurrent_seqs >= 1


def layout_memory(shape: ModelConfig, hardware: Accelerator, layout: Layout, placement: ExpertPlacement | None,
                  block_size: int, context_len: int, memory_utilization: float, kv_cache_dtype: str = "auto",
                  dtype_bytes: int = 2) -> LayoutMemory:
    if not 0 < memory_utilization <= 1:
        raise ConfigError(f"memory utilisation must be in (0, 1], got {memory_utilization}")
    held = [len(experts) for experts in placement.ranks] if placement is not None else [0] * layout.ep
    per_layer_kv = layer_kv_bytes_per_token(shape, layout, kv_cache_dtype, dtype_bytes)
    usable = hardware.memory_bytes - hardware.reserved_bytes
    stage_weights, total, fullest = [], 0.0, None
    for stage in range(layout.pp):
        weights = [device_parameters(shape, layout, stage, n) * dtype_bytes for n in held]
        stage_weights.append(max(weights))
        total += layout.ffn_tp * sum(weights)  # the devices of an EP rank: a TP group, or the rank itself
        kv_per_token = per_layer_kv * len(stage_layers(shape.num_layers, stage, layout.pp))
        blocks = kv_pool_blocks(memory_utilization * (usable - max(weights)), kv_per_token, block_size)
        if fullest is None or blocks < fullest[0]:
            fullest = (blocks, max(weights), kv_per_token)
    blocks, weights, kv_per_token = fullest
    per_sequence = blocks_for(context_len, block_size)
    free = usable - weights
    return LayoutMemory(
        memory_bytes=hardware.memory_bytes, reserved_bytes=hardware.reserved_bytes, weight_bytes=weights,
        stage_weight_bytes=tuple(stage_weights), total_weight_bytes=total, free_bytes=free,
        memory_utilization=memory_utilization, kv_pool_bytes=max(0.0, memory_utilization * free),
        kv_bytes_per_token=kv_per_token, block_bytes=kv_per_token * block_size, num_blocks=blocks,
        kv_tokens_per_device=blocks * block_size, context_len=context_len, blocks_per_sequence=per_sequence,
        max_concurrent_seqs=layout.sequence_groups * (blocks // per_sequence))


def engine_refusal(shape: ModelConfig, layout: Layout) -> str | None:
    """Why servelab's own engine does not run `layout` yet (None: it does)."""
    if layout.tp > 1 and layout.ep > 1 and not layout.attention_tp:
        # servelab's EP x TP puts both on the same ranks (the attention_tp layouts), not a TP x EP grid
        return ("servelab runs EP x TP with both on the same ranks (tensor_parallel_size = expert_parallel_size, "
                "the +TP-attn layouts), not EP ranks that are TP groups")
    try:
        EngineConfig.from_dict({"engine": {"tensor_parallel_size": layout.tp, "pipeline_parallel_size": layout.pp,
                                           "expert_parallel_size": layout.ep}})
        check_experts_shardable(shape, layout.tp, layout.ep)
    except ConfigError as exc:
        return str(exc)
    return None
